"""Llama-style GPTs <-> transformers' LlamaForCausalLM / Qwen2ForCausalLM /
Qwen3ForCausalLM (megatron/hf_interop.py through tools/checkpoint_util.py).

Our RMSNorm/RoPE/SwiGLU/grouped-query GPT exported with --to-hf loads in transformers and
gives our logits; a Llama saved with save_pretrained imports (--from-hf) into any (t, d)
layout and our model built from it gives transformers' logits; export(import(x)) is x's
weights bit for bit.  The same for Qwen3 (--qk-layernorm, also with --kv-channels) and
Llama 3.1/3.2's RoPE scaling (--use-rope-scaling, transformers' rope_type "llama3").
Tolerances: transformers computes RMSNorm and RoPE's angles in
float32 whatever the model's dtype, so float32 models agree to ~1e-6 (checked < 1e-4)
and float64 ones to ~1e-7 (checked < 1e-5), not to rounding.  Combinations no
transformers model computes are refused with one line naming the flags.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.checkpointing import save_payload  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.errors import CheckpointError  # noqa: E402
from megatron.hf_import import import_hf  # noqa: E402
from megatron.hf_interop import export_hf  # noqa: E402
from megatron.hf_layouts import qkv_groups_to_ours, qkv_ours_to_groups  # noqa: E402
from megatron.model.bert_model import BertModel  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.tensor_parallel import TPInfo  # noqa: E402
from tools.checkpoint_util import convert, main, merge_checkpoint, read_checkpoint  # noqa: E402

TP = TPInfo.single()
VOCAB = 96
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True)
QWEN3 = dict(qk_layernorm=True, add_bias_linear=False)
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                ffn_hidden_size=48, padded_vocab_size=128, hidden_dropout=0.0,
                attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.2,
                rotary_base=500000, **LLAMA)
    base.update(kw)
    return ModelConfig(**base)


def _record(cfg: ModelConfig) -> dict:
    """config["model"] as training saves it (dataclasses.asdict; dtypes as text)."""
    return {k: (str(v) if isinstance(v, torch.dtype) else v)
            for k, v in dataclasses.asdict(cfg).items()}


def _model(cfg: ModelConfig, seed: int = 5):
    """A model whose norms are not 1 and biases not 0, so a swapped or dropped one shows."""
    model = GPTModel(cfg, TP, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def _save(root, model, cfg, model_record=None, data=None):
    base = os.path.join(root, "iter_0000004", "mp_rank_00")
    os.makedirs(base)
    save_payload({"iteration": 4, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                  "model": model.state_dict(),
                  "config": {"model": model_record or _record(cfg),
                             "data": data or {"tokenizer_type": "NullTokenizer",
                                              "vocab_size": VOCAB,
                                              "make_vocab_size_divisible_by": 64}}},
                 os.path.join(base, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    return root


def _ids(vocab=VOCAB):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))


def _load_hf(path, cls=None):
    cls = cls or transformers.LlamaForCausalLM
    hf, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), \
        info
    return hf.eval()


def test_qkv_groups_round_trip_and_layout():
    heads, groups, d, h = 4, 2, 3, 5
    w = torch.arange((heads + 2 * groups) * d * h, dtype=torch.float64).reshape(-1, h)
    q, k, v = qkv_ours_to_groups(w, heads, groups)
    assert (q.shape, k.shape, v.shape) == ((12, 5), (6, 5), (6, 5))
    # ours: [group, (q heads of the group, k, v), d]; group 0 = rows 0..11, group 1 = 12..23
    assert torch.equal(q[:6], w[:6]) and torch.equal(k[:3], w[6:9]) and torch.equal(v[:3], w[9:12])
    assert torch.equal(q[6:], w[12:18]) and torch.equal(k[3:], w[18:21])
    assert torch.equal(qkv_groups_to_ours(q, k, v, groups), w)
    b = w[:, 0].clone()  # a bias: no trailing dims
    assert torch.equal(qkv_groups_to_ours(*qkv_ours_to_groups(b, heads, groups), groups), b)


@pytest.mark.parametrize("groups,bias,untie,resplit", [
    (2, False, True, False),   # GQA, Llama's usual: no biases, untied output
    (4, True, False, False),   # multi-head attention, biases, tied output
    (1, False, False, True),   # multi-query attention, exported from a t=2 d=2 layout
    (2, True, True, True),
])
def test_llama_export_loads_in_transformers_with_our_logits(tmp_path, capsys, groups, bias,
                                                            untie, resplit):
    cfg = _cfg(num_query_groups=groups, add_bias_linear=bias,
               untie_embeddings_and_output_weights=untie)
    model = _model(cfg)
    src = _save(str(tmp_path / "ckpt"), model, cfg)
    if resplit:  # any layout exports: SwiGLU's stride-2 split is undone on merge
        tp = 2 if groups % 2 == 0 else 1  # t must divide the query groups
        if tp == 1:
            with pytest.raises(CheckpointError, match="number of query groups"):
                convert(src, str(tmp_path / "t2d2"), tp=2, pp=2)
        convert(src, str(tmp_path / "t2d2"), tp=tp, pp=2)
        src = str(tmp_path / "t2d2")
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    capsys.readouterr()
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert hf_cfg["architectures"] == ["LlamaForCausalLM"] and hf_cfg["model_type"] == "llama"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    hf = _load_hf(out)
    c = hf.config
    assert (c.vocab_size, c.num_key_value_heads, c.attention_bias, c.mlp_bias,
            c.tie_word_embeddings, c.intermediate_size, c.rms_norm_eps) == \
        (VOCAB, groups, bias, bias, not untie, 48, 1e-5)
    assert c.rope_parameters["rope_theta"] == 500000 and c.rope_parameters["rope_type"] == "default"
    with torch.no_grad():
        ours = model(_ids(), None, None)[..., :VOCAB]
        theirs = hf(_ids()).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_float64_export_agrees_to_float32_rounding_of_norms(tmp_path):
    cfg = _cfg(num_query_groups=2, add_bias_linear=False, params_dtype=torch.float64,
               untie_embeddings_and_output_weights=True)
    model = _model(cfg)
    out = str(tmp_path / "hf")
    export_hf(_save(str(tmp_path / "ckpt"), model, cfg), out)
    hf = _load_hf(out)
    assert hf.dtype == torch.float64
    with torch.no_grad():
        diff = (model(_ids(), None, None)[..., :VOCAB] - hf(_ids()).logits).abs().max().item()
    assert diff < 1e-5


def test_qwen2_style_qkv_bias_exports_as_qwen2(tmp_path):
    """--disable-bias-linear --add-qkv-bias (biases on q, k, v only) is Qwen2's block."""
    cfg = _cfg(num_query_groups=2, add_bias_linear=False, add_qkv_bias=True)
    model = _model(cfg)
    out = str(tmp_path / "hf")
    export_hf(_save(str(tmp_path / "ckpt"), model, cfg), out)
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert (hf_cfg["architectures"], hf_cfg["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
    hf = _load_hf(out, transformers.Qwen2ForCausalLM)
    with torch.no_grad():
        diff = (model(_ids(), None, None)[..., :VOCAB] - hf(_ids()).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("groups,head,untie,resplit", [
    (2, None, True, False),    # Qwen3's usual: GQA, heads of hidden / heads
    (4, None, False, True),    # tied, exported from a t=2 d=2 layout (replicated norms)
    (2, 16, True, True),       # --kv-channels 16 in a hidden size of 32 (Qwen3-0.6B's kind)
])
def test_qwen3_export_loads_in_transformers_with_our_logits(tmp_path, capsys, groups, head,
                                                            untie, resplit):
    """--qk-layernorm without biases is Qwen3's block: q_norm/k_norm are our
    self_attention.q_layernorm/k_layernorm weights (replicated over tensor ranks, so a
    t=2 checkpoint merges to one copy), and head_dim is always written (Qwen3's default
    is 128, not hidden / heads)."""
    cfg = _cfg(num_query_groups=groups, kv_channels=head,
               untie_embeddings_and_output_weights=untie, **QWEN3)
    model = _model(cfg)
    src = _save(str(tmp_path / "ckpt"), model, cfg)
    if resplit:
        convert(src, str(tmp_path / "t2d2"), tp=2, pp=2)
        src = str(tmp_path / "t2d2")
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    capsys.readouterr()
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    assert (hf_cfg["architectures"], hf_cfg["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")
    assert (hf_cfg["head_dim"], hf_cfg["attention_bias"], hf_cfg["tie_word_embeddings"]) == \
        (head or 8, False, not untie)
    hf = _load_hf(out, transformers.Qwen3ForCausalLM)
    layer = hf.model.layers[1].self_attn
    assert torch.equal(layer.q_norm.weight,
                       model.state_dict()["encoder.layers.1.self_attention.q_layernorm.weight"])
    assert torch.equal(layer.k_norm.weight,
                       model.state_dict()["encoder.layers.1.self_attention.k_layernorm.weight"])
    with torch.no_grad():
        diff = (model(_ids(), None, None)[..., :VOCAB] - hf(_ids()).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("kw,cls", [
    (dict(num_query_groups=2, add_bias_linear=False), transformers.LlamaForCausalLM),
    (dict(num_query_groups=2, rope_scaling_factor=32.0, **QWEN3), transformers.Qwen3ForCausalLM),
    (dict(add_bias_linear=False, add_qkv_bias=True), transformers.Qwen2ForCausalLM),
], ids=["llama3.1", "qwen3-factor32", "qwen2"])
def test_rope_scaled_export_gives_transformers_our_frequencies(tmp_path, capsys, kw, cls):
    """--use-rope-scaling exports as rope_type "llama3" with Llama 3.1's constants, in
    rope_parameters (transformers 5) and rope_scaling + rope_theta (older versions); all
    three models compute their frequencies from it.  max_position_embeddings stays ours
    (16 here): transformers then warns that original_max_position_embeddings (8192) should
    be below it, and computes the same frequencies (they do not depend on it).  Base
    10000 puts a frequency in the blended band, so dropping the scaling would show in
    the logits."""
    cfg = _cfg(rotary_base=10000, rope_scaling=True, untie_embeddings_and_output_weights=True,
               **kw)
    model = _model(cfg)
    out = str(tmp_path / "hf")
    main(["--load", _save(str(tmp_path / "ckpt"), model, cfg), "--to-hf", out])
    assert "keeps max_position_embeddings 16" in capsys.readouterr().err
    hf_cfg = json.load(open(os.path.join(out, "config.json")))
    factor = cfg.rope_scaling_factor
    assert hf_cfg["rope_parameters"] == dict(LLAMA31_ROPE, factor=factor, rope_theta=10000.0)
    assert hf_cfg["rope_scaling"] == dict(LLAMA31_ROPE, factor=factor)
    assert (hf_cfg["rope_theta"], hf_cfg["max_position_embeddings"]) == (10000.0, 16)
    hf = _load_hf(out, cls)
    ours = model.encoder.rotary.inv_freq(torch.device("cpu"))
    assert torch.allclose(hf.model.rotary_emb.inv_freq.double(), ours, rtol=1e-6, atol=0)
    with torch.no_grad():
        logits = model(_ids(), None, None)[..., :VOCAB]
        assert (logits - hf(_ids()).logits).abs().max().item() < 1e-4
        plain = GPTModel(dataclasses.replace(cfg, rope_scaling=False), TP, seed=1).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(_ids(), None, None)[..., :VOCAB] - logits).abs().max().item() > 1e-3
    # an older transformers reads rope_scaling and the top-level rope_theta only
    _edit_config(out, rope_parameters=None)
    old = _load_hf(out, cls)
    assert torch.allclose(old.model.rotary_emb.inv_freq.double(), ours, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------- import
def _hf_llama(tmp_path, name="hf", cls=None, **kw):
    """A tiny random transformers Llama (or ``cls``) saved with save_pretrained, its norms
    and biases moved away from 1 and 0."""
    cls = cls or transformers.LlamaForCausalLM
    config_cls = {transformers.Qwen2ForCausalLM: transformers.Qwen2Config,
                  transformers.Qwen3ForCausalLM: transformers.Qwen3Config}.get(
                      cls, transformers.LlamaConfig)
    args = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                rms_norm_eps=1e-5, rope_theta=500000.0, initializer_range=0.2,
                tie_word_embeddings=False)
    if cls is transformers.Qwen3ForCausalLM:
        args["head_dim"] = 8  # Qwen3's default is 128 whatever the width
    args.update(kw)
    torch.manual_seed(0)
    hf = cls(config_cls(**args)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path / name)
    hf.save_pretrained(path)
    return hf, path


def _ours_from(root) -> GPTModel:
    """Our one-rank model from an imported checkpoint (of any layout), built from the
    config the checkpoint records."""
    ckpt = read_checkpoint(root)
    record = dict(ckpt.config["model"])
    record["params_dtype"] = getattr(torch, record["params_dtype"].removeprefix("torch."))
    model = GPTModel(ModelConfig(**record), TP, seed=1).eval()
    model.load_state_dict(merge_checkpoint(ckpt))
    return model


@pytest.mark.parametrize("tp,pp,groups,bias,tie", [
    (1, 1, 2, False, False), (2, 2, 2, True, True), (2, 1, 4, False, True)])
def test_llama_import_gives_transformers_logits(tmp_path, capsys, tp, pp, groups, bias, tie):
    hf, path = _hf_llama(tmp_path, num_key_value_heads=groups, attention_bias=bias,
                         mlp_bias=bias, tie_word_embeddings=tie)
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out, "--target-tensor-parallel-size", str(tp),
          "--target-pipeline-parallel-size", str(pp), "--make-vocab-size-divisible-by", "64"])
    err = capsys.readouterr().err
    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 48 "
             "--max-position-embeddings 16 --normalization RMSNorm --norm-epsilon 1e-05 "
             "--position-embedding-type rope --rotary-base 500000 --swiglu")
    assert flags in err, err
    assert ("--group-query-attention --num-query-groups 2" in err) == (groups == 2)
    assert ("--disable-bias-linear" in err) == (not bias)
    assert ("--untie-embeddings-and-output-weights" in err) == (not tie)
    assert "--hidden-dropout 0.0 --attention-dropout 0.0" in err and "--finetune" in err
    ckpt = read_checkpoint(out)
    assert (ckpt.tensor, ckpt.pipeline) == (tp, pp)
    model = _ours_from(out)
    with torch.no_grad():
        ours = model(_ids(100), None, None)[..., :100]
        theirs = hf(_ids(100)).logits
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen3-scaled"])
def test_printed_flags_build_the_recorded_model(tmp_path, capsys, kind):
    """The flags the import prints give the trainer the model the checkpoint records
    (also with --qk-layernorm, --kv-channels and --use-rope-scaling: a Qwen3 with Llama
    3.1's RoPE scaling, which transformers' Qwen3 computes too)."""
    from megatron.arguments import build_config, parse_args, validate_args
    from megatron.checkpoint_shape import check_model_shape

    if kind == "llama":
        _, path = _hf_llama(tmp_path, num_key_value_heads=2)
    else:
        _, path = _hf_llama(tmp_path, cls=transformers.Qwen3ForCausalLM, head_dim=16,
                            rope_parameters=dict(LLAMA31_ROPE, rope_theta=500000.0))
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out])
    line = [l for l in capsys.readouterr().err.splitlines() if "train with:" in l][0]
    argv = line.split("train with: ", 1)[1].replace(" [--finetune]", "").split()
    argv += ["--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", "16",
             "--train-iters", "1", "--lr", "1e-4", "--mock-data"]
    model = build_config(validate_args(parse_args(argv), 1)).model
    saved = read_checkpoint(out).config
    check_model_shape(out, saved, model)  # raises on any differing flag
    for key in ("normalization", "position_embedding_type", "rotary_base", "swiglu",
                "num_query_groups", "add_bias_linear", "untie_embeddings_and_output_weights",
                "layernorm_epsilon", "ffn_hidden_size", "hidden_dropout", "attention_dropout",
                "qk_layernorm", "kv_channels", "rope_scaling", "rope_scaling_factor"):
        assert getattr(model, key) == saved["model"][key], key
    assert model.qk_layernorm == model.rope_scaling == (kind != "llama")


def _round_trip(tmp_path, path):
    """Import ``path`` at t=2 d=2, export it again, check every tensor comes back bit for
    bit, and return (config.json before, config.json after)."""
    from safetensors.torch import load_file

    import_hf(path, str(tmp_path / "ours"), tp=2, pp=2, divisible_by=64)
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    a = load_file(os.path.join(path, "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with open(os.path.join(path, "config.json")) as f:
        before = json.load(f)
    with open(str(tmp_path / "back" / "config.json")) as f:
        return before, json.load(f)


@pytest.mark.parametrize("bias,tie", [(False, False), (True, True)])
def test_export_of_an_import_is_the_original_weights(tmp_path, bias, tie):
    _, path = _hf_llama(tmp_path, attention_bias=bias, mlp_bias=bias, tie_word_embeddings=tie)
    before, after = _round_trip(tmp_path, path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "attention_bias", "mlp_bias", "tie_word_embeddings", "rope_parameters",
                "max_position_embeddings", "head_dim"):
        assert before[key] == after[key], key


def test_qwen2_import_gives_transformers_logits(tmp_path, capsys):
    hf, path = _hf_llama(tmp_path, cls=transformers.Qwen2ForCausalLM)
    main(["--from-hf", path, "--save", str(tmp_path / "ours"), "--target-tensor-parallel-size",
          "2"])
    assert "--disable-bias-linear --add-qkv-bias" in capsys.readouterr().err
    model = _ours_from(str(tmp_path / "ours"))
    with torch.no_grad():
        diff = (model(_ids(100), None, None)[..., :100] - hf(_ids(100)).logits).abs().max()
    assert diff.item() < 1e-4


@pytest.mark.parametrize("tp,pp,head,tie", [(1, 1, 8, False), (2, 2, 8, True),
                                             (2, 1, 16, False)])
def test_qwen3_import_gives_transformers_logits(tmp_path, capsys, tp, pp, head, tie):
    """Qwen3's q_norm/k_norm become --qk-layernorm's weights; a head_dim other than
    hidden / heads (16 of 4 heads in 32 here, as Qwen3-0.6B's 128 of 16 in 1024) is
    --kv-channels."""
    hf, path = _hf_llama(tmp_path, cls=transformers.Qwen3ForCausalLM, head_dim=head,
                         tie_word_embeddings=tie)
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out, "--target-tensor-parallel-size", str(tp),
          "--target-pipeline-parallel-size", str(pp), "--make-vocab-size-divisible-by", "64"])
    err = capsys.readouterr().err
    assert "--rotary-base 500000 --swiglu --qk-layernorm" in err, err
    assert ("--kv-channels 16" in err) == (head == 16)
    assert "--disable-bias-linear" in err and "--add-qkv-bias" not in err
    assert "--use-rope-scaling" not in err
    record = read_checkpoint(out).config["model"]
    assert (record["qk_layernorm"], record["kv_channels"], record["add_bias_linear"],
            record["rope_scaling"]) == (True, head, False, False)
    model = _ours_from(out)
    with torch.no_grad():
        diff = (model(_ids(100), None, None)[..., :100] - hf(_ids(100)).logits).abs().max()
    assert diff.item() < 1e-4


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_llama31_rope_scaling_imports(tmp_path, capsys, style):
    """Llama 3.1/3.2's rope_type "llama3" with low 1, high 4, original 8192 is
    --use-rope-scaling --rope-scaling-factor F, whether the file is transformers 5's
    (rope_parameters) or older (rope_scaling and a top-level rope_theta)."""
    rope = dict(LLAMA31_ROPE, factor=32.0, rope_theta=10000.0)
    hf, path = _hf_llama(tmp_path, rope_parameters=rope, max_position_embeddings=16384)
    if style == "rope_scaling":
        _edit_config(path, rope_parameters=None, rope_theta=10000.0,
                     rope_scaling=dict(LLAMA31_ROPE, factor=32.0))
    main(["--from-hf", path, "--save", str(tmp_path / "ours"),
          "--target-tensor-parallel-size", "2"])
    err = capsys.readouterr().err
    assert ("--position-embedding-type rope --rotary-base 10000 --use-rope-scaling "
            "--rope-scaling-factor 32 --swiglu") in err, err
    record = read_checkpoint(str(tmp_path / "ours")).config["model"]
    assert (record["rope_scaling"], record["rope_scaling_factor"]) == (True, 32.0)
    model = _ours_from(str(tmp_path / "ours"))
    assert torch.allclose(model.encoder.rotary.inv_freq(torch.device("cpu")),
                          hf.model.rotary_emb.inv_freq.double(), rtol=1e-6, atol=0)
    with torch.no_grad():
        diff = (model(_ids(100), None, None)[..., :100] - hf(_ids(100)).logits).abs().max()
    assert diff.item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "llama3.2"])
def test_export_of_a_qwen3_or_scaled_import_is_the_original(tmp_path, family):
    if family == "qwen3":
        _, path = _hf_llama(tmp_path, cls=transformers.Qwen3ForCausalLM, head_dim=16,
                            tie_word_embeddings=True)
        keys = ("head_dim", "attention_bias", "rope_parameters", "use_sliding_window")
    else:
        _, path = _hf_llama(tmp_path, rope_parameters=dict(LLAMA31_ROPE, factor=32.0,
                                                           rope_theta=500000.0),
                            max_position_embeddings=16384)
        keys = ("head_dim", "attention_bias", "mlp_bias", "rope_parameters")
    before, after = _round_trip(tmp_path, path)
    for key in keys + ("model_type", "num_key_value_heads", "rms_norm_eps",
                       "tie_word_embeddings", "max_position_embeddings"):
        assert before[key] == after[key], key


def test_llama_tokenizer_directory_is_recorded_and_exported(tmp_path, capsys):
    """A directory whose tokenizer AutoTokenizer loads (Llama's tokenizer.json) is
    recorded as --tokenizer-type HuggingFaceTokenizer; the export writes its files back
    and takes bos/eos ids from it."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(98)}
    vocab.update({"<s>": 98, "</s>": 99})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", unk_token="w0")
    _, path = _hf_llama(tmp_path)
    fast.save_pretrained(path)
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out])
    err = capsys.readouterr().err
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {os.path.abspath(path)}" \
        in err
    data = read_checkpoint(out).config["data"]
    assert data["tokenizer_type"] == "HuggingFaceTokenizer"
    main(["--load", out, "--to-hf", str(tmp_path / "back")])
    assert "tokenizer.json" in os.listdir(tmp_path / "back")
    cfg = json.load(open(tmp_path / "back" / "config.json"))
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (98, 99)
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert back("w5 w7")["input_ids"] == [5, 7]


# ----------------------------------------------------------------------------- refusals
def _one_line(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("kw,expected", [
    (dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
          num_query_groups=2),
     "GPT-2 has no equivalent of this GPT's --num-query-groups 2, and transformers' "
     "LlamaForCausalLM would also need --normalization RMSNorm --position-embedding-type "
     "rope --swiglu"),
    (dict(position_embedding_type="learned_absolute"),
     "GPT-2 has no equivalent of this GPT's --normalization RMSNorm --swiglu, and "
     "transformers' LlamaForCausalLM would also need --position-embedding-type rope"),
    (dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
          add_bias_linear=False),
     "GPT-2 has no equivalent of this GPT's --disable-bias-linear"),
    (dict(rotary_percent=0.5), "--rotary-percent 0.5"),
    (dict(normalization="LayerNorm", qk_layernorm=True, add_bias_linear=False),
     "GPT-2 has no equivalent of this GPT's --position-embedding-type rope --swiglu "
     "--qk-layernorm --disable-bias-linear, and transformers' Qwen3ForCausalLM would also "
     "need --normalization RMSNorm;"),
    (dict(qk_layernorm=True),
     "this GPT's --normalization RMSNorm --position-embedding-type rope --swiglu "
     "--qk-layernorm, and transformers' Qwen3ForCausalLM would also need "
     "--disable-bias-linear;"),
    (dict(qk_layernorm=True, add_bias_linear=False, add_qkv_bias=True),
     "Qwen3ForCausalLM would also need --disable-bias-linear without --add-qkv-bias;"),
    (dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
          qk_layernorm=True),
     "GPT-2 has no equivalent of this GPT's --qk-layernorm, and transformers' "
     "Qwen3ForCausalLM would also need --normalization RMSNorm --position-embedding-type "
     "rope --swiglu"),
    (dict(rope_scaling=True, qk_layernorm=True, rotary_percent=0.5, add_bias_linear=False),
     "(--rotary-percent 0.5); transformers' Qwen3ForCausalLM rotates whole heads"),
])
def test_export_refuses_what_no_transformers_model_computes(tmp_path, capsys, kw, expected):
    cfg = _cfg(**kw)
    src = _save(str(tmp_path / "ckpt"), GPTModel(cfg, TP, seed=1), cfg)
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert expected in err, err
    assert not os.path.exists(tmp_path / "hf")


def test_gpt2_and_bert_exports_refuse_llama_options_in_the_record(tmp_path, capsys):
    """A checkpoint whose record says the block is not GPT-2's is refused even when its
    tensor names look like GPT-2's (GPT-2 weights for another block would load in
    transformers and compute something else)."""
    plain = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        padded_vocab_size=128, num_tokentypes=2)
    bert = BertModel(plain, TP, seed=1)
    record = dict(_record(plain), normalization="RMSNorm")
    src = _save(str(tmp_path / "bert"), bert, plain, model_record=record)
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert "this BERT was built with --normalization RMSNorm" in err
    gpt_cfg = dataclasses.replace(plain, num_tokentypes=0)
    src = _save(str(tmp_path / "gpt"), GPTModel(gpt_cfg, TP, seed=1), gpt_cfg,
                model_record=dict(_record(gpt_cfg), swiglu=True))
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert "GPT-2 has no equivalent of this GPT's --swiglu" in err


def test_export_refuses_a_recorded_option_it_does_not_know(tmp_path, capsys):
    """A key of the recorded model config that the export does not map is refused with
    one line unless it has its default: an option added to the trainer later (or by a
    newer version) never vanishes silently from an exported model."""
    from megatron.hf_export_target import EXPORT_IGNORES, EXPORT_READS

    cfg = _cfg(num_query_groups=2, add_bias_linear=False)
    model = GPTModel(cfg, TP, seed=1)
    src = _save(str(tmp_path / "new"), model, cfg,
                model_record=dict(_record(cfg), num_experts=8))
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert "records num_experts=8, a model option this export does not know" in err, err
    assert not os.path.exists(tmp_path / "hf")
    # off (null or false), an unknown option changes nothing: it exports
    src = _save(str(tmp_path / "off"), model, cfg,
                model_record=dict(_record(cfg), num_experts=None, some_new_switch=False))
    export_hf(src, str(tmp_path / "hf"))
    # every field of ModelConfig is either written (or refused) or known not to matter,
    # so a field added to it must be placed in one of the two here
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert fields == EXPORT_READS | EXPORT_IGNORES
    assert not EXPORT_READS & EXPORT_IGNORES


def test_export_refuses_a_tensor_its_record_does_not_account_for(tmp_path, capsys):
    """Query/key norm weights in a checkpoint whose record predates --qk-layernorm (or
    lost it): the export would drop them, so it stops instead."""
    cfg = _cfg(num_query_groups=2, **QWEN3)
    record = _record(cfg)
    del record["qk_layernorm"]
    src = _save(str(tmp_path / "ckpt"), GPTModel(cfg, TP, seed=1), cfg, model_record=record)
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert "holds 'encoder.layers.0.self_attention.k_layernorm.weight' (and 3 more), which " \
           "its recorded config does not account for" in err, err


def test_qk_norms_are_replicated_over_tensor_ranks(tmp_path):
    """The resharding tool's name rule keeps the query/key norm weights whole on every
    rank (they are [head_dim], shared by the heads), as the model does."""
    from megatron.checkpoint_merge import partition_dim_by_name

    for name in ("encoder.layers.3.self_attention.q_layernorm.weight",
                 "encoder.layers.3.self_attention.k_layernorm.weight",
                 "encoder.layers.3.self_attention.k_layernorm.bias"):
        assert partition_dim_by_name(name) is None
    cfg = _cfg(num_query_groups=2, **QWEN3)
    src = _save(str(tmp_path / "ckpt"), _model(cfg), cfg)
    convert(src, str(tmp_path / "t2"), tp=2, pp=1)
    ckpt = read_checkpoint(str(tmp_path / "t2"))
    name = "encoder.layers.0.self_attention.q_layernorm.weight"
    a, b = (ckpt.payloads[(r, 0)]["model"][name] for r in (0, 1))
    assert a.shape == (8,) and torch.equal(a, b)


def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    json.dump(cfg, open(cfg_path, "w"))


@pytest.mark.parametrize("changes,expected", [
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}),
     "llama3 RoPE scaling with low_freq_factor None, high_freq_factor None, "
     "original_max_position_embeddings 16; this trainer's --use-rope-scaling has Llama 3.1's "
     "low_freq_factor 1, high_freq_factor 4 and original_max_position_embeddings 8192 fixed"),
    (dict(rope_parameters=dict(LLAMA31_ROPE, low_freq_factor=2.0, rope_theta=500000.0)),
     "llama3 RoPE scaling with low_freq_factor 2.0;"),
    (dict(rope_parameters=dict(LLAMA31_ROPE, rope_theta=500000.0),
          original_max_position_embeddings=4096),  # transformers 5 takes the top level's
     "llama3 RoPE scaling with original_max_position_embeddings 4096, "
     "original_max_position_embeddings 4096 at the top level but 8192 in the RoPE settings"),
    (dict(rope_parameters=dict(LLAMA31_ROPE, rope_theta=500000.0),
          rope_scaling=dict(LLAMA31_ROPE, factor=32.0)),
     "rope_parameters and rope_scaling disagree on factor (8.0 and 32.0)"),
    (dict(rope_parameters=dict(LLAMA31_ROPE, factor=0.5, rope_theta=500000.0)),
     "expected the llama3 RoPE factor to be a number >= 1, found 0.5"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}),
     "rope_parameters has rope_type 'yarn' (RoPE scaling)"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_theta=10000.0),
     "rope_theta 10000.0 at the top level but 500000.0 in the RoPE settings"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2}),
     "rope_scaling has rope_type 'dynamic' (RoPE scaling)"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor 0.5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.5}),
     "rope_theta 10000.5 is not a whole number"),
    (dict(attention_bias=True), "attention_bias=true but mlp_bias=false"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' has no equivalent here"),
    # a head_dim of its own is --kv-channels; these weights are not of that shape
    (dict(head_dim=16), "'layers.0.self_attn.q_proj.weight' is float32 (32, 32)"),
])
def test_import_refuses_what_this_trainer_does_not_compute(tmp_path, capsys, changes, expected):
    _, path = _hf_llama(tmp_path)
    _edit_config(path, **changes)
    capsys.readouterr()
    err = _one_line(capsys, ["--from-hf", path, "--save", str(tmp_path / "ours")])
    assert expected in err, err
    assert not os.path.exists(tmp_path / "ours")


@pytest.mark.parametrize("changes,expected", [
    (dict(attention_bias=True), "attention_bias=true (Qwen3: biases on q, k, v and o_proj, "
                                "none in the MLP)"),
    (dict(use_sliding_window=True), "sliding-window attention"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "sliding-window attention"),
    (dict(head_dim=None), "expected head_dim to be a positive integer, found None"),
])
def test_qwen3_import_refusals(tmp_path, capsys, changes, expected):
    _, path = _hf_llama(tmp_path, cls=transformers.Qwen3ForCausalLM)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(changes)  # head_dim None is written as null
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    capsys.readouterr()
    err = _one_line(capsys, ["--from-hf", path, "--save", str(tmp_path / "ours")])
    assert expected in err, err
    assert not os.path.exists(tmp_path / "ours")


def test_qwen3_without_head_dim_has_heads_of_128(tmp_path, capsys):
    """transformers' Qwen3Config defaults head_dim to 128 whatever the width, so a file
    without one is read so (and here its 8-wide weights do not fit)."""
    _, path = _hf_llama(tmp_path, cls=transformers.Qwen3ForCausalLM)
    _edit_config(path, head_dim=None)
    capsys.readouterr()
    err = _one_line(capsys, ["--from-hf", path, "--save", str(tmp_path / "ours")])
    assert "head_dim 128" in err and "expects floating point (512, 32)" in err, err


def test_older_llama_configs_import(tmp_path, capsys):
    """transformers 4's config.json: rope_theta at the top level, no rope_parameters,
    no head_dim, rope_scaling null."""
    hf, path = _hf_llama(tmp_path)
    _edit_config(path, rope_parameters=None, head_dim=None, rope_theta=500000.0)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["rope_scaling"] = None
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    main(["--from-hf", path, "--save", str(tmp_path / "ours")])
    assert "--rotary-base 500000" in capsys.readouterr().err
    model = _ours_from(str(tmp_path / "ours"))
    with torch.no_grad():
        diff = (model(_ids(100), None, None)[..., :100] - hf(_ids(100)).logits).abs().max()
    assert diff.item() < 1e-4

"""Llama-style GPTs <-> transformers' LlamaForCausalLM / Qwen2ForCausalLM
(megatron/hf_interop.py through tools/checkpoint_util.py).

Our RMSNorm/RoPE/SwiGLU/grouped-query GPT exported with --to-hf loads in transformers and
gives our logits; a Llama saved with save_pretrained imports (--from-hf) into any (t, d)
layout and our model built from it gives transformers' logits; export(import(x)) is x's
weights bit for bit.  Tolerances: transformers computes RMSNorm and RoPE's angles in
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
from megatron.hf_interop import (export_hf, import_hf, qkv_groups_to_ours,  # noqa: E402
                                 qkv_ours_to_groups)
from megatron.model.bert_model import BertModel  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.tensor_parallel import TPInfo  # noqa: E402
from tools.checkpoint_util import convert, main, merge_checkpoint, read_checkpoint  # noqa: E402

TP = TPInfo.single()
VOCAB = 96
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True)


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


# ------------------------------------------------------------------------------- import
def _hf_llama(tmp_path, name="hf", cls=None, **kw):
    """A tiny random transformers Llama (or ``cls``) saved with save_pretrained, its norms
    and biases moved away from 1 and 0."""
    cls = cls or transformers.LlamaForCausalLM
    config_cls = transformers.Qwen2Config if cls is transformers.Qwen2ForCausalLM \
        else transformers.LlamaConfig
    args = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                rms_norm_eps=1e-5, rope_theta=500000.0, initializer_range=0.2,
                tie_word_embeddings=False)
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


def test_printed_flags_build_the_recorded_model(tmp_path, capsys):
    """The flags the import prints give the trainer the model the checkpoint records."""
    from megatron.arguments import build_config, parse_args, validate_args
    from megatron.checkpointing import check_model_shape

    _, path = _hf_llama(tmp_path, num_key_value_heads=2)
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
                "layernorm_epsilon", "ffn_hidden_size", "hidden_dropout", "attention_dropout"):
        assert getattr(model, key) == saved["model"][key], key


@pytest.mark.parametrize("bias,tie", [(False, False), (True, True)])
def test_export_of_an_import_is_the_original_weights(tmp_path, bias, tie):
    from safetensors.torch import load_file

    _, path = _hf_llama(tmp_path, attention_bias=bias, mlp_bias=bias, tie_word_embeddings=tie)
    import_hf(path, str(tmp_path / "ours"), tp=2, pp=2, divisible_by=64)
    export_hf(str(tmp_path / "ours"), str(tmp_path / "back"))
    a = load_file(os.path.join(path, "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    before = json.load(open(os.path.join(path, "config.json")))
    after = json.load(open(str(tmp_path / "back" / "config.json")))
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
     "rope_parameters has rope_type 'llama3' (RoPE scaling)"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2}),
     "rope_scaling has rope_type 'linear' (RoPE scaling)"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor 0.5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.5}),
     "rope_theta 10000.5 is not a whole number"),
    (dict(attention_bias=True), "attention_bias=true but mlp_bias=false"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' has no equivalent here"),
    (dict(head_dim=16), "head_dim 16 is not hidden_size / num_attention_heads (8)"),
])
def test_import_refuses_what_this_trainer_does_not_compute(tmp_path, capsys, changes, expected):
    _, path = _hf_llama(tmp_path)
    _edit_config(path, **changes)
    capsys.readouterr()
    err = _one_line(capsys, ["--from-hf", path, "--save", str(tmp_path / "ours")])
    assert expected in err, err
    assert not os.path.exists(tmp_path / "ours")


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

"""The Llama-style block options of the GPT model (RMSNorm, RoPE, SwiGLU, grouped-query
attention, no biases, untied output layer): the math against transformers' Llama in
float64, the tensor-parallel split of the new weights, parameter counts, the flags and
their errors.  Multi-rank training with these options: tests/distributed/test_llama_block.py.
"""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megatron.arguments import ArgumentError, build_config, parse_args, validate_args
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.transformer import apply_rotary, non_gpt2_options
from megatron.tensor_parallel import TPInfo
from megatron.tensor_parallel.param_init import shard, unshard

LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=16,
                padded_vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0,
                ffn_hidden_size=96, params_dtype=torch.float64, layernorm_epsilon=1e-6)
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------ against transformers
def _to_llama_state(model: GPTModel, cfg: ModelConfig) -> dict:
    """Our weights under transformers' Llama names (written here independently of
    megatron/hf_interop.py: q/k/v rows per group, SwiGLU's [gate; up])."""
    p = {n: t.detach() for n, t in model.named_parameters()}
    a, g, h = cfg.num_attention_heads, cfg.num_query_groups, cfg.hidden_size
    d, per = cfg.kv_channels, a // g
    out = {"model.embed_tokens.weight": p["embedding.word_embeddings.weight"],
           "lm_head.weight": p["output_layer.weight"],
           "model.norm.weight": p["encoder.final_layernorm.weight"]}
    for i in range(cfg.num_layers):
        o, t = f"encoder.layers.{i}.", f"model.layers.{i}."
        qkv = p[o + "self_attention.query_key_value.weight"].view(g, per + 2, d, h)
        out[t + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(a * d, h)
        out[t + "self_attn.k_proj.weight"] = qkv[:, per].reshape(g * d, h)
        out[t + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(g * d, h)
        bias = p.get(o + "self_attention.query_key_value.bias")
        if bias is not None:
            bias = bias.view(g, per + 2, d)
            out[t + "self_attn.q_proj.bias"] = bias[:, :per].reshape(a * d)
            out[t + "self_attn.k_proj.bias"] = bias[:, per].reshape(g * d)
            out[t + "self_attn.v_proj.bias"] = bias[:, per + 1].reshape(g * d)
        out[t + "self_attn.o_proj.weight"] = p[o + "self_attention.dense.weight"]
        gate, up = p[o + "mlp.dense_h_to_4h.weight"].chunk(2)
        out[t + "mlp.gate_proj.weight"], out[t + "mlp.up_proj.weight"] = gate, up
        out[t + "mlp.down_proj.weight"] = p[o + "mlp.dense_4h_to_h.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[t + norm + ".weight"] = p[o + norm + ".weight"]
        if cfg.qk_layernorm:  # Qwen3's names
            out[t + "self_attn.q_norm.weight"] = p[o + "self_attention.q_layernorm.weight"]
            out[t + "self_attn.k_norm.weight"] = p[o + "self_attention.k_layernorm.weight"]
    return out


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("family, groups, head", [
    ("llama", 8, 8), ("llama", 2, 8), ("llama", 1, 8), ("qwen2", 2, 8), ("qwen3", 2, 8),
    ("qwen3", 2, 16), ("llama3.1", 2, 8)],
    ids=["llama-mha", "llama-gqa", "llama-mqa", "qwen2-qkv-bias", "qwen3-qk-norm",
         "qwen3-wide-heads", "llama3.1-rope-scaling"])
def test_equals_transformers_in_float64(family, groups, head, monkeypatch):
    """Llama (no biases), Qwen2 (--disable-bias-linear --add-qkv-bias), Qwen3
    (--qk-layernorm; with heads of 16 in a hidden size of 64: --kv-channels, as
    Qwen3-0.6B) and Llama 3.1 (--use-rope-scaling)."""
    transformers = pytest.importorskip("transformers")
    import importlib

    scaled = family == "llama3.1"
    family = "llama" if scaled else family
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")

    # transformers computes RMSNorm in float32 whatever the model's dtype (and RoPE's
    # angles too); in float64 both sides must agree to rounding.
    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))
    norm_class = {"llama": "LlamaRMSNorm", "qwen2": "Qwen2RMSNorm", "qwen3": "Qwen3RMSNorm"}
    monkeypatch.setattr(getattr(module, norm_class[family]), "forward", rms_norm)

    cfg = _config(num_query_groups=groups, rotary_base=500000, add_qkv_bias=family == "qwen2",
                  qk_layernorm=family == "qwen3", rope_scaling=scaled, kv_channels=head, **LLAMA)
    model = GPTModel(cfg, TPInfo.single(), seed=3).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swap would show
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype,
                                         generator=torch.Generator().manual_seed(len(name))))
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=groups, max_position_embeddings=16,
                  rms_norm_eps=1e-6, rope_theta=500000.0, tie_word_embeddings=False)
    if family == "llama":
        if scaled:
            common["rope_parameters"] = dict(LLAMA31_ROPE, rope_theta=500000.0)
            common["max_position_embeddings"] = 16384  # > the original 8192 context
        hf_cfg = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    elif family == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=head, **common))
    hf = hf.double().eval()
    ours_inv = model.encoder.rotary.inv_freq(torch.device("cpu"))
    if scaled:  # transformers' own Llama 3.1 frequencies (float32) against ours (float64)
        theirs_inv = hf.model.rotary_emb.inv_freq.double()
        assert torch.allclose(ours_inv, theirs_inv, rtol=1e-6, atol=0)
        assert not torch.allclose(ours_inv, 1.0 / 500000.0 ** (torch.arange(0, 8, 2).double() / 8))

    def rope64(x, position_ids):  # the same angles in float64
        inv = ours_inv if scaled else \
            1.0 / (500000.0 ** (torch.arange(0, head, 2, dtype=torch.float64) / head))
        ang = position_ids[..., None].double() * inv
        ang = torch.cat((ang, ang), dim=-1)
        return ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    monkeypatch.setattr(hf.model.rotary_emb, "forward", rope64)
    result = hf.load_state_dict(_to_llama_state(model, cfg), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids, None, None)
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-12


def test_rotary_half_layout_and_partial_rotation():
    """Dimension j of the rotated part pairs with j + r/2; dimensions past r pass."""
    x = torch.randn(5, 1, 1, 8, dtype=torch.float64)
    cfg = _config(hidden_size=64, num_attention_heads=8, position_embedding_type="rope",
                  rotary_percent=0.5)
    assert cfg.rotary_dim == 4
    from megatron.model.transformer import RotaryEmbedding

    cos, sin = RotaryEmbedding(cfg)(5, x.device, x.dtype)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])
    for pos in range(5):
        for j in range(2):
            angle = pos / 10000 ** (2 * j / 4)
            c, s = torch.cos(torch.tensor(angle, dtype=torch.float64)), \
                torch.sin(torch.tensor(angle, dtype=torch.float64))
            a, b = x[pos, 0, 0, j], x[pos, 0, 0, j + 2]
            assert torch.allclose(y[pos, 0, 0, j], a * c - b * s)
            assert torch.allclose(y[pos, 0, 0, j + 2], b * c + a * s)
    # a relative property: q.k after rotation depends on the position difference only
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    cos, sin = RotaryEmbedding(_config(position_embedding_type="rope"))(9, x.device, x.dtype)
    def dot(i, j):
        return (apply_rotary(q, cos[i:i + 1], sin[i:i + 1])
                * apply_rotary(k, cos[j:j + 1], sin[j:j + 1])).sum()
    assert torch.allclose(dot(2, 5), dot(5, 8)) and torch.allclose(dot(0, 3), dot(2, 5))


# ------------------------------------------------------------------ parameters and layout
def test_parameter_names_and_counts():
    cfg = _config(num_query_groups=2, **LLAMA)
    model = GPTModel(cfg, TPInfo.single())
    names = {n: p.shape for n, p in model.named_parameters()}
    h, f, v, d = 64, 96, 128, 8
    assert "embedding.position_embeddings.weight" not in names
    assert names["output_layer.weight"] == (v, h)
    assert names["encoder.layers.0.self_attention.query_key_value.weight"] == ((8 + 2 * 2) * d, h)
    assert names["encoder.layers.0.mlp.dense_h_to_4h.weight"] == (2 * f, h)
    assert not any(n.endswith(".bias") for n in names)
    per_layer = h * (8 + 4) * d + h * h + 3 * h * f + 2 * h
    assert sum(p.numel() for p in model.parameters()) == 2 * per_layer + h + 2 * v * h
    # the defaults are GPT-2's block, parameter for parameter
    plain = GPTModel(_config(), TPInfo.single())
    assert "embedding.position_embeddings.weight" in dict(plain.named_parameters())
    assert non_gpt2_options(_config()) == []
    assert non_gpt2_options(cfg) == ["--normalization RMSNorm", "--position-embedding-type rope",
                                     "--swiglu", "--num-query-groups 2", "--disable-bias-linear",
                                     "--untie-embeddings-and-output-weights"]


def test_tensor_parallel_partitions_reassemble_the_single_process_weights():
    """t = 2: each rank holds whole key/value groups with their queries, and [gate_r; up_r]
    of SwiGLU's first weight (stride 2); the pieces give back the t = 1 tensors."""
    cfg = _config(num_query_groups=2, **LLAMA)
    full = dict(GPTModel(cfg, TPInfo.single(), seed=9).named_parameters())
    ranks = [dict(GPTModel(cfg, TPInfo(group=object(), size=2, rank=r), seed=9)
                  .named_parameters()) for r in range(2)]
    qkv = "encoder.layers.1.self_attention.query_key_value.weight"
    assert torch.equal(torch.cat([ranks[0][qkv], ranks[1][qkv]]), full[qkv])
    h4h = "encoder.layers.1.mlp.dense_h_to_4h.weight"
    assert ranks[0][h4h].partition_stride == 2
    gate, up = full[h4h].chunk(2)
    assert torch.equal(ranks[1][h4h], torch.cat([gate[48:], up[48:]]))
    assert torch.equal(unshard([ranks[0][h4h], ranks[1][h4h]], 0, stride=2), full[h4h])
    out = "output_layer.weight"
    assert torch.equal(torch.cat([ranks[0][out], ranks[1][out]]), full[out])


def test_shard_and_unshard_are_inverse():
    x = torch.arange(48.0).view(12, 4)
    for size, stride in [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (2, 3)]:
        parts = [shard(x, 0, r, size, stride) for r in range(size)]
        assert torch.equal(unshard(parts, 0, stride), x)
    assert torch.equal(shard(x, 0, 1, 2, 2), torch.cat([x[3:6], x[9:12]]))


def test_model_refuses_inconsistent_options():
    with pytest.raises(ValueError, match="--num-query-groups 3 must divide"):
        GPTModel(_config(num_query_groups=3), TPInfo.single())
    with pytest.raises(ValueError, match="--num-query-groups"):
        GPTModel(_config(num_query_groups=2), TPInfo(group=object(), size=4, rank=0))
    with pytest.raises(ValueError, match="--normalization 'BatchNorm'"):
        GPTModel(_config(normalization="BatchNorm"), TPInfo.single())
    with pytest.raises(ValueError, match="--rotary-percent"):
        GPTModel(_config(position_embedding_type="rope", rotary_percent=0.1), TPInfo.single())
    from megatron.model import BertModel

    with pytest.raises(ValueError, match="--swiglu apply to GPT models only"):
        BertModel(_config(swiglu=True, num_tokentypes=2), TPInfo.single())


def test_gqa_attention_backends_agree():
    """sdpa's enable_gqa and the manual path's repeated key/value heads: same output."""
    from megatron.model.transformer import CoreAttention

    cfg = _config(num_query_groups=2)
    q = torch.randn(16, 2, 8, 8, dtype=torch.float64)
    k, v = torch.randn(16, 2, 2, 8, dtype=torch.float64), torch.randn(16, 2, 2, 8, dtype=torch.float64)
    manual = CoreAttention(cfg, TPInfo.single(), backend="manual")(q, k, v, None)
    sdpa = CoreAttention(cfg, TPInfo.single(), backend="sdpa")(q, k, v, None)
    assert torch.allclose(manual, sdpa, atol=1e-12)
    # query head i reads key/value head i // 4
    one = CoreAttention(cfg, TPInfo.single(), backend="manual")(
        q[:, :, 5:6], k[:, :, 1:2], v[:, :, 1:2], None)
    assert torch.allclose(manual[..., 40:48], one)


# ------------------------------------------------------------------ flags
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
         "--mock-data", "--lr", "1e-3"]
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--swiglu", "--group-query-attention", "--num-query-groups", "2",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--norm-epsilon", "1e-6", "--rotary-base", "500000"]


def _validate(argv, world=1):
    return validate_args(parse_args(argv), world)


def test_flags_reach_the_model_config():
    model = build_config(_validate(SMALL + LLAMA_FLAGS)).model
    assert (model.normalization, model.position_embedding_type, model.swiglu,
            model.num_query_groups, model.add_bias_linear,
            model.untie_embeddings_and_output_weights, model.layernorm_epsilon,
            model.rotary_base) == ("RMSNorm", "rope", True, 2, False, True, 1e-6, 500000)
    plain = build_config(_validate(SMALL)).model
    assert plain.num_query_groups == 8 and not non_gpt2_options(plain)
    # Megatron-LM's older spellings
    old = build_config(_validate(SMALL + ["--use-rotary-position-embeddings",
                                          "--no-position-embedding"])).model
    assert old.position_embedding_type == "rope"
    qwen3 = build_config(_validate(SMALL + LLAMA_FLAGS + ["--qk-layernorm", "--use-rope-scaling",
                                                          "--rope-scaling-factor", "32"])).model
    assert (qwen3.qk_layernorm, qwen3.rope_scaling, qwen3.rope_scaling_factor) == (True, True, 32)
    assert {"--qk-layernorm", "--use-rope-scaling --rope-scaling-factor 32"} <= set(
        non_gpt2_options(qwen3))
    qwen = build_config(_validate(SMALL + ["--disable-bias-linear", "--add-qkv-bias"])).model
    assert (qwen.add_bias_linear, qwen.add_qkv_bias) == (False, True)
    assert non_gpt2_options(qwen) == ["--disable-bias-linear", "--add-qkv-bias"]
    # SwiGLU's default width is Megatron-LM's: 8/3 h rounded down to a multiple of 64
    assert build_config(_validate(SMALL + ["--swiglu"])).model.ffn_hidden_size == 128
    wide = [a if a != "64" else "4096" for a in SMALL]
    assert build_config(_validate(wide + ["--swiglu"])).model.ffn_hidden_size == 10880
    assert build_config(_validate(wide)).model.ffn_hidden_size == 16384
    assert ModelConfig(num_layers=1, hidden_size=4096, num_attention_heads=32,
                       swiglu=True).ffn_hidden_size == 10880
    # --num-query-groups alone is Megatron-LM's default 1, read only with the switch
    assert build_config(_validate(SMALL + ["--num-query-groups", "2"])).model.num_query_groups == 8


@pytest.mark.parametrize("extra, world, text", [
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     "--num-query-groups (3) must divide --num-attention-heads (8)"),
    (["--group-query-attention", "--num-query-groups", "2",
      "--tensor-model-parallel-size", "4"], 4,
     "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"], 1, "--rotary-percent 0.1"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], 1,
     "--rotary-percent must be in (0, 1]"),
    (["--no-position-embedding"], 1, "--no-position-embedding"),
    (["--rotary-interleaved"], 1, "--rotary-interleaved needs --position-embedding-type rope"),
    (["--use-rope-scaling"], 1, "--use-rope-scaling needs --position-embedding-type rope"),
    (["--qk-layernorm", "--swiglu", "--squared-relu"], 1,
     "--squared-relu and --swiglu are two MLP activations"),
])
def test_flag_errors_name_the_flag(extra, world, text):
    with pytest.raises(ArgumentError) as info:
        _validate(SMALL + extra, world)
    assert text in str(info.value)


def test_bert_refuses_the_options_at_argument_time():
    import pretrain_bert

    argv = SMALL + ["--swiglu"]
    args = parse_args(argv, extra_args_provider=pretrain_bert.add_bert_args)
    validate_args(args, 1)
    with pytest.raises(ArgumentError, match="--swiglu: built for GPT models only"):
        build_config(args)


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_of_another_block_is_refused_naming_the_flags():
    from megatron.checkpoint_shape import check_model_shape
    from megatron.errors import CheckpointError

    run = _config(num_query_groups=2, **LLAMA)
    old = {"model": dict(num_layers=2, hidden_size=64, num_attention_heads=8,
                         ffn_hidden_size=96, seq_length=16, max_position_embeddings=16,
                         padded_vocab_size=128, layernorm_epsilon=1e-6)}  # before the options
    with pytest.raises(CheckpointError) as err:
        check_model_shape("ck", old, run)
    msg = str(err.value)
    for part in ("--normalization LayerNorm in the checkpoint, RMSNorm in this run",
                 "--position-embedding-type learned_absolute in the checkpoint, rope",
                 "--swiglu off in the checkpoint, on in this run",
                 "--num-query-groups 8 in the checkpoint, 2 in this run",
                 "biases (--disable-bias-linear) on in the checkpoint, off in this run",
                 "--untie-embeddings-and-output-weights off in the checkpoint, on"):
        assert part in msg, msg
    check_model_shape("ck", old, _config())  # an old checkpoint of the plain block loads
    # RoPE's settings without RoPE, and a QKV bias where every layer has biases: no change
    check_model_shape("ck", old, _config(rotary_base=500000, add_qkv_bias=True))
    with pytest.raises(CheckpointError, match="--norm-epsilon 1e-05 in the checkpoint, 1e-06"):
        check_model_shape("ck", {"model": dict(old["model"], layernorm_epsilon=1e-5)},
                          _config(layernorm_epsilon=1e-6))
    with pytest.raises(CheckpointError, match="--rotary-base 10000 in the checkpoint, 500000"):
        check_model_shape("ck", {"model": dict(old["model"], position_embedding_type="rope")},
                          _config(position_embedding_type="rope", rotary_base=500000))
    same = {"model": dict(old["model"], **LLAMA, num_query_groups=2, rotary_base=10000,
                          rotary_percent=1.0)}
    check_model_shape("ck", same, run)


def test_use_checkpoint_args_takes_the_block_options(tmp_path):
    import pretrain_gpt
    from megatron.training import pretrain

    ck = str(tmp_path / "ck")
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step,
                 argv=SMALL + LLAMA_FLAGS + ["--train-iters", "1", "--eval-iters", "0",
                                             "--num-workers", "0", "--save", ck])
    args = validate_args(parse_args(["--use-checkpoint-args", "--load", ck, "--micro-batch-size",
                                     "2", "--train-iters", "4", "--lr", "1e-4", "--mock-data"]), 1)
    model = build_config(args).model
    assert (model.normalization, model.position_embedding_type, model.swiglu,
            model.num_query_groups, model.add_bias_linear,
            model.untie_embeddings_and_output_weights, model.rotary_base,
            model.layernorm_epsilon) == ("RMSNorm", "rope", True, 2, False, True, 500000, 1e-6)
    note = next(n for n in args.megatron_lm_notes if "--use-checkpoint-args" in n)
    assert "--swiglu" in note and "--group-query-attention --num-query-groups 2" in note
    assert "--disable-bias-linear" in note
    # a flag given under another name counts as given: the command line still wins
    args = validate_args(parse_args(["--use-checkpoint-args", "--load", ck, "--micro-batch-size",
                                     "2", "--train-iters", "4", "--lr", "1e-4", "--mock-data",
                                     "--layernorm-epsilon", "1e-5"]), 1)
    assert args.layernorm_epsilon == 1e-5
    args = validate_args(parse_args(["--use-checkpoint-args", "--load", ck, "--micro-batch-size",
                                     "2", "--train-iters", "4", "--lr", "1e-4", "--mock-data",
                                     "--norm-epsilon", "1e-4"]), 1)
    assert args.layernorm_epsilon == 1e-4


# ------------------------------------------------------------------ Megatron-LM scripts
LLAMA31_8B = [  # the model flags of a Megatron-LM Llama-3.1-8B command line
    "--use-mcore-models", "--bf16", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--use-rotary-position-embeddings",
    "--rotary-percent", "1.0", "--no-rope-fusion", "--no-position-embedding",
    "--normalization", "RMSNorm", "--swiglu", "--num-layers", "32", "--hidden-size", "4096",
    "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
    "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings", "8192",
    "--kv-channels", "128", "--norm-epsilon", "1e-5", "--rotary-base", "500000",
    "--vocab-size", "128256", "--make-vocab-size-divisible-by", "128",
    "--tokenizer-type", "NullTokenizer", "--mock-data",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
    "--pipeline-schedule", "2bw", "--micro-batch-size", "1", "--global-batch-size", "64",
    "--train-iters", "100", "--lr", "3e-4", "--use-distributed-optimizer",
    "--overlap-param-gather"]


def test_megatron_lm_llama3_command_line_validates():
    """32 ranks (t=8: one key/value group per rank, d=4), with Llama 3.1's RoPE scaling."""
    cfg = build_config(_validate(LLAMA31_8B + ["--use-rope-scaling"], world=32))
    model = cfg.model
    assert cfg.optimizer.use_distributed_optimizer and cfg.optimizer.overlap_param_gather
    assert (model.num_query_groups, model.swiglu, model.rotary_base, model.kv_channels,
            model.untie_embeddings_and_output_weights) == (8, True, 500000, 128, True)
    assert (model.rope_scaling, model.rope_scaling_factor) == (True, 8.0)
    with pytest.raises(ArgumentError, match="--rope-scaling-factor must be >= 1"):
        _validate(LLAMA31_8B + ["--use-rope-scaling", "--rope-scaling-factor", "0.5"], world=32)
    with pytest.raises(ArgumentError, match=r"--num-query-groups \(8\) must be divisible by "
                                            r"--tensor-model-parallel-size \(16\)"):
        _validate([a if a != "8" or LLAMA31_8B[i - 1] != "--tensor-model-parallel-size"
                   else "16" for i, a in enumerate(LLAMA31_8B)], world=64)

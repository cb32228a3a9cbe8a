"""The planner and the FLOP count with the Llama-style block options (RMSNorm, RoPE,
SwiGLU, grouped-query attention, no linear biases, untied output layer).

Expected values are written out by hand (or are the published parameter counts), not
taken from the module's helpers; the activation formula is also held to the bytes the
executor's counter measures on the trainer's own layers.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model.flops import gpt_flops_per_iteration, gpt_forward_flops
from megatron.pipeline.planner import (Config, CostModel, HardwareSpec, ModelSpec, command_line,
                                       get_model, search)
from megatron.pipeline.planner.profile import SCHEMA, Profile

REPO = Path(__file__).resolve().parents[2]
GiB = 2.0 ** 30
PLAIN = HardwareSpec(name="plain", gpus_per_server=8, gpu_memory_bytes=16 * GiB, peak_flops=1e12,
                     achieved_flops=1e12, intra_server_bandwidth=1e11,
                     inter_server_bandwidth=1e9, reserved_memory_bytes=0.0)
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True)

# a toy Llama: 8 layers, h=64, 8 heads of 8 dims in 2 groups (kv = 16), f=96, s=32, V=100
L, H, A, G, F, S, V = 8, 64, 8, 2, 96, 32, 100
KV = G * (H // A)
TOY = ModelSpec(num_layers=L, hidden_size=H, num_attention_heads=A, num_query_groups=G,
                ffn_hidden_size=F, seq_length=S, vocab_size=V, **LLAMA)
TOY_LAYER = H * (H + 2 * KV) + H * H + 3 * H * F + 2 * H   # QKV, out, gate+up+down, 2 RMSNorm


# ------------------------------------------------------------------ parameter counts
def test_llama_presets_have_the_published_parameter_counts():
    assert get_model("llama2-7b").num_params == 6_738_415_616
    assert get_model("llama3-8b").num_params == 8_030_261_248
    # Llama-2-7B by hand: per layer 4 h^2 (attention) + 3 h f (SwiGLU) + 2 h (RMSNorms);
    # the word embedding, the final RMSNorm and an untied output layer
    h, f, v = 4096, 11008, 32000
    assert 32 * (4 * h * h + 3 * h * f + 2 * h) + v * h + h + v * h == 6_738_415_616
    # Llama-3-8B: 8 key/value heads of 128 dims, so the QKV projection is h (h + 2 x 1024)
    h, f, v = 4096, 14336, 128256
    assert 32 * (h * (h + 2048) + h * h + 3 * h * f + 2 * h) + 2 * v * h + h == 8_030_261_248


def test_toy_counts_by_hand():
    assert TOY.params_per_layer == TOY_LAYER
    assert TOY.embedding_params == V * H                  # RoPE: no position table
    assert TOY.head_params == H + V * H                   # final RMSNorm + output layer
    assert TOY.num_params == L * TOY_LAYER + V * H + H + V * H
    # each option on its own, against the GPT-2 block's 12 h^2 + 13 h (f = 4h)
    gpt = dict(num_layers=2, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=V)
    base = ModelSpec(**gpt).params_per_layer
    assert base == 12 * H * H + 13 * H
    assert ModelSpec(**gpt, normalization="RMSNorm").params_per_layer == base - 2 * H
    assert ModelSpec(**gpt, swiglu=True, ffn_hidden_size=4 * H).params_per_layer == \
        base + 4 * H * H + 4 * H
    # SwiGLU's default width is Megatron-LM's 8h/3 rounded down to 64: 128 for h = 64
    assert ModelSpec(**gpt, swiglu=True).ffn == 128
    no_bias = base - (3 * H + H + 4 * H + H)              # QKV, output, MLP biases
    assert ModelSpec(**gpt, add_bias_linear=False).params_per_layer == no_bias
    assert ModelSpec(**gpt, add_bias_linear=False, add_qkv_bias=True).params_per_layer == \
        base - (H + 4 * H + H)
    assert ModelSpec(**gpt, num_query_groups=2).params_per_layer == \
        base - 2 * (H - KV) * H - 2 * (H - KV)            # K and V weights and biases
    assert ModelSpec(**gpt, position_embedding_type="rope").embedding_params == V * H
    untied = ModelSpec(**gpt, untie_embeddings_and_output_weights=True)
    assert untied.num_params == ModelSpec(**gpt).num_params + V * H


@pytest.mark.parametrize("options", [
    {}, LLAMA, {**LLAMA, "num_query_groups": 2}, {"swiglu": True, "num_query_groups": 1},
    {"add_bias_linear": False, "add_qkv_bias": True, "normalization": "RMSNorm"},
])
def test_closed_form_counts_the_trainers_model(options):
    """ModelSpec.num_params is the number of parameters the trainer's GPTModel builds."""
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo

    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=40,
                     seq_length=16, vocab_size=64, **options)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                         ffn_hidden_size=40, seq_length=16, padded_vocab_size=64, **options)
    model = GPTModel(config, TPInfo.single())
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_all_defaults_keep_the_gpt_numbers():
    """A GPT-2 block: the same counts as before the options existed (the old formulas,
    written out), and no new flag on its command line."""
    for name in ("gpt-355m", "gpt-1.3b", "gpt-2.2b", "gpt-3.8b"):
        m = get_model(name)
        h, f, s, a, v = m.hidden_size, m.ffn, m.seq_length, m.num_attention_heads, m.vocab_size
        assert m.params_per_layer == 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        assert m.embedding_params == v * h + s * h and m.head_params == 2 * h
        for b, t in ((1, 1), (4, 2)):
            assert m.layer_forward_flops(b) == 2.0 * b * s * (4 * h * h + 2 * h * f) + \
                4.0 * b * s * s * h
            assert m.layer_activation_bytes(b, t) == \
                s * b * h * (10.0 + 8.0 / t) + 4.0 * s * b * f / t + 5.0 * a * s * s * b / t
        assert m.llama_options() == [] and "RMSNorm" not in m.describe()
        assert m == dataclasses.replace(m, num_query_groups=None)  # None means G = a
    assert get_model("gpt-355m").num_params == 354_871_296
    assert "--swiglu" not in command_line(Config(w=1, d=2, b=1, m=4), get_model("gpt-1.3b"))


# ------------------------------------------------------------------ FLOPs
def test_gqa_swiglu_layer_flops_by_hand():
    b = 3
    qkv = 2 * b * S * H * (H + 2 * KV)        # 2 * 3 * 32 * 64 * 96 = 1,179,648
    out = 2 * b * S * H * H                   # 786,432
    mlp = 2 * b * S * 3 * H * F               # 3,538,944
    attn = 4 * b * S * S * H                  # 786,432
    assert qkv + out + mlp + attn == 6_291_456
    assert TOY.layer_forward_flops(b) == 6_291_456
    # the vocabulary matmul is the same whether the output layer is tied or not
    tied = dataclasses.replace(TOY, untie_embeddings_and_output_weights=False)
    assert TOY.head_forward_flops(b) == tied.head_forward_flops(b) == 2 * b * S * H * V


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S,
                padded_vocab_size=V)
    return ModelConfig(**{**base, **kw})


def test_model_flops_of_a_llama_block_by_hand():
    cfg = _config(ffn_hidden_size=F, num_query_groups=G, **LLAMA)
    b = 3
    forward = L * 6_291_456 + 1.5 * b * S * H * V      # the layer above x L + the vocab term
    assert gpt_forward_flops(cfg, b, S) == pytest.approx(forward, rel=1e-15)
    assert gpt_flops_per_iteration(cfg, b, S) == pytest.approx(3 * forward, rel=1e-15)
    assert gpt_flops_per_iteration(cfg, b, S, recompute=True) == pytest.approx(4 * forward,
                                                                               rel=1e-15)
    # tied or untied: the same count; the layer part is the planner's
    assert gpt_forward_flops(dataclasses.replace(
        cfg, untie_embeddings_and_output_weights=False), b, S) == gpt_forward_flops(cfg, b, S)
    assert gpt_forward_flops(cfg, b, S) - 1.5 * b * S * H * V == pytest.approx(
        L * TOY.layer_forward_flops(b), rel=1e-15)


def test_model_flops_of_gpt_are_exactly_the_formulas():
    """All defaults: bit for bit Narayanan's 24 B s l h^2 (1 + s/6h + V/16lh)."""
    for l, h, a, s, v, batch in ((24, 1024, 16, 1024, 50304, 8), (2, 6, 2, 12, 96, 3),
                                 (48, 1920, 24, 512, 50304, 16)):
        cfg = ModelConfig(num_layers=l, hidden_size=h, num_attention_heads=a, seq_length=s,
                          padded_vocab_size=v)
        b, ss = float(batch), float(s)
        assert gpt_forward_flops(cfg, batch, s) == \
            24.0 * b * ss * l * h * h * (1.0 + ss / (6.0 * h) + v / (16.0 * l * h))
    # a GPT-2 block of another MLP width is counted matrix by matrix (the formula
    # assumes f = 4h): f = 2h gives 2 B s (4 h^2 + 2 h 2h) + 4 B s^2 h per layer
    b = 2
    narrow = _config(ffn_hidden_size=2 * H)
    layer = 2 * b * S * (4 * H * H + 4 * H * H) + 4 * b * S * S * H
    assert gpt_forward_flops(narrow, b, S) == pytest.approx(L * layer + 1.5 * b * S * H * V,
                                                            rel=1e-15)


# ------------------------------------------------------------------ activations
def test_activation_bytes_by_hand():
    s, h, f, a, kv = S, H, F, A, KV
    for b, t in ((1, 1), (2, 2)):
        replicated = 10 * s * b * h
        split = (2 * s * b * (h + 2 * kv)      # QKV output (q, k, v views keep it whole)
                 + 2 * s * b * (h + kv)        # RoPE's rotated q and k
                 + 2 * s * b * h               # attention context (output projection)
                 + 8 * s * b * f               # SwiGLU: gate|up, silu(gate), product
                 + 5 * a * s * s * b)          # softmax, its dropout mask and output
        assert TOY.layer_activation_bytes(b, t) == replicated + split / t
        # grouped-query attention without RoPE copies the queries into head order instead
        no_rope = dataclasses.replace(TOY, position_embedding_type="learned_absolute")
        assert no_rope.layer_activation_bytes(b, t) == \
            replicated + (split - 2 * s * b * (h + kv) + 2 * s * b * h) / t
        # the head: final norm input + fp32 logits, tied or not
        assert TOY.head_activation_bytes(b, t) == 2 * s * b * h + 4 * s * b * V / t


def _layer_stash(config: ModelConfig, b: int) -> int:
    """Bytes the executor's counter charges one trainer layer (RoPE's shared table left
    out, as tools/profile_model.py leaves it out of a block)."""
    from megatron.model.transformer import ParallelTransformerLayer, RotaryEmbedding
    from megatron.pipeline.memory import StashTracker
    from megatron.tensor_parallel import TPInfo

    layer = ParallelTransformerLayer(config, TPInfo.single(), 0, seed=1).train()
    s = config.seq_length
    rotary = (RotaryEmbedding(config)(s, torch.device("cpu"), config.params_dtype)
              if config.position_embedding_type == "rope" else None)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in rotary or ()}
    x = torch.randn(s, b, config.hidden_size, dtype=config.params_dtype, requires_grad=True)
    tracker = StashTracker(skip)
    with tracker.counting(0):
        out = layer(x, None, rotary)
    out.sum().backward()
    return tracker.in_flight[0]


def _norm_extra_values(normalization: str, s: int, b: int, h: int) -> int:
    """Values a norm keeps beyond its input: LayerNorm's mean and 1/std per token,
    RMSNorm's 1/rms per token, plus, where torch's RMSNorm is a composite (outside
    CUDA), the normalised input its weight product keeps -- measured, not assumed."""
    from megatron.pipeline.memory import StashTracker

    if normalization == "LayerNorm":
        return 2 * s * b
    norm = torch.nn.RMSNorm(h, dtype=torch.float32)
    x = torch.randn(s, b, h, requires_grad=True)
    tracker = StashTracker({p.untyped_storage().data_ptr() for p in norm.parameters()})
    with tracker.counting(0):
        norm(x)
    kept = tracker.in_flight[0] // 4 - s * b * h      # beyond its input
    assert kept in (s * b, s * b + s * b * h), kept
    return kept


@pytest.mark.parametrize("options", [
    {}, {"normalization": "RMSNorm"}, {"position_embedding_type": "rope"},
    {"swiglu": True}, {"num_query_groups": 2}, {"add_bias_linear": False},
    {"position_embedding_type": "rope", "num_query_groups": 2, "rotary_percent": 0.5},
    {**LLAMA, "num_query_groups": 2}, LLAMA,
])
def test_activation_formula_matches_the_bytes_the_executor_counts(options):
    """The closed form, less what this measurement does not have (no dropout: no masks;
    torch's fused attention: no s x s tensors, a log-sum-exp per query instead), equals
    the counted bytes of a trainer layer up to the per-token norm statistics the
    formula neglects.  fp32 here: the formula's 2-byte values are 4 bytes."""
    s, b, h, a, f = 16, 2, 32, 4, 40
    config = ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=a, seq_length=s,
                         ffn_hidden_size=f, padded_vocab_size=64, hidden_dropout=0.0,
                         attention_dropout=0.0, **options)
    spec = ModelSpec(num_layers=2, hidden_size=h, num_attention_heads=a, seq_length=s,
                     ffn_hidden_size=f, vocab_size=64, **options)
    fp16 = spec.layer_activation_bytes(b) - 2 * s * b * h - 5 * a * s * s * b
    norms = 2 * _norm_extra_values(config.normalization, s, b, h)
    lse = a * b * s
    assert _layer_stash(config, b) == 4 * (fp16 / 2 + norms + lse)


# ------------------------------------------------------------------ stages
def test_untied_output_layer_lives_on_the_last_stage():
    cm = CostModel(TOY, PLAIN)
    for d in (1, 2, 4):
        stages = cm.stage_costs(Config(w=1, d=d, b=1, m=4, schedule="flush"))
        per = (L // d) * TOY_LAYER
        if d == 1:
            assert stages[0].params == per + V * H + H + V * H
            continue
        assert stages[0].params == per + V * H            # word embedding, no positions
        assert stages[-1].params == per + H + V * H       # final RMSNorm + output layer
        assert all(st.params == per for st in stages[1:-1])
        assert sum(st.params for st in stages) == TOY.num_params   # nothing twice
        last = stages[-1]
        assert last.weights_bytes == 2 * last.params and last.optimizer_bytes == 14 * last.params
    # tied: the last stage keeps a copy of the word embedding, summed with the first's
    tied = dataclasses.replace(TOY, untie_embeddings_and_output_weights=False)
    two = CostModel(tied, PLAIN).stage_costs(Config(w=1, d=2, b=1, m=4, schedule="flush"))
    assert two[-1].params == (L // 2) * TOY_LAYER + H + V * H
    assert two[0].allreduce_s > 0 and two[-1].allreduce_s > 0
    # untied: nothing shared between the stages, so no all-reduce with one pipeline
    one = cm.stage_costs(Config(w=1, d=2, b=1, m=4, schedule="flush"))
    assert one[0].allreduce_s == one[-1].allreduce_s == 0.0


def test_tensor_parallelism_must_divide_the_query_groups():
    cm = CostModel(TOY, PLAIN)
    cm.check(Config(w=1, d=1, t=2))
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 4 must divide "
                                         "--num-query-groups 2"):
        cm.check(Config(w=1, d=1, t=4))
    rows = search(TOY, PLAIN, 4, 16, tensor_parallel=True)
    t4 = [r for r in rows if r.config.t == 4]
    assert t4 and all(not r.fits and "2 query groups" in r.reason_rejected for r in t4)
    assert any(r.fits and r.config.t == 2 for r in rows)


def test_bad_options_are_clear_errors():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=16,
                vocab_size=64)
    with pytest.raises(ValueError, match="--num-query-groups 3 must divide "
                                         "--num-attention-heads 8"):
        ModelSpec(**base, num_query_groups=3)
    with pytest.raises(ValueError, match="--normalization 'BatchNorm'"):
        ModelSpec(**base, normalization="BatchNorm")
    with pytest.raises(ValueError, match="--position-embedding-type 'alibi'"):
        ModelSpec(**base, position_embedding_type="alibi")
    with pytest.raises(ValueError, match="--rotary-percent 0.1"):
        ModelSpec(**base, position_embedding_type="rope", rotary_percent=0.1)
    with pytest.raises(ValueError, match="--swiglu apply to GPT models only"):
        ModelSpec(**base, kind="bert", swiglu=True)


def test_command_line_passes_the_options_the_trainer_parses():
    from megatron.arguments import parse_args

    model = get_model("llama3-8b")
    cmd = command_line(Config(w=2, d=4, t=8, b=1, m=8, schedule="flush"), model)
    words = shlex.split(cmd)
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    args = parse_args(words[script + 1:])
    assert (args.normalization, args.position_embedding_type, args.rotary_base) == \
        ("RMSNorm", "rope", 500000)
    assert args.swiglu and args.group_query_attention and args.num_query_groups == 8
    assert not args.add_bias_linear and args.untie_embeddings_and_output_weights
    assert args.ffn_hidden_size == 14336


# ------------------------------------------------------------------ profiles
def _profile_dict(model: dict, rotary: int = 0) -> dict:
    rows = []
    for b in (1, 2):
        row = {"micro_batch_size": b, "stage_input_bytes": 4 * S * b * H,
               "data_bytes": b * (S + 1) * 8,
               **{name: {"forward_s": 1e-3 * b, "backward_s": 2e-3 * b, "stash_bytes": 100 * b}
                  for name in ("block", "embedding", "head")}}
        if rotary:
            row["rotary_table_bytes"] = rotary
        rows.append(row)
    return {"schema": SCHEMA, "device": {"type": "cpu", "name": "t", "torch": "x", "threads": 1},
            "settings": {}, "model": model, "weights": {},
            "optimizer_step_s": {"block": 1e-3, "embedding": 2e-3, "head": 3e-3,
                                 "tied_embedding": 5e-3},
            "microbatches": rows}


GPT_MODEL = {"kind": "gpt", "num_layers": 4, "hidden_size": H, "num_attention_heads": A,
             "seq_length": S, "ffn_hidden_size": 4 * H, "vocab_size": V}


def test_an_old_profile_is_of_a_gpt2_block():
    prof = Profile(_profile_dict(dict(GPT_MODEL)))
    spec = prof.model_spec()
    assert spec == ModelSpec(num_layers=4, hidden_size=H, num_attention_heads=A, seq_length=S,
                             vocab_size=V, name=spec.name)
    CostModel(spec, PLAIN, profile=prof)                    # matches
    with pytest.raises(ValueError, match=r"--swiglu \(profiled without it\)"):
        CostModel(dataclasses.replace(spec, swiglu=True), PLAIN, profile=prof)
    with pytest.raises(ValueError, match=r"--disable-bias-linear \(profiled without it\)"):
        CostModel(dataclasses.replace(spec, add_bias_linear=False), PLAIN, profile=prof)
    # the last of d > 1 stages steps its copy of the tied embedding
    assert prof.stage(2, False, True, 1, d=2).step_s == pytest.approx(2e-3 + 3e-3 + 5e-3)


def test_a_llama_profile_carries_its_options():
    model = {**GPT_MODEL, "ffn_hidden_size": F, "num_query_groups": G, "rotary_base": 500000,
             **LLAMA}
    prof = Profile(_profile_dict(model, rotary=640))
    spec = prof.model_spec(num_layers=L)
    assert spec == dataclasses.replace(TOY, rotary_base=500000, name=spec.name)
    CostModel(dataclasses.replace(spec, rotary_base=10000), PLAIN, profile=prof)  # no cost
    with pytest.raises(ValueError, match="--num-query-groups 8 .profiled 2."):
        CostModel(dataclasses.replace(spec, num_query_groups=None), PLAIN, profile=prof)
    # RoPE's table once per stage, whatever its layers; no tied copy to step when untied
    st = prof.stage(3, False, True, 2, d=2)
    assert st.stash_bytes == 3 * 200 + 200 + 640
    assert st.step_s == pytest.approx(3e-3 + 3e-3)
    with pytest.raises(ValueError, match="model.swiglu must be bool"):
        Profile(_profile_dict({**model, "swiglu": "yes"}))
    with pytest.raises(ValueError, match="--num-query-groups 3 must divide"):
        Profile(_profile_dict({**model, "num_query_groups": 3}))


def test_profiler_takes_the_options_and_its_pieces_compose_into_stages(tmp_path):
    """tools/profile_model.py on a Llama block: the options reach the model JSON, the
    weights are the closed form's, and each whole GPTModel stage saves its pieces plus
    RoPE's table once."""
    from tools.profile_model import main

    out = tmp_path / "llama.json"
    torch.set_num_threads(1)
    rc = main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--ffn-hidden-size", "40", "--seq-length", "16", "--vocab-size", "64",
               "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--normalization", "RMSNorm",
               "--position-embedding-type", "rope", "--swiglu", "--group-query-attention",
               "--num-query-groups", "2", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--micro-batch-sizes", "1", "2",
               "--warmup", "0", "--repeat", "1", "--device", "cpu", "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    m = data["model"]
    assert (m["normalization"], m["position_embedding_type"], m["swiglu"],
            m["num_query_groups"], m["add_bias_linear"],
            m["untie_embeddings_and_output_weights"]) == ("RMSNorm", "rope", True, 2, False, True)
    spec = Profile(data).model_spec()
    w = data["weights"]
    # QKV 32 x (32 + 2 x 16), output 32 x 32, SwiGLU 3 x 32 x 40, two RMSNorms
    assert w["block_params"] == spec.params_per_layer == 2048 + 1024 + 3840 + 64
    assert w["embedding_params"] == 64 * 32                      # no position table
    assert w["head_params"] == 32 + 64 * 32 and w["tied_embedding_params"] == 0
    chain = data["settings"]["chain_blocks"]
    for row in data["microbatches"]:
        assert row["rotary_table_bytes"] == 2 * 16 * 8 * 4      # cos and sin, s x head_dim
        for kind, st in row["stages"].items():
            pre, post = kind in ("whole", "first"), kind in ("whole", "last")
            assert st["stash_bytes"] == (chain * row["block"]["stash_bytes"]
                                         + pre * row["embedding"]["stash_bytes"]
                                         + post * row["head"]["stash_bytes"]
                                         + row["rotary_table_bytes"])
    prof = Profile(data)
    b = 2
    row = data["microbatches"][1]
    assert prof.stage_stash_bytes(chain, False, False, b) == \
        row["stages"]["middle"]["stash_bytes"]
    # and the planner plans it, passing the profiled options on
    res = subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), "--profile", str(out),
                          "--cluster", "cpu", "--num-gpus", "2", "--max-batch-size", "8"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    for flag in ("--normalization RMSNorm", "--position-embedding-type rope", "--swiglu",
                 "--group-query-attention --num-query-groups 2", "--disable-bias-linear",
                 "--untie-embeddings-and-output-weights"):
        assert flag in res.stdout


# ------------------------------------------------------------------ plan.py
def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_plan_cli_takes_the_llama_flags(tmp_path):
    out = tmp_path / "plan.json"
    res = _plan("--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
                "--ffn-hidden-size", "14336", "--seq-length", "8192", "--vocab-size", "128256",
                "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--rotary-base", "500000", "--swiglu", "--group-query-attention",
                "--num-query-groups", "8", "--disable-bias-linear",
                "--untie-embeddings-and-output-weights", "--cluster", "dgx-a100",
                "--num-gpus", "64", "--max-batch-size", "512", "--tensor-parallel",
                "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "8.03B parameters" in res.stdout and "8 query groups" in res.stdout
    data = json.loads(out.read_text())
    assert data["model"]["num_query_groups"] == 8 and data["model"]["swiglu"]
    assert ModelSpec(**{k: v for k, v in data["model"].items()}).num_params == \
        get_model("llama3-8b").num_params
    assert ("--normalization RMSNorm --position-embedding-type rope --rotary-base 500000 "
            "--swiglu --group-query-attention --num-query-groups 8 --disable-bias-linear "
            "--untie-embeddings-and-output-weights") in data["command"]
    # t = 16 would split 8 key/value heads: rejected with the reason
    t16 = [r for r in data["rows"] if r["config"]["t"] == 16]
    assert t16 and all(not r["fits"] and "8 query groups" in r["reason_rejected"] for r in t16)


def test_plan_cli_presets_and_flag_errors():
    res = _plan("--model", "llama2-7b", "--cluster", "dgx-a100", "--num-gpus", "8",
                "--max-batch-size", "64", "--top", "3")
    assert res.returncode == 0, res.stderr
    assert "6.74B parameters" in res.stdout and "--swiglu" in res.stdout
    assert "--group-query-attention" not in res.stdout
    # a preset with one option changed (and a GPT preset made Llama-like)
    res = _plan("--model", "gpt-1.3b", "--swiglu", "--normalization", "RMSNorm",
                "--num-gpus", "8", "--max-batch-size", "64", "--top", "1")
    assert res.returncode == 0, res.stderr
    assert "gpt-1.3b (modified)" in res.stdout and "--swiglu" in res.stdout
    res = _plan("--model", "gpt-1.3b", "--num-query-groups", "4", "--num-gpus", "8",
                "--max-batch-size", "64")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "--num-query-groups 4 needs --group-query-attention" in res.stderr
    res = _plan("--model", "gpt-1.3b", "--group-query-attention", "--num-query-groups", "3",
                "--num-gpus", "8", "--max-batch-size", "64")
    assert res.returncode == 2 and "--num-query-groups 3 must divide" in res.stderr
    res = _plan("--model", "bert-355m", "--swiglu", "--num-gpus", "8", "--max-batch-size", "64")
    assert res.returncode == 2 and "GPT models only" in res.stderr

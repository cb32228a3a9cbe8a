"""The planner and the FLOP count with the Llama-style block options (RMSNorm, RoPE,
SwiGLU, grouped-query attention, no linear biases, untied output layer, Qwen3's
query/key norms and head size (--kv-channels), Llama 3.1's RoPE scaling).

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


def test_qwen3_preset_has_the_published_parameter_count():
    """Qwen3-0.6B: 596,049,920 parameters (its safetensors hold 751,632,384 because the
    tied lm_head is stored too: + 151936 x 1024)."""
    # the same shape built field by field here, not from the preset's helper
    by_hand = ModelSpec(num_layers=28, hidden_size=1024, num_attention_heads=16,
                        num_query_groups=8, kv_channels=128, ffn_hidden_size=3072,
                        seq_length=32768, vocab_size=151936, normalization="RMSNorm",
                        position_embedding_type="rope", rotary_base=1000000, swiglu=True,
                        qk_layernorm=True, add_bias_linear=False,
                        untie_embeddings_and_output_weights=False)
    assert by_hand.num_params == 596_049_920
    qwen = get_model("qwen3-0.6b")
    assert qwen == dataclasses.replace(by_hand, name="qwen3-0.6b")
    # per layer: q 16 x 128 = 2048 (twice h) and k, v 8 x 128 = 1024 each, so QKV is
    # 1024 x 4096 and the output projection 2048 x 1024; SwiGLU 3 x 1024 x 3072; two
    # RMSNorms of 1024 and the query and key RMSNorms of 128.  Then the word embedding
    # (tied: counted once, no output layer) and the final RMSNorm.
    h, f, v = 1024, 3072, 151936
    layer = h * (2048 + 2 * 1024) + 2048 * h + 3 * h * f + 2 * h + 2 * 128
    assert layer == 15_730_944 and qwen.params_per_layer == layer
    assert 28 * layer + v * h + h == 596_049_920
    assert qwen.num_params - qwen.embedding_params == 440_467_456   # the card's "0.44B"
    assert qwen.llama_options()[qwen.llama_options().index("--kv-channels") + 1] == "128"
    assert "16 heads of 128" in qwen.describe() and "QK norm" in qwen.describe()
    assert "untied output" not in qwen.describe() and "0.60B parameters" in qwen.describe()
    # its layer FLOPs are the model FLOP count's (megatron/model/flops.py) layer part
    cfg = ModelConfig(num_layers=28, hidden_size=h, num_attention_heads=16, num_query_groups=8,
                      kv_channels=128, ffn_hidden_size=f, seq_length=4096,
                      padded_vocab_size=v, swiglu=True)
    spec = dataclasses.replace(qwen, seq_length=4096)
    assert gpt_forward_flops(cfg, 2, 4096) - 2 * 2 * 4096 * h * v == pytest.approx(
        28 * spec.layer_forward_flops(2), rel=1e-14)


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
    # --qk-layernorm: a query and a key norm of head_dim (8) each, weight (and bias)
    assert ModelSpec(**gpt, qk_layernorm=True).params_per_layer == base + 4 * 8
    assert ModelSpec(**gpt, qk_layernorm=True, normalization="RMSNorm").params_per_layer == \
        base - 2 * H + 2 * 8
    # RoPE scaling: other angles, no parameters
    scaled = ModelSpec(**gpt, position_embedding_type="rope", rope_scaling=True)
    assert scaled.num_params == ModelSpec(**gpt, position_embedding_type="rope").num_params
    # --kv-channels 16 (twice h / a = 8): queries, keys and values 8 x 16 = 128 = 2 H wide;
    # QKV H x 3 x 128 + 3 x 128 bias, output 128 x H + H bias: 4 H^2 + 3 H more
    wide = ModelSpec(**gpt, kv_channels=16)
    assert wide.params_per_layer == base + 4 * H * H + 3 * H
    assert wide.params_per_layer == (H * 384 + 384) + (128 * H + H) + (2 * H * 4 * H + 5 * H) \
        + 4 * H
    # --kv-channels 4 (half): 32 = H / 2 wide, QKV H x 96 + 96, output 32 x H + H
    narrow = ModelSpec(**gpt, kv_channels=4)
    assert narrow.params_per_layer == base - 2 * H * H - 3 * H // 2
    # with GQA (2 groups: keys and values 2 x 16 = 32 wide) and the query/key norms of 16
    wide_gqa = ModelSpec(**gpt, kv_channels=16, num_query_groups=2, qk_layernorm=True)
    assert wide_gqa.params_per_layer == H * (128 + 64) + (128 + 64) + 128 * H + H \
        + 2 * H * 4 * H + 5 * H + 4 * H + 4 * 16
    # the default given explicitly is the same model (and no flag)
    assert ModelSpec(**gpt, kv_channels=H // A) == ModelSpec(**gpt)
    assert "--kv-channels" not in ModelSpec(**gpt, kv_channels=H // A).llama_options()
    assert wide.llama_options() == ["--kv-channels", "16"]
    # a hidden size the heads do not divide, with the head size given: 60 = 8 x 7.5
    odd = dict(gpt, hidden_size=60)
    assert ModelSpec(**odd, kv_channels=8).params_per_layer == \
        60 * 192 + 192 + 64 * 60 + 60 + 2 * 60 * 240 + 240 + 60 + 4 * 60


@pytest.mark.parametrize("options", [
    {}, LLAMA, {**LLAMA, "num_query_groups": 2}, {"swiglu": True, "num_query_groups": 1},
    {"add_bias_linear": False, "add_qkv_bias": True, "normalization": "RMSNorm"},
    {**LLAMA, "num_query_groups": 2, "qk_layernorm": True, "rope_scaling": True},
    {"qk_layernorm": True},
    # --kv-channels: heads of 2x and 0.5x h / a (8), with GQA, MQA, norms, biases
    {"kv_channels": 16}, {"kv_channels": 4, "qk_layernorm": True},
    {**LLAMA, "kv_channels": 16, "num_query_groups": 2, "qk_layernorm": True},
    {"kv_channels": 4, "num_query_groups": 1, "add_bias_linear": False, "add_qkv_bias": True},
    # a hidden size the 4 heads do not divide (30), with the head size given
    {"hidden_size": 30, "kv_channels": 8},
    {**LLAMA, "hidden_size": 30, "kv_channels": 6, "num_query_groups": 2,
     "qk_layernorm": True},
])
def test_closed_form_counts_the_trainers_model(options):
    """ModelSpec.num_params is the number of parameters the trainer's GPTModel builds."""
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo

    options = {"hidden_size": 32, **options}
    spec = ModelSpec(num_layers=2, num_attention_heads=4, ffn_hidden_size=40,
                     seq_length=16, vocab_size=64, **options)
    config = ModelConfig(num_layers=2, num_attention_heads=4,
                         ffn_hidden_size=40, seq_length=16, padded_vocab_size=64, **options)
    model = GPTModel(config, TPInfo.single())
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_all_defaults_keep_the_gpt_numbers():
    """A GPT-2 block: the same counts as before the options existed (the old formulas,
    written out; Korthikanti's activations with the explicit softmax, --attention-backend
    local, and a log-sum-exp per query head and token in place of the 5 a s^2 b with
    the default fused kernels), and no new flag on its command line."""
    for name in ("gpt-355m", "gpt-1.3b", "gpt-2.2b", "gpt-3.8b"):
        m = get_model(name)
        h, f, s, a, v = m.hidden_size, m.ffn, m.seq_length, m.num_attention_heads, m.vocab_size
        assert m.params_per_layer == 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        assert m.embedding_params == v * h + s * h and m.head_params == 2 * h
        for b, t in ((1, 1), (4, 2)):
            assert m.layer_forward_flops(b) == 2.0 * b * s * (4 * h * h + 2 * h * f) + \
                4.0 * b * s * s * h
            local = dataclasses.replace(m, attention_backend="local")
            assert local.layer_activation_bytes(b, t) == \
                s * b * h * (10.0 + 8.0 / t) + 4.0 * s * b * f / t + 5.0 * a * s * s * b / t
            assert m.layer_activation_bytes(b, t) == \
                s * b * h * (10.0 + 8.0 / t) + 4.0 * s * b * f / t + 4.0 * a * s * b / t
        assert m.llama_options() == m.backend_options() == [] and \
            "RMSNorm" not in m.describe()
        assert m == dataclasses.replace(m, num_query_groups=None)  # None means G = a
        assert m.kv_channels == h // a and m == dataclasses.replace(m, kv_channels=None)
        assert f"{a} heads," in m.describe()                      # no "of d"
    assert get_model("gpt-355m").num_params == 354_871_296
    assert "--swiglu" not in command_line(Config(w=1, d=2, b=1, m=4), get_model("gpt-1.3b"))
    assert "--kv-channels" not in command_line(Config(w=1, d=2, b=1, m=4), get_model("llama3-8b"))


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


@pytest.mark.parametrize("options", [
    {}, {"kv_channels": 16}, {"kv_channels": 4}, {"swiglu": True, "kv_channels": 16,
                                                  "num_query_groups": 2},
    {**LLAMA, "kv_channels": 4, "num_query_groups": 1, "qk_layernorm": True},
    {"hidden_size": 60, "kv_channels": 8, "ffn_hidden_size": 200},
])
def test_layer_flops_are_the_model_flops_layer_part(options):
    """ModelSpec.layer_forward_flops is megatron/model/flops.py's layer part, head size
    (--kv-channels) included."""
    options = {"hidden_size": H, "ffn_hidden_size": F, **options}
    spec = ModelSpec(num_layers=L, num_attention_heads=A, seq_length=S, vocab_size=V,
                     **options)
    cfg = _config(**options)
    b, h = 3, options["hidden_size"]
    assert gpt_forward_flops(cfg, b, S) - 2 * b * S * h * V == pytest.approx(
        L * spec.layer_forward_flops(b), rel=1e-14)


def test_kv_channels_layer_flops_by_hand():
    """Heads of 16 (2 h / a): the queries and the attention context are 128 = 2h wide."""
    b = 3
    wide = dataclasses.replace(TOY, kv_channels=16)        # q = 8 x 16, kv = 2 x 16
    qkv = 2 * b * S * H * (128 + 2 * 32)      # 2 * 3 * 32 * 64 * 192 = 2,359,296
    out = 2 * b * S * 128 * H                 # 1,572,864
    mlp = 2 * b * S * 3 * H * F               # 3,538,944
    attn = 4 * b * S * S * 128                # 1,572,864
    assert qkv + out + mlp + attn == 9_043_968
    assert wide.layer_forward_flops(b) == 9_043_968
    # heads of 4: 32 = h / 2 wide
    narrow = dataclasses.replace(TOY, kv_channels=4)       # q = 32, kv = 8
    assert narrow.layer_forward_flops(b) == 2 * b * S * (H * 48 + 32 * H + 3 * H * F) + \
        4 * b * S * S * 32
    # the head's vocabulary matmul is h wide whatever d is
    assert wide.head_forward_flops(b) == TOY.head_forward_flops(b)


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S,
                padded_vocab_size=V)
    return ModelConfig(**{**base, **kw})


def test_model_flops_of_a_llama_block_by_hand():
    cfg = _config(ffn_hidden_size=F, num_query_groups=G, **LLAMA)
    b = 3
    layers, head = L * 6_291_456, 2 * b * S * H * V    # the layer above x L; the vocab matmul
    forward = layers + head
    assert gpt_forward_flops(cfg, b, S) == pytest.approx(forward, rel=1e-15)
    assert gpt_flops_per_iteration(cfg, b, S) == pytest.approx(3 * forward, rel=1e-15)
    assert gpt_flops_per_iteration(cfg, b, S, recompute=True) == pytest.approx(
        4 * layers + 3 * head, rel=1e-15)
    # tied or untied: the same count; the layer part is the planner's
    assert gpt_forward_flops(dataclasses.replace(
        cfg, untie_embeddings_and_output_weights=False), b, S) == gpt_forward_flops(cfg, b, S)
    assert gpt_forward_flops(cfg, b, S) - 2 * b * S * H * V == pytest.approx(
        L * TOY.layer_forward_flops(b), rel=1e-15)


def test_model_flops_of_gpt_are_exactly_the_formulas():
    """All defaults: bit for bit Narayanan's 24 B s l h^2 (1 + s/6h) for the layers, plus
    the output layer's 2 B s h V (6 B s h V an iteration, as current Megatron-LM)."""
    for l, h, a, s, v, batch in ((24, 1024, 16, 1024, 50304, 8), (2, 6, 2, 12, 96, 3),
                                 (48, 1920, 24, 512, 50304, 16)):
        cfg = ModelConfig(num_layers=l, hidden_size=h, num_attention_heads=a, seq_length=s,
                          padded_vocab_size=v)
        b, ss = float(batch), float(s)
        assert gpt_forward_flops(cfg, batch, s) == \
            24.0 * b * ss * l * h * h * (1.0 + ss / (6.0 * h)) + 2.0 * b * ss * h * v
        assert gpt_flops_per_iteration(cfg, batch, s) == pytest.approx(
            72.0 * b * ss * l * h * h * (1.0 + ss / (6.0 * h)) + 6.0 * b * ss * h * v,
            rel=1e-15)
    # a GPT-2 block of another MLP width is counted matrix by matrix (the formula
    # assumes f = 4h): f = 2h gives 2 B s (4 h^2 + 2 h 2h) + 4 B s^2 h per layer
    b = 2
    narrow = _config(ffn_hidden_size=2 * H)
    layer = 2 * b * S * (4 * H * H + 4 * H * H) + 4 * b * S * S * H
    assert gpt_forward_flops(narrow, b, S) == pytest.approx(L * layer + 2 * b * S * H * V,
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
                 + 4 * a * s * b)              # fused attention's fp32 log-sum-exp
        assert TOY.layer_activation_bytes(b, t) == replicated + split / t
        # grouped-query attention without RoPE copies the queries into head order instead
        no_rope = dataclasses.replace(TOY, position_embedding_type="learned_absolute")
        assert no_rope.layer_activation_bytes(b, t) == \
            replicated + (split - 2 * s * b * (h + kv) + 2 * s * b * h) / t
        # the head: final norm input and output + the logits in fp16, tied or not
        assert TOY.head_activation_bytes(b, t) == 4 * s * b * h + 2 * s * b * V / t
        # --qk-layernorm with RoPE: the query norm keeps the query copy alive (its input;
        # the key norm's input is a view of the QKV output); RoPE keeps the rotated ones
        qk = dataclasses.replace(TOY, qk_layernorm=True)
        assert qk.layer_activation_bytes(b, t) == replicated + (split + 2 * s * b * h) / t
        # without RoPE: attention keeps the normalised q and k, the query norm the copy
        qk_no_rope = dataclasses.replace(qk, position_embedding_type="learned_absolute")
        assert qk_no_rope.layer_activation_bytes(b, t) == qk.layer_activation_bytes(b, t)
        # multi-head (and multi-query) attention: q is a view, nothing copied (kv = h:
        # the QKV output and the rotated k grow by 2 (h - kv) and h - kv values)
        mha = dataclasses.replace(qk, num_query_groups=A)
        assert mha.layer_activation_bytes(b, t) == replicated + (
            split + 2 * s * b * 2 * (h - kv) + 2 * s * b * (h - kv)) / t
        mqa = dataclasses.replace(qk, num_query_groups=1)   # kv = h / A
        assert mqa.layer_activation_bytes(b, t) == replicated + (
            split - 2 * s * b * 2 * (kv - h // A) - 2 * s * b * (kv - h // A)) / t
        # RoPE scaling changes the angles only
        scaled = dataclasses.replace(TOY, rope_scaling=True, rope_scaling_factor=32.0)
        assert scaled.layer_activation_bytes(b, t) == TOY.layer_activation_bytes(b, t)
        # --kv-channels 16 (2 h / a): q = 8 x 16 = 128, k and v 2 x 16 = 32 wide; the
        # replicated 10 s b h (norms, matrix inputs, residual masks: width h) and the
        # per-head softmax terms stay, every query/key/value width doubles
        wide = dataclasses.replace(TOY, kv_channels=16)
        wide_split = (2 * s * b * (128 + 2 * 32)   # QKV output
                      + 2 * s * b * (128 + 32)     # rotated q and k
                      + 2 * s * b * 128            # context, the output projection's input
                      + 8 * s * b * f + 4 * a * s * b)
        assert wide.layer_activation_bytes(b, t) == replicated + wide_split / t
        # without RoPE: the query copy (128 wide) instead of the rotated q and k
        assert dataclasses.replace(wide, position_embedding_type="learned_absolute") \
            .layer_activation_bytes(b, t) == \
            replicated + (wide_split - 2 * s * b * (128 + 32) + 2 * s * b * 128) / t
        # with the query/key norms and RoPE: + the query copy the query norm keeps
        assert dataclasses.replace(wide, qk_layernorm=True).layer_activation_bytes(b, t) == \
            replicated + (wide_split + 2 * s * b * 128) / t
        # --kv-channels 4 (h / 2a): q = 32, k and v 8 wide
        narrow = dataclasses.replace(TOY, kv_channels=4)
        assert narrow.layer_activation_bytes(b, t) == replicated + (
            2 * s * b * (32 + 16) + 2 * s * b * (32 + 8) + 2 * s * b * 32
            + 8 * s * b * f + 4 * a * s * b) / t
        # the explicit softmax keeps its probabilities, dropout mask and output instead
        for backend in ("unfused", "local"):
            assert dataclasses.replace(TOY, attention_backend=backend) \
                .layer_activation_bytes(b, t) == replicated + (
                    split - 4 * a * s * b + 5 * a * s * s * b) / t
        for backend in ("flash", "fused"):
            assert dataclasses.replace(TOY, attention_backend=backend) \
                .layer_activation_bytes(b, t) == TOY.layer_activation_bytes(b, t)
        # the stage input and the head are h wide whatever d is
        assert wide.input_activation_bytes(b) == TOY.input_activation_bytes(b)
        assert wide.head_activation_bytes(b, t) == TOY.head_activation_bytes(b, t)


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


def _head_norm_extra_values(normalization: str, s: int, b: int, heads: int, d: int) -> int:
    """The same for one --qk-layernorm norm over the d dimensions of each of ``heads``
    heads: its statistics per head and token (and a composite RMSNorm's normalised
    input), measured as above."""
    return _norm_extra_values(normalization, s, b * heads, d)


@pytest.mark.parametrize("options", [
    {}, {"normalization": "RMSNorm"}, {"position_embedding_type": "rope"},
    {"swiglu": True}, {"num_query_groups": 2}, {"num_query_groups": 1},
    {"add_bias_linear": False},
    {"position_embedding_type": "rope", "num_query_groups": 2, "rotary_percent": 0.5},
    {**LLAMA, "num_query_groups": 2}, LLAMA,
    # --qk-layernorm: LayerNorm and RMSNorm, with and without RoPE, MHA, GQA and MQA
    {"qk_layernorm": True}, {"qk_layernorm": True, "num_query_groups": 2},
    {"qk_layernorm": True, "num_query_groups": 1},
    {"qk_layernorm": True, "position_embedding_type": "rope", "num_query_groups": 2},
    {"qk_layernorm": True, "position_embedding_type": "rope", "num_query_groups": 1,
     "normalization": "RMSNorm"},
    {**LLAMA, "qk_layernorm": True, "num_query_groups": 2, "rope_scaling": True},
    {**LLAMA, "qk_layernorm": True},
    # --kv-channels: heads of 16 and 4 (h / a = 8), with and without GQA, MQA, RoPE and
    # the query/key norms, and a hidden size the heads do not divide
    {"kv_channels": 16}, {"kv_channels": 4},
    {"kv_channels": 16, "num_query_groups": 2}, {"kv_channels": 4, "num_query_groups": 2},
    {"kv_channels": 16, "num_query_groups": 1},
    {"kv_channels": 16, "position_embedding_type": "rope"},
    {"kv_channels": 4, "position_embedding_type": "rope", "num_query_groups": 2,
     "rotary_percent": 0.5},
    {"kv_channels": 16, "qk_layernorm": True}, {"kv_channels": 4, "qk_layernorm": True,
                                                "num_query_groups": 2},
    {"kv_channels": 16, "qk_layernorm": True, "position_embedding_type": "rope",
     "num_query_groups": 2},
    {**LLAMA, "kv_channels": 16, "qk_layernorm": True, "num_query_groups": 2},   # Qwen3's
    {**LLAMA, "kv_channels": 4, "num_query_groups": 1, "qk_layernorm": True},
    {**LLAMA, "kv_channels": 4},
    {"hidden_size": 36, "kv_channels": 8},
    {**LLAMA, "hidden_size": 36, "kv_channels": 8, "qk_layernorm": True,
     "num_query_groups": 2},
])
def test_activation_formula_matches_the_bytes_the_executor_counts(options):
    """The closed form, less what this measurement does not have (no dropout: no masks;
    torch's fused attention: no s x s tensors, a log-sum-exp per query instead), equals
    the counted bytes of a trainer layer up to the norm statistics the formula neglects
    (per token for the block's norms, per head and token for the query/key norms).
    fp32 here: the formula's 2-byte values are 4 bytes."""
    s, b, a, f = 16, 2, 4, 40
    options = {"hidden_size": 32, **options}
    h = options["hidden_size"]
    config = ModelConfig(num_layers=2, num_attention_heads=a, seq_length=s,
                         ffn_hidden_size=f, padded_vocab_size=64, hidden_dropout=0.0,
                         attention_dropout=0.0, **options)
    spec = ModelSpec(num_layers=2, num_attention_heads=a, seq_length=s,
                     ffn_hidden_size=f, vocab_size=64, **options)
    assert config.kv_channels == spec.head_dim
    # the residual branches' dropout masks are h wide (s b h bytes each); the fused
    # kernel's log-sum-exp is fp32 in either precision
    lse = a * b * s
    fp16 = spec.layer_activation_bytes(b) - 2 * s * b * h - 4 * lse
    norms = 2 * _norm_extra_values(config.normalization, s, b, h)
    if config.qk_layernorm:
        norms += sum(_head_norm_extra_values(config.normalization, s, b, heads,
                                             config.kv_channels)
                     for heads in (a, config.num_query_groups))
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
    with pytest.raises(ValueError, match="--qk-layernorm apply to GPT models only"):
        ModelSpec(**base, kind="bert", qk_layernorm=True)
    with pytest.raises(ValueError, match="--use-rope-scaling needs --position-embedding-type"):
        ModelSpec(**base, rope_scaling=True)
    with pytest.raises(ValueError, match="--rope-scaling-factor 0.5: expected >= 1"):
        ModelSpec(**base, position_embedding_type="rope", rope_scaling=True,
                  rope_scaling_factor=0.5)
    # the trainer's rule: h / a must divide unless the head size is given
    with pytest.raises(ValueError, match="--hidden-size 60 must be divisible by "
                                         "--num-attention-heads 8, or give --kv-channels"):
        ModelSpec(**{**base, "hidden_size": 60})
    assert ModelSpec(**{**base, "hidden_size": 60}, kv_channels=8).q_size == 64
    with pytest.raises(ValueError, match="--kv-channels must be >= 1, got 0"):
        ModelSpec(**base, kv_channels=0)
    with pytest.raises(ValueError, match="--rotary-percent 0.5 of the head size 2"):
        ModelSpec(**base, kv_channels=2, position_embedding_type="rope", rotary_percent=0.5)
    with pytest.raises(ValueError, match="--kv-channels 16 apply to GPT models only"):
        ModelSpec(**base, kind="bert", kv_channels=16)
    ModelSpec(**base, kind="bert", kv_channels=8)          # h / a: BERT's own heads


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
    # Qwen3's norms and Llama 3.2's RoPE scaling reach the trainer's parser too
    qwen = dataclasses.replace(model, qk_layernorm=True, rope_scaling=True,
                               rope_scaling_factor=32.0)
    cmd = command_line(Config(w=2, d=4, t=8, b=1, m=8, schedule="flush"), qwen)
    assert "--use-rope-scaling --rope-scaling-factor 32 --swiglu --qk-layernorm" in cmd
    words = shlex.split(cmd)
    args = parse_args(words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:])
    assert args.qk_layernorm and args.rope_scaling and args.rope_scaling_factor == 32.0
    assert "QK norm" in qwen.describe() and "RoPE scaling x32" in qwen.describe()
    assert "--qk-layernorm" not in command_line(Config(w=2, d=4, t=8, b=1, m=8), model)
    # Qwen3-0.6B's 16 heads of 128: the command gives the trainer --kv-channels 128
    qwen3 = get_model("qwen3-0.6b")
    cmd = command_line(Config(w=2, d=4, t=2, b=1, m=8, schedule="flush"), qwen3)
    assert "--qk-layernorm --kv-channels 128 --group-query-attention --num-query-groups 8" \
        in cmd
    words = shlex.split(cmd)
    args = parse_args(words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:])
    assert (args.kv_channels, args.hidden_size, args.num_attention_heads) == (128, 1024, 16)
    assert args.qk_layernorm and args.rotary_base == 1000000
    assert not args.untie_embeddings_and_output_weights


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
    with pytest.raises(ValueError, match=r"--qk-layernorm \(profiled without it\)"):
        CostModel(dataclasses.replace(spec, qk_layernorm=True), PLAIN, profile=prof)
    assert (prof.model["qk_layernorm"], prof.model["rope_scaling"],
            prof.model["rope_scaling_factor"]) == (False, False, 8.0)
    # no kv_channels recorded: heads of h / a
    assert prof.model["kv_channels"] == H // A and spec.kv_channels == H // A
    with pytest.raises(ValueError, match=r"--kv-channels 16 \(profiled 8\)"):
        CostModel(dataclasses.replace(spec, kv_channels=16), PLAIN, profile=prof)
    # another hidden size with default heads: named once, not again as a head size
    with pytest.raises(ValueError, match=r"other model shape: --hidden-size 128 "
                                         r"\(profiled 64\)$"):
        CostModel(ModelSpec(num_layers=4, hidden_size=2 * H, num_attention_heads=A,
                            ffn_hidden_size=4 * H, seq_length=S, vocab_size=V), PLAIN,
                  profile=prof)
    # the last of d > 1 stages steps its copy of the tied embedding
    assert prof.stage(2, False, True, 1, d=2).step_s == pytest.approx(2e-3 + 3e-3 + 5e-3)


def test_a_llama_profile_carries_its_options():
    model = {**GPT_MODEL, "ffn_hidden_size": F, "num_query_groups": G, "rotary_base": 500000,
             **LLAMA}
    prof = Profile(_profile_dict(model, rotary=640))
    spec = prof.model_spec(num_layers=L)
    assert spec == dataclasses.replace(TOY, rotary_base=500000, name=spec.name)
    CostModel(dataclasses.replace(spec, rotary_base=10000), PLAIN, profile=prof)  # no cost
    CostModel(dataclasses.replace(spec, rope_scaling=True), PLAIN, profile=prof)   # no cost
    # a profile of Qwen3's block with Llama 3.1's RoPE carries both
    qwen = Profile(_profile_dict({**model, "qk_layernorm": True, "rope_scaling": True,
                                  "rope_scaling_factor": 32.0}, rotary=640))
    qspec = qwen.model_spec(num_layers=L)
    assert (qspec.qk_layernorm, qspec.rope_scaling, qspec.rope_scaling_factor) == \
        (True, True, 32.0)
    with pytest.raises(ValueError, match=r"no --qk-layernorm \(profiled with it\)"):
        CostModel(dataclasses.replace(qspec, qk_layernorm=False), PLAIN, profile=qwen)
    with pytest.raises(ValueError, match="model.qk_layernorm must be bool"):
        Profile(_profile_dict({**model, "qk_layernorm": 1}))
    with pytest.raises(ValueError, match="--num-query-groups 8 .profiled 2."):
        CostModel(dataclasses.replace(spec, num_query_groups=None), PLAIN, profile=prof)
    # RoPE's table once per stage, whatever its layers and microbatches in flight (the
    # stage's shared bytes); no tied copy to step when untied
    st = prof.stage(3, False, True, 2, d=2)
    assert st.stash_bytes == 3 * 200 + 200
    assert prof.shared_bytes(3) == 640 and prof.shared_bytes(0) == 0
    assert prof.stage_stash_bytes(3, False, True, 2) == 3 * 200 + 200 + 640
    for cost in CostModel(spec, PLAIN, profile=prof).stage_costs(
            Config(w=1, d=2, b=2, m=4, schedule="gpipe")):
        assert cost.shared_bytes == 640 and cost.in_flight == 4
    assert st.step_s == pytest.approx(3e-3 + 3e-3)
    with pytest.raises(ValueError, match="model.swiglu must be bool"):
        Profile(_profile_dict({**model, "swiglu": "yes"}))
    with pytest.raises(ValueError, match="--num-query-groups 3 must divide"):
        Profile(_profile_dict({**model, "num_query_groups": 3}))


def test_a_profile_carries_its_head_size():
    """A Qwen3-like profile (heads of 16 where h / a = 8): the planned model gets the
    head size, and a plan with another one is refused, naming the flag."""
    model = {**GPT_MODEL, "ffn_hidden_size": F, "num_query_groups": G, **LLAMA,
             "qk_layernorm": True, "kv_channels": 16}
    prof = Profile(_profile_dict(model, rotary=2 * S * 16 * 4))
    spec = prof.model_spec(num_layers=L)
    assert spec == dataclasses.replace(TOY, qk_layernorm=True, kv_channels=16, name=spec.name)
    assert spec.q_size == 2 * H
    with pytest.raises(ValueError, match=r"--kv-channels 8 \(profiled 16\)"):
        CostModel(dataclasses.replace(spec, kv_channels=None), PLAIN, profile=prof)
    with pytest.raises(ValueError, match="model.kv_channels must be int or NoneType"):
        Profile(_profile_dict({**model, "kv_channels": "16"}))
    with pytest.raises(ValueError, match="--kv-channels must be >= 1"):
        Profile(_profile_dict({**model, "kv_channels": 0}))
    # a hidden size the heads do not divide: loads only with its head size
    odd = {**model, "hidden_size": 60, "kv_channels": 8}
    assert Profile(_profile_dict(odd)).model_spec().q_size == 64
    with pytest.raises(ValueError, match="--hidden-size 60 must be divisible by "
                                         "--num-attention-heads 8, or give --kv-channels"):
        Profile(_profile_dict({**odd, "kv_channels": None}))


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
               "--untie-embeddings-and-output-weights", "--qk-layernorm", "--use-rope-scaling",
               "--rope-scaling-factor", "32", "--micro-batch-sizes", "1", "2",
               "--warmup", "0", "--repeat", "1", "--device", "cpu", "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    m = data["model"]
    assert (m["normalization"], m["position_embedding_type"], m["swiglu"],
            m["num_query_groups"], m["add_bias_linear"],
            m["untie_embeddings_and_output_weights"]) == ("RMSNorm", "rope", True, 2, False, True)
    assert (m["qk_layernorm"], m["rope_scaling"], m["rope_scaling_factor"]) == (True, True, 32.0)
    spec = Profile(data).model_spec()
    w = data["weights"]
    # QKV 32 x (32 + 2 x 16), output 32 x 32, SwiGLU 3 x 32 x 40, two RMSNorms, the
    # query and key RMSNorms of head_dim 8
    assert w["block_params"] == spec.params_per_layer == 2048 + 1024 + 3840 + 64 + 16
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
                 "--untie-embeddings-and-output-weights", "--qk-layernorm",
                 "--use-rope-scaling --rope-scaling-factor 32"):
        assert flag in res.stdout


def test_profiler_records_the_head_size(tmp_path, capsys):
    """tools/profile_model.py --kv-channels: the head size reaches the model and the JSON,
    the weights are the closed form's, and a plan from the profile passes it on."""
    from tools.plan import run
    from tools.profile_model import main

    out = tmp_path / "qwen.json"
    torch.set_num_threads(1)
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--ffn-hidden-size", "40", "--seq-length", "16", "--vocab-size", "64",
             "--make-vocab-size-divisible-by", "32", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--swiglu", "--qk-layernorm",
             "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear"]
    rc = main([*flags, "--kv-channels", "16", "--micro-batch-sizes", "2", "--warmup", "0",
               "--repeat", "1", "--no-stages", "--device", "cpu", "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["model"]["kv_channels"] == 16
    spec = Profile(data).model_spec()
    # QKV 32 x (64 + 2 x 32), output 64 x 32, SwiGLU 3 x 32 x 40, two RMSNorms of 32,
    # the query and key RMSNorms of 16
    assert data["weights"]["block_params"] == spec.params_per_layer == \
        4096 + 2048 + 3840 + 64 + 32
    assert data["microbatches"][0]["rotary_table_bytes"] == 2 * 16 * 16 * 4   # s x 16
    capsys.readouterr()
    assert run(["--profile", str(out), "--cluster", "cpu", "--num-gpus", "2",
                "--max-batch-size", "8", "--top", "1"]) == 0
    printed = capsys.readouterr().out
    assert "--qk-layernorm --kv-channels 16 --group-query-attention" in printed
    assert "4 heads of 16" in printed
    # a hidden size the heads do not divide needs the head size, as in the trainer
    rc = main(["--num-layers", "2", "--hidden-size", "30", "--num-attention-heads", "4",
               "--seq-length", "16", "--vocab-size", "64", "--output", str(tmp_path / "x")])
    assert rc == 2 and "or give --kv-channels" in capsys.readouterr().err


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
    # Qwen3's norms and Llama 3.1's RoPE scaling on a preset: passed on, priced
    res = _plan("--model", "llama3-8b", "--qk-layernorm", "--use-rope-scaling",
                "--rope-scaling-factor", "32", "--cluster", "dgx-a100", "--num-gpus", "8",
                "--max-batch-size", "64", "--top", "1")
    assert res.returncode == 0, res.stderr
    assert "--use-rope-scaling --rope-scaling-factor 32" in res.stdout
    assert "--qk-layernorm" in res.stdout and "QK norm" in res.stdout
    assert "8.03B parameters" in res.stdout  # + 2 x 128 per layer: 8,030,269,440
    res = _plan("--model", "llama3-8b", "--rope-scaling-factor", "32", "--num-gpus", "8",
                "--max-batch-size", "64")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "--rope-scaling-factor 32 needs --use-rope-scaling" in res.stderr
    res = _plan("--model", "gpt-1.3b", "--use-rope-scaling", "--num-gpus", "8",
                "--max-batch-size", "64")
    assert res.returncode == 2 and "--use-rope-scaling needs --position-embedding-type" \
        in res.stderr


def test_plan_cli_takes_the_head_size(tmp_path, capsys):
    """--kv-channels on the planner's command line: the Qwen3 preset, the flags by hand,
    a preset changed, and the trainer's error when h / a does not divide (in-process)."""
    from tools.plan import run

    def plan(*args: str) -> tuple:
        rc = run([*args, "--num-gpus", "8", "--max-batch-size", "64", "--top", "1"])
        out = capsys.readouterr()
        return rc, out.out, out.err

    # (at its full 32768-token context the closed form's s x s softmax terms, 5 a s^2 b
    # bytes a layer, fit no 80 GB GPU: planned here at 4096)
    rc, out, err = plan("--model", "qwen3-0.6b", "--seq-length", "4096", "--cluster",
                        "h100-sxm")
    assert rc == 0, err
    assert "16 heads of 128" in out and "0.60B parameters" in out
    assert "--kv-channels 128" in out and "--qk-layernorm" in out
    assert "--untie-embeddings-and-output-weights" not in out
    # the same model from the flags
    path = tmp_path / "qwen.json"
    rc, out, err = plan("--num-layers", "28", "--hidden-size", "1024", "--num-attention-heads",
                        "16", "--kv-channels", "128", "--ffn-hidden-size", "3072",
                        "--seq-length", "4096", "--vocab-size", "151936",
                        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                        "--rotary-base", "1000000", "--swiglu", "--qk-layernorm",
                        "--group-query-attention", "--num-query-groups", "8",
                        "--disable-bias-linear", "--cluster", "h100-sxm", "--json", str(path))
    assert rc == 0, err
    model = json.loads(path.read_text())["model"]
    assert model["kv_channels"] == 128
    assert ModelSpec(**model).num_params == get_model("qwen3-0.6b").num_params == 596_049_920
    # a GPT preset with more heads keeps heads of h / a (no flag); with --kv-channels, not
    rc, out, err = plan("--model", "gpt-1.3b", "--num-attention-heads", "32")
    assert rc == 0 and "32 heads," in out and "--kv-channels" not in out, err
    rc, out, err = plan("--model", "gpt-1.3b", "--kv-channels", "256")
    assert rc == 0 and "16 heads of 256" in out and "--kv-channels 256" in out, err
    # the Qwen3 preset resized keeps its heads of 128
    rc, out, err = plan("--model", "qwen3-0.6b", "--hidden-size", "1536", "--seq-length",
                        "4096", "--cluster", "h100-sxm")
    assert rc == 0 and "--hidden-size 1536" in out and "--kv-channels 128" in out, err
    rc, out, err = plan("--num-layers", "2", "--hidden-size", "1000", "--num-attention-heads",
                        "16", "--seq-length", "64")
    assert rc == 2 and err.strip().count("\n") == 0
    assert "--hidden-size 1000 must be divisible by --num-attention-heads 16, or give " \
        "--kv-channels" in err
    rc, out, err = plan("--num-layers", "2", "--hidden-size", "1000", "--num-attention-heads",
                        "16", "--seq-length", "64", "--kv-channels", "64")
    assert rc == 0 and "16 heads of 64" in out and "--kv-channels 64" in out, err

"""Model FLOPs per training iteration (Narayanan et al., SC'21, eq. 3, with the output
layer counted as current Megatron-LM counts it).

A forward pass of a GPT with l layers, hidden size h, sequence s, vocab V and batch B
costs 24 B s l h^2 (1 + s / (6 h)) + 2 B s h V floating-point operations (2 per
multiply-add).  Backward costs twice the forward, so an iteration costs 3x: the output
layer 6 B s h V.  With full activation recomputation the transformer layers' forward
runs twice (4x); the output layer is not recomputed.

The paper writes the vocabulary term as V / (16 l h) inside a formula it multiplies by 4
(96 B s l h^2: recomputation on), which is the output layer's 6 B s h V; Megatron-LM's
older logging multiplied the same formula by 3 without recomputation, 4.5 B s h V, an
under-count (3.3% of GPT-345M's total).  This module did too until 2026-11-25.

The 24 B s h^2 of a layer are its four weight matrices with an MLP of width f = 4h:
2 B s (3 h^2 + h^2 + 2 h f).  For other blocks the layer part is counted matrix by
matrix (as the planner's ``ModelSpec.layer_forward_flops``): with G key/value heads
(grouped-query attention; G = a without it) of head_dim dimensions the QKV
projection is 2 B s h (a head_dim + 2 G head_dim); the output projection
2 B s (a head_dim) h; the MLP 2 B s h f x 2, or x 3 with SwiGLU (gate, up and down
matrices); the attention matmuls 4 B s^2 (a head_dim), whatever G is.  head_dim is
--kv-channels, h / a by default.  The vocabulary matmul is the same whether the output
layer is tied to the word embedding or not (the planner's ``head_forward_flops``).
Norms, RoPE (in either pair layout, with or without position interpolation), the
activation (GeLU or --squared-relu), residual adds and biases are elementwise work, not
counted, as in the formula.
"""
from __future__ import annotations

from megatron.config import ModelConfig


def _layers_forward_flops(config: ModelConfig, b: float, s: float) -> float:
    l, h = config.num_layers, config.hidden_size
    f = config.ffn_hidden_size or 4 * h
    a = config.num_attention_heads
    groups = config.num_query_groups or a
    d = config.kv_channels or h // a
    if not config.swiglu and groups == a and f == 4 * h and a * d == h:
        return 24.0 * b * s * l * h * h * (1.0 + s / (6.0 * h))
    q, kv = a * d, groups * d  # query and key/value widths (h and h without GQA/--kv-channels)
    mlp = (3 if config.swiglu else 2) * h * f
    layer = 2.0 * b * s * (h * (q + 2 * kv) + q * h + mlp) + 4.0 * b * s * s * q
    return l * layer


def _output_forward_flops(config: ModelConfig, b: float, s: float) -> float:
    return 2.0 * b * s * config.hidden_size * config.padded_vocab_size


def gpt_forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens."""
    b, s = float(batch_size), float(seq_len)
    return _layers_forward_flops(config, b, s) + _output_forward_flops(config, b, s)


def gpt_flops_per_iteration(config: ModelConfig, batch_size: int, seq_len: int, *,
                            recompute: bool = False) -> float:
    """FLOPs of forward + backward (3x the forward); with ``recompute`` the transformer
    layers' forward once more (the output layer is not recomputed)."""
    b, s = float(batch_size), float(seq_len)
    return ((4.0 if recompute else 3.0) * _layers_forward_flops(config, b, s)
            + 3.0 * _output_forward_flops(config, b, s))

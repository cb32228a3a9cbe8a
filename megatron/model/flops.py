"""Model FLOPs per training iteration (Narayanan et al., SC'21, eq. 3).

A forward pass of a GPT with l layers, hidden size h, sequence s, vocab V and batch B
costs 24 B s l h^2 (1 + s / (6 h) + V / (16 l h)) floating-point operations (2 per
multiply-add).  Backward costs twice the forward, so an iteration costs 3x; with
full activation recomputation the forward runs twice, 4x.
"""
from __future__ import annotations

from megatron.config import ModelConfig


def gpt_forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens."""
    l, h, v = config.num_layers, config.hidden_size, config.padded_vocab_size
    b, s = float(batch_size), float(seq_len)
    return 24.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def gpt_flops_per_iteration(config: ModelConfig, batch_size: int, seq_len: int, *,
                            recompute: bool = False) -> float:
    """FLOPs of forward + backward (x3), or x4 when activations are recomputed."""
    return (4.0 if recompute else 3.0) * gpt_forward_flops(config, batch_size, seq_len)

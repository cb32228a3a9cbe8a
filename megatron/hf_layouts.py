"""What our tensors and transformers' share, both ways (``megatron.hf_interop`` writes,
``megatron.hf_import`` reads): the q/k/v row layouts of a fused attention projection,
interleaved RoPE's head-dimension order, and the names both directions use (our fused
attention projection, transformers' activation and Llama-family model names).
"""
from __future__ import annotations

from typing import Tuple

import torch

QKV_NAME = "self_attention.query_key_value"
GELU_EXACT = ("gelu",)
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
RELU_SQUARED = "relu2"
"""transformers' relu(x)^2 (``ReLUSquaredActivation``): our --squared-relu."""


LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
"""transformers' models of the Llama-style block: Llama (biases on the four linear
layers of a block, or none), Qwen2 (biases on q, k, v only: --disable-bias-linear
--add-qkv-bias) and Qwen3 (no biases, per-head query/key RMSNorms: --qk-layernorm)."""


# ------------------------------------------------------------------- q/k/v layouts
def qkv_ours_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head, (q, k, v), head_dim] -> [(q, k, v), head, head_dim] (weight or bias)."""
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(heads, 3, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest)


def qkv_hf_to_ours(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(3, heads, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest)


def qkv_ours_to_groups(w: torch.Tensor, heads: int, groups: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [group, (the group's heads/groups q heads, k, v), head_dim] -> (q, k, v)
    with rows [head, head_dim] / [group, head_dim] each: Llama's q/k/v_proj (weight or
    bias).  Query head j belongs to group j // (heads / groups), in both layouts."""
    rest = w.shape[1:]
    per = heads // groups
    hd = w.shape[0] // (heads + 2 * groups)
    grouped = w.reshape(groups, per + 2, hd, *rest)
    q = grouped[:, :per].reshape(heads * hd, *rest)
    k = grouped[:, per].reshape(groups * hd, *rest)
    v = grouped[:, per + 1].reshape(groups * hd, *rest)
    return q, k, v


def qkv_groups_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       groups: int) -> torch.Tensor:
    """The inverse of ``qkv_ours_to_groups``: Llama's q/k/v_proj -> our fused rows."""
    rest = q.shape[1:]
    hd = k.shape[0] // groups
    per = q.shape[0] // (groups * hd)
    return torch.cat([q.reshape(groups, per, hd, *rest), k.reshape(groups, 1, hd, *rest),
                      v.reshape(groups, 1, hd, *rest)], dim=1).reshape(-1, *rest)


def rotate_half_order(head_dim: int) -> torch.Tensor:
    """The dimension order [0, 2, 4, ..., 1, 3, 5, ...] of one head: interleaved RoPE's
    pair (2i, 2i+1) lands on rotate-half's pair (i, i + head_dim/2), which turns with the
    same frequency base^(-2i/head_dim).  Queries and keys reordered alike keep every
    q.k product, so the exported model computes the same attention."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def reorder_heads(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows [head, head_dim] (a q/k projection's weight or bias) with each head's
    dimensions taken in ``order``."""
    d = order.numel()
    return rows.unflatten(0, (rows.shape[0] // d, d))[:, order].flatten(0, 1)

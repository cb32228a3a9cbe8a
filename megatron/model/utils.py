"""Helpers shared by the GPT and BERT models: stage splits and attention masks.

Attention masks follow Megatron's convention: a bool tensor broadcastable to
[batch, heads, seq, seq] that is True where attention is NOT allowed.
"""
from __future__ import annotations

from typing import Union

import torch


def stage_layer_numbers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global (0-based) layer numbers held by pipeline stage ``pp_rank`` of ``pp_size``.

    Stages get equal contiguous blocks: stage 0 the first num_layers/pp_size layers.
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline stage {pp_rank} of {pp_size} does not exist")
    if num_layers % pp_size != 0:
        raise ValueError(f"--num-layers {num_layers} must be divisible by "
                         f"--pipeline-model-parallel-size {pp_size}")
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def get_attention_mask(kind: str, seq_len: int,
                       device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """[1, 1, s, s] bool mask, True = masked out.

    ``kind``: 'causal' (left to right, GPT) or 'none' (full attention).  Padding masks
    depend on the batch; build them with ``padding_attention_mask``.
    """
    if kind == "causal":
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)
    elif kind == "none":
        mask = torch.zeros(seq_len, seq_len, dtype=torch.bool, device=device)
    else:
        raise ValueError(f"attention mask kind {kind!r}: expected 'causal' or 'none'")
    return mask.view(1, 1, seq_len, seq_len)


def padding_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool mask from a [b, s] mask with 1/True for real tokens, 0 for padding.

    A pair (i, j) is masked when either token is padding, as in Megatron's BERT.
    """
    keep = padding_mask.bool()
    both = keep.unsqueeze(1) & keep.unsqueeze(2)
    return (~both).unsqueeze(1)


def position_ids_for(input_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """[b, s] positions 0..s-1 (plus ``offset``) matching ``input_ids``."""
    b, s = input_ids.shape
    pos = torch.arange(offset, offset + s, dtype=torch.long, device=input_ids.device)
    return pos.unsqueeze(0).expand(b, s)

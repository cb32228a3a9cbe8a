"""Helpers shared by the GPT and BERT models: stage splits and attention masks.

Attention masks follow Megatron's convention: a bool tensor broadcastable to
[batch, heads, seq, seq] that is True where attention is NOT allowed.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch


def stage_layer_counts(num_layers: int, pp_size: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> List[int]:
    """Layers of each pipeline stage, first to last.

    Without ``first``/``last`` every stage gets ``num_layers / pp_size``.  ``first``
    (``--decoder-first-pipeline-num-layers``) and ``last``
    (``--decoder-last-pipeline-num-layers``) fix the first and last stage's counts, so the
    stage with the embedding and the one with the LM head and loss can hold fewer
    layers; the remaining layers are split evenly over the other stages.  Every stage
    holds at least one layer.  Raises ValueError naming the flag that does not fit.
    """
    if pp_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp_size}")
    if first is None and last is None:
        if num_layers % pp_size != 0:
            raise ValueError(f"--num-layers ({num_layers}) must be divisible by "
                             f"--pipeline-model-parallel-size ({pp_size}) (or set "
                             f"--decoder-first/last-pipeline-num-layers)")
        return [num_layers // pp_size] * pp_size
    if pp_size == 1:
        raise ValueError("--decoder-first/last-pipeline-num-layers need "
                         "--pipeline-model-parallel-size > 1")
    for flag, n in (("--decoder-first-pipeline-num-layers", first),
                    ("--decoder-last-pipeline-num-layers", last)):
        if n is not None and not 1 <= n < num_layers:
            raise ValueError(f"{flag} must be between 1 and --num-layers - 1 "
                             f"({num_layers - 1}), got {n}")
    fixed = [n for n in (first, last) if n is not None]
    free_stages = pp_size - len(fixed)
    rest = num_layers - sum(fixed)
    if free_stages == 0:
        if rest != 0:
            raise ValueError(f"--decoder-first-pipeline-num-layers ({first}) + "
                             f"--decoder-last-pipeline-num-layers ({last}) must equal "
                             f"--num-layers ({num_layers}) with 2 stages")
        return [first, last]
    if rest < free_stages or rest % free_stages != 0:
        raise ValueError(f"--num-layers {num_layers} minus the first/last stage's "
                         f"{'+'.join(map(str, fixed))} leaves {rest} layers, which must split "
                         f"evenly (at least 1 each) over the other {free_stages} stage(s)")
    middle = rest // free_stages
    counts = [middle] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layer_numbers(num_layers: int, pp_size: int, pp_rank: int,
                        first: Optional[int] = None, last: Optional[int] = None) -> range:
    """Global (0-based) layer numbers held by pipeline stage ``pp_rank`` of ``pp_size``.

    Stages hold contiguous blocks; sizes follow ``stage_layer_counts`` (equal unless
    ``first``/``last`` give the first or last stage's count).
    """
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline stage {pp_rank} of {pp_size} does not exist")
    counts = stage_layer_counts(num_layers, pp_size, first, last)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


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

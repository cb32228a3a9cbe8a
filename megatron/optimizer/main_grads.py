"""What each main parameter of ``MegatronOptimizer`` reads from a weight buffer.

A main parameter stands for one model parameter, or with the distributed optimizer for
one piece of it (``megatron.optimizer.sharding``; ``pieces`` is None without).
``unit_grads`` and ``unit_weights`` take each one's gradient or weights out of a buffer
as views; ``unscaled_grads`` divides the gradients by the loss scale, in float32 for
fp32 master weights, else in the weights' own dtype.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron.optimizer.clip_grads import scale_grads_
from megatron.optimizer.sharding import Piece, copy_all, flat_view
from megatron.optimizer.staleness import use_foreach


def unit_grads(grads_from: Sequence[nn.Parameter], pieces: Optional[List[Piece]],
               skip: Tuple[int, ...] = ()) -> List[Optional[torch.Tensor]]:
    """The gradient of each main parameter as it is (None: parameter in ``skip`` or
    without a gradient): ``grads_from[i].grad``, or with the distributed optimizer
    each piece's elements of it (a view: the reducer wrote the average there)."""
    if pieces is None:
        return [None if i in skip or p.grad is None else p.grad
                for i, p in enumerate(grads_from)]
    out: List[Optional[torch.Tensor]] = []
    for pc in pieces:
        g = grads_from[pc.param].grad
        if g is None or pc.param in skip:
            out.append(None)
        else:
            out.append(flat_view(g if g.is_contiguous() else g.contiguous(), pc))
    return out


def unit_weights(buf: Sequence[nn.Parameter],
                 pieces: Optional[List[Piece]]) -> List[torch.Tensor]:
    """Each main parameter's weights in ``buf`` (views of its storage)."""
    if pieces is None:
        return [p.data for p in buf]
    return [flat_view(buf[pc.param].data, pc) for pc in pieces]


def unscaled_grads(grads: List[Optional[torch.Tensor]], inv: float, use_masters: bool,
                   dtypes: List[torch.dtype]) -> List[Optional[torch.Tensor]]:
    """``grads`` (one per entry of ``dtypes``) times ``inv`` (1 / the loss scale): for
    masters in float32 (fp32 gradients in place, others as fp32 copies), else in place
    in the weights' dtype (``dtypes``)."""
    if use_masters:
        # Gradients already in float32 (accumulated so, --accumulate-allreduce-grads-
        # in-fp32) are used as they are: the step releases them anyway.  Others are
        # copied: on an accelerator into views of one float32 allocation, filled by
        # one multi-tensor copy (a cast per parameter was hundreds of launches per
        # step); on the CPU a cast per parameter is cheaper than making the views.
        out: List[Optional[torch.Tensor]] = [None] * len(grads)
        take = []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if g.dtype == torch.float32:
                out[i] = g
            else:
                take.append(i)
        if take and not use_foreach([grads[take[0]]]):
            for i in take:
                out[i] = grads[i].to(torch.float32, copy=True)
        elif take:
            src = [grads[i] for i in take]
            flat = torch.empty(sum(g.numel() for g in src), dtype=torch.float32,
                               device=src[0].device)
            views, at = [], 0
            for g in src:
                views.append(flat[at:at + g.numel()].view(g.shape))
                at += g.numel()
            copy_all(src, views)
            for i, v in zip(take, views):
                out[i] = v
        scale_grads_(out, inv)
        return out
    # the update runs in the weights' dtype: a gradient accumulated in another
    # (fp32 gradients of bf16 weights without masters) is cast to it
    grads = [None if g is None else g if g.dtype == d else g.to(d)
             for g, d in zip(grads, dtypes)]
    scale_grads_(grads, inv)
    return grads

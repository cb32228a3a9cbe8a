"""Autograd-aware communication at the edges of tensor-parallel regions.

Each function is the conjugate of another in the backward pass:

    copy_to_tp_region      forward identity          backward all-reduce
    reduce_from_tp_region  forward all-reduce        backward identity
    gather_from_tp_region  forward all-gather (last) backward keep own slice
    scatter_to_tp_region   forward keep own slice    backward all-gather (last)

All of them return their input unchanged when the tensor-parallel size is 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.tensor_parallel.utils import TPInfo, split_along_last_dim


def _all_reduce(tensor: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    # Collectives work in place; clone so that autograd-saved inputs are never modified.
    out = tensor.clone().contiguous()
    dist.all_reduce(out, group=tp.group)
    return out


def _gather_last_dim(tensor: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(tp.size)]
    dist.all_gather(pieces, tensor, group=tp.group)
    return torch.cat(pieces, dim=-1).contiguous()


def _own_slice(tensor: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    return split_along_last_dim(tensor, tp.size)[tp.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_last_dim(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.tp), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _own_slice(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.tp), None


def copy_to_tp_region(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Enter a TP region with a replicated input (gradients are summed over ranks)."""
    return _CopyToRegion.apply(x, tp) if tp.is_parallel else x


def reduce_from_tp_region(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Leave a TP region by summing the ranks' partial results."""
    return _ReduceFromRegion.apply(x, tp) if tp.is_parallel else x


def gather_from_tp_region(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Leave a TP region by concatenating the ranks' partitions along the last dim."""
    return _GatherFromRegion.apply(x, tp) if tp.is_parallel else x


def scatter_to_tp_region(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Enter a TP region keeping only this rank's slice of the last dim."""
    return _ScatterToRegion.apply(x, tp) if tp.is_parallel else x

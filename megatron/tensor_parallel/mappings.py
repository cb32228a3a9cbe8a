"""Autograd-aware communication at the edges of tensor-parallel regions.

Each function is the conjugate of another in the backward pass:

    copy_to_tp_region      forward identity          backward all-reduce
    reduce_from_tp_region  forward all-reduce        backward identity
    gather_from_tp_region  forward all-gather (last) backward keep own slice
    scatter_to_tp_region   forward keep own slice    backward all-gather (last)

and, for sequence parallelism (--sequence-parallel: the activations that tensor
parallelism replicates are split along the sequence, dim 0 of [s, b, h], instead):

    scatter_to_sequence_parallel_region      forward keep own s/t rows  backward all-gather
    gather_from_sequence_parallel_region     forward all-gather (first) backward
                                             reduce-scatter (or keep own rows)
    reduce_scatter_to_sequence_parallel_region  forward reduce-scatter  backward all-gather

All of them return their input unchanged when the tensor-parallel size is 1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.tensor_parallel.utils import TPInfo, divide, split_along_last_dim


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


# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.10-2.12 have
# only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


def _own_rows(tensor: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """This rank's block of dim 0 (the sequence of [s, b, h]), copied: a block of dim 0
    is already contiguous, so without the copy it would be a view that keeps the whole
    tensor alive for as long as anything keeps the block (the first norm's input, when
    the embedding has no dropout; Megatron-LM clones it too)."""
    rows = divide(tensor.size(0), tp.size, "sequence length (--sequence-parallel)")
    return tensor.narrow(0, tp.rank * rows, rows).clone()


def gather_rows(tensor: torch.Tensor, tp: TPInfo, async_op: bool = False):
    """The ranks' blocks of dim 0 concatenated in rank order (no autograd).
    ``async_op``: return (the output, still being filled, and the work to wait for)."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((tensor.size(0) * tp.size,) + tuple(tensor.shape[1:]))
    work = _all_gather_single(out, tensor, group=tp.group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(tensor: torch.Tensor, tp: TPInfo, async_op: bool = False):
    """The sum over ranks of ``tensor``, of which this rank keeps its block of dim 0.
    ``async_op``: return (the output, still being filled, and the work to wait for)."""
    tensor = tensor.contiguous()
    rows = divide(tensor.size(0), tp.size, "sequence length (--sequence-parallel)")
    out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
    work = _reduce_scatter_single(out, tensor, group=tp.group, async_op=async_op)
    return (out, work) if async_op else out


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


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _own_rows(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.tp), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, reduce_grad):
        ctx.tp, ctx.reduce_grad = tp, reduce_grad
        return gather_rows(x, tp)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_rows(grad, ctx.tp), None, None
        return _own_rows(grad, ctx.tp), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return reduce_scatter_rows(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad, ctx.tp), None


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


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Enter the sequence-parallel region from a replicated [s, b, h]: keep this rank's
    s/t positions (the gradient is gathered back whole)."""
    return _ScatterToSequence.apply(x, tp) if tp.is_parallel else x


def gather_from_sequence_parallel_region(x: torch.Tensor, tp: TPInfo, *,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """[s/t, b, h] -> the whole [s, b, h] on every rank.  ``tensor_parallel_output_grad``:
    what follows is tensor-parallel, each rank's gradient a partial sum, so the backward
    reduce-scatters; False: what follows is replicated (each rank holds the whole
    gradient), so the backward keeps this rank's rows."""
    return (_GatherFromSequence.apply(x, tp, tensor_parallel_output_grad)
            if tp.is_parallel else x)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """Leave a tensor-parallel region into the sequence-parallel one: sum the ranks'
    partial [s, b, h] and keep this rank's s/t positions."""
    return _ReduceScatterToSequence.apply(x, tp) if tp.is_parallel else x

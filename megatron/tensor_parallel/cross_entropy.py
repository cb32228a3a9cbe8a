"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

No rank ever holds the full [.., V] logits: three all-reduces (max, target logit,
sum of exponentials) over [..]-shaped tensors give the exact loss, and the backward
pass is local (softmax minus one-hot restricted to this rank's vocabulary slice).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.tensor_parallel.utils import TPInfo, vocab_range


def _all_reduce(tensor: torch.Tensor, tp: TPInfo, op=dist.ReduceOp.SUM) -> None:
    if tp.is_parallel:
        dist.all_reduce(tensor, op=op, group=tp.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(compute_dtype)
        # Subtracting the global max keeps exp() finite; it cancels out of the loss.
        global_max = x.max(dim=-1).values
        _all_reduce(global_max, tp, dist.ReduceOp.MAX)
        x = x - global_max.unsqueeze(-1)

        part = x.size(-1)
        start, end = vocab_range(part * tp.size, tp.rank, tp.size)
        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        _all_reduce(target_logit, tp)

        exp = x.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, tp)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        # In place, as Megatron: logits-sized buffers dominate the last stage's memory.
        # The price is that this graph cannot be back-propagated twice.
        grad = softmax
        inside = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -inside)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad.to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp: TPInfo = TPInfo()) -> torch.Tensor:
    """Per-token loss -log softmax(logits)[target], same shape as ``target``.

    ``logits``: [..., V / tp.size], this rank's vocabulary slice (rank r holds ids
    [r * V/t, (r+1) * V/t)).  ``target``: [...] global token ids.  The loss is computed
    in float32, or float64 when the logits are float64.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and "
                         f"target {tuple(target.shape)} must agree on all but the last dim")
    return _VocabParallelCrossEntropy.apply(logits, target, tp)

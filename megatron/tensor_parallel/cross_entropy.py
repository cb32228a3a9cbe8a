"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

No rank ever holds the full [.., V] logits: per-token all-reduces (max and sum of the
per-rank log-sum-exps, the target logit) over [..]-shaped tensors give the exact loss,
and the backward pass is local (softmax minus one-hot restricted to this rank's
vocabulary slice).

Nor does any rank hold the logits in float32 for a whole microbatch: the logits stay
in their own dtype (bf16/fp16 under mixed precision) and the float32 (or wider) math
runs over chunks of tokens, ``chunk_rows`` at a time.  The forward pass saves the
logits plus one float per token (the log-sum-exp); the backward pass recomputes each
chunk's softmax from them.  At GPT-345M's shape (seq 1024, micro batch 8, vocab
50304, bf16) that is 0.77 GiB saved per microbatch instead of a 1.54 GiB float32
softmax (plus a 1.54 GiB float32 copy of the logits and a 1.54 GiB float32 gradient at
the peak).

``fused=True`` (``--cross-entropy-loss-fusion``) hands the per-token math to
``torch.compile``: the forward pass is one kernel that reads the low-precision logits
once for the log-sum-exp and the target logit, the backward pass one kernel that reads
them again and writes the low-precision gradient.  The float32 values never reach
memory, so no chunking is needed; the price is a second logits-sized buffer during the
backward pass (the gradient is a new tensor, not written over the logits), and the
compilation (seconds: once for the first shape, once more for all other shapes).  The chunked eager code stays the default and the
reference the fused path is tested against.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron.tensor_parallel.utils import TPInfo, vocab_range

CHUNK_BYTES = 64 * 2 ** 20
"""Size of one chunk's float32 working copy: big enough that a chunk is a few large
kernels on a GPU, small next to the logits of a microbatch."""


def _all_reduce(tensor: torch.Tensor, tp: TPInfo, op=dist.ReduceOp.SUM) -> None:
    if tp.is_parallel:
        dist.all_reduce(tensor, op=op, group=tp.group)


def default_chunk_rows(vocab_part: int, compute_dtype: torch.dtype) -> int:
    elem = torch.finfo(compute_dtype).bits // 8
    return max(1, CHUNK_BYTES // (vocab_part * elem))


def _fused_lse_and_target(x: torch.Tensor, target: torch.Tensor, dtype: torch.dtype):
    """Per row of ``x`` [n, V]: log-sum-exp and ``x[target]``, both in ``dtype``."""
    xf = x.to(dtype)
    return torch.logsumexp(xf, dim=-1), xf.gather(-1, target[:, None]).squeeze(-1)


def _fused_grad(x: torch.Tensor, lse: torch.Tensor, target: torch.Tensor,
                inside: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """(softmax(x) - onehot(target) * inside) * grad_loss per row, in ``x``'s dtype."""
    p = torch.exp(x.to(lse.dtype) - lse[:, None])
    hit = torch.arange(x.size(-1), device=x.device)[None, :] == target[:, None]
    p = p - hit.to(p.dtype) * inside[:, None]
    return (p * grad_loss[:, None].to(p.dtype)).to(x.dtype)


_COMPILED: dict = {}


def _compiled(name: str):
    """The fused functions under ``torch.compile`` (built on first use, one per process).
    The first logits shape gets a static kernel; a second shape (evaluation, a task with
    other lengths) recompiles once with dynamic shapes that serve every later one.  Not
    ``fullgraph``: were dynamo's recompile limit ever hit (a new dtype, say) it runs the
    same functions eagerly, still exact, instead of failing the run."""
    fn = _COMPILED.get(name)
    if fn is None:
        fn = torch.compile({"forward": _fused_lse_and_target, "backward": _fused_grad}[name])
        _COMPILED[name] = fn
    return fn


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, chunk_rows, inplace_backward, fused=False):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        part = logits.size(-1)
        flat = logits.reshape(-1, part)
        tgt = target.reshape(-1)
        n = tgt.numel()
        rows = chunk_rows or default_chunk_rows(part, compute_dtype)

        start, end = vocab_range(part * tp.size, tp.rank, tp.size)
        outside = (tgt < start) | (tgt >= end)
        local_target = (tgt - start).masked_fill(outside, 0)

        if fused:
            local_lse, target_logit = _compiled("forward")(flat, local_target, compute_dtype)
        else:
            local_lse = torch.empty(n, dtype=compute_dtype, device=logits.device)
            target_logit = torch.empty(n, dtype=compute_dtype, device=logits.device)
            for i in range(0, n, rows):
                x = flat[i:i + rows].to(compute_dtype)
                # logsumexp subtracts the row max itself: exp() never overflows
                torch.logsumexp(x, dim=-1, out=local_lse[i:i + rows])
                target_logit[i:i + rows] = x.gather(-1, local_target[i:i + rows, None]).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        _all_reduce(target_logit, tp)
        if tp.is_parallel:
            # log sum_r exp(lse_r) = m + log sum_r exp(lse_r - m), m = max_r lse_r
            global_max = local_lse.clone()
            _all_reduce(global_max, tp, dist.ReduceOp.MAX)
            sum_exp = (local_lse - global_max).exp_()
            _all_reduce(sum_exp, tp)
            lse = global_max + sum_exp.log_()
        else:
            lse = local_lse
        loss = lse - target_logit

        ctx.save_for_backward(flat, local_target, outside, lse)
        ctx.rows = rows
        ctx.shape = logits.shape
        ctx.inplace = inplace_backward
        ctx.fused = fused
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        flat, local_target, outside, lse = ctx.saved_tensors
        if ctx.fused:
            inside = (~outside).to(lse.dtype)
            grad = _compiled("backward")(flat, lse, local_target, inside,
                                         grad_loss.reshape(-1))
            return grad.view(ctx.shape), None, None, None, None, None
        # In place (the models' logits are a temporary nobody else reads), as Megatron:
        # logits-sized buffers dominate the last stage's memory.  The price is that this
        # graph cannot be back-propagated twice.
        grad = flat if ctx.inplace else torch.empty_like(flat)
        g = grad_loss.reshape(-1)
        inside = (~outside).to(lse.dtype)
        rows = ctx.rows
        # same dtype and in place: work on the logits directly, no copy at all
        direct = ctx.inplace and flat.dtype == lse.dtype
        for i in range(0, flat.size(0), rows):
            if direct:
                p = flat[i:i + rows].sub_(lse[i:i + rows, None])
            else:  # one pass: read the low-precision logits, write float32 differences
                p = torch.sub(flat[i:i + rows], lse[i:i + rows, None])
            p.exp_()
            p.scatter_add_(-1, local_target[i:i + rows, None], -inside[i:i + rows, None])
            p.mul_(g[i:i + rows, None].to(p.dtype))
            if not direct:
                grad[i:i + rows].copy_(p)
        return grad.view(ctx.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp: TPInfo = TPInfo(), *, chunk_rows: Optional[int] = None,
                                 inplace_backward: bool = False,
                                 fused: bool = False) -> torch.Tensor:
    """Per-token loss -log softmax(logits)[target], same shape as ``target``.

    ``logits``: [..., V / tp.size], this rank's vocabulary slice (rank r holds ids
    [r * V/t, (r+1) * V/t)).  ``target``: [...] global token ids.  The loss is computed
    in float32, or float64 when the logits are float64, ``chunk_rows`` tokens at a time
    (default: 64 MiB of float32 per chunk).  ``inplace_backward``: write the gradient
    into the logits' storage (only for logits no one else reads after the forward).
    ``fused``: compute through ``torch.compile`` (module docstring); ``chunk_rows`` and
    ``inplace_backward`` then do not apply.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and "
                         f"target {tuple(target.shape)} must agree on all but the last dim")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"vocab_parallel_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    return _VocabParallelCrossEntropy.apply(logits, target, tp, chunk_rows, inplace_backward,
                                            fused)

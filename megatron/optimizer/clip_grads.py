"""Gradient statistics and clipping with the "count each logical parameter once" rule.

A model replica spreads its parameters over tensor x pipeline ranks, and a few of them
exist on more than one rank:

* the tied word embedding lives on the first stage and, as a copy marked
  ``param.shared = True``, on the last stage: only the first stage counts it;
* parameters not split by tensor parallelism (LayerNorm, most biases) are replicated on
  every tensor-parallel rank: only tensor-parallel rank 0 counts them.  As in
  Megatron-LM, a parameter without a ``tensor_model_parallel`` attribute is treated as
  replicated (with one tensor-parallel rank this makes no difference).

Each rank computes its local contribution; the optimizer adds them with one all-reduce
(on gloo, a direct exchange: ``megatron.exchange``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_HALF = (torch.float16, torch.bfloat16)


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` contributes to global gradient statistics."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def norm_mask(params: Sequence[torch.Tensor], tp_rank: int) -> List[bool]:
    """``counts_in_norm`` for every parameter, in order."""
    return [counts_in_norm(p, tp_rank) for p in params]


def per_tensor_norms(grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """L2 norm of each tensor; half-precision tensors are reduced in fp32.

    Tensors are grouped by (device, dtype) so each group is one fused foreach call.
    """
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    out: List[Optional[torch.Tensor]] = [None] * len(grads)
    for (_, dtype), idx in groups.items():
        tensors = [grads[i] for i in idx]
        if dtype in _HALF:
            norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        else:
            norms = torch._foreach_norm(tensors, 2)
        for i, n in zip(idx, norms):
            out[i] = n
    return out  # type: ignore[return-value]


def local_grad_stats(grads: Sequence[Optional[torch.Tensor]], mask: Sequence[bool],
                     device: torch.device, count_zeros: bool = False) -> torch.Tensor:
    """This rank's ``[sum of squares, non-finite tensors, zeros]`` as a float64 vector.

    * sum of squares: over gradients whose ``mask`` entry is True;
    * non-finite tensors: number of gradients (ALL of them, masked or not, so a
      replicated copy cannot hide an overflow) holding an inf or nan;
    * zeros: number of zero elements over masked gradients (0 unless ``count_zeros``).
    ``None`` gradients (unused parameters) contribute nothing.  No host sync happens here.
    """
    if len(grads) != len(mask):
        raise ValueError(f"clip_grads: {len(grads)} gradients but {len(mask)} mask entries")
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    present = [(g, m) for g, m in zip(grads, mask) if g is not None]
    if not present:
        return stats
    all_norms = _norms_f64([g for g, _ in present], device)
    counted = tuple(m for _, m in present)
    if all(counted):
        stats[0] = all_norms.square().sum()
    else:
        # A masked-out non-finite norm would poison the sum even when multiplied by 0.
        keep = _bool_tensor(counted, device)
        stats[0] = torch.where(keep, all_norms.square(), torch.zeros_like(all_norms)).sum()
    stats[1] = (~torch.isfinite(all_norms)).sum()
    if count_zeros and any(counted):
        zeros = _zeros_f64([g for g, _ in present], counted, device)
        stats[2] = zeros[_bool_tensor(counted, device)].sum()
    return stats


def local_piece_stats(pieces: Sequence[Optional[torch.Tensor]], param_of: Sequence[int],
                      mask: Sequence[bool], device: torch.device, count_zeros: bool = False,
                      *, group: Any = None) -> torch.Tensor:
    """``local_grad_stats`` for the distributed optimizer, where this rank holds averaged
    gradients for ``pieces`` only (runs of elements of parameter ``param_of[k]``; None:
    no gradient), and every element has one owner in ``group``.

    The pieces' sums of squares, non-finite flags and zero counts are added per
    parameter over ``group`` (one all-reduce of 3 x parameters numbers), so each
    statistic keeps its per-parameter rules: ``mask`` decides what counts in the norm
    and the zeros, and a parameter cut between ranks is ONE non-finite tensor however
    many of its pieces overflow.  Every rank of ``group`` returns the same vector (the
    sum for its whole stage: count it once over the data-parallel group).  The norm is
    the same up to rounding as without sharding (a cut parameter's squares are summed
    in another order), not the same bits."""
    if len(param_of) != len(pieces):
        raise ValueError(f"clip_grads: {len(pieces)} pieces but {len(param_of)} parameter "
                         f"indices")
    per_param = torch.zeros(3, len(mask), dtype=torch.float64, device=device)
    present = [(g, i) for g, i in zip(pieces, param_of) if g is not None]
    if present:
        index = torch.tensor([i for _, i in present], dtype=torch.int64, device=device)
        norms = _norms_f64([g for g, _ in present], device)
        sq = norms.square()
        rows = [sq, (~torch.isfinite(norms)).to(torch.float64)]
        rows.append(_zeros_f64([g for g, _ in present], (True,) * len(present), device)
                    if count_zeros else torch.zeros_like(sq))
        per_param.index_add_(1, index, torch.stack(rows))
    if group is not None:
        dist.all_reduce(per_param, group=group)
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    keep = _bool_tensor(tuple(bool(m) for m in mask), device)
    # a masked-out non-finite sum would poison the total even when multiplied by 0
    stats[0] = torch.where(keep, per_param[0], torch.zeros_like(per_param[0])).sum()
    stats[1] = (per_param[1] > 0).sum()
    if count_zeros:
        stats[2] = torch.where(keep, per_param[2], torch.zeros_like(per_param[2])).sum()
    return stats


def _norms_f64(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each tensor's L2 norm, stacked, as float64 on ``device``."""
    norms = per_tensor_norms(grads)
    # one stack and one cast when the norms share dtype and device (the usual case): a
    # cast per tensor was most of local_grad_stats' CPU time on a small model
    if len({(n.dtype, n.device) for n in norms}) == 1:
        return torch.stack(norms).to(device=device, dtype=torch.float64)
    return torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])


def _zeros_f64(grads: Sequence[torch.Tensor], counted: Tuple[bool, ...],
               device: torch.device) -> torch.Tensor:
    """Zero elements of each counted tensor (0 for the others), as float64."""
    return torch.stack([(g.numel() - torch.count_nonzero(g)).to(device)
                        if m else torch.zeros((), dtype=torch.int64, device=device)
                        for g, m in zip(grads, counted)]).to(torch.float64)


def local_weight_sq(params: Sequence[torch.Tensor], mask: Sequence[bool],
                    device: torch.device) -> torch.Tensor:
    """This rank's sum of squares of the weights ``params`` whose ``mask`` entry is True
    (a float64 scalar on ``device``; no host sync)."""
    if len(params) != len(mask):
        raise ValueError(f"clip_grads: {len(params)} weights but {len(mask)} mask entries")
    counted = [p.detach() for p, m in zip(params, mask) if m]
    if not counted:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = per_tensor_norms(counted)
    return torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()


_BOOL_TENSORS: Dict[Tuple[torch.device, Tuple[bool, ...]], torch.Tensor] = {}


def _bool_tensor(flags: Tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """``torch.tensor(flags)`` on ``device``, made once per pattern (a model has a few)."""
    key = (torch.device(device), flags)
    out = _BOOL_TENSORS.get(key)
    if out is None:
        out = _BOOL_TENSORS[key] = torch.tensor(flags, dtype=torch.bool, device=device)
    return out


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their global norm is at most ``max_norm``.

    Returns 1.0 when clipping is disabled (``max_norm <= 0``), not needed, or the norm
    is not finite (then the step is skipped or reported elsewhere).
    """
    if max_norm <= 0.0 or not total_norm == total_norm or total_norm == float("inf"):
        return 1.0
    coeff = max_norm / (total_norm + 1.0e-6)
    return coeff if coeff < 1.0 else 1.0


def scale_grads_(grads: Sequence[Optional[torch.Tensor]], factor: float) -> None:
    """Multiply every non-None gradient by ``factor`` in place (skipped when factor is 1)."""
    if factor == 1.0:
        return
    present = [g for g in grads if g is not None]
    if present:
        torch._foreach_mul_(present, factor)

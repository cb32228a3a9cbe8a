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
                     device: torch.device, count_zeros: bool = False, *,
                     owned: Optional[Sequence[bool]] = None, group: Any = None
                     ) -> torch.Tensor:
    """This rank's ``[sum of squares, non-finite tensors, zeros]`` as a float64 vector.

    * sum of squares: over gradients whose ``mask`` entry is True;
    * non-finite tensors: number of gradients (ALL of them, masked or not, so a
      replicated copy cannot hide an overflow) holding an inf or nan;
    * zeros: number of zero elements over masked gradients (0 unless ``count_zeros``).
    ``None`` gradients (unused parameters) contribute nothing.  No host sync happens here.

    ``owned`` and ``group`` (the distributed optimizer): only the gradients this rank
    owns are averaged here, the others are its own unreduced ones.  Each gradient's norm
    (and zero count) is taken from its owner by one sum over ``group`` of vectors that
    are zero elsewhere (x + 0 = x: exact), and the statistics are then formed from the
    same values in the same order as without sharding, so they are the same bits.
    """
    if len(grads) != len(mask):
        raise ValueError(f"clip_grads: {len(grads)} gradients but {len(mask)} mask entries")
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    present = [(g, m) for g, m in zip(grads, mask) if g is not None]
    if not present:
        return stats
    norms = per_tensor_norms([g for g, _ in present])
    # one stack and one cast when the norms share dtype and device (the usual case): a
    # cast per tensor was most of this function's CPU time on a small model
    if len({(n.dtype, n.device) for n in norms}) == 1:
        all_norms = torch.stack(norms).to(device=device, dtype=torch.float64)
    else:
        all_norms = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
    counted = tuple(m for _, m in present)
    zeros = None
    if count_zeros:
        zeros = torch.stack([(g.numel() - torch.count_nonzero(g)).to(device)
                             if m else torch.zeros((), dtype=torch.int64, device=device)
                             for g, m in present]).to(torch.float64)
    if group is not None:
        mine = _bool_tensor(tuple(o for g, o in zip(grads, owned) if g is not None), device)
        both = torch.stack([all_norms, zeros if zeros is not None
                            else torch.zeros_like(all_norms)])
        both = torch.where(mine, both, torch.zeros_like(both))
        dist.all_reduce(both, group=group)
        all_norms, zeros = both[0], (both[1] if zeros is not None else None)
    if all(counted):
        stats[0] = all_norms.square().sum()
    else:
        # A masked-out non-finite norm would poison the sum even when multiplied by 0.
        keep = _bool_tensor(counted, device)
        stats[0] = torch.where(keep, all_norms.square(), torch.zeros_like(all_norms)).sum()
    stats[1] = (~torch.isfinite(all_norms)).sum()
    if zeros is not None and any(counted):
        stats[2] = zeros[_bool_tensor(counted, device)].sum()
    return stats


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

"""Where the distributed optimizer's state lives: an even split of flat buckets.

``--use-distributed-optimizer`` (ZeRO stage 1) lays a stage's parameters end to end in
flat gradient buckets (``plan_buckets``), pads each bucket to a multiple of the data-
parallel size w and cuts it into w equal contiguous segments: data-parallel rank r owns
segment r of every bucket.  A segment boundary may fall inside a parameter, so a rank
owns ``Piece``s: runs of one parameter's flattened elements.  Every rank holds within a
bucket's padding (< w elements per bucket) of 1/w of the state, whatever the sizes of
the parameters; a split by whole parameters left the owner of one huge parameter (the
word embedding) with far more than the others.

The gradient reducer (``megatron.pipeline.grad_reduction.GradientReduction``) and the
optimizer (``megatron.optimizer.optimizer``) read the same ``OptimizerShard``, so the segment a
rank receives from the reduce-scatter is the one whose optimizer state it holds.  The
tied word embedding is a bucket of its own: where the engine averages it apart (an
all-reduce after its sum between first and last stage), the reducer leaves that bucket
out and the optimizer reads its pieces of the averaged gradient all the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.optimizer.staleness import use_foreach

BUCKET_BYTES = 32 * 2 ** 20
"""Gradient bytes per bucket (the reducer's default for plain data parallelism too)."""

# torch 2.13 names the single-tensor collectives all_gather_single/reduce_scatter_single
# (the older names warn there); 2.10-2.12 have only all_gather_into_tensor and
# reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = (getattr(dist, "reduce_scatter_single", None)
                       or dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: parameters ``params`` (indices into the stage's parameter list)
    laid end to end from ``offsets``, ``numel`` elements in all, zero-padded to
    ``padded`` (a multiple of the data-parallel size)."""

    params: Tuple[int, ...]
    offsets: Tuple[int, ...]
    numel: int
    padded: int


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter ``param`` (flattened), which one rank owns:
    they lie at ``at`` in that rank's segment of bucket ``bucket``."""

    param: int
    start: int
    stop: int
    bucket: int
    at: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_buckets(numels: Sequence[int], keys: Sequence[Any], world: int,
                 bucket_bytes: int = BUCKET_BYTES, itemsizes: Optional[Sequence[int]] = None,
                 alone: Sequence[bool] = ()) -> Tuple[Bucket, ...]:
    """Buckets over parameters of ``numels`` elements, in REVERSE parameter order (the
    order the backward pass finishes them).  A bucket closes when the next parameter
    would take it past ``bucket_bytes`` (``itemsizes``: bytes per element, default 4),
    at a change of ``keys`` (the dtype: one flat tensor has one), and around a parameter
    marked in ``alone`` (the tied word embedding, whose gradient is averaged elsewhere)."""
    if world < 1:
        raise ValueError(f"plan_buckets: world must be >= 1, got {world}")
    sizes = list(itemsizes) if itemsizes is not None else [4] * len(numels)
    solo = list(alone) + [False] * (len(numels) - len(alone))
    groups: List[List[int]] = []
    used = 0
    for i in reversed(range(len(numels))):
        nbytes = int(numels[i]) * sizes[i]
        last = groups[-1] if groups else None
        if (last is None or solo[i] or solo[last[0]] or keys[i] != keys[last[0]]
                or used + nbytes > bucket_bytes):
            groups.append([i])
            used = nbytes
        else:
            last.append(i)
            used += nbytes
    out = []
    for members in groups:
        offsets, at = [], 0
        for i in members:
            offsets.append(at)
            at += int(numels[i])
        out.append(Bucket(params=tuple(members), offsets=tuple(offsets), numel=at,
                          padded=-(-at // world) * world))
    return tuple(out)


def pieces_of(buckets: Sequence[Bucket], numels: Sequence[int], world: int,
              rank: int) -> List[Piece]:
    """The pieces rank ``rank`` owns: segment ``rank`` of every bucket, bucket by bucket,
    in flat order (pieces of no element are left out)."""
    out = []
    for b, bucket in enumerate(buckets):
        seg = bucket.padded // world
        lo, hi = rank * seg, (rank + 1) * seg
        for i, off in zip(bucket.params, bucket.offsets):
            start, stop = max(lo, off) - off, min(hi, off + int(numels[i])) - off
            if start < stop:
                out.append(Piece(param=i, start=start, stop=stop, bucket=b,
                                 at=off + start - lo))
    return out


@dataclass(frozen=True)
class OptimizerShard:
    """The distributed optimizer's split of one stage over its data-parallel group
    (``group``; None in one process, where ``size`` is 1): ``buckets`` and the
    parameters' element counts ``numels``; this rank is ``rank``."""

    rank: int
    size: int
    buckets: Tuple[Bucket, ...]
    numels: Tuple[int, ...]
    group: Any = None

    def pieces(self, rank: Optional[int] = None) -> List[Piece]:
        """What ``rank`` (default: this rank) owns."""
        return pieces_of(self.buckets, self.numels, self.size,
                         self.rank if rank is None else rank)

    def segment(self, b: int) -> int:
        """Elements of each rank's segment of bucket b."""
        return self.buckets[b].padded // self.size


def flat_view(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """``piece``'s elements of ``t`` (a tensor of its parameter's shape, contiguous) as a
    1-D view: writing it writes ``t``."""
    return t.view(-1)[piece.start:piece.stop]


def plan_shard(params: Sequence[torch.nn.Parameter], dp_group: Any,
               grad_dtype: Optional[torch.dtype],
               bucket_elements: Optional[int] = None) -> Optional[OptimizerShard]:
    """--use-distributed-optimizer: the stage's buckets (as the gradient reducer will
    build them) and this rank's place in its data-parallel group; None for one replica
    (nothing to split: the optimizer is the plain one).  ``bucket_elements``
    (--ddp-bucket-size): parameters per bucket instead of 32 MiB of gradients."""
    size = dist.get_world_size(dp_group) if dp_group is not None else 1
    rank = dist.get_rank(dp_group) if dp_group is not None else 0
    if size == 1:
        return None
    if any(not p.requires_grad for p in params):
        raise ValueError("--use-distributed-optimizer: every parameter of the stage must be "
                         "trainable (the gradient buckets hold them all)")
    numels = [p.numel() for p in params]
    # the gradients' dtype: --accumulate-allreduce-grads-in-fp32 gives weights of
    # another dtype float32 gradients (``megatron.pipeline.weights.grad_dtype_of``)
    itemsizes = [(p.dtype if grad_dtype is None else grad_dtype).itemsize for p in params]
    limit = BUCKET_BYTES
    if bucket_elements is not None:
        itemsizes, limit = [1] * len(params), bucket_elements
    buckets = plan_buckets(numels, [p.dtype for p in params], size, limit, itemsizes,
                           alone=[bool(getattr(p, "shared_embedding", False)) for p in params])
    return OptimizerShard(rank=rank, size=size, buckets=buckets, numels=tuple(numels),
                          group=dp_group)


class WeightGather:
    """The distributed optimizer's new weights, from every replica's segments: one
    all-gather per bucket (``start``).  Without ``overlap`` they are waited for at
    once; with it (``--overlap-param-gather``) they stay in flight until ``wait``:
    until then a bucket's parameters hold, outside this rank's own pieces, the weights
    from before the step, and whoever reads them waits first (the pipeline engine's
    forward hooks wait layer by layer; the optimizer's next step, evaluation and
    checkpoints wait for all)."""

    def __init__(self, shard: OptimizerShard,
                 pieces_by_bucket: Sequence[Sequence[Tuple[int, Piece]]]) -> None:
        self.shard = shard
        self.pieces_by_bucket = pieces_by_bucket
        self.overlap = False
        self.order: List[int] = list(range(len(shard.buckets) - 1, -1, -1))
        """The order the all-gathers start in: the order the next forward pass reads the
        buckets (default: last bucket first, as the buckets follow the backward pass)."""
        # bucket -> (work, gathered flat tensor, sent segment kept alive, destinations)
        self._pending: Dict[int, Tuple[Any, torch.Tensor, torch.Tensor,
                                       List[torch.nn.Parameter]]] = {}

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def set_order(self, order: Sequence[int]) -> None:
        order = [int(b) for b in order]
        if sorted(order) != list(range(len(self.shard.buckets))):
            raise ValueError(f"WeightGather.set_order: {order} is not an order of the "
                             f"{len(self.shard.buckets)} buckets")
        self.order = order

    def start(self, write_to: Sequence[torch.nn.Parameter],
              mine: Sequence[torch.Tensor]) -> None:
        """All-gather every bucket of ``write_to`` (a weight buffer), this rank's segment
        filled from ``mine`` (its pieces, in ``shard.pieces()`` order, any float dtype;
        cast to the weights' dtype)."""
        self.wait()
        sh = self.shard
        for b in self.order:
            bucket = sh.buckets[b]
            dst = [write_to[i] for i in bucket.params]
            seg = torch.zeros(sh.segment(b), dtype=dst[0].dtype, device=dst[0].device)
            owned = self.pieces_by_bucket[b]
            copy_all([mine[k] for k, _ in owned],
                      [seg[pc.at:pc.at + pc.numel] for _, pc in owned])
            full = torch.empty(bucket.padded, dtype=dst[0].dtype, device=dst[0].device)
            work = all_gather_flat(full, seg, group=sh.group, async_op=True)
            self._pending[b] = (work, full, seg, dst)
        if not self.overlap:
            self.wait()

    def wait(self, buckets: Optional[Iterable[int]] = None) -> None:
        """Finish the all-gathers of ``buckets`` (default: all) still in flight and
        write what they brought into the weights."""
        if not self._pending:
            return
        for b in (list(self._pending) if buckets is None else buckets):
            got = self._pending.pop(b, None)
            if got is None:
                continue
            work, full, _, dst = got
            work.wait()
            offsets = self.shard.buckets[b].offsets
            views = [p.data.view(-1) for p in dst]
            copy_all([full[off:off + v.numel()] for off, v in zip(offsets, views)], views)


def copy_all(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i (casting): one multi-tensor copy on an accelerator
    (a copy per parameter was hundreds of launches per step), a loop on the CPU."""
    if use_foreach(dst):
        torch._foreach_copy_(list(dst), list(src))
    else:
        for s, d in zip(src, dst):
            d.copy_(s)

"""Data-parallel gradient reduction of one weight buffer, overlapped with the backward
pass: the executor's REDUCE_GRADS and STEP actions start and finish it
(``megatron.pipeline.engine``)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.optimizer.sharding import flat_view, reduce_scatter_flat
from megatron.pipeline.weights import grad_dtype_of, zero_grad_like


class GradientReduction:
    """Average one weight buffer's gradients over the data-parallel group, in flat
    buckets, overlapped with the backward pass (as DDP and Megatron do).

    Every trainable parameter gets a post-accumulate-grad hook that counts how many
    microbatch backward passes have added to its ``.grad``.  The m-th addition is the
    batch's last one: the gradient is final, and when every parameter of a bucket is
    final the bucket's asynchronous all-reduce starts at once, while autograd goes on
    with earlier layers.  Buckets follow the REVERSE parameter order (the order the
    backward pass finishes them), so the last layers' bucket leaves first.  They leave
    strictly in that order on every replica, as DDP's do: a bucket whose gradients are
    final waits for the buckets before it.  Collectives of one group pair up by the
    order they are issued in, and a parameter unused in one replica's microbatch
    (its bucket then left at REDUCE_GRADS there, at once on the others) paired
    different buckets of different replicas.  A gradient that arrives after its
    bucket left (more than m contributions per batch) is an error, not lost.

    ``launch_remaining`` (REDUCE_GRADS) starts what the hooks did not (parameters that
    got no gradient: zero-filled, as an unused parameter contributes 0); ``finish``
    (STEP) waits and copies the averages back into ``.grad``.  Under 2BW each weight
    buffer has its own Parameter objects and so its own reducer.

    With the distributed optimizer (``shard``, a ``megatron.optimizer.sharding.
    OptimizerShard``) the buckets are the shard's: each is padded to a multiple of the
    data-parallel size w and reduce-scattered instead of all-reduced, so rank r receives
    the average of its own segment r only, half an all-reduce's traffic (the optimizer
    all-gathers the new weights after its step: the other half).  ``finish`` writes that
    average into the pieces of ``.grad`` the segment covers; the rest of each ``.grad``
    keeps this replica's own, unaveraged gradient, which nothing reads.
    """

    def __init__(self, params: List[nn.Parameter], group, world: int, microbatches: int,
                 bucket_bytes: int = 32 * 2 ** 20, overlap: bool = True,
                 exclude: Tuple[nn.Parameter, ...] = (), shard: Any = None,
                 bucket_elements: Optional[int] = None) -> None:
        """``exclude``: parameters averaged elsewhere (the tied word embedding, whose sum
        between first and last stage the engine starts first).  ``shard``: the
        distributed optimizer's ``OptimizerShard`` over ``params`` (all of them, in
        order), or None; its buckets replace ``bucket_bytes``, and an excluded
        parameter must be alone in its bucket (``plan_buckets``' ``alone``).
        ``bucket_elements``: close buckets by parameter count instead of bytes."""
        kept = [i for i, p in enumerate(params)
                if p.requires_grad and not any(p is e for e in exclude)]
        self.params = [params[i] for i in kept]
        self.shard = shard
        self.group, self.world, self.microbatches = group, world, microbatches
        self.active = group is not None and world > 1
        self._pending: List[tuple] = []
        self._buckets: List[List[int]] = []
        self._bucket_of: Dict[int, int] = {}
        self._counts = [0] * len(self.params)
        self._ready: List[int] = []
        self._launched: List[bool] = []
        self._next = 0
        self._hooks = []
        # with a shard: per bucket, its index in ``shard.buckets`` and this rank's pieces
        # as (position in self.params, Piece)
        self._layout: List[int] = []
        self._mine: List[List[tuple]] = []
        self.launched_in_backward = 0
        """Buckets whose reduction the hooks started (the rest start at REDUCE_GRADS)."""
        if not self.active:
            return
        if shard is not None:
            self._use_shard(kept)
        else:
            self._plan(bucket_bytes, bucket_elements)
        for b, members in enumerate(self._buckets):
            for i in members:
                self._bucket_of[i] = b
        self._reset()
        if overlap:
            for i, p in enumerate(self.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, i=i: self._on_grad(i)))

    def _plan(self, bucket_bytes: int, bucket_elements: Optional[int] = None) -> None:
        """Plain data parallelism: buckets in the reverse parameter order; one closes
        when full (``bucket_bytes``, or ``bucket_elements`` parameters) or at a change of
        dtype."""
        limit = bucket_bytes if bucket_elements is None else bucket_elements
        bucket: List[int] = []
        size = 0
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            dtype = grad_dtype_of(p)
            nbytes = p.numel() * (dtype.itemsize if bucket_elements is None else 1)
            if bucket and (dtype != grad_dtype_of(self.params[bucket[0]])
                           or size + nbytes > limit):
                self._buckets.append(bucket)
                bucket, size = [], 0
            bucket, size = bucket + [i], size + nbytes
        if bucket:
            self._buckets.append(bucket)

    def _use_shard(self, kept: List[int]) -> None:
        """The distributed optimizer's buckets, less those of excluded parameters."""
        position = {i: j for j, i in enumerate(kept)}
        pieces = self.shard.pieces()
        for b, bucket in enumerate(self.shard.buckets):
            inside = [i in position for i in bucket.params]
            if not any(inside):
                continue  # averaged elsewhere: the optimizer reads its own pieces of it
            if not all(inside):
                raise ValueError("GradientReduction: a bucket of the distributed optimizer "
                                 "mixes parameters reduced here with excluded ones")
            dtypes = {grad_dtype_of(self.params[position[i]]) for i in bucket.params}
            if len(dtypes) != 1:
                raise ValueError(f"GradientReduction: bucket {b} mixes gradient dtypes "
                                 f"{sorted(map(str, dtypes))}")
            self._buckets.append([position[i] for i in bucket.params])
            self._layout.append(b)
            self._mine.append([(position[pc.param], pc) for pc in pieces if pc.bucket == b])

    def _reset(self) -> None:
        self._counts = [0] * len(self.params)
        self._ready = [0] * len(self._buckets)
        self._launched = [False] * len(self._buckets)
        self._next = 0
        """The bucket that leaves next: they leave in index order (``_on_grad``)."""

    def _on_grad(self, i: int) -> None:
        b = self._bucket_of[i]
        if self._launched[b]:
            # a gradient added after its bucket left would be overwritten by the average
            raise RuntimeError(
                f"gradient reduction: parameter {i} (of shape {tuple(self.params[i].shape)}) "
                f"received a gradient after its bucket's reduction started: more than the "
                f"{self.microbatches} backward contributions per batch the reducer counts "
                f"(a parameter whose gradient is accumulated twice in one microbatch's "
                f"backward, e.g. by reentrant checkpointing?)")
        self._counts[i] += 1
        if self._counts[i] != self.microbatches:
            return
        self._ready[b] += 1
        # Buckets leave in index order, whatever order their gradients became final in:
        # collectives of one group pair up by issue order, and a replica on which a
        # parameter missed a microbatch (its bucket left only at REDUCE_GRADS) would
        # otherwise have paired its buckets with other buckets of its peers.
        while (self._next < len(self._buckets)
               and self._ready[self._next] == len(self._buckets[self._next])):
            self._launch(self._next)
            self.launched_in_backward += 1

    def _launch(self, b: int) -> None:
        if b != self._next:
            raise RuntimeError(f"gradient reduction: bucket {b} started out of order "
                               f"(next is {self._next})")
        self._next += 1
        grads = []
        for i in self._buckets[b]:
            p = self.params[i]
            if p.grad is None:
                p.grad = zero_grad_like(p)
            grads.append(p.grad)
        self._launched[b] = True
        if self.shard is None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(self.world)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((work, flat, grads, None))
            return
        bucket = self.shard.buckets[self._layout[b]]
        # the shard's flat order, zero-padded to w equal segments
        flat = torch.cat([g.reshape(-1) for g in grads]
                         + [grads[0].new_zeros(bucket.padded - bucket.numel)])
        flat.div_(self.world)
        mine = flat.new_empty(bucket.padded // self.world)
        work = reduce_scatter_flat(mine, flat, group=self.group, async_op=True)
        # the pieces of .grad the segment covers (made contiguous to be written in place)
        targets = []
        for i, pc in self._mine[b]:
            p = self.params[i]
            if not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            targets.append((flat_view(p.grad, pc), pc.at))
        self._pending.append((work, mine, targets, flat))

    def launch_remaining(self) -> None:
        """REDUCE_GRADS: start every bucket the hooks did not start."""
        if not self.active:
            return
        while self._next < len(self._buckets):
            self._launch(self._next)
        self._reset()

    def finish(self) -> None:
        """STEP: wait for the reductions and write the averages into ``.grad`` (with a
        shard, this rank's segment into the pieces it covers)."""
        for work, flat, grads, sent in self._pending:
            work.wait()
            if sent is not None:
                for target, at in grads:
                    target.copy_(flat[at:at + target.numel()])
                continue
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n
        self._pending.clear()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

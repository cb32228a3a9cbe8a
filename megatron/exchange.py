"""Sums over a small process group by direct exchange (the gloo path).

Two sums end every training batch: the tied word-embedding gradient of the first and
last pipeline stage, and the optimizer's agreement on the global gradient norm and on
overflow (4 numbers per model rank).  Under a flushing 1F1B schedule the first stage
always finishes its backward passes last, so every other member is already waiting
when it joins the sum, and whatever the sum costs after that moment delays the next
batch on every stage.

gloo's ``all_reduce`` starts moving data only once the last member has joined, and
then takes several round trips between the processes' I/O threads (a ring: reduce-
scatter, then all-gather).  ``ExchangeSum`` instead has each member send its tensor to
every other member as soon as it has it, and add what the others sent.  The member
that joins last finds the others' tensors already received (into receives posted
ahead, for large tensors) and only posts its own sends: it does not wait at all.  The
others wait for its message, as they waited inside the ``all_reduce`` before.

Every member adds the contributions in group-rank order, so all of them compute the
same sum bit for bit, as the agreement requires.  A one-off timing on the 2-core bench
machine (two ranks, the other member already waiting): 0.61 ms for gloo's all_reduce
of a 512 KiB gradient against 0.12 ms for the exchange with its receive posted ahead;
the committed side-by-side effect on whole batches is in ``bench/pipeline_schedules.py``.

Messages per sum grow as (members - 1) per member, so this is meant for the groups of
one model replica (a pipeline's stages times its tensor-parallel ranks), not the data-
parallel group.  NCCL keeps ``all_reduce``: there it is one kernel on the GPU's stream
and the host does not wait for it.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


_SHORT_WAIT_S = 0.3e-3
"""A wait shorter than this counts as none (``PendingExchange.is_completed``).  Chosen,
not tuned: a few times the ~0.1 ms one microbatch's read took on the bench GPT (a
one-off profile), so a member whose wait was shorter gains nothing by reading ahead."""


def exchange_pays(group: Any) -> bool:
    """Whether sums over ``group`` should use ``ExchangeSum`` (gloo) or ``all_reduce``."""
    return (ExchangeSum.enabled and group is not None
            and dist.get_backend(group) == "gloo")


class ExchangeSum:
    """Repeated sums of a tensor of one shape over ``group``, by direct exchange.

    Every member calls ``start`` once per round, in the same order of rounds, and
    ``wait`` on what it returns before the next ``start``.  ``post_receives`` posts one
    round's receives ahead of its ``start`` (only for a round that will surely happen:
    a receive left posted when the group is destroyed is an error).
    """

    enabled = True
    """False: sums use all_reduce on gloo too (the side-by-side ablation of
    ``bench/pipeline_schedules.py``); read when an engine or optimizer first sums."""

    def __init__(self, group: Any, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.group = group
        self.ranks: List[int] = list(dist.get_process_group_ranks(group))
        self.me = dist.get_rank()
        if self.me not in self.ranks:
            raise ValueError(f"rank {self.me} is not in the exchange group {self.ranks}")
        self.peers = [r for r in self.ranks if r != self.me]
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._posted: Deque[Dict[int, Tuple[Any, torch.Tensor]]] = deque()
        # sends of finished rounds, with the copy each sends: waited at the next start
        # (gloo releases a send only when it is waited on)
        self._sends: List[Tuple[Any, torch.Tensor]] = []
        self.last_wait_s: Optional[float] = None
        """How long this member's latest ``wait`` blocked (None before the first)."""

    @property
    def num_posted(self) -> int:
        """Rounds whose receives are posted and not yet started."""
        return len(self._posted)

    def post_receives(self) -> None:
        """Post the receives of the next round not yet posted."""
        posted = {}
        for r in self.peers:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            posted[r] = (dist.irecv(buf, src=r, group=self.group), buf)
        self._posted.append(posted)

    def start(self, tensor: torch.Tensor) -> "PendingExchange":
        """Send ``tensor`` to every peer and return the pending sum; ``tensor`` may be
        changed at once (a copy is sent) and receives the sum at ``wait``."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"exchange sum: got a {tuple(tensor.shape)} {tensor.dtype} "
                             f"tensor, built for {self.shape} {self.dtype}")
        self.drain()
        own = tensor.detach().clone()
        sends = [(dist.isend(own, dst=r, group=self.group), own) for r in self.peers]
        if not self._posted:
            self.post_receives()
        return PendingExchange(self, tensor, own, self._posted.popleft(), sends)

    def drain(self) -> None:
        """Wait for the sends of finished rounds (they completed long ago in practice)."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()


class PendingExchange:
    """One round of ``ExchangeSum`` in flight; ``wait`` writes the sum into the tensor."""

    def __init__(self, owner: ExchangeSum, tensor: torch.Tensor, own: torch.Tensor,
                 receives: Dict[int, Tuple[Any, torch.Tensor]],
                 sends: List[Tuple[Any, torch.Tensor]]) -> None:
        self._owner = owner
        self._tensor = tensor
        self._own = own
        self._receives = receives
        self._sends = sends
        self._done = False

    def is_completed(self) -> bool:
        """Whether ``wait`` would return at once.  gloo's point-to-point requests do not
        report completion before they are waited on, so this guesses from the previous
        round: a member that did not wait then (it joins last, as the first stage does
        under a flushing schedule) is taken not to wait now.  Callers use it to decide
        whether to do other work before ``wait`` (``PipelineEngine._prefetch_during``);
        a member that does wait gets that work for free."""
        if self._done:
            return True
        last = self._owner.last_wait_s
        return last is not None and last < _SHORT_WAIT_S

    def wait(self) -> bool:
        if self._done:
            return True
        begin = time.perf_counter()
        for work, _ in self._receives.values():
            work.wait()
        self._owner.last_wait_s = time.perf_counter() - begin
        parts = [self._own if r == self._owner.me else self._receives[r][1]
                 for r in self._owner.ranks]
        with torch.no_grad():  # ((p0 + p1) + p2) ..., in place: none of the parts aliases it
            self._tensor.copy_(parts[0])
            for part in parts[1:]:
                self._tensor.add_(part)
        self._owner._sends.extend(self._sends)
        self._receives, self._sends, self._done = {}, [], True
        return True

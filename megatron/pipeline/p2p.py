"""Point-to-point transfer of activations and gradients between neighbouring stages.

Sends are non-blocking (``isend``): the sender keeps the tensor alive until the send
completes and never waits for the receiver to reach the matching ``recv``.  Receives
block until the data has arrived.  Messages on one (src, dst) channel are matched in
order, which is why schedules must post sends and receives of a channel in the same
order (the schedule validator checks this).  Under these two rules every schedule the
validator accepts is deadlock-free on gloo and on NCCL.

On gloo a receive can also be posted ahead of the action that needs it
(``prepost_receives``): gloo moves a message's payload only once the receiving side has
posted its buffer, so a receive posted when needed pays a round trip between the two
processes' I/O threads before any byte moves.  Posted ahead -- the first of each channel
when a segment starts, each next one just before the wait on the one before it -- the
payload arrives while the stage computes.  That needs a core for gloo's I/O thread
while the stage's threads compute: with more busy threads than cores it measured slower
(``prepost_pays``).  NCCL does not get this: there a pair's sends and receives share one
stream, and a receive posted early would hold up this rank's own sends behind it.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def prepost_pays(backend: str, local_ranks: int, threads_per_rank: int,
                 cores: int) -> bool:
    """Whether to post receives ahead (``P2PCommunicator.prepost_receives``) by default.

    Only on gloo (see the module docstring for NCCL), and only when the node's ranks'
    compute threads leave the I/O threads a core: on the 2-core bench machine 2BW at
    d=2 (two ranks, one thread each) ran 1.06-1.23x faster with receives posted ahead,
    and at d=4 (four ranks on two cores) 0.93-1.00x (``bench/p2p_prepost.py``,
    docs/pipeline.md)."""
    return backend == "gloo" and local_ranks * threads_per_rank <= cores


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class P2PCommunicator:
    """Sends and receives tensors of one known shape to/from pipeline neighbours."""

    post_next_before_wait = True
    """With ``prepost_receives``: post a channel's next receive just before waiting on
    the current one (False: just after that wait returned, as session 8 did; kept for
    the side-by-side ablation of ``bench/p2p_prepost.py``)."""

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int],
                 shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 prepost_receives: bool = False,
                 max_pending_sends: Optional[int] = None) -> None:
        """``max_pending_sends``: wait for the oldest send once more are in flight (None:
        never).  gloo's send work never reports completion until it is waited on, so
        without a bound every tensor sent stays referenced until the segment ends: a
        2BW segment of 100 batches held 100 x m activations.  Safe at any bound of at
        least the pipeline depth: a stage that waits for its send k has the receiver
        past every action that needs this stage's later messages."""
        if max_pending_sends is not None and max_pending_sends < 1:
            raise ValueError(f"max_pending_sends must be at least 1, got {max_pending_sends}")
        self.max_pending_sends = max_pending_sends
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.prepost_receives = prepost_receives
        # per channel ("act" from prev_rank, "grad" from next_rank): receives posted
        # ahead, oldest first, and how many more the current segment will make
        self._posted: Dict[str, Deque[Tuple[object, torch.Tensor]]] = {
            "act": deque(), "grad": deque()}
        self._to_post: Dict[str, int] = {"act": 0, "grad": 0}
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device
        self._pending: List[Tuple[object, torch.Tensor]] = []
        self.bytes_sent = 0
        self.bytes_received = 0
        self.on_idle: Optional[Callable[[object], None]] = None
        """Called with a posted receive's work handle before waiting on it (the engine
        fetches upcoming microbatches there while the work is not completed)."""

    # -- sends -------------------------------------------------------------------------
    def _isend(self, tensor: torch.Tensor, dst: Optional[int], what: str) -> None:
        if dst is None:
            raise RuntimeError(f"cannot send {what}: no neighbour on that side of this stage")
        tensor = tensor.detach().contiguous()
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"{what} has shape {tuple(tensor.shape)}, the pipeline was set up "
                               f"for {self.shape}")
        if tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        work = dist.isend(tensor, dst=dst)
        self._pending.append((work, tensor))
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self._reap()

    def send_forward(self, tensor: torch.Tensor) -> None:
        self._isend(tensor, self.next_rank, "activation")

    def send_backward(self, tensor: torch.Tensor) -> None:
        self._isend(tensor, self.prev_rank, "gradient")

    # -- receives ----------------------------------------------------------------------
    def expect_receives(self, activations: int, gradients: int) -> None:
        """A segment starts that will receive ``activations`` tensors from the previous
        stage and ``gradients`` from the next.  With ``prepost_receives`` the first of
        each is posted now; otherwise this only checks the counts."""
        if any(self._posted.values()):
            raise RuntimeError("receives posted ahead by an earlier segment are still "
                               "outstanding: that segment failed, so this pipeline's "
                               "message order is lost")
        self._to_post = {"act": activations, "grad": gradients}
        if self.prepost_receives:
            self._post_next("act")
            self._post_next("grad")

    def _src(self, channel: str) -> Optional[int]:
        return self.prev_rank if channel == "act" else self.next_rank

    def _post_next(self, channel: str) -> None:
        src = self._src(channel)
        if self._to_post[channel] <= 0 or src is None:
            return
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._posted[channel].append((dist.irecv(buf, src=src), buf))
        self._to_post[channel] -= 1

    def _recv(self, channel: str, what: str) -> torch.Tensor:
        src = self._src(channel)
        if src is None:
            raise RuntimeError(f"cannot receive {what}: no neighbour on that side of this stage")
        if self._posted[channel]:
            work, buf = self._posted[channel].popleft()
        else:  # posted when needed (NCCL, or an oversubscribed node)
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            work = dist.irecv(buf, src=src)
        before = self.prepost_receives and self.post_next_before_wait
        after = self.prepost_receives and not self.post_next_before_wait
        if before:
            # The channel's next message, posted before this wait so that it flows while
            # the stage computes afterwards.  Not right after the wait: posting there
            # blocked for 2-5 ms about once a batch under Flush (the I/O thread still
            # busy with the message just received, we think); bench/p2p_prepost.py
            # measures both points.
            self._post_next(channel)
        if self.on_idle is not None and not work.is_completed():
            self.on_idle(work)  # useful work while the message is in flight
        work.wait()
        self.bytes_received += buf.numel() * buf.element_size()
        if after:
            self._post_next(channel)
        return buf

    def recv_forward(self) -> torch.Tensor:
        return self._recv("act", "activation")

    def recv_backward(self) -> torch.Tensor:
        return self._recv("grad", "gradient")

    # -- completion --------------------------------------------------------------------
    def _reap(self) -> None:
        """Forget sends that have completed, so their buffers can be freed; past
        ``max_pending_sends``, wait for the oldest (on gloo the only way to learn that a
        send has completed)."""
        self._pending = [(w, t) for (w, t) in self._pending if not w.is_completed()]
        while self.max_pending_sends is not None and len(self._pending) > self.max_pending_sends:
            work, _ = self._pending.pop(0)
            work.wait()

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_posted_receives(self) -> int:
        return sum(len(q) for q in self._posted.values())

"""Point-to-point transfer of activations and gradients between neighbouring stages.

Sends are non-blocking (``isend``): the sender keeps the tensor alive until the send
completes and never waits for the receiver to reach the matching ``recv``.  Receives
block until the data has arrived.  Messages on one (src, dst) channel are matched in
order, which is why schedules must post sends and receives of a channel in the same
order (the schedule validator checks this).  Under these two rules every schedule the
validator accepts is deadlock-free on gloo and on NCCL.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class P2PCommunicator:
    """Sends and receives tensors of one known shape to/from pipeline neighbours."""

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int],
                 shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
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
    def _recv(self, src: Optional[int], what: str) -> torch.Tensor:
        if src is None:
            raise RuntimeError(f"cannot receive {what}: no neighbour on that side of this stage")
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(buf, src=src)
        if self.on_idle is not None:
            self.on_idle(work)  # useful work while the message is in flight
        work.wait()
        self.bytes_received += buf.numel() * buf.element_size()
        return buf

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.prev_rank, "activation")

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.next_rank, "gradient")

    # -- completion --------------------------------------------------------------------
    def _reap(self) -> None:
        """Forget sends that have completed, so their buffers can be freed."""
        self._pending = [(w, t) for (w, t) in self._pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

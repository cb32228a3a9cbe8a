"""When P2PCommunicator posts its receives, checked against a recording stand-in for
torch.distributed (no process group): the order of posts and waits is the whole point."""
from __future__ import annotations

from typing import List, Tuple

import pytest
import torch

from megatron.pipeline import p2p as p2p_mod
from megatron.pipeline.p2p import P2PCommunicator


class _Work:
    def __init__(self, log: List[Tuple[str, int]], kind: str, n: int) -> None:
        self.log, self.kind, self.n = log, kind, n

    def is_completed(self) -> bool:  # gloo's point-to-point work: only once waited on
        return False

    def wait(self) -> None:
        self.log.append((f"wait-{self.kind}", self.n))


class _RecordingDist:
    def __init__(self) -> None:
        self.log: List[Tuple[str, int]] = []
        self.recvs = 0
        self.sends = 0

    def irecv(self, buf: torch.Tensor, src: int) -> _Work:
        self.recvs += 1
        self.log.append(("post-recv", self.recvs))
        return _Work(self.log, "recv", self.recvs)

    def isend(self, tensor: torch.Tensor, dst: int) -> _Work:
        self.sends += 1
        return _Work(self.log, "send", self.sends)


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> _RecordingDist:
    fake = _RecordingDist()
    monkeypatch.setattr(p2p_mod, "dist", fake)
    return fake


def _receive_all(prepost: bool, n: int, fake: _RecordingDist) -> List[Tuple[str, int]]:
    comm = P2PCommunicator(prev_rank=0, next_rank=None, shape=(2,), dtype=torch.float32,
                           device=torch.device("cpu"), prepost_receives=prepost)
    comm.expect_receives(activations=n, gradients=0)
    for _ in range(n):
        comm.recv_forward()
    assert comm.num_posted_receives == 0
    return fake.log


def test_posted_ahead_the_next_receive_is_posted_before_the_wait_on_this_one(
        recording: _RecordingDist) -> None:
    # posting right after a wait returned blocked in gloo (its I/O thread still busy with
    # the message just received); before the wait, the next message still flows while
    # the stage computes
    log = _receive_all(True, 3, recording)
    assert log == [("post-recv", 1),            # at the segment's start
                   ("post-recv", 2), ("wait-recv", 1),
                   ("post-recv", 3), ("wait-recv", 2),
                   ("wait-recv", 3)]           # no fourth: the segment receives three


def test_posted_when_needed_each_receive_is_posted_by_its_own_action(
        recording: _RecordingDist) -> None:
    log = _receive_all(False, 3, recording)
    assert log == [("post-recv", 1), ("wait-recv", 1), ("post-recv", 2), ("wait-recv", 2),
                   ("post-recv", 3), ("wait-recv", 3)]


def test_the_data_fetch_runs_while_the_receive_is_in_flight(recording: _RecordingDist) -> None:
    comm = P2PCommunicator(prev_rank=0, next_rank=None, shape=(2,), dtype=torch.float32,
                           device=torch.device("cpu"), prepost_receives=True)
    comm.on_idle = lambda work: recording.log.append(("idle", work.n))
    comm.expect_receives(activations=2, gradients=0)
    comm.recv_forward()
    assert recording.log == [("post-recv", 1), ("post-recv", 2), ("idle", 1), ("wait-recv", 1)]


def test_sends_past_the_bound_wait_for_the_oldest(recording: _RecordingDist) -> None:
    # gloo's send work reports completion only once waited on: without the bound every
    # tensor sent in a segment stays referenced until its end
    comm = P2PCommunicator(prev_rank=None, next_rank=1, shape=(2,), dtype=torch.float32,
                           device=torch.device("cpu"), max_pending_sends=2)
    for _ in range(5):
        comm.send_forward(torch.zeros(2))
        assert comm.num_pending <= 2
    assert recording.log == [("wait-send", 1), ("wait-send", 2), ("wait-send", 3)]
    comm.wait_all()
    assert comm.num_pending == 0


def test_unbounded_sends_wait_only_at_the_end(recording: _RecordingDist) -> None:
    comm = P2PCommunicator(prev_rank=None, next_rank=1, shape=(2,), dtype=torch.float32,
                           device=torch.device("cpu"))
    for _ in range(5):
        comm.send_forward(torch.zeros(2))
    assert comm.num_pending == 5 and recording.log == []


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_pending_sends must be at least 1, got 0"):
        P2PCommunicator(prev_rank=None, next_rank=1, shape=(2,), dtype=torch.float32,
                        device=torch.device("cpu"), max_pending_sends=0)

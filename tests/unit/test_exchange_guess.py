"""``PendingExchange.is_completed``: gloo's point-to-point requests never report
completion before they are waited on, so a pending sum guesses from its member's
previous wait whether waiting would block (the engine reads data ahead only then)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron.exchange import _SHORT_WAIT_S, PendingExchange


class _NeverDone:
    """A receive as gloo reports it: not completed until waited on."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waited = True
        return True


def _pending(last_wait_s):
    owner = SimpleNamespace(last_wait_s=last_wait_s, me=0, ranks=[0, 1], _sends=[])
    recv = _NeverDone()
    t = torch.ones(3)
    pending = PendingExchange(owner, t, t.clone(), {1: (recv, torch.full((3,), 2.0))}, [])
    return pending, owner, recv, t


def test_first_round_is_taken_to_wait() -> None:
    pending, _, _, _ = _pending(None)
    assert not pending.is_completed()


def test_a_member_that_did_not_wait_last_round_is_taken_not_to_wait_now() -> None:
    assert _pending(_SHORT_WAIT_S / 10)[0].is_completed()
    assert not _pending(_SHORT_WAIT_S * 10)[0].is_completed()


def test_wait_sums_in_rank_order_and_records_how_long_it_blocked() -> None:
    pending, owner, recv, t = _pending(1.0)
    assert pending.wait() and recv.waited
    assert torch.equal(t, torch.full((3,), 3.0))
    assert owner.last_wait_s is not None and owner.last_wait_s < 1.0
    assert pending.is_completed()  # done: no guess needed

"""The executor's stash counters leave the training step: saved-tensor hooks run on
the first batch of the run (or every --measure-memory-interval batches) and later
microbatches replay the counted bytes, so the peaks stay exact (one process, d=1)."""
from __future__ import annotations

import pytest
import torch

from megatron.pipeline import memory
from megatron.pipeline.memory import StashTracker
from tests.distributed.gpt_harness import TINY

ITERS, M = 3, 4  # global batch 8 / micro batch 2
ORIGINAL_COUNTING = StashTracker.counting


def test_replay_charges_the_counted_bytes():
    tracker = StashTracker(weight_ptrs=set())
    x = torch.ones(8, requires_grad=True)
    with tracker.counting(0, key=0):
        (x * x).sum()
    counted = tracker.in_flight[0]
    assert counted == 8 * 4 and tracker.knows(0) and not tracker.knows(1)
    tracker.replay(1, key=0)
    assert tracker.stats.peak_stashed_bytes == 2 * counted
    assert tracker.stats.peak_in_flight == 2
    tracker.forget_pattern()
    assert not tracker.knows(0)


def test_a_storage_kept_by_two_microbatches_in_flight_is_charged_once():
    """A tensor the stage caches (as the explicit softmax's causal mask) and every
    microbatch saves is one storage: charged to the stage once while any microbatch is
    in flight, and left out of the replayed pattern, so replays charge it once too."""
    tracker = StashTracker(weight_ptrs=set())
    cached = torch.ones(16, dtype=torch.float64)                  # 128 bytes

    def forward(mb: int):
        x = torch.ones(8, requires_grad=True)                     # 32 bytes saved each
        with tracker.counting(mb, key=mb):
            y = (x * x * cached[:8]).sum()
        return x, y

    kept = [forward(0)]
    assert tracker.in_flight == {0: 128 + 32} and not tracker.shared
    kept.append(forward(1))
    assert tracker.shared == {cached.untyped_storage().data_ptr(): 128}
    assert tracker.in_flight == {0: 32, 1: 32} and tracker.pattern == {0: 32, 1: 32}
    assert tracker.stashed_bytes() == 128 + 2 * 32 == tracker.stats.peak_stashed_bytes
    tracker.release(0)
    tracker.release(1)
    assert tracker.stashed_bytes() == 0
    for mb in range(3):                                           # a later batch, replayed
        tracker.replay(10 + mb, key=mb % 2)
    assert tracker.stashed_bytes() == 128 + 3 * 32 == tracker.stats.peak_stashed_bytes
    # counted again with the cache known: charged to the stage, not to the microbatch
    tracker.release(10)
    kept.append(forward(0))
    assert tracker.in_flight[0] == 32


def test_a_storage_freed_and_reused_is_not_taken_for_shared():
    """Two microbatches never in flight together: the second may reuse the first's
    addresses, and each is charged its own bytes."""
    tracker = StashTracker(weight_ptrs=set())
    for mb in range(3):
        x = torch.ones(64, requires_grad=True)
        with tracker.counting(mb, key=mb):
            (x * x).sum()
        assert tracker.in_flight[mb] == 64 * 4
        tracker.release(mb)
    assert not tracker.shared and tracker.stats.peak_stashed_bytes == 64 * 4


def _train(monkeypatch, *extra: str):
    import pretrain_gpt
    from megatron.training import pretrain

    calls = []
    def counting(self, microbatch, key=None):
        calls.append(microbatch)
        return ORIGINAL_COUNTING(self, microbatch, key)

    monkeypatch.setattr(memory.StashTracker, "counting", counting)
    argv = [a for a in TINY] + ["--train-iters", str(ITERS), "--eval-iters", "0", *extra]
    torch.manual_seed(0)
    result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                      pretrain_gpt.forward_step, argv=argv)
    return calls, result.memory["per_rank"][0], [result.losses[k]["lm loss"]
                                                 for k in sorted(result.losses)]




def test_hooks_run_on_the_first_batch_only_and_counts_stay_exact(monkeypatch):
    first_only, mem_first, losses_first = _train(monkeypatch)
    every, mem_every, losses_every = _train(monkeypatch, "--measure-memory-interval", "1")
    # microbatch numbers restart in every pipeline segment (the loop may drain after each
    # batch), so compare how many microbatches were counted, by position in the batch
    assert [mb % M for mb in first_only] == list(range(M))           # batch 0 only
    assert [mb % M for mb in every] == list(range(M)) * ITERS        # every batch, on request
    assert mem_first == mem_every
    assert mem_first["peak_stashed_activation_bytes"] > 0
    assert losses_first == losses_every


def test_interval_counts_every_nth_batch(monkeypatch):
    calls, _, _ = _train(monkeypatch, "--measure-memory-interval", "2")
    # batches 0 (the first) and 2 (divisible by 2)
    assert [mb % M for mb in calls] == list(range(M)) * 2

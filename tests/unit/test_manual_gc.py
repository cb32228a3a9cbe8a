"""Megatron-LM's --manual-gc (megatron/manual_gc.py): Python's automatic collection is off
while a run trains and every rank collects at the same iterations; the collector's
state comes back when training ends."""
from __future__ import annotations

import contextlib
import gc
import io

import pytest
import torch

from megatron.config import TrainingConfig
from megatron.manual_gc import ManualGC
from tests.arg_errors import assert_one_line_error

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3"]


def _recording(monkeypatch):
    calls = []
    real = ManualGC._collect

    def collect(self, generation=2):
        calls.append((generation, gc.isenabled()))
        real(self, generation)

    monkeypatch.setattr(ManualGC, "_collect", collect)
    return calls


def test_collections_follow_the_interval_and_evaluations(monkeypatch):
    import pretrain_gpt
    from megatron.training import pretrain
    from tests.distributed.gpt_harness import TINY

    calls = _recording(monkeypatch)
    enabled_at_steps = []
    real_after = ManualGC.after_step
    monkeypatch.setattr(ManualGC, "after_step", lambda self, t: (
        enabled_at_steps.append(gc.isenabled()), real_after(self, t)))
    assert gc.isenabled()
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step,
                          argv=TINY + ["--train-iters", "6", "--eval-interval", "3",
                                       "--eval-iters", "1", "--manual-gc",
                                       "--manual-gc-interval", "2"])
    assert result.iteration == 6 and gc.isenabled()  # restored
    assert enabled_at_steps == [False] * 6  # automatic collection off while training
    # start; after iteration 2; around the evaluation at 3; after 4; after 6, and
    # around the evaluation at 6 (the in-loop one: the end-of-run one follows training)
    assert calls == [(2, False), (2, False), (2, False), (0, False), (2, False),
                     (2, False), (2, False), (0, False)], calls


def test_without_the_flag_nothing_changes(monkeypatch):
    calls = _recording(monkeypatch)
    manual = ManualGC(TrainingConfig())
    with manual:
        assert gc.isenabled()
        manual.after_step(0)
        with manual.around_evaluation():
            pass
    assert calls == [] and gc.isenabled()


def test_no_eval_collections_and_a_disabled_collector_stays_disabled(monkeypatch):
    calls = _recording(monkeypatch)
    manual = ManualGC(TrainingConfig(manual_gc=True, manual_gc_interval=0,
                                     manual_gc_eval=False))
    gc.disable()
    try:
        with manual:
            for t in range(5):
                manual.after_step(t)
            with manual.around_evaluation():
                pass
        assert not gc.isenabled()  # the caller had it off: left off
    finally:
        gc.enable()
    assert calls == [(2, False)]  # the start's only


@pytest.mark.parametrize("extra,expected", [
    (["--manual-gc-interval", "5"], "--manual-gc-interval needs --manual-gc"),
    (["--no-manual-gc-eval"], "--no-manual-gc-eval needs --manual-gc"),
    (["--manual-gc", "--manual-gc-interval", "-1"], "--manual-gc-interval must be >= 0"),
])
def test_flag_errors_are_one_line(extra, expected, capsys, monkeypatch):
    assert_one_line_error(BASE + extra, expected, capsys, monkeypatch)


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_training_steps_leave_no_cyclic_garbage(monkeypatch, schedule):
    """What --manual-gc-interval 0 relies on: after the start's collection, a collection
    after every step finds nothing unreachable."""
    import pretrain_gpt
    from megatron.training import pretrain
    from tests.distributed.gpt_harness import TINY

    found = []
    monkeypatch.setattr(ManualGC, "_collect",
                        lambda self, generation=2: found.append(gc.collect(generation)))
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step,
                 argv=TINY + ["--train-iters", "12", "--eval-iters", "0", "--manual-gc",
                              "--manual-gc-interval", "1", "--pipeline-schedule", schedule])
    assert len(found) == 13 and found[1:] == [0] * 12, found

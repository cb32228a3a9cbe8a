"""Learning-rate schedule values at hand-computed points."""
from __future__ import annotations

import math

import pytest

from megatron.config import OptimizerConfig
from megatron.optimizer import OptimizerParamScheduler


def sched(style, warmup=10, decay=110, max_lr=1.0, min_lr=0.1):
    return OptimizerParamScheduler(max_lr, min_lr, warmup, decay, style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_from_zero(style):
    s = sched(style)
    assert s.get_lr(0) == 0.0
    assert s.get_lr(3) == pytest.approx(0.3)
    assert s.get_lr(10) == pytest.approx(1.0)


def test_constant_after_warmup():
    s = sched("constant")
    assert [s.get_lr(k) for k in (11, 110, 10_000)] == [1.0, 1.0, 1.0]


def test_linear_decay_counts_decay_steps_from_zero():
    s = sched("linear")
    # ratio = (step - 10) / (110 - 10); lr = 0.1 + (1 - ratio) * 0.9
    assert s.get_lr(35) == pytest.approx(0.1 + 0.75 * 0.9)
    assert s.get_lr(60) == pytest.approx(0.55)
    assert s.get_lr(110) == pytest.approx(0.1)
    assert s.get_lr(111) == 0.1 and s.get_lr(500) == 0.1


def test_cosine_decay():
    s = sched("cosine")
    assert s.get_lr(60) == pytest.approx(0.55)      # half way: cos(pi/2) = 0
    assert s.get_lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1))
    assert s.get_lr(110) == pytest.approx(0.1)
    assert s.get_lr(1000) == 0.1


def test_no_warmup_starts_at_max_lr():
    s = OptimizerParamScheduler(2.0, 0.0, 0, 4, "linear")
    assert [s.get_lr(k) for k in range(6)] == [2.0, 1.5, 1.0, 0.5, 0.0, 0.0]


def test_step_and_state_dict_round_trip():
    s = sched("linear")
    for _ in range(35):
        s.step()
    assert s.get_lr() == pytest.approx(0.775)
    t = sched("linear")
    t.load_state_dict(s.state_dict())
    assert t.num_steps == 35 and t.get_lr() == s.get_lr()


def test_load_state_dict_checks_hyperparameters():
    sd = sched("linear").state_dict()
    other = sched("cosine")
    with pytest.raises(ValueError, match="decay_style='linear'"):
        other.load_state_dict(sd)
    other.load_state_dict(sd, override=True)
    assert other.decay_style == "cosine"
    other.load_state_dict(sd, use_checkpoint=True)
    assert other.decay_style == "linear"


def test_bad_input_and_from_config():
    with pytest.raises(ValueError, match="--lr-decay-style"):
        sched("exp")
    with pytest.raises(ValueError, match="--lr-decay-iters"):
        sched("linear", warmup=10, decay=10)
    cfg = OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_warmup_iters=5, lr_decay_style="cosine")
    s = OptimizerParamScheduler.from_config(cfg, train_iters=100)
    assert s.decay_steps == 100 and s.get_lr(5) == pytest.approx(3e-4)


def test_sample_based_schedule_steps_by_batches_and_converts_old_states():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear",
                          lr_schedule_unit="samples", lr_decay_samples=64, lr_warmup_samples=16)
    s = OptimizerParamScheduler.from_config(cfg, train_iters=8)
    assert (s.unit, s.warmup_steps, s.decay_steps) == ("samples", 16, 64)
    s.step_batch(8)
    assert s.num_steps == 8 and s.get_lr() == pytest.approx(0.5)
    s.step_batch(16)  # a larger batch after a resume moves the schedule further
    assert s.num_steps == 24 and s.get_lr() == pytest.approx(1 - 8 / 48)
    assert s.state_dict()["unit"] == "samples"
    # an iteration-counted state (no "unit": written before units existed) at iteration 3
    # of batches of 8: the same schedule, converted with its samples per iteration
    old = {"max_lr": 1.0, "min_lr": 0.0, "warmup_steps": 2, "decay_steps": 8,
           "decay_style": "linear", "num_steps": 3}
    s.load_state_dict(old, samples_per_iteration=8.0)
    assert s.num_steps == 24
    # and back: a samples state loaded by an iteration-counted run
    it = OptimizerParamScheduler(1.0, 0.0, 2, 8, "linear")
    it.load_state_dict(s.state_dict(), samples_per_iteration=8.0)
    assert it.num_steps == 3 and it.get_lr() == pytest.approx(1 - 1 / 6)
    with pytest.raises(ValueError, match=r"decay_steps=64 but this run has decay_steps=32 "
                                         r"\(samples\)"):
        OptimizerParamScheduler(1.0, 0.0, 16, 32, "linear", unit="samples").load_state_dict(
            s.state_dict())
    with pytest.raises(ValueError, match="samples per iteration are unknown"):
        OptimizerParamScheduler(1.0, 0.0, 16, 64, "linear", unit="samples").load_state_dict(old)
    with pytest.raises(ValueError, match="unit"):
        OptimizerParamScheduler(1.0, 0.0, 2, 8, "linear", unit="epochs")

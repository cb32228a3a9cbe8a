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


def test_inverse_square_root_after_warmup():
    """Megatron-LM's inverse-square-root: max_lr * sqrt(warmup / step), floored at min_lr;
    min_lr after the decay length, as Megatron-LM (qa37: it used to play no part)."""
    s = sched("inverse-square-root", warmup=16, decay=10**7, min_lr=0.1)
    assert s.get_lr(8) == pytest.approx(0.5)  # warmup as the other styles
    assert [s.get_lr(k) for k in (16, 64, 256)] == pytest.approx([1.0, 0.5, 0.25])
    assert s.get_lr(1600) == pytest.approx(0.1) and s.get_lr(10**6) == 0.1  # the floor
    short = sched("inverse-square-root", warmup=16, decay=20, min_lr=0.1)
    assert short.get_lr(20) == pytest.approx(math.sqrt(16 / 20))
    assert short.get_lr(21) == short.get_lr(64) == 0.1  # past the decay: min_lr
    # no warmup: counted as one step of it
    assert OptimizerParamScheduler(1.0, 0.0, 0, 10, "inverse-square-root").get_lr(4) == 0.5


@pytest.mark.parametrize("style,coeff", [
    ("linear", lambda r: 1 - r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5 ** r - 1), ("minus_sqrt", lambda r: 1 - math.sqrt(r))])
def test_wsd_is_constant_then_anneals_over_its_last_steps(style, coeff):
    """WSD with decay 110, warmup 10 and an anneal of 40: max_lr up to step 70, then the
    style's curve from 1 to 0 of (max_lr - min_lr), min_lr after step 110."""
    s = OptimizerParamScheduler(1.0, 0.1, 10, 110, "WSD", wsd_decay_steps=40,
                                wsd_decay_style=style)
    assert s.get_lr(5) == pytest.approx(0.5)
    assert [s.get_lr(k) for k in (10, 40, 70)] == [1.0, 1.0, 1.0]
    for k in (71, 80, 90, 109, 110):
        assert s.get_lr(k) == pytest.approx(0.1 + 0.9 * coeff((k - 70) / 40)), k
    assert s.get_lr(110) == pytest.approx(0.1) and s.get_lr(111) == 0.1
    rates = [s.get_lr(k) for k in range(70, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # never rises


def test_wsd_needs_an_anneal_that_fits_and_round_trips():
    for bad in (None, 0, 101):
        with pytest.raises(ValueError, match="WSD needs an anneal of 1 to 100"):
            OptimizerParamScheduler(1.0, 0.0, 10, 110, "WSD", wsd_decay_steps=bad)
    with pytest.raises(ValueError, match="--lr-wsd-decay-style"):
        OptimizerParamScheduler(1.0, 0.0, 10, 110, "WSD", wsd_decay_steps=5,
                                wsd_decay_style="exp")
    s = OptimizerParamScheduler(1.0, 0.0, 10, 110, "WSD", wsd_decay_steps=40)
    s.step(90)
    t = OptimizerParamScheduler(1.0, 0.0, 10, 110, "WSD", wsd_decay_steps=40)
    t.load_state_dict(s.state_dict())
    assert t.get_lr() == s.get_lr() < 1.0
    with pytest.raises(ValueError, match="wsd_decay_steps=40 but this run has wsd_decay_steps=20"):
        OptimizerParamScheduler(1.0, 0.0, 10, 110, "WSD", wsd_decay_steps=20).load_state_dict(
            s.state_dict())
    # a checkpoint from before WSD existed (no wsd fields) resumes a linear run as before
    old = {k: v for k, v in sched("linear").state_dict().items() if not k.startswith("wsd_")}
    sched("linear").load_state_dict(old)
    # the anneal converted between units: its samples end where the decay's do
    samples = OptimizerParamScheduler(1.0, 0.0, 80, 880, "WSD", unit="samples",
                                      wsd_decay_steps=320)
    samples.load_state_dict(s.state_dict(), samples_per_iteration=8.0)
    assert samples.num_steps == 720 and samples.get_lr() == pytest.approx(s.get_lr())


def test_wsd_and_inverse_square_root_from_megatron_lm_flags(monkeypatch):
    """Megatron-LM's flags of the two styles reach the scheduler; bad combinations are
    one error line each, before any rank waits."""
    from megatron.arguments import ArgumentError, build_config, parse_args, validate_args

    monkeypatch.setenv("RANK", "0")
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
            "--max-position-embeddings", "32", "--lr", "1.0", "--min-lr", "0.1",
            "--mock-data", "--vocab-size", "100", "--lr-warmup-iters", "10"]

    def scheduler(*extra):
        args = validate_args(parse_args(base + list(extra)), 1)
        return args, OptimizerParamScheduler.from_config(build_config(args).optimizer,
                                                         args.train_iters)

    _, s = scheduler("--train-iters", "110", "--lr-decay-style", "WSD",
                     "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "40")
    assert (s.decay_style, s.wsd_decay_steps, s.wsd_decay_style) == ("WSD", 40, "linear")
    assert s.get_lr(70) == 1.0 and s.get_lr(90) == pytest.approx(0.55)
    _, s = scheduler("--train-samples", "880", "--lr-decay-style", "WSD",
                     "--lr-wsd-decay-iters", "40")  # counted in samples: 40 x 8
    assert (s.unit, s.wsd_decay_steps, s.wsd_decay_style) == ("samples", 320, "exponential")
    _, s = scheduler("--train-iters", "110", "--lr-decay-style", "inverse-square-root")
    assert s.get_lr(40) == pytest.approx(0.5)
    args, s = scheduler("--train-iters", "110", "--lr-wsd-decay-iters", "40")
    assert s.decay_style == "linear" and s.wsd_decay_steps is None
    assert any("--lr-wsd-decay-iters changes nothing" in n for n in args.megatron_lm_notes)
    for extra, message in (
            (["--lr-decay-style", "WSD"], "WSD needs the length of its anneal"),
            (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "101"],
             r"--lr-wsd-decay-iters \(101\) must fit in the decay after warmup: 110 "
             r"iterations .* = 100"),
            (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "4",
              "--lr-wsd-decay-samples", "32"], "mutually exclusive"),
            (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "0"], "lr-wsd-decay-iters")):
        with pytest.raises(ArgumentError, match=message):
            validate_args(parse_args(base + ["--train-iters", "110"] + extra), 1)


def test_warmup_starts_from_lr_warmup_init(monkeypatch):
    """Megatron-LM's --lr-warmup-init: the warmup rises linearly from it (the decoupled
    schedule's too) and the decay is unchanged; saved only where it is not 0, compared
    on resume where a warmup uses it; out of [0, --lr] it is one error line."""
    s = OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear", warmup_init=0.2,
                                decoupled_lr=2.0)
    assert s.get_lr(0) == 0.2 and s.get_lr(5) == pytest.approx(0.6) and s.get_lr(10) == 1.0
    assert s.get_decoupled_lr(0) == 0.2 and s.get_decoupled_lr(5) == pytest.approx(1.1)
    plain = OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear")
    assert [s.get_lr(k) for k in range(10, 120)] == [plain.get_lr(k) for k in range(10, 120)]
    assert "warmup_init" not in plain.state_dict()
    s.num_steps = 30
    sd = s.state_dict()
    assert sd["warmup_init"] == 0.2
    again = OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear", warmup_init=0.2,
                                    decoupled_lr=2.0)
    again.load_state_dict(sd)
    assert again.num_steps == 30
    with pytest.raises(ValueError, match=r"checkpoint has warmup_init=0\.0 but this run has "
                                         r"warmup_init=0\.2"):
        OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear",
                                warmup_init=0.2).load_state_dict(plain.state_dict())
    # no warmup on either side: nothing starts from it
    OptimizerParamScheduler(1.0, 0.1, 0, 110, "linear", warmup_init=0.5).load_state_dict(
        OptimizerParamScheduler(1.0, 0.1, 0, 110, "linear").state_dict())
    with pytest.raises(ValueError, match="--lr-warmup-init must be in"):
        OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear", warmup_init=1.5)

    from megatron.arguments import ArgumentError, build_config, parse_args, validate_args
    monkeypatch.setenv("RANK", "0")
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
            "--max-position-embeddings", "32", "--lr", "1.0", "--min-lr", "0.1",
            "--mock-data", "--vocab-size", "100", "--lr-warmup-iters", "10",
            "--train-iters", "110"]
    args = validate_args(parse_args(base + ["--lr-warmup-init", "0.2"]), 1)
    t = OptimizerParamScheduler.from_config(build_config(args).optimizer, args.train_iters)
    assert t.get_lr(0) == 0.2 and t.get_lr(5) == pytest.approx(0.6)
    with pytest.raises(ArgumentError, match=r"--lr-warmup-init must be in \[0, --lr \(1\.0\)\], "
                                            r"got 2\.0"):
        validate_args(parse_args(base + ["--lr-warmup-init", "2"]), 1)

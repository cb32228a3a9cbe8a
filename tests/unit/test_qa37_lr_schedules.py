"""Regressions from a QA pass over the LR / weight-decay schedule flags (qa37).

* A --train-samples run's schedule is checked in samples only: its rounded iteration
  counts used to refuse a WSD anneal filling the decay after warmup, or a warmup just
  short of the decay, that Megatron-LM accepts.
* inverse-square-root gives min_lr after the decay length, as Megatron-LM's get_lr
  (``step > decay_steps`` is checked before the style).
* Error lines name the flag that set the value (--lr-warmup-fraction; --train-iters or
  --train-samples for the weight-decay ramp's length on resume).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.arguments import ArgumentError, build_config, parse_args, validate_args
from megatron.optimizer import OptimizerParamScheduler
from tests.distributed.gpt_harness import TINY

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--micro-batch-size", "2", "--seq-length", "32", "--max-position-embeddings", "32",
        "--lr", "1.0", "--min-lr", "0.1", "--mock-data", "--vocab-size", "100"]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scheduler(*extra):
    args = validate_args(parse_args(BASE + list(extra)), 1)
    return OptimizerParamScheduler.from_config(build_config(args).optimizer, args.train_iters)


# ---- --train-samples: checked in samples -------------------------------------------------

def test_samples_wsd_anneal_filling_the_decay_is_accepted():
    # 1000 samples at 64 a batch: 15 iterations (floor), warmup 100 samples -> 2 (ceil),
    # anneal 900 samples -> 15 (ceil) > 15 - 2: refused before, though 900 = 1000 - 100
    s = scheduler("--global-batch-size", "64", "--train-samples", "1000",
                  "--lr-warmup-samples", "100", "--lr-decay-style", "WSD",
                  "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-samples", "900")
    assert (s.unit, s.warmup_steps, s.decay_steps, s.wsd_decay_steps) == (
        "samples", 100, 1000, 900)
    assert s.get_lr(100) == 1.0 and s.get_lr(550) == pytest.approx(0.1 + 0.9 * 0.5)
    with pytest.raises(ArgumentError, match=r"the WSD anneal \(901 samples"):
        scheduler("--global-batch-size", "64", "--train-samples", "1000",
                  "--lr-warmup-samples", "100", "--lr-decay-style", "WSD",
                  "--lr-wsd-decay-samples", "901")


@pytest.mark.parametrize("warmup", [["--lr-warmup-samples", "990"],
                                    ["--lr-warmup-fraction", "0.99"]])
def test_samples_warmup_just_short_of_the_decay_is_accepted(warmup):
    s = scheduler("--global-batch-size", "64", "--train-samples", "1000", *warmup)
    assert (s.warmup_steps, s.decay_steps) == (990, 1000)
    with pytest.raises(ArgumentError, match=r"LR warmup \(1000 samples\) must be shorter"):
        scheduler("--global-batch-size", "64", "--train-samples", "1000",
                  "--lr-warmup-samples", "1000")


def test_iteration_checks_stay_for_train_iters_and_name_the_flag_given():
    with pytest.raises(ArgumentError, match=r"--lr-wsd-decay-iters \(9\) must fit"):
        scheduler("--global-batch-size", "8", "--train-iters", "10", "--lr-warmup-iters", "2",
                  "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "9")
    with pytest.raises(ArgumentError, match=r"LR warmup \(8 iterations, --lr-warmup-fraction\)"):
        scheduler("--global-batch-size", "8", "--train-iters", "8", "--lr-warmup-fraction", "1")
    with pytest.raises(ArgumentError, match=r"LR warmup \(8 iterations, --lr-warmup-iters\)"):
        scheduler("--global-batch-size", "8", "--train-iters", "8", "--lr-warmup-iters", "8")


# ---- inverse-square-root after the decay ---------------------------------------------------

def test_inverse_square_root_is_min_lr_after_the_decay_length():
    s = scheduler("--global-batch-size", "8", "--train-iters", "100", "--lr-warmup-iters", "4",
                  "--lr-decay-iters", "16", "--lr-decay-style", "inverse-square-root",
                  "--decoupled-lr", "2.0", "--decoupled-min-lr", "0.3")
    assert s.get_lr(16) == pytest.approx(math.sqrt(4 / 16)) == 0.5
    assert s.get_decoupled_lr(16) == pytest.approx(1.0)
    assert (s.get_lr(17), s.get_decoupled_lr(17)) == (0.1, 0.3)  # Megatron-LM: min_lr
    # the decay defaults to the run: never reached while training, as before
    s = scheduler("--global-batch-size", "8", "--train-iters", "100", "--lr-warmup-iters", "4",
                  "--lr-decay-style", "inverse-square-root")
    assert s.get_lr(99) == pytest.approx(max(0.1, math.sqrt(4 / 99)))


# ---- resume error names the ramp's length flags -------------------------------------------

def test_wd_ramp_length_mismatch_names_train_iters():
    def sched(steps):
        return OptimizerParamScheduler(1.0, 0.0, 0, 8, "linear", start_wd=0.0, end_wd=0.1,
                                       wd_incr_steps=steps, wd_incr_style="linear")
    saved = sched(8)
    saved.step(4)
    with pytest.raises(ValueError, match=r"wd_incr_steps=8 but this run has wd_incr_steps=12 "
                                         r"\(iterations\) \(the length of the weight-decay "
                                         r"ramp: the run's, --train-iters or --train-samples\)"):
        sched(12).load_state_dict(saved.state_dict())
    resumed = sched(12)
    resumed.load_state_dict(saved.state_dict(), override=True)
    assert resumed.get_wd() == pytest.approx(0.1 * 4 / 12)


# ---- real runs, in process ----------------------------------------------------------------

def _pretrain(*extra):
    import pretrain_gpt
    from megatron.training import pretrain

    i = TINY.index("--train-iters")  # the runs here count samples
    argv = TINY[:i] + TINY[i + 2:] + ["--eval-iters", "0", *extra]
    torch.manual_seed(0)
    result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                      pretrain_gpt.forward_step, argv=argv)
    lrs = {r.iteration + 1: r.lr for r in result.reports}
    losses = {k: v["lm loss"] for k, v in result.losses.items()}
    return lrs, losses


def test_samples_wsd_run_resumes_exactly(tmp_path):
    """The schedule the argument check used to refuse trains and resumes exactly
    (fp64): 48 samples at 8 a batch, warmup 8, anneal over the remaining 40."""
    flags = ["--train-samples", "48", "--lr-warmup-samples", "8", "--lr-decay-style", "WSD",
             "--lr-wsd-decay-style", "cosine", "--lr-wsd-decay-samples", "40",
             "--min-lr", "1e-4", "--start-weight-decay", "0", "--end-weight-decay", "0.1",
             "--weight-decay-incr-style", "linear"]
    full_lrs, full_losses = _pretrain(*flags)
    assert sorted(full_lrs) == [1, 2, 3, 4, 5, 6]
    # step k samples: warmup to 8, then the cosine anneal from 8 to 48
    for it, lr in full_lrs.items():
        step = 8 * (it - 1)
        want = (1e-3 * step / 8 if step <= 8 else
                1e-4 + 0.5 * (math.cos(math.pi * (step - 8) / 40) + 1) * 9e-4)
        assert lr == pytest.approx(want, rel=1e-12), it
    save = str(tmp_path / "ck")
    _pretrain(*flags, "--save", save, "--save-interval", "3", "--exit-interval", "3")
    lrs, losses = _pretrain(*flags, "--load", save)
    assert lrs == {k: v for k, v in full_lrs.items() if k > 3}
    assert losses == pytest.approx({k: v for k, v in full_losses.items() if k > 3},
                                   rel=1e-12)

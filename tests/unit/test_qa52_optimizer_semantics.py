"""Regressions from a QA pass over the optimizer, loss scaler and LR schedule (qa52),
checked against Megatron-LM's semantics.

* The dynamic loss scaler's hysteresis tracker goes below 0 as Megatron-LM's does (each
  overflow after the hysteresis is spent takes one more unit), so an fp16 run that had
  hysteresis + 1 overflows since its scale last grew -- any run starting from the
  default --initial-loss-scale 2^32 -- saved a state that its own resume refused.
* A growth tracker past --loss-scale-window (a resume with a shorter window) grows the
  scale at the next clean step instead of never again.
* inverse-square-root without warmup, in a --train-iters run: Megatron-LM counts its
  schedule in samples and floors warmup and step at one SAMPLE, so after step k the rate
  is lr / sqrt(k * global batch size), not lr / sqrt(k).
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.config import OptimizerConfig, PrecisionConfig
from megatron.optimizer import OptimizerParamScheduler, get_megatron_optimizer
from megatron.optimizer.grad_scaler import DynamicGradScaler
from tests.distributed.gpt_harness import TINY


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _megatron_scaler_trace(found_infs, initial, window, hysteresis):
    """(scale, growth tracker, hysteresis tracker) after each update, as Megatron-LM's
    DynamicGradScaler.update computes them (growth 2, backoff 0.5, floor 1)."""
    scale, growth, hyst, out = initial, 0, hysteresis, []
    for found in found_infs:
        if found:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2.0
        out.append((scale, growth, hyst))
    return out


def test_scaler_state_after_repeated_overflows_round_trips():
    pattern = [True] * 5 + [False] * 3 + [True] * 2 + [False] * 4
    want = _megatron_scaler_trace(pattern, 2.0 ** 32, 4, 2)
    s = DynamicGradScaler(2.0 ** 32, 1.0, growth_interval=4, hysteresis=2)
    for k, found in enumerate(pattern):
        s.update(found)
        sd = s.state_dict()
        assert (sd["scale"], sd["growth_tracker"], sd["hysteresis_tracker"]) == want[k], k
        # every state the scaler reaches loads into a fresh one and continues identically
        t = DynamicGradScaler(2.0 ** 32, 1.0, growth_interval=4, hysteresis=2)
        t.load_state_dict(sd)
        assert t.state_dict() == sd
    assert min(w[2] for w in want) < 0  # the case: the tracker went below zero


def test_fp16_optimizer_state_after_repeated_overflows_round_trips():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3).half()), torch.nn.Parameter(torch.randn(3).half())]
    pcfg = PrecisionConfig(fp16=True, initial_loss_scale=2.0 ** 16, hysteresis=2,
                           fp32_master_weights=True)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3), pcfg, params)
    for _ in range(4):  # overflows: the hysteresis tracker ends at -2
        for p in params:
            p.grad = torch.full_like(p, float("inf"))
        assert opt.step(params, params, params, 1e-3).skipped
    sd = opt.state_dict()
    assert sd["grad_scaler"]["hysteresis_tracker"] == -2
    other = get_megatron_optimizer(OptimizerConfig(lr=1e-3), pcfg, params)
    other.load_state_dict(sd)
    assert other.scaler.state_dict() == sd["grad_scaler"]


def test_growth_tracker_past_a_shorter_window_grows_at_the_next_clean_step():
    saved = DynamicGradScaler(1024.0, 1.0, growth_interval=100, hysteresis=2)
    for _ in range(60):
        saved.update(False)
    s = DynamicGradScaler(1024.0, 1.0, growth_interval=50, hysteresis=2)  # shorter window
    s.load_state_dict(saved.state_dict())
    s.update(False)
    assert s.scale == 2048.0
    assert s.state_dict()["growth_tracker"] == 0


def _pretrain(*extra):
    import pretrain_gpt
    from megatron.training import pretrain

    torch.manual_seed(0)
    result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                      pretrain_gpt.forward_step, argv=list(extra))
    return result


def test_fp16_run_resumes_after_repeated_overflows(tmp_path):
    """A tiny fp16 model from --initial-loss-scale 2^20 overflows at its first three
    steps: the checkpoint of iteration 3 holds a hysteresis tracker of -1, and the
    resumed run continues exactly as the uninterrupted one (skips, scales, losses)."""
    base = [a for a in TINY if a != "--fp64"]
    i = base.index("--train-iters")
    base = base[:i] + base[i + 2:] + ["--fp16", "--eval-iters", "0", "--train-iters", "8",
                                      "--initial-loss-scale", str(2.0 ** 20),
                                      "--loss-scale-window", "2"]
    full = _pretrain(*base)
    assert [r.skipped for r in full.reports[:3]] == [True] * 3  # the case
    save = str(tmp_path / "ck")
    _pretrain(*base, "--save", save, "--save-interval", "3", "--exit-interval", "3")
    resumed = _pretrain(*base, "--load", save)

    def trace(result):
        return [(r.iteration, r.skipped, r.loss_scale, r.grad_scale) for r in result.reports]

    assert trace(resumed) == trace(full)[3:]
    assert resumed.losses == {k: v for k, v in full.losses.items() if k > 3}


def test_inverse_square_root_without_warmup_floors_at_one_sample():
    """Megatron-LM: lr * sqrt(max(warmup, 1) / max(step, 1)) with both in samples; a
    --train-iters run of batch 8 after k steps is at lr / sqrt(8 k)."""
    base = list(TINY)
    at = base.index("--lr-decay-style")
    base[at + 1] = "inverse-square-root"
    result = _pretrain(*base)  # --train-iters 4, --global-batch-size 8, --lr 1e-3
    lrs = [r.lr for r in result.reports]
    want = [1e-3] + [1e-3 / math.sqrt(8 * k) for k in (1, 2, 3)]
    assert lrs == pytest.approx(want, rel=1e-12)


def test_inverse_square_root_floor_in_the_scheduler():
    # samples: the floor is one sample, the schedule's own unit
    s = OptimizerParamScheduler(1.0, 0.0, 0, 800, "inverse-square-root", unit="samples")
    assert [s.get_lr(n) for n in (0, 8, 32)] == pytest.approx([1.0, 8 ** -0.5, 32 ** -0.5])
    # iterations of 8 samples: the same rates at the same samples
    cfg = OptimizerConfig(lr=1.0, lr_decay_style="inverse-square-root", lr_warmup_iters=0)
    s = OptimizerParamScheduler.from_config(cfg, 100, global_batch_size=8)
    assert [s.get_lr(n) for n in (0, 1, 4)] == pytest.approx([1.0, 8 ** -0.5, 32 ** -0.5])
    # with warmup the ratio is the same in either unit: no change
    s = OptimizerParamScheduler.from_config(
        OptimizerConfig(lr=1.0, lr_decay_style="inverse-square-root", lr_warmup_iters=4),
        100, global_batch_size=8)
    assert s.get_lr(16) == pytest.approx(0.5)
    # the floor is not part of the checkpoint: states are unchanged
    assert "min_count" not in s.state_dict()


def test_evaluation_only_run_loads_a_decoupled_lr_checkpoint(tmp_path):
    """--skip-train takes no step, so the checkpoint's LR schedule is not compared nor
    adopted: a checkpoint trained with --decoupled-lr evaluates with or without the flag
    (the schedule check used to refuse it, naming --use-checkpoint-opt_param-scheduler,
    which the run did not pass)."""
    save = str(tmp_path / "ck")
    trained = _pretrain(*TINY, "--decoupled-lr", "2e-3", "--lr-decay-style", "linear",
                        "--save", save, "--save-interval", "4")
    want = trained.eval_losses[4]["lm loss"]
    for extra in ([], ["--decoupled-lr", "2e-3"], ["--lr", "5e-4"]):
        result = _pretrain(*TINY, "--skip-train", "--load", save, *extra)
        assert not result.reports
        losses = [v["lm loss"] for v in result.eval_losses.values()]
        assert losses and losses[0] == pytest.approx(want, rel=1e-12), extra

"""Megatron-LM's TensorBoard selection flags (helper-51): which scalars --tensorboard-dir
writes, under which flag and at which interval, as Megatron-LM's ``training_log`` and
``evaluate_and_print_results`` write them.

* per-iteration scalars on iterations divisible by --tensorboard-log-interval (default 1);
* learning-rate and loss-scale on by default (--no-log-learning-rate-to-tensorboard,
  Megatron-LM's own spelling --no-log-learnig-rate-to-tensorboard, and
  --no-log-loss-scale-to-tensorboard turn them off);
* batch-size, world-size, validation ppl, mem-*, iteration-time / throughput / the
  per-phase ``*-time`` timers only when asked;
* --tensorboard-queue-size is SummaryWriter's max_queue;
* a skipped iteration has no grad norm (Megatron-LM's optimizer returns none for it).

The tensorboard package is not a test dependency: most tests record the writer's calls;
``test_event_files_read_back`` reads real event files back where tensorboard is installed.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.pipeline.update import StepReport
from tests import fake_tensorboard
from tests.distributed.gpt_harness import TINY


@pytest.fixture
def fake_tb(monkeypatch):
    """--tensorboard-dir without the tensorboard package (not a test dependency)."""
    return fake_tensorboard.install(monkeypatch)


def _logger(tmp_path, argv, device=None):
    """A TrainingLogger built as a run builds it (its SummaryWriter included)."""
    from megatron.arguments import parse_and_validate
    from megatron.training_log import TrainingLogger

    _, cfg = parse_and_validate(TINY + ["--tensorboard-dir", str(tmp_path / "tb")] + argv,
                                world_size=1)
    groups = SimpleNamespace(layout=SimpleNamespace(world_size=1), dp_size=1, tp_size=1,
                             pp_size=1)
    extra = {"device": device} if device is not None else {}
    log = TrainingLogger(cfg, groups, flops_per_iteration=8e12, **extra)
    return log, log.writer


def _train(log, n, skipped=(), gbs=8):
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    for t in range(n):
        skip = t in skipped
        rep = StepReport(iteration=t, skipped=skip, grad_norm=float("inf") if skip else 1.5,
                         loss_scale=2.0, lr=1e-3, weight_version=t,
                         losses={"lm loss": 4.0 - 0.1 * t})
        state.iteration = t + 1
        state.consumed_train_samples += gbs
        log.on_step(rep, state, gbs)
    return state


def _validate(log, iteration=4, samples=32):
    from megatron.training_loop import evaluate_and_print

    class Engine:
        def evaluate(self, it, n):
            return {"lm loss": 2.5}

    evaluate_and_print(Engine(), None, 1, "validation", iteration, log, samples=samples)


# ---- defaults ---------------------------------------------------------------------------
def test_defaults_write_megatrons_default_scalars_only(fake_tb, tmp_path, capsys):
    log, w = _logger(tmp_path, ["--log-interval", "2"])
    _train(log, 4)
    _validate(log)
    for tag in ("lm loss", "learning-rate", "loss-scale", "grad-norm"):
        assert w.steps(tag) == [1, 2, 3, 4], tag
        assert w.steps(tag + " vs samples") == [8, 16, 24, 32], tag
    assert w.steps("lm loss validation") == [4]
    off = {"batch-size", "batch-size vs samples", "world-size", "world-size vs samples",
           "lm loss validation ppl", "lm loss validation ppl vs samples", "iteration-time",
           "throughput", "forward-compute-time", "optimizer-time", "mem-allocated-bytes"}
    assert not off & w.tags(), off & w.tags()
    assert w.kwargs.get("max_queue") == 1000


# ---- one flag at a time -----------------------------------------------------------------
@pytest.mark.parametrize("flag,tags", [
    ("--log-batch-size-to-tensorboard", ("batch-size", "batch-size vs samples")),
    ("--log-world-size-to-tensorboard", ("world-size", "world-size vs samples")),
])
def test_opt_in_scalars(fake_tb, tmp_path, flag, tags):
    log, w = _logger(tmp_path, [])
    _train(log, 3)
    assert not set(tags) & w.tags()
    log, w = _logger(tmp_path, [flag])
    _train(log, 3)
    assert w.steps(tags[0]) == [1, 2, 3]
    assert w.steps(tags[1]) == [8, 16, 24]
    assert w.values(tags[0]) == ([8.0] * 3 if "batch" in flag else [1.0] * 3)


@pytest.mark.parametrize("flag,tag", [
    ("--no-log-learning-rate-to-tensorboard", "learning-rate"),
    ("--no-log-learnig-rate-to-tensorboard", "learning-rate"),  # Megatron-LM's spelling
    ("--no-log-loss-scale-to-tensorboard", "loss-scale"),
])
def test_opt_out_scalars(fake_tb, tmp_path, flag, tag, capsys):
    log, w = _logger(tmp_path, [flag])
    _train(log, 3)
    assert tag not in w.tags() and tag + " vs samples" not in w.tags()
    assert w.steps("lm loss") == [1, 2, 3]  # the rest is still written
    assert "ignored" not in capsys.readouterr().err


def test_validation_ppl_only_when_asked(fake_tb, tmp_path):
    log, w = _logger(tmp_path, [])
    _validate(log)
    assert w.steps("lm loss validation") == [4]
    assert "lm loss validation ppl" not in w.tags()
    log, w = _logger(tmp_path, ["--log-validation-ppl-to-tensorboard",
                                "--tensorboard-log-interval", "3"])
    _validate(log, iteration=4, samples=32)  # evaluations ignore the TensorBoard interval
    assert w.steps("lm loss validation ppl") == [4]
    assert w.steps("lm loss validation ppl vs samples") == [32]
    assert w.values("lm loss validation ppl") == [pytest.approx(12.182494, rel=1e-6)]


def test_tensorboard_log_interval(fake_tb, tmp_path, capsys):
    log, w = _logger(tmp_path, ["--tensorboard-log-interval", "3", "--log-interval", "2",
                                "--log-batch-size-to-tensorboard",
                                "--log-world-size-to-tensorboard", "--log-params-norm"])
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    for t in range(7):
        rep = StepReport(iteration=t, skipped=False, grad_norm=1.5, loss_scale=2.0, lr=1e-3,
                         weight_version=t, losses={"lm loss": float(t)}, params_norm=3.0)
        state.iteration, state.consumed_train_samples = t + 1, 8 * (t + 1)
        log.on_step(rep, state, 8)
    for tag in ("lm loss", "learning-rate", "loss-scale", "grad-norm", "batch-size",
                "world-size", "params-norm"):
        assert w.steps(tag) == [3, 6], tag
        assert w.steps(tag + " vs samples") == [24, 48], tag
    # the iteration's own value, not an average
    assert w.values("lm loss") == [2.0, 5.0]
    # the log line keeps --log-interval
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln]
    assert [ln.split("/")[0].split()[-1] for ln in lines] == ["2", "4", "6"]


def test_timers_iteration_time_and_throughput(fake_tb, tmp_path):
    log, w = _logger(tmp_path, ["--log-interval", "2"])
    _train(log, 4)
    assert not {"iteration-time", "throughput"} & w.tags()
    log, w = _logger(tmp_path, ["--log-interval", "2", "--log-timers-to-tensorboard",
                                "--tensorboard-log-interval", "3"])
    _train(log, 4)
    # with the log line (--log-interval), as Megatron-LM
    assert w.steps("iteration-time") == [2, 4]
    assert w.steps("throughput") == [2, 4]


def test_queue_size_is_summary_writers_max_queue(fake_tb, tmp_path):
    _, w = _logger(tmp_path, ["--tensorboard-queue-size", "7"])
    assert w.kwargs["max_queue"] == 7


def test_memory_on_cpu_warns_once_and_writes_nothing(fake_tb, tmp_path, capsys):
    log, w = _logger(tmp_path, ["--log-memory-to-tensorboard"], device=torch.device("cpu"))
    _train(log, 3)
    out = capsys.readouterr().out
    assert out.count("--log-memory-to-tensorboard") == 1, out
    assert "warning:" in out
    assert not any(t.startswith("mem-") for t in w.tags())
    assert w.steps("lm loss") == [1, 2, 3]


def test_memory_on_cuda_writes_megatrons_counters(fake_tb, tmp_path, monkeypatch, capsys):
    stats = {"reserved_bytes.all.current": 4096, "allocated_bytes.all.current": 1024,
             "allocated_bytes.all.peak": 2048, "allocation.all.current": 5}
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda device=None: asked.append(device) or dict(stats))
    log, w = _logger(tmp_path, [], device=torch.device("cuda", 0))
    _train(log, 2)
    assert not any(t.startswith("mem-") for t in w.tags()) and not asked
    log, w = _logger(tmp_path, ["--log-memory-to-tensorboard", "--tensorboard-log-interval",
                                "2"], device=torch.device("cuda", 0))
    _train(log, 4)
    assert "warning" not in capsys.readouterr().out
    assert w.steps("mem-reserved-bytes") == [2, 4]
    assert w.values("mem-reserved-bytes") == [4096.0, 4096.0]
    assert w.values("mem-allocated-bytes") == [1024.0, 1024.0]
    assert w.values("mem-max-allocated-bytes") == [2048.0, 2048.0]
    assert w.values("mem-allocated-count") == [5.0, 5.0]
    assert asked == [torch.device("cuda", 0)] * 2


def test_skipped_iteration_has_no_grad_norm(fake_tb, tmp_path, capsys):
    """Megatron-LM's optimizer returns no grad norm for a skipped step: the log line has no
    'grad norm' field and TensorBoard no grad-norm point for it."""
    log, w = _logger(tmp_path, ["--log-interval", "2", "--log-num-zeros-in-grad"])
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    for t in range(4):
        skip = t == 1
        rep = StepReport(iteration=t, skipped=skip, grad_norm=float("inf") if skip else 1.5,
                         loss_scale=2.0, lr=1e-3, weight_version=t, losses={"lm loss": 3.0},
                         num_zeros=0)
        state.iteration, state.consumed_train_samples = t + 1, 8 * (t + 1)
        log.on_step(rep, state, 8)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln]
    assert "grad norm" not in lines[0] and "num zeros" not in lines[0], lines[0]
    assert "loss scale: 2.0 | number of skipped iterations:   1 |" in lines[0], lines[0]
    assert "number of skipped iterations:   1 |" in lines[0]
    assert "grad norm: 1.500 |" in lines[1]
    assert w.steps("grad-norm") == [1, 3, 4]
    assert w.steps("num-zeros") == [1, 3, 4]


# ---- the flags are parsed and checked ---------------------------------------------------
@pytest.mark.parametrize("flag", ["--tensorboard-log-interval", "--tensorboard-queue-size"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_bad_values_are_one_error_naming_the_flag(flag, value):
    from megatron.arguments import ArgumentError, parse_args, validate_args

    with pytest.raises(ArgumentError, match=f"^{flag} must be >= 1, got {value}$"):
        validate_args(parse_args(TINY + [flag, value]), 1)


def test_flags_are_no_longer_ignored(capsys):
    from megatron.arguments import parse_and_validate

    args, cfg = parse_and_validate(TINY + [
        "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
        "--no-log-loss-scale-to-tensorboard", "--tensorboard-log-interval", "5",
        "--tensorboard-queue-size", "3"], world_size=1)
    tb = cfg.training.tensorboard
    assert (tb.timers, tb.validation_ppl, tb.memory, tb.world_size, tb.batch_size) == (True,) * 5
    assert (tb.learning_rate, tb.loss_scale, tb.log_interval, tb.queue_size) == (False, False, 5, 3)
    assert "tensorboard" not in capsys.readouterr().err  # no 'ignored' note names them
    _, cfg = parse_and_validate(TINY, world_size=1)
    tb = cfg.training.tensorboard
    assert (tb.timers, tb.validation_ppl, tb.memory, tb.world_size, tb.batch_size) == (False,) * 5
    assert (tb.learning_rate, tb.loss_scale, tb.log_interval, tb.queue_size) == (True, True, 1, 1000)


# ---- a run: per-phase timers from the executor -----------------------------------------
def test_a_run_writes_per_phase_timers(fake_tb, tmp_path, capsys):
    import pretrain_gpt
    from megatron.training import pretrain

    pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step,
             argv=TINY + ["--log-interval", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                          "--log-timers-to-tensorboard", "--tensorboard-log-interval", "2"])
    w = fake_tb.instances[-1]
    # one stage: forward, backward, the gradient reduction and the optimizer step
    for name in ("forward-compute", "backward-compute", "all-grads-sync", "optimizer",
                 "forward-backward"):
        assert w.steps(f"{name}-time") == [2, 4], name
        assert all(v > 0 for v in w.values(f"{name}-time")), name
    assert set(w.steps("forward-backward-time")) == {2, 4}
    # no neighbour to talk to
    assert not {f"{d}-{io}-time" for d in ("forward", "backward")
                for io in ("send", "recv")} & w.tags()
    assert w.steps("iteration-time") == [2, 4]
    fb, it = w.values("forward-backward-time"), w.values("iteration-time")
    assert all(a <= b for a, b in zip(fb, it)), (fb, it)  # per iteration, within it


def test_a_run_without_the_flag_writes_no_timers(fake_tb, tmp_path, capsys):
    import pretrain_gpt
    from megatron.training import pretrain

    pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step,
             argv=TINY + ["--log-interval", "2", "--tensorboard-dir", str(tmp_path / "tb")])
    w = fake_tb.instances[-1]
    assert w.steps("lm loss") == [1, 2, 3, 4]
    assert not any(t.endswith("-time") for t in w.tags()), w.tags()


# ---- real event files -------------------------------------------------------------------
def test_event_files_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log, _ = _logger(tmp_path, ["--tensorboard-log-interval", "2",
                                "--log-batch-size-to-tensorboard",
                                "--no-log-loss-scale-to-tensorboard",
                                "--log-validation-ppl-to-tensorboard"])
    _train(log, 4)
    _validate(log)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("lm loss")] == [2, 4]
    assert [e.step for e in acc.Scalars("batch-size vs samples")] == [16, 32]
    assert [e.value for e in acc.Scalars("batch-size")] == [8.0, 8.0]
    assert [e.step for e in acc.Scalars("lm loss validation ppl")] == [4]
    assert "loss-scale" not in tags and "world-size" not in tags
    assert not {"iteration-time", "throughput"} & tags

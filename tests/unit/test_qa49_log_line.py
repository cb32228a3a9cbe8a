"""What a run reports, against Megatron-LM's ``training_log`` and
``evaluate_and_print_results``: users grep the log lines and overlay the TensorBoard
scalars of our runs on their Megatron-LM runs (helper-49's QA pass).

* the iteration line: Megatron-LM's field names in its order (``throughput per GPU
  (TFLOP/s/GPU)`` after the time, ``global batch size`` after the learning rates, on
  every line), fixed-point numbers a ``[0-9.]+`` grep reads;
* the interval's loss is the mean over the iterations that were applied: a skipped
  (fp16 overflow) iteration's finite loss is left out, as Megatron-LM leaves it out;
* the validation and test lines: `` validation loss at iteration N | ... |``, at the end
  ``iteration N on validation set`` / ``on test set``, framed by dashes of its length;
* TensorBoard: Megatron-LM's tag names (``lm loss``, ``learning-rate``, ``loss-scale``,
  ``grad-norm``, ...), each with its `` vs samples`` twin at the consumed samples, at
  every iteration; ``lm loss validation`` (and with --log-validation-ppl-to-tensorboard
  ``... ppl``) at the evaluation's iteration; ``batch-size`` with
  --log-batch-size-to-tensorboard, ``iteration-time`` with --log-timers-to-tensorboard.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megatron.pipeline.update import StepReport
from tests import fake_tensorboard as tb_stub
from tests.distributed.gpt_harness import TINY

_Writer = tb_stub.RecordingWriter


@pytest.fixture
def fake_tensorboard(monkeypatch):
    """--tensorboard-dir without the tensorboard package (not a test dependency)."""
    return tb_stub.install(monkeypatch)


def _logger(argv, writer=None):
    from megatron.arguments import parse_and_validate
    from megatron.training_log import TrainingLogger

    _, cfg = parse_and_validate(TINY + argv, world_size=1)
    groups = SimpleNamespace(layout=SimpleNamespace(world_size=1), dp_size=1, tp_size=1,
                             pp_size=1)
    log = TrainingLogger(cfg, groups, flops_per_iteration=8e12)
    log.writer = writer
    return log, cfg


def _step(log, state, t, loss, skipped=False, scale=1.0, gbs=8):
    rep = StepReport(iteration=t, skipped=skipped, grad_norm=1.5, loss_scale=scale,
                     lr=1e-3, weight_version=t, losses={"lm loss": loss})
    state.iteration = t + 1
    state.consumed_train_samples += gbs
    log.on_step(rep, state, gbs)


def _fields(line):
    return [p.strip().split(":")[0] for p in line.split("|")[:-1]]


def test_iteration_line_has_megatron_fields_in_megatron_order(capsys):
    log, _ = _logger(["--log-interval", "2"])
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    for t in range(2):
        _step(log, state, t, 4.0)
    line = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln][0]
    names = _fields(line)
    mega = ["iteration        2/       4", "consumed samples", "elapsed time per iteration (ms)",
            "throughput per GPU (TFLOP/s/GPU)", "learning rate", "global batch size",
            "lm loss", "loss scale", "grad norm", "number of skipped iterations",
            "number of nan iterations"]
    # extra fields of ours may sit in between; Megatron-LM's keep its order
    assert [n for n in names if n in mega or n.startswith("iteration")] == mega, line
    assert re.search(r"throughput per GPU \(TFLOP/s/GPU\): [0-9]+\.[0-9]+ \|", line), line
    assert "global batch size:     8 |" in line
    assert line.startswith(" iteration ") and line.endswith(" |")


def test_loss_average_leaves_out_skipped_iterations(capsys):
    """Megatron-LM sums the loss of applied iterations only and divides by their count."""
    log, _ = _logger(["--log-interval", "3"])
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    _step(log, state, 0, 3.0)
    _step(log, state, 1, 100.0, skipped=True)   # fp16 overflow: finite loss, step skipped
    _step(log, state, 2, 5.0)
    line = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln][0]
    assert "lm loss: 4.000000E+00 |" in line, line
    assert "number of skipped iterations:   1 |" in line


def test_tensorboard_tags_and_steps_are_megatrons():
    w = _Writer()
    log, _ = _logger(["--log-interval", "2", "--log-batch-size-to-tensorboard",
                      "--log-timers-to-tensorboard"], writer=w)
    state = SimpleNamespace(iteration=0, consumed_train_samples=0)
    for t in range(4):
        _step(log, state, t, 4.0 - t)
    for tag in ("lm loss", "learning-rate", "loss-scale", "grad-norm", "batch-size"):
        assert [s for s, _ in w.series(tag)] == [1, 2, 3, 4], tag
        assert [s for s, _ in w.series(tag + " vs samples")] == [8, 16, 24, 32], tag
    assert [v for _, v in w.series("lm loss")] == [4.0, 3.0, 2.0, 1.0]
    assert [v for _, v in w.series("batch-size")] == [8.0] * 4
    assert [s for s, _ in w.series("iteration-time")] == [2, 4]
    assert not any(t.startswith("train/") for t in w.tags()), w.tags()


def test_validation_and_test_lines_and_scalars(capsys):
    from megatron.training_loop import evaluate_and_print

    class Engine:
        def evaluate(self, it, n):
            return {"lm loss": 2.5}

    w = _Writer()
    log, _ = _logger(["--log-validation-ppl-to-tensorboard"], writer=w)
    evaluate_and_print(Engine(), None, 1, "validation", 3, log, samples=24)
    evaluate_and_print(Engine(), None, 1, "validation", 4, log, samples=32, at_end=True)
    evaluate_and_print(Engine(), None, 1, "test", 4, log, samples=32, at_end=True)
    lines = capsys.readouterr().out.splitlines()
    body = " validation loss at iteration 3 | lm loss value: 2.500000E+00 | " \
           "lm loss PPL: 1.218249E+01 | "
    assert lines[0:3] == ["-" * (len(body) + 1), body, "-" * (len(body) + 1)]
    assert " validation loss at iteration 4 on validation set | lm loss value" in lines[4]
    assert " validation loss at iteration 4 on test set | lm loss value" in lines[7]
    assert w.series("lm loss validation")[:2] == [(3, 2.5), (4, 2.5)]
    assert [s for s, _ in w.series("lm loss validation vs samples")][:2] == [24, 32]
    assert [s for s, _ in w.series("lm loss validation ppl")][:2] == [3, 4]
    assert w.series("lm loss test") == [(4, 2.5)]


def test_ppl_is_clamped_at_exp_20(capsys):
    from megatron.training_loop import evaluate_and_print

    class Engine:
        def evaluate(self, it, n):
            return {"lm loss": 30.0}

    log, _ = _logger([])
    evaluate_and_print(Engine(), None, 1, "validation", 3, log)
    assert "lm loss PPL: 4.851652E+08 |" in capsys.readouterr().out


def test_a_run_writes_megatrons_scalars(fake_tensorboard, tmp_path, capsys):
    import pretrain_gpt
    from megatron.training import pretrain

    pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step,
             argv=TINY + ["--eval-interval", "2", "--log-interval", "2",
                          "--tensorboard-dir", str(tmp_path / "tb")])
    out = capsys.readouterr().out
    w = fake_tensorboard.instances[-1]
    assert [s for s, _ in w.series("lm loss")] == [1, 2, 3, 4]
    assert [s for s, _ in w.series("lm loss vs samples")] == [8, 16, 24, 32]
    # the in-training evaluations, then the end-of-training one (at the same step)
    assert [s for s, _ in w.series("lm loss validation")] == [2, 4, 4]
    assert [s for s, _ in w.series("lm loss validation vs samples")] == [16, 32, 32]
    assert " validation loss at iteration 2 |" in out
    assert " validation loss at iteration 4 on validation set |" in out
    assert " validation loss at iteration 4 on test set |" in out
    assert "global batch size:     8 |" in out

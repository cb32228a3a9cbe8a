"""Fault injection for the training loop (issue 12): what a user gets when a run goes wrong.

* NaN/Inf loss or gradients: skipped on every rank and schedule (fp32 too), counted,
  never applied or saved; a run that keeps skipping stops with one line and exit 1;
* a run with nothing to train (no iterations left, empty training split) is an error;
* bad flags (--lr inf, unwritable --save) stop before anything starts;
* entry points: one ``error:`` line / ``interrupted``, exit codes 2 / 130, --debug;
* failure grids are a window, not the whole segment;
* SIGTERM with --exit-signal-handler: every rank saves at the same iteration, exit 0;
* a worker whose launcher (torchrun's agent) is killed exits within seconds.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY

REPO = Path(__file__).resolve().parents[2]
# float32 (the "in fp32 a NaN step is applied and saved"), 4 layers for pp=2.
FP32 = [a for a in TINY if a != "--fp64"]


def _argv(*extra: str, iters: int = 4) -> list:
    base = list(FP32)
    base[base.index("--train-iters") + 1] = str(iters)
    return base + list(extra)


# ---- NaN injection: forward_steps that poison the loss of chosen batches ------------------

class _Poison:
    """Counts last-stage forwards (m per batch) and poisons the loss of chosen batches."""

    def __init__(self, batches, m: int, how: str) -> None:
        self.batches, self.m, self.how, self.calls = set(batches), m, how, 0

    def __call__(self, data_iterator, model):
        import pretrain_gpt

        output, loss_fn = pretrain_gpt.forward_step(data_iterator, model)
        batch = self.calls // self.m
        self.calls += 1
        if batch not in self.batches and not (self.batches == {"all"} and batch >= 1):
            return output, loss_fn

        def poisoned(out):
            loss, reported = loss_fn(out)
            # "mul": NaN gradients too; "add": the gradients stay finite, only the loss
            # says the batch is bad (the optimizer's gradient check alone misses it).
            bad = loss * float("nan") if self.how == "mul" else loss + float("nan")
            return bad, {k: v + float("nan") for k, v in reported.items()}
        return output, poisoned


def _train(argv, forward_step):
    import pretrain_gpt
    from megatron.training import pretrain

    return pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, forward_step,
                    argv=argv)


@pytest.mark.parametrize("how", ["mul", "add"])
def test_fp32_nan_step_is_skipped_counted_and_not_applied(how, capsys):
    """Single rank, fp32: batch 1 (iteration 2) has a NaN loss.  Old code applied it."""
    argv = _argv("--log-interval", "1", "--eval-iters", "0")
    res = _train(argv, _Poison({1}, m=4, how=how))
    assert [r.skipped for r in res.reports] == [False, True, False, False]
    out = capsys.readouterr().out
    assert "number of nan iterations:   1" in out
    assert all(math.isfinite(v["lm loss"]) for t, v in res.losses.items() if t != 2)
    # The skipped batch changed nothing: iteration 2's weights equal iteration 1's, so
    # the run is the clean run shifted by one batch from there on -- at least finite.
    assert all(math.isfinite(r.grad_norm) for r in res.reports if not r.skipped)
    assert res.shared_embedding is not None and torch.isfinite(res.shared_embedding).all()


def _nan_two_stages(rank: int, world: int, save_root: str):
    from megatron.errors import UserError

    out = {}
    for schedule in ("flush", "2bw"):
        argv = _argv("--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
                     "--eval-iters", "0", "--save", f"{save_root}/{schedule}", iters=5)
        res = _train(argv, _Poison({2}, m=4, how="mul"))
        out[schedule] = {"skipped": [r.skipped for r in res.reports],
                         "embedding_finite": (res.shared_embedding is None
                                              or bool(torch.isfinite(res.shared_embedding).all()))}
        # Every batch from the second on is NaN: the run stops after 3 skipped steps in a
        # row, on both stages, and saves nothing.
        argv = _argv("--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
                     "--eval-iters", "0", "--max-consecutive-skipped-steps", "3",
                     "--save", f"{save_root}/{schedule}_stuck", "--save-interval", "100",
                     iters=30)
        poison = _Poison({"all"}, m=4, how="mul")
        try:
            _train(argv, poison)
            out[schedule]["stuck"] = None
        except UserError as exc:
            out[schedule]["stuck"] = (type(exc).__name__, getattr(exc, "exit_code", 2), str(exc))
        out[schedule]["stuck_forwards"] = poison.calls
    return out


def test_nan_under_flush_and_2bw_is_agreed_skipped_and_stops(tmp_path):
    res = run_distributed(_nan_two_stages, 2, args=(str(tmp_path),), timeout=240)
    for schedule in ("flush", "2bw"):
        stage0, stage1 = res[0][schedule], res[1][schedule]
        # NaN loss and gradients on the last stage only; both stages skip batch 2.
        assert stage0["skipped"] == stage1["skipped"] == [False, False, True, False, False]
        assert stage0["embedding_finite"] and stage1["embedding_finite"]
        for stage in (stage0, stage1):
            name, code, msg = stage["stuck"]
            assert name == "NonFiniteError" and code == 1
            assert "3 optimizer steps in a row were skipped" in msg and "\n" not in msg
        assert not list((tmp_path / f"{schedule}_stuck").glob("iter_*"))
        assert list((tmp_path / schedule).glob("iter_*"))  # the healthy run did save
    # Flush stops right after the third skipped batch (batch 4 of 30, 4 microbatches
    # each) on both stages, although its segments are many batches long; 2BW checks
    # every NAN_CHECK_BATCHES_2BW batches, here at the end of the 30.
    assert res[0]["flush"]["stuck_forwards"] == res[1]["flush"]["stuck_forwards"] == 16
    assert res[1]["2bw"]["stuck_forwards"] == 30 * 4


def test_skip_monitor_counts_floor_and_calibration():
    from megatron.pipeline.update import StepReport
    from megatron.training_exits import SkipMonitor

    def rep(t, skipped, scale=1.0, norm=float("nan")):
        return StepReport(iteration=t, skipped=skipped, grad_norm=norm, loss_scale=scale,
                          lr=1.0, weight_version=t, grad_scale=scale)

    m = SkipMonitor(limit=3)
    for t, s in enumerate([True, True, False, True, True]):
        m.update(rep(t, s))
    assert m.reason is None  # never 3 in a row
    m.update(rep(5, True))
    assert m.reason and "iterations 4-6" in m.reason
    # fp16 dynamic scaling: calibration skips before the first applied step are free...
    f = SkipMonitor(limit=3, dynamic_fp16=True, min_loss_scale=1.0)
    for t in range(20):
        f.update(rep(t, True, scale=2.0 ** (32 - t)))
    assert f.reason is None
    f.update(rep(20, False, scale=4096.0, norm=1.0))
    for t in range(21, 24):
        f.update(rep(t, True, scale=4096.0))
    assert f.reason and "3 optimizer steps" in f.reason
    # ...unless they ran at the floor, where the scale cannot calibrate further: those
    # count; an overflow there is one more skip (as Megatron-LM), not a stop.
    g = SkipMonitor(limit=3, dynamic_fp16=True, min_loss_scale=1.0)
    g.update(rep(0, True, scale=1.0, norm=float("inf")))
    g.update(rep(1, False, scale=1.0, norm=1.0))
    g.update(rep(2, True, scale=1.0, norm=float("inf")))
    assert g.reason is None
    g.update(rep(3, True, scale=1.0, norm=float("inf")))
    g.update(rep(4, True, scale=1.0, norm=float("inf")))
    assert g.reason and "at the minimum loss scale 1 (--min-loss-scale)" in g.reason
    assert "iterations 3-5" in g.reason
    h = SkipMonitor(limit=2, dynamic_fp16=True, min_loss_scale=4.0)
    for t, scale in enumerate([16.0, 8.0, 4.0, 4.0]):  # never applied, reaches the floor
        h.update(rep(t, True, scale=scale))
    assert h.reason and "iterations 3-4" in h.reason
    assert not SkipMonitor(limit=0, dynamic_fp16=True).batches_before_verdict(0)


def test_batches_before_verdict_is_the_first_batch_that_could_stop_the_run():
    """A flushing schedule's segment is this long: it must end on the first batch whose
    report could stop the run, never later (the run would go on past its stop) and,
    away from a streak or the loss-scale floor, not every batch."""
    from megatron.optimizer.grad_scaler import DynamicGradScaler
    from megatron.pipeline.update import StepReport
    from megatron.training_exits import SkipMonitor

    def rep(t, skipped, scale=1.0, norm=1.0):
        return StepReport(iteration=t, skipped=skipped, grad_norm=norm, loss_scale=scale,
                          lr=1.0, weight_version=t, grad_scale=scale)

    # Simulate: after each batch, the monitor must have stopped iff the bound said the
    # segment could end there.  Skips at random, limit 4.
    import random
    rng = random.Random(0)
    m, t, ends = SkipMonitor(limit=4), 0, 0
    while m.reason is None:
        ahead = m.batches_before_verdict()
        assert ahead is not None and 1 <= ahead <= 4
        for k in range(ahead):
            m.update(rep(t, rng.random() < 0.6))
            t += 1
            # a stop can only come on the segment's last batch
            assert m.reason is None or k == ahead - 1, (t, k, ahead)
        ends += 1
    assert "4 optimizer steps in a row" in m.reason and ends < t
    assert SkipMonitor(limit=0).batches_before_verdict() is None

    s = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=2.0 ** 7, hysteresis=2)
    assert s.steps_to_min_scale() == 3
    for _ in range(4):  # hysteresis 2: the first overflow does not back off
        s.update(found_inf=True)
    assert s.scale == 2.0 ** 7 and s.steps_to_min_scale() == 0
    f = SkipMonitor(limit=10, dynamic_fp16=True, min_loss_scale=2.0 ** 7)
    # before any applied step, skips count from the batch at the floor on
    assert f.batches_before_verdict(steps_to_min_scale=3) == 13
    assert f.batches_before_verdict(steps_to_min_scale=0) == 10
    f.update(rep(0, False, scale=2.0 ** 10))
    assert f.batches_before_verdict(steps_to_min_scale=50) == 10


def test_validation_nan_prints_nan_not_a_ppl(capsys):
    from megatron.training_loop import evaluate_and_print

    class Engine:
        def evaluate(self, it, n):
            return {"lm loss": float("nan")}

    class Logger:
        tb = SimpleNamespace(validation_ppl=False)

        def scalar(self, *a):
            pass

        def scalars(self, *a):
            pass

    evaluate_and_print(Engine(), None, 1, "validation", 3, Logger())
    out = capsys.readouterr().out
    assert "lm loss PPL: nan" in out and "E+08" not in out


# ---- nothing to train ----------------------------------------------------------------------

def test_resuming_at_or_past_train_iters_is_an_error(tmp_path):
    import pretrain_gpt
    from megatron.errors import UserError

    ckpt = str(tmp_path / "ck")
    _train(_argv("--save", ckpt, "--eval-iters", "0", iters=2), pretrain_gpt.forward_step)
    with pytest.raises(UserError, match=r"nothing to train: .* at iteration 2 and --train-iters is 2"
                       ) as info:
        _train(_argv("--load", ckpt, "--eval-iters", "0", iters=2), pretrain_gpt.forward_step)
    assert info.value.every_rank_alike  # one line per node, not one per rank


def test_empty_training_split_is_an_error():
    import pretrain_gpt
    from megatron.errors import DataError
    from megatron.training import pretrain

    def no_train(cfg, tokenizer, num_samples):
        _, valid, test = pretrain_gpt.datasets_provider(cfg, tokenizer, num_samples)
        return None, valid, test

    with pytest.raises(DataError, match="training split is empty"):
        pretrain(no_train, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                 argv=_argv("--eval-iters", "0"))


# ---- bad flags stop before anything starts --------------------------------------------------

def _validate(argv):
    from megatron.arguments import parse_and_validate

    return parse_and_validate(argv, world_size=1)


@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--lr", "nan"), ("--min-lr", "nan"),
                                        ("--clip-grad", "inf"), ("--weight-decay", "nan"),
                                        ("--adam-eps", "inf"), ("--initial-loss-scale", "inf")])
def test_non_finite_float_flag_is_one_error_line(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        _validate(_argv(flag, value))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {flag} must be a finite number, got {float(value)}"


@pytest.mark.parametrize("flag", ["--save", "--tensorboard-dir"])
def test_unwritable_output_dir_is_found_at_start_up(flag, capsys, tmp_path, monkeypatch):
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec  # tensorboard need not be installed for this check
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        importlib.machinery.ModuleSpec(name, None) if name == "tensorboard" else real(name, *a)))
    with pytest.raises(SystemExit):
        _validate(_argv(flag, "/proc/nope/ck"))
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag} /proc/nope/ck is not a writable directory")
    # A missing directory passes (its parent is writable) and is not created: validation
    # leaves nothing behind; the run creates it when it starts training.
    made = tmp_path / "a" / "b"
    _validate(_argv(flag, str(made)))
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []
    # A file on the way is named.
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit):
        _validate(_argv(flag, str(tmp_path / "f" / "ck")))
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {flag} {tmp_path / 'f' / 'ck'} is not a writable directory "
                   f"(it is under the file {tmp_path / 'f'})")


# ---- entry points ---------------------------------------------------------------------------

def _entry(main, argv, monkeypatch, debug=False):
    from megatron.entry import run_entry_point

    # "0" (not delenv): monkeypatch then also undoes the "1" that --debug exports.
    monkeypatch.setenv("MEGATRON_DEBUG", "0")
    if debug:
        argv = argv + ["--debug"]
    with pytest.raises(SystemExit) as exc:
        run_entry_point(main, argv)
    return exc.value.code


@pytest.mark.parametrize("debug", [False, True])
def test_entry_point_user_error_and_ctrl_c(debug, capsys, monkeypatch):
    from megatron.errors import CheckpointError

    def bad(argv):
        assert "--debug" not in argv  # stripped for parsers that do not know it
        raise CheckpointError("--load ck: file model.safetensors is corrupt")

    def interrupted(argv):
        raise KeyboardInterrupt

    assert _entry(bad, [], monkeypatch, debug) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: --load ck: file model.safetensors is corrupt"
    assert ("Traceback" in err) == debug
    assert _entry(interrupted, [], monkeypatch, debug) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted" and ("Traceback" in err) == debug
    assert _entry(lambda argv: None, [], monkeypatch) == 0


def test_argument_errors_are_printed_by_rank_0_only(capsys, monkeypatch):
    """Every rank validates the same command line: one error line a node in torchrun's
    output (local rank 0's), not one per rank.  Errors that can differ between ranks
    still print everywhere."""
    from megatron.arguments import ArgumentError
    from megatron.errors import DataError

    def bad_flag(argv):
        raise ArgumentError("--lr must be >= 0, got -1.0")

    def bad_file(argv):
        raise DataError("--data-path x: x.idx is missing")

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for rank, local, printed in (("0", None, True), ("3", None, False), ("3", "1", False),
                                 ("8", "0", True)):  # rank 8: local rank 0 of a second node
        monkeypatch.setenv("RANK", rank)
        if local is not None:
            monkeypatch.setenv("LOCAL_RANK", local)
        assert _entry(bad_flag, [], monkeypatch) == 2
        assert ("error: --lr must be >= 0" in capsys.readouterr().err) == printed
        assert _entry(bad_file, [], monkeypatch) == 2
        assert "error: --data-path x" in capsys.readouterr().err


def test_entry_point_lost_peer_is_one_line_other_errors_keep_their_traceback(capsys,
                                                                             monkeypatch):
    def lost(argv):
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:2171")
        except RuntimeError as exc:
            raise ValueError("[rank 0] pipeline stage 0 failed at action #3\ngrid") from exc

    def bug(argv):
        raise ZeroDivisionError("a bug")

    def hung(argv):
        try:
            raise RuntimeError("[unbound_buffer.cc:81] Timed out waiting 15000ms for recv "
                               "operation to complete")
        except RuntimeError as exc:
            raise ValueError("[rank 1] pipeline stage 1 failed at action #7\ngrid") from exc

    monkeypatch.setenv("RANK", "0")
    assert _entry(lost, [], monkeypatch) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: [rank 0] a peer rank exited") and "\n" not in err
    monkeypatch.setenv("RANK", "1")
    assert _entry(hung, [], monkeypatch) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: [rank 1] a peer rank did not answer within "
                          "--distributed-timeout-minutes") and "\n" not in err
    assert "stage 1 failed at action #7" in err
    with pytest.raises(ZeroDivisionError):
        from megatron.entry import run_entry_point
        run_entry_point(bug, [])


def test_entry_point_unwraps_a_user_error_raised_inside_another(capsys, monkeypatch):
    from megatron.errors import DataError

    def wrapped(argv):
        try:
            raise DataError("c.bin: token id 15000 is outside the vocabulary [0, 4096)")
        except DataError as exc:
            raise RuntimeError("[rank 0] pipeline stage 0 failed\ngrid") from exc

    assert _entry(wrapped, [], monkeypatch) == 2
    assert capsys.readouterr().err.strip() == \
        "error: c.bin: token id 15000 is outside the vocabulary [0, 4096)"


def test_token_id_outside_the_vocabulary_is_one_error_line_at_d2(tmp_path):
    """Data made with another tokenizer, found inside the pipeline's forward on both
    stages: one error line per rank naming the file and the id, exit 2, no schedule grid."""
    from megatron.data.indexed_dataset import IndexedDatasetBuilder
    import numpy as np

    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), np.int32)
    for d in range(40):
        builder.add_item(np.arange(30) + (5000 if d == 3 else 0))
        builder.end_document()
    builder.finalize(str(tmp_path / "c.idx"))
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "20", "--lr", "1e-3",
            "--data-path", str(tmp_path / "c"), "--split", "1,0,0", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--pipeline-model-parallel-size", "2",
            "--distributed-backend", "gloo", "--eval-iters", "0", "--num-workers", "0"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, timeout=300, env=_env())
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    # one line per rank that got there first (torchrun stops the other at once)
    assert proc.returncode != 0 and 1 <= len(lines) <= 2, proc.stderr[-3000:]
    assert all(re.search(r"c\.bin: token id 50\d\d .* outside the vocabulary \[0, 65\)", x)
               for x in lines), proc.stderr[-3000:]
    # torchrun's agent prints its own summary; the workers print no traceback, no grid
    assert "exitcode  : 2" in proc.stderr and "terminate called" not in proc.stderr
    assert "DataError" not in proc.stderr and "pipeline stage" not in proc.stderr, \
        proc.stderr[-3000:]


def test_nan_run_exits_1_with_one_line_and_saves_nothing(tmp_path):
    """--lr huge through the real entry point: NaN after one step, stop, exit 1."""
    argv = _argv("--lr", "1e30", "--max-consecutive-skipped-steps", "3", "--eval-iters", "0",
                 "--save", str(tmp_path / "ck"), iters=40)
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: 3 optimizer steps in a row were skipped")
    assert not list((tmp_path / "ck").glob("iter_*"))


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MEGATRON_DEBUG", None)
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


# ---- failure grids -------------------------------------------------------------------------

def test_failure_grid_is_a_window_around_the_failing_action():
    from megatron.pipeline.schedules import build_schedule, format_grid

    schedule = build_schedule("2bw", 4, 4, 200)
    index = len(schedule[2]) // 2
    full = format_grid(schedule, mark=(2, index))
    cut = format_grid(schedule, mark=(2, index), window=12)
    assert len(full) > 50_000 and len(cut) < 2_000
    lines = cut.splitlines()
    assert sum(line.startswith("stage ") for line in lines) == 4  # every stage
    assert ">>" in lines[2] and "units left" in cut and "marked: stage 2" in cut


def test_pipeline_failure_message_stays_small(capsys):
    """The executor's failure message for an action late in a long 2BW segment (what a
    timeout prints on every rank): a window of the grid, not the whole segment."""
    from types import SimpleNamespace

    from megatron.pipeline.engine import PipelineEngine
    from megatron.pipeline.schedules import build_schedule

    actions = build_schedule("2bw", 4, 8, 300)
    index = len(actions[1]) * 3 // 4
    fake = SimpleNamespace(stage=1, groups=SimpleNamespace(rank=1), schedule_name="2bw",
                           num_stages=4, num_microbatches=8, iteration=225)
    msg = PipelineEngine._report_failure(fake, actions, index, actions[1][index],
                                         RuntimeError("Connection closed by peer"))
    assert "Connection closed by peer" in msg and ">>" in msg and "units left" in msg
    assert len(msg) < 3_000, len(msg)  # the whole grid is ~500 KB
    assert capsys.readouterr().err.strip() == msg.strip()


def test_failed_send_or_receive_names_the_rank_at_its_other_end(capsys):
    """After a kill the dead rank prints nothing: the survivor's message names it."""
    from types import SimpleNamespace

    from megatron.pipeline.actions import Op
    from megatron.pipeline.engine import PipelineEngine
    from megatron.pipeline.schedules import build_schedule

    actions = build_schedule("flush", 3, 4, 1)
    fake = SimpleNamespace(stage=1, groups=SimpleNamespace(rank=5), schedule_name="flush",
                           num_stages=3, num_microbatches=4, iteration=0,
                           p2p=SimpleNamespace(prev_rank=1, next_rank=9))
    want = {Op.RECV_ACT: 1, Op.SEND_GRAD: 1, Op.SEND_ACT: 9, Op.RECV_GRAD: 9}
    for op, peer in want.items():
        i = next(k for k, a in enumerate(actions[1]) if a.op is op)
        msg = PipelineEngine._report_failure(fake, actions, i, actions[1][i], RuntimeError("x"))
        assert f"{actions[1][i]} (with rank {peer})" in msg.splitlines()[0]
    i = next(k for k, a in enumerate(actions[1]) if a.op is Op.FORWARD)
    msg = PipelineEngine._report_failure(fake, actions, i, actions[1][i], RuntimeError("x"))
    assert "with rank" not in msg.splitlines()[0]
    capsys.readouterr()


# ---- signals and a dead launcher ------------------------------------------------------------

def _children(pid: int) -> list:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for(pattern: str, path: Path, proc, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = path.read_text() if path.exists() else ""
        if pattern in text:
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"'{pattern}' not seen; output:\n{path.read_text()[-3000:]}")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("loader_workers", [0, 2])
def test_sigterm_with_exit_signal_handler_saves_on_every_rank_and_exits_0(loader_workers,
                                                                          tmp_path):
    """torchrun, 2 pipeline stages: SIGTERM to ONE worker; both agree, save the same
    iteration, and the job exits 0 (old code: killed, nothing saved).

    With DataLoader workers (the default --num-workers 2) the signal goes to every
    process of that rank, loader workers included, as SLURM and a process-group kill
    deliver it.  Regression: the loader workers died of it and the rank failed on its
    next read ("DataLoader worker ... killed by signal: Terminated"), saving nothing."""
    ckpt, log = tmp_path / "ck", tmp_path / "out.txt"
    # gloo: two CPU ranks also where one GPU is visible (NCCL would need two)
    argv = _argv("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "flush",
                 "--distributed-backend", "gloo", "--eval-iters", "0", "--log-interval", "1", "--exit-signal-handler",
                 "--save", str(ckpt), "--save-interval", "1000", iters=100000)
    argv[argv.index("--num-workers") + 1] = str(loader_workers)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                 "2", "--master-port", str(_port()), str(REPO / "pretrain_gpt.py"),
                                 *argv], stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        _wait_for("iteration        2/", log, proc, 90)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        loaders = _children(workers[0])
        assert len(loaders) >= loader_workers, loaders
        for pid in [workers[0], *loaders]:
            os.kill(pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text
    stopped = int(re.search(r"stopped at iteration (\d+): SIGTERM \(--exit-signal-handler\), "
                            r"checkpoint saved", text).group(1))
    assert stopped >= 2 and (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() \
        == str(stopped)


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_exit_duration_stops_every_rank_at_one_iteration_with_a_checkpoint(schedule,
                                                                           tmp_path):
    """torchrun, 2 pipeline stages, --exit-duration-in-mins already passed at the first
    check: both ranks agree on one batch boundary, save it, print one line and exit 0
    (Megatron-LM's flag for scheduler time limits; unrecognised before)."""
    ckpt = tmp_path / "ck"
    argv = _argv("--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
                 "--distributed-backend", "gloo", "--eval-iters", "0", "--log-interval", "1",
                 "--exit-duration-in-mins", "0.001", "--save", str(ckpt), iters=100000)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(_port()), str(REPO / "pretrain_gpt.py"),
                          *argv], capture_output=True, text=True, env=_env(), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    found = re.findall(r"stopped at iteration (\d+): [\d.]+ minutes since start "
                       r"\(--exit-duration-in-mins 0.001\), checkpoint saved to", out.stdout)
    assert len(found) == 1, out.stdout[-3000:]
    stopped = int(found[0])
    assert 1 <= stopped < 100000
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert f"iteration {stopped + 1:8d}/" not in out.stdout  # nothing trained past it


def _port() -> int:
    from tests.dist_utils import free_port

    return free_port()


_ORPHAN = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
from megatron.initialize import exit_when_parent_dies
import time
print("armed", exit_when_parent_dies(poll_seconds=0.2), flush=True)
time.sleep(120)
'''])
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("use_prctl", [True, False])
def test_worker_exits_when_its_launcher_is_killed(use_prctl, monkeypatch):
    """kill -9 of the parent (torchrun's agent): the worker is gone within seconds."""
    env = _env(MEGATRON_EXIT_WITH_PARENT="1")
    code = _ORPHAN
    if not use_prctl:  # the portable fallback: a thread polling os.getppid()
        code = code.replace("from megatron.initialize import exit_when_parent_dies",
                            "import megatron.initialize as mi; mi._set_parent_death_signal = "
                            "lambda: False; exit_when_parent_dies = mi.exit_when_parent_dies")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        worker = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "armed True"
        assert _alive(worker)
        parent.kill()
        parent.wait()
        deadline = time.time() + 10
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the orphaned worker kept running"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_parent_death_check_is_off_outside_torchrun(monkeypatch):
    from megatron.initialize import exit_when_parent_dies

    monkeypatch.delenv("MEGATRON_EXIT_WITH_PARENT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert exit_when_parent_dies() is False  # nohup python pretrain_gpt.py & must survive


def test_fault_checks_drain_2bw_rarely_and_flush_where_a_stop_could_come():
    from megatron.arguments import parse_and_validate
    from megatron.training_loop import _check_every

    def cfg(*extra):
        return parse_and_validate(_argv(*extra), world_size=1)[1]

    # flush: no drain points of its own (the skip monitor ends its segments, see below)
    assert _check_every(cfg("--pipeline-schedule", "flush"), 0.0) == 0
    flush_sig = cfg("--pipeline-schedule", "flush", "--exit-signal-handler")
    assert _check_every(flush_sig, 0.0) == 1    # nothing measured yet
    assert _check_every(flush_sig, 0.01) == 100  # about every second
    assert _check_every(flush_sig, 5.0) == 1
    assert _check_every(cfg("--pipeline-schedule", "2bw"), 0.0) == 100
    assert _check_every(cfg("--pipeline-schedule", "2bw", "--max-consecutive-skipped-steps",
                            "0"), 0.0) == 0
    sig = cfg("--pipeline-schedule", "2bw", "--exit-signal-handler")
    assert _check_every(sig, 0.0) == 1          # nothing measured yet
    assert _check_every(sig, 1.0) == 20         # about every 20 s
    assert _check_every(sig, 0.01) == 100       # never rarer than the NaN check


def test_resume_with_another_lr_schedule_needs_megatrons_flag(tmp_path):
    """Raising --train-iters on resume moves a linear decay's length: an error naming both
    of Megatron's flags, unless one of them says which schedule to follow.  A constant
    schedule has no decay length to disagree on."""
    import pretrain_gpt
    from megatron.errors import CheckpointError

    linear = ["--lr-decay-style", "linear", "--eval-iters", "0"]
    ckpt = str(tmp_path / "ck")
    _train(_argv("--save", ckpt, *linear, iters=2), pretrain_gpt.forward_step)
    with pytest.raises(CheckpointError, match=r"--load .*decay_steps=2 but this run has "
                                              r"decay_steps=4 \(iterations\); pass --override-opt_param-"
                                              r"scheduler .* --use-checkpoint-opt_param-scheduler") as info:
        _train(_argv("--load", ckpt, *linear, iters=4), pretrain_gpt.forward_step)
    assert info.value.every_rank_alike  # the same schedule on every rank: one line a node
    kept = _train(_argv("--load", ckpt, *linear, "--override-opt_param-scheduler", iters=4),
                  pretrain_gpt.forward_step)
    taken = _train(_argv("--load", ckpt, *linear, "--use-checkpoint-opt_param-scheduler",
                         iters=4), pretrain_gpt.forward_step)
    assert kept.iteration == taken.iteration == 4
    constant = str(tmp_path / "const")
    _train(_argv("--save", constant, "--eval-iters", "0", iters=2), pretrain_gpt.forward_step)
    assert _train(_argv("--load", constant, "--eval-iters", "0", iters=4),
                  pretrain_gpt.forward_step).iteration == 4


def test_suspect_weights_are_not_saved_and_a_run_ending_on_them_fails(tmp_path, capsys):
    """fp32, --save-interval 2: a checkpoint whose last step was skipped for NaN is held
    back (the weights produced the NaN), a later good step saves again; a run whose last
    step is skipped exits 1 and leaves the tracker on the last good checkpoint."""
    from megatron.training_exits import NonFiniteError

    mid = tmp_path / "mid"
    _train(_argv("--save", str(mid), "--save-interval", "2", "--eval-iters", "0"),
           _Poison({1}, m=4, how="mul"))
    assert "not saving the checkpoint of iteration 2" in capsys.readouterr().out
    assert sorted(p.name for p in mid.glob("iter_*")) == ["iter_0000004"]

    end = tmp_path / "end"
    with pytest.raises(NonFiniteError, match=r"last 1 optimizer step\(s\) \(iteration 4\)"):
        _train(_argv("--save", str(end), "--save-interval", "2", "--eval-iters", "0"),
               _Poison({3}, m=4, how="add"))
    assert sorted(p.name for p in end.glob("iter_*")) == ["iter_0000002"]
    assert (end / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

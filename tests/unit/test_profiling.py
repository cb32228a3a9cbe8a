"""Megatron-LM's --profile window (megatron/profiling.py): which batches a rank's
torch.profiler trace holds, the flags' one-line errors, and a real run's trace."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import List

import pytest
import torch

from megatron.config import ProfileOptions
from megatron.profiling import StepProfiler
from tests.arg_errors import assert_one_line_error

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--mock-data", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3"]


def _trace_names(path: str) -> List[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e.get("name", "") for e in events]


def _batches(path: str) -> List[int]:
    return sorted({int(n[len("batch"):]) for n in _trace_names(path)
                   if n.startswith("batch") and n[len("batch"):].isdigit()})


def _run(tmp_path: Path, start: int, end: int, first: int, last: int, rank: int = 0,
         ranks=(0,)) -> StepProfiler:
    """Batches first..last-1, each a named range with some work, through a profiler."""
    opts = ProfileOptions(start=start, end=end, ranks=tuple(ranks), pytorch=True,
                          trace_dir=str(tmp_path))
    prof = StepProfiler(opts, rank=rank, first_iteration=first, device=torch.device("cpu"))
    x = torch.randn(8, 8)
    with prof:
        for t in range(first, last):
            with torch.profiler.record_function(f"batch{t}"):
                x = torch.tanh(x @ x)
            prof.on_step(t)
    return prof


@pytest.mark.parametrize("start,end,first,last,want", [
    (2, 4, 0, 6, [2, 3]),      # a fresh run
    (0, 2, 0, 5, [0, 1]),      # from the first batch: no warm-up step
    (2, 5, 3, 8, [3, 4]),      # resumed inside the window: the rest of it
    (4, 6, 1, 9, [4, 5]),      # resumed before it
    (2, 9, 0, 5, [2, 3, 4]),   # the run ends first: what was recorded is written
])
def test_the_trace_holds_the_window_batches(tmp_path, capsys, start, end, first, last, want):
    prof = _run(tmp_path, start, end, first, last)
    files = list(tmp_path.glob("*.pt.trace.json"))
    assert [str(f) for f in files] == [prof.trace_path]
    assert "_rank0." in files[0].name and not list(tmp_path.glob(".*.tmp"))
    assert _batches(prof.trace_path) == want
    err = capsys.readouterr().err
    assert f"profiler (rank 0): wrote the torch.profiler trace of batches {want[0]}..{want[-1]}" in err


@pytest.mark.parametrize("first,rank,ranks", [(6, 0, (0,)), (0, 1, (0,)), (0, 2, (0, 3))])
def test_a_rank_outside_the_window_writes_nothing(tmp_path, first, rank, ranks):
    prof = _run(tmp_path, 2, 4, first, first + 6, rank=rank, ranks=ranks)
    assert not prof.enabled and prof.trace_path is None and not list(tmp_path.iterdir())


def test_no_options_is_inert(tmp_path):
    prof = StepProfiler(None, rank=0, first_iteration=0, device=torch.device("cpu"))
    with prof:
        prof.on_step(0)
    assert not prof.enabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nsys mode calls cudaProfilerStart")
def test_nsys_window_opens_and_closes_on_cuda(capsys):
    opts = ProfileOptions(start=1, end=3, ranks=(0,), pytorch=False)
    prof = StepProfiler(opts, rank=0, first_iteration=0, device=torch.device("cuda"))
    x = torch.randn(64, 64, device="cuda")
    with prof:
        for t in range(4):
            x = torch.tanh(x @ x)
            prof.on_step(t)
            assert prof._cuda_open == (t in (0, 1))  # open after batch 0, closed after 2
    err = capsys.readouterr().err
    assert "cudaProfilerStart before batch 1" in err and "cudaProfilerStop after batch 2" in err


@pytest.mark.parametrize("extra,expected", [
    (["--profile-step-start", "3"], "--profile-step-start needs --profile"),
    (["--use-pytorch-profiler"], "--use-pytorch-profiler needs --profile"),
    (["--profile", "--use-pytorch-profiler"],
     "--use-pytorch-profiler writes each profiled rank's trace under --profile-dir"),
    (["--profile", "--profile-dir", "x"], "--profile-dir is where --use-pytorch-profiler"),
    (["--profile", "--use-pytorch-profiler", "--profile-dir", "x", "--profile-step-start",
      "4", "--profile-step-end", "4"], "--profile-step-end (4) must be greater than"),
    (["--profile", "--use-pytorch-profiler", "--profile-dir", "x", "--profile-step-start",
      "-1"], "--profile-step-start must be >= 0"),
    (["--profile", "--use-pytorch-profiler", "--profile-dir", "x", "--profile-ranks", "0",
      "1"], "--profile-ranks: rank 1 is not a rank of this run"),
    (["--profile", "--use-pytorch-profiler", "--profile-dir", "x"],
     "--profile-step-start 10 is past the run's last iteration (--train-iters 6)"),
])
def test_window_errors_are_one_line(extra, expected, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(BASE + extra, expected, capsys, monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the nsys refusal is for CPU ranks")
def test_nsys_mode_is_refused_on_cpu_ranks(capsys, monkeypatch):
    assert_one_line_error(BASE + ["--profile"], "--profile without --use-pytorch-profiler "
                          "marks the window for nsys", capsys, monkeypatch)


def test_a_training_run_writes_its_window(tmp_path):
    """Batches 1 and 2 of a 5-iteration run: their steps, their forward passes."""
    import pretrain_gpt
    from megatron.training import pretrain
    from tests.distributed.gpt_harness import TINY

    torch.manual_seed(0)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step,
                          argv=TINY + ["--train-iters", "5", "--profile",
                                       "--use-pytorch-profiler", "--profile-step-start", "1",
                                       "--profile-step-end", "3", "--profile-dir",
                                       str(tmp_path / "prof")])
    assert result.iteration == 5
    files = list((tmp_path / "prof").glob("*.pt.trace.json"))
    assert len(files) == 1, files
    names = _trace_names(str(files[0]))
    assert sorted({n for n in names if n.startswith("ProfilerStep#")}) == [
        "ProfilerStep#1", "ProfilerStep#2"]
    assert any(n.startswith("aten::") for n in names)
    assert "wrote the torch.profiler trace of batches 1..2" in err.getvalue()


def test_profile_with_skip_train_is_refused(capsys, monkeypatch, tmp_path):
    """--skip-train trains no batch: the window would record nothing, silently."""
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(BASE + ["--profile", "--use-pytorch-profiler", "--profile-dir", "x",
                                  "--skip-train"],
                          "--profile profiles training batches, and --skip-train trains none",
                          capsys, monkeypatch)


def test_tensorboard_missing_names_profile_dir_for_profiler_runs(capsys, monkeypatch, tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here: the error does not arise")
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(BASE + ["--profile", "--use-pytorch-profiler", "--tensorboard-dir",
                                  "tb"], "--tensorboard-dir tb needs the tensorboard package",
                          capsys, monkeypatch)
    from megatron.arguments import parse_and_validate

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        parse_and_validate(BASE + ["--profile", "--use-pytorch-profiler", "--tensorboard-dir",
                                   "tb"])
    assert "--use-pytorch-profiler writes its traces to --profile-dir" in capsys.readouterr().err

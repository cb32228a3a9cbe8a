"""QA pass on --profile, --manual-gc and the executor's StagePlans (helper-73).

* A trace holds a ``ProfilerStep#k`` only for batches the run trained: a window that
  reaches past --train-iters or an --exit-interval stop, or a run stopped between
  segments (SIGTERM), opened one more step for a batch never run (the checkpoint save
  of the stop was recorded in it).
* Finetuning (one train() call per epoch) wrote one trace per epoch the window touched,
  the later ones numbering their steps from 0, and left Python's collector on while it
  scored between epochs, with no --manual-gc collections around the scoring.
* The failure report of a segment named the run's schedule and training m, not the
  failing segment's (the flush warm-up of --2bw-mitigation warmup, an evaluation's m).
* A resumed run past the window said nothing about profiling nothing.
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
from pathlib import Path
from typing import List

import pytest
import torch

from megatron.config import ProfileOptions
from megatron.profiling import StepProfiler
from tests.distributed.gpt_harness import TINY
from tests.unit.test_qa30_tasks_cli import BERT, MNLI, VOCAB


def _steps(path) -> List[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    return sorted((n for n in names if n.startswith("ProfilerStep#")),
                  key=lambda n: int(n.split("#")[1]))


def _traces(folder: Path) -> List[Path]:
    return sorted(folder.glob("*.pt.trace.json"))


def _pretrain(extra: List[str]):
    import pretrain_gpt
    from megatron.training import pretrain

    torch.manual_seed(0)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=TINY + extra)
    return result, err.getvalue()


@pytest.mark.parametrize("extra,iterations,want", [
    # the window reaches past --train-iters 4: batches 2 and 3, no step 4
    (["--train-iters", "4"], 4, ["ProfilerStep#2", "ProfilerStep#3"]),
    # --exit-interval 3 stops the run inside the window (its save is no step 3)
    (["--train-iters", "8", "--exit-interval", "3"], 3, ["ProfilerStep#2"]),
])
def test_the_trace_has_no_step_for_a_batch_the_run_never_trained(tmp_path, extra,
                                                                   iterations, want):
    out = tmp_path / "prof"
    result, err = _pretrain(extra + ["--profile", "--use-pytorch-profiler",
                                     "--profile-step-start", "2", "--profile-step-end", "7",
                                     "--profile-dir", str(out)])
    assert result.iteration == iterations
    files = _traces(out)
    assert len(files) == 1, files
    assert _steps(files[0]) == want
    assert f"batches 2..{iterations - 1}" in err


def _segments(tmp_path: Path, sizes: List[int], start: int, end: int, stop_early: bool):
    """Segments of ``sizes`` batches through a profiler as the training loop drives it;
    ``stop_early``: the run stops after the last segment (a SIGTERM's agreed stop)."""
    opts = ProfileOptions(start=start, end=end, ranks=(0,), pytorch=True,
                          trace_dir=str(tmp_path))
    prof = StepProfiler(opts, rank=0, first_iteration=0, device=torch.device("cpu"))
    x = torch.randn(8, 8)
    t = 0
    with prof:
        for size in sizes:
            prof.next_segment()
            prof.segment_end = t + size
            for _ in range(size):
                with torch.profiler.record_function(f"batch{t}"):
                    x = torch.tanh(x @ x)
                prof.on_step(t)
                t += 1
            if stop_early:
                continue
            prof.next_segment()
        if stop_early:  # train(): the trace ends before the stop's save
            prof.stop()
            with torch.profiler.record_function("checkpoint_save"):
                x = torch.tanh(x @ x)
    return prof


def test_a_run_stopped_between_segments_ends_its_trace_with_its_last_batch(tmp_path):
    _segments(tmp_path, [2, 2], start=1, end=9, stop_early=True)
    files = _traces(tmp_path)
    assert len(files) == 1
    assert _steps(files[0]) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    with open(files[0]) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "checkpoint_save" not in names and "batch3" in names


def test_segments_that_go_on_keep_one_step_per_batch(tmp_path):
    _segments(tmp_path, [2, 3, 2], start=1, end=6, stop_early=False)
    files = _traces(tmp_path)
    assert len(files) == 1
    assert _steps(files[0]) == [f"ProfilerStep#{k}" for k in range(1, 6)]


def test_a_run_resumed_past_the_window_says_it_profiles_nothing(tmp_path, capsys):
    opts = ProfileOptions(start=1, end=3, ranks=(0,), pytorch=True, trace_dir=str(tmp_path))
    with StepProfiler(opts, rank=0, first_iteration=4, device=torch.device("cpu")) as prof:
        prof.on_step(4)
    assert not _traces(tmp_path)
    assert "nothing profiled: this run starts at iteration 4, past the window (batches " \
           "1..2)" in capsys.readouterr().err


needs_mnli = pytest.mark.skipif(not (VOCAB.exists() and MNLI.exists()),
                                reason="../shared/data (BERT vocab, MNLI) absent")
TRAIN = ["--task", "MNLI", "--train-data", str(MNLI / "train.tsv"),
         "--valid-data", str(MNLI / "dev_matched.tsv")]


@needs_mnli
def test_finetuning_profiles_a_window_across_epochs_into_one_trace(tmp_path):
    """6 samples, global batch 2: 3 iterations an epoch; batches 2..4 span two epochs."""
    from tasks.main import main

    torch.set_num_threads(1)
    out = tmp_path / "prof"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        result = main(BERT + TRAIN + ["--epochs", "2", "--profile", "--use-pytorch-profiler",
                                      "--profile-step-start", "2", "--profile-step-end", "5",
                                      "--profile-dir", str(out)])
    assert result.iteration == 6
    files = _traces(out)
    assert len(files) == 1, files
    assert _steps(files[0]) == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]
    assert "batches 2..4" in err.getvalue()


@needs_mnli
def test_finetuning_with_manual_gc_collects_around_the_scores_between_epochs(monkeypatch):
    """Per epoch: a full collection before the score and a young-generation one after,
    with the collector off throughout; it is back on after the run."""
    from tasks.main import main

    torch.set_num_threads(1)
    seen = []
    real = gc.collect

    def collect(generation: int = 2) -> int:
        seen.append((generation, gc.isenabled()))
        return real(generation)

    scores = []
    import tasks.finetune_utils as fu
    real_score = fu.evaluate_accuracy

    def evaluate_accuracy(*args, **kwargs):
        scores.append(gc.isenabled())
        return real_score(*args, **kwargs)

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(fu, "evaluate_accuracy", evaluate_accuracy)
    assert gc.isenabled()
    with contextlib.redirect_stdout(io.StringIO()):
        result = main(BERT + TRAIN + ["--epochs", "2", "--manual-gc"])
    assert result.iteration == 6
    assert gc.isenabled()
    assert scores == [False, False]  # the collector is off while scoring, as in training
    # the start's full collection, then per epoch a full one before its score and a
    # young-generation one after
    assert [g for g, _ in seen] == [2, 2, 0, 2, 0]
    assert not any(enabled for _, enabled in seen)


def test_a_failure_report_names_the_failing_segments_schedule():
    """The flush warm-up of a 2BW run (--2bw-mitigation warmup): the header says flush,
    with the segment's m, as its grid is drawn; an evaluation's says forward only."""
    from types import SimpleNamespace

    from megatron.pipeline.actions import Op
    from megatron.pipeline.engine import PipelineEngine, PipelineError
    from megatron.pipeline.stage_plan import StagePlans

    def boom(action, seg):
        raise RuntimeError("injected")

    fake = SimpleNamespace(stage=1, groups=SimpleNamespace(rank=1), schedule_name="2bw",
                           num_stages=2, num_microbatches=4, iteration=0, p2p=None,
                           trace_enabled=False, _handlers={op: boom for op in Op})
    fake._report_failure = lambda *a, **k: PipelineEngine._report_failure(fake, *a, **k)
    plans = StagePlans(stage=1)
    for plan, header in ((plans.get("flush", 2, 4, 3), "(flush, d=2, m=4, iteration 0)"),
                         (plans.get("2bw", 2, 8, 1, forward_only=True),
                          "(2bw, forward only, d=2, m=8, iteration 0)")):
        with contextlib.redirect_stderr(io.StringIO()):
            with pytest.raises(PipelineError) as info:
                PipelineEngine._run_actions(fake, plan, SimpleNamespace())
        first = str(info.value).splitlines()[0]
        assert header in first, first
        assert ">>" in str(info.value)

"""A failing rank never leaves the others hanging, and the failure names the pipeline step."""
from __future__ import annotations

import re
import time

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY

_CALLS = {"n": 0}


def _exploding_forward_step(data_iterator, model):
    import pretrain_gpt

    _CALLS["n"] += 1
    if _CALLS["n"] == 6:  # second batch, stage 1
        raise ValueError("injected failure in forward_step")
    return pretrain_gpt.forward_step(data_iterator, model)


def _run(rank: int, world: int):
    import pretrain_gpt
    from megatron.training import pretrain

    step = _exploding_forward_step if rank == 1 else pretrain_gpt.forward_step
    argv = TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                   "--distributed-timeout-minutes", "0.5"]
    start = time.time()
    try:
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, step, argv=argv)
    except Exception as exc:  # noqa: BLE001 - what the test inspects
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.time() - start}
    return {"error": None, "seconds": time.time() - start}


def test_failure_on_one_stage_stops_both_with_the_step_marked():
    res = run_distributed(_run, 2, timeout=120)
    failing, peer = res[1], res[0]
    assert failing["error"] is not None and "PipelineError" in failing["error"]
    assert "injected failure in forward_step" in failing["error"]
    assert ">>" in failing["error"]           # the grid marks the failing action
    assert "stage 1 failed at action" in failing["error"]
    # the healthy stage does not hang: it fails within the 30 s timeout (+ slack)
    assert peer["error"] is not None
    assert peer["seconds"] < 90
    # stuck in a send or receive to stage 1: the message names rank 1
    stuck = re.search(r"failed at action #\d+ 0(RA|RG|SA|SG)\d+( \(with rank 1\))?",
                      peer["error"])
    assert stuck is None or stuck.group(2), peer["error"][:300]


def _dies_without_reporting(rank: int, world: int):
    import os

    if rank == 1:
        os._exit(3)  # as a SIGKILL or a crash in native code would: no result, no traceback
    return rank


def test_a_rank_process_that_dies_silently_fails_the_run_within_seconds():
    """The spawn harness (tests and the benches' run_groups) notices a rank that exited
    without reporting, instead of waiting out its timeout."""
    import pytest

    start = time.time()
    with pytest.raises(RuntimeError, match="rank 1 ---\nexited with code 3"):
        run_distributed(_dies_without_reporting, 2, timeout=600)
    assert time.time() - start < 60

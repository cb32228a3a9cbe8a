"""A failing rank never leaves the others hanging, and the failure names the pipeline step."""
from __future__ import annotations

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

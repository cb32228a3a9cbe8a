"""Under 2BW the first stage's data-parallel all-reduce runs beside the next batch.

The first stage ends each batch's backward passes last.  Its STEP(t) does not wait for
the gradient all-reduce: the update begins, and is finished, when batch t+2 first needs
the new weights (``megatron.pipeline.update.Updater.step``).  Under Flush the STEP waits, as it must.
A slow all-reduce (``GradientReduction.finish`` made to take 0.4 s) shows where the
wait lands in the executor's own trace: in a STEP under Flush, in a forward under 2BW.
The float64 losses of both are checked against the schedules' semantics elsewhere
(tests/distributed/test_pipeline_semantics.py).
"""
from __future__ import annotations

import os

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY

SLOW_S = 0.4


def _worker(rank: int, world: int, out_dir: str):
    import torch

    import pretrain_gpt
    from megatron.pipeline import grad_reduction
    from megatron.pipeline.trace import load_trace
    from megatron.training import pretrain

    slow_finish = grad_reduction.GradientReduction.finish

    def finish(self):
        import time

        time.sleep(SLOW_S)
        slow_finish(self)

    grad_reduction.GradientReduction.finish = finish
    torch.set_num_threads(1)
    out = {}
    for schedule in ("flush", "2bw"):
        path = os.path.join(out_dir, schedule, "timeline.json")
        argv = TINY + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
                       "--train-iters", "4", "--timeline-file", path]
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=argv)
        events, _ = load_trace(os.path.join(out_dir, schedule, f"timeline_rank{rank}.json"))
        out[schedule] = [(e.stage, e.op, e.duration) for e in events]
    return out


def test_first_stage_step_leaves_the_all_reduce_to_the_next_batch(tmp_path):
    results = run_distributed(_worker, 4, args=(str(tmp_path),), timeout=300)
    first = [r for r in results if r["2bw"][0][0] == 0]
    assert len(first) == 2  # w=2 replicas of stage 0
    for r in first:
        flush_steps = [d for _, op, d in r["flush"] if op == "S@"]
        assert len(flush_steps) == 4 and min(flush_steps) >= SLOW_S
        steps = [d for _, op, d in r["2bw"] if op == "S@"]
        assert len(steps) == 4 and max(steps) < SLOW_S / 2, steps
        # batches 0 and 1 are finished by the forwards of batches 2 and 3; the last two
        # at the end of the run, outside any action
        slow_forwards = [d for _, op, d in r["2bw"] if op == "F" and d >= SLOW_S]
        assert len(slow_forwards) == 2

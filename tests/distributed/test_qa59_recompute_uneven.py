"""Recomputation on uneven pipeline stages, N not dividing a stage, N above a stage's
layers (QA pass 59).

Megatron-LM's methods, per stage: ``uniform`` N checkpoints chunks of N layers (the last
one shorter) and keeps only each chunk's input; ``block`` N checkpoints the first N
layers one by one (all of them on a stage with fewer).  Five layers split 2 + 3
(--decoder-first-pipeline-num-layers 2): N = 2 does not divide the 3-layer stage and
N = 3 exceeds the 2-layer stage.  In float64 with dropout on (the rebuilt layers must
redraw the same masks), every method gives the bits of the run without recomputation
under 2BW (all methods), flush (uniform) and 2BW in bf16 (uniform); the executor's stash counters differ between methods
by the chunk inputs the planner's ``Config.layer_recompute`` says each keeps.
"""
from __future__ import annotations

import math
from typing import List

import pytest

from megatron.pipeline.planner import Config
from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

FULL = ["--recompute-granularity", "full", "--recompute-method"]
METHODS = {
    "none": [],
    "u2": FULL + ["uniform", "--recompute-num-layers", "2"],
    "u3": FULL + ["uniform", "--recompute-num-layers", "3"],
    "b3": FULL + ["block", "--recompute-num-layers", "3"],
    "sel": ["--recompute-granularity", "selective"],
    "stage": ["--recompute-activations"],
}
RUNS = [("2bw", m) for m in METHODS] + [("flush", m) for m in ("none", "u2")] \
    + [("bf16", m) for m in ("none", "u2")]
LAYERS = (2, 3)
S, B, H = 16, 2, 32   # TINY's sequence, micro-batch and hidden size


def _argv(schedule: str, *extra: str) -> List[str]:
    argv = list(TINY)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        argv[argv.index(flag) + 1] = "0.1"
    argv[argv.index("--num-layers") + 1] = "5"
    argv[argv.index("--train-iters") + 1] = "3"
    if schedule == "bf16":
        argv = [a for a in argv if a != "--fp64"] + ["--bf16"]
        schedule = "2bw"
    return argv + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
                   "--decoder-first-pipeline-num-layers", str(LAYERS[0]), *extra]


@pytest.fixture(scope="module")
def runs():
    configs = [(f"{s}/{m}", _argv(s, *METHODS[m]), None) for s, m in RUNS]
    return run_distributed(train_configs, 2, args=(configs,), timeout=300)


def _same(a: List[float], b: List[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("schedule, method", [r for r in RUNS if r[1] != "none"])
def test_recomputation_changes_nothing_but_memory(runs, schedule, method):
    last = runs[-1]
    plain, recomputed = last[f"{schedule}/none"], last[f"{schedule}/{method}"]
    assert _same(recomputed["grad_norms"], plain["grad_norms"]), (
        recomputed["grad_norms"], plain["grad_norms"])
    assert _same([recomputed["losses"][t] for t in sorted(recomputed["losses"])],
                 [plain["losses"][t] for t in sorted(plain["losses"])])


def _stage_stats(runs, name: str, stage: int) -> dict:
    entries = [e for e in runs[stage][name]["memory"]["per_rank"] if e["stage"] == stage]
    assert len(entries) == 1, runs[stage][name]["memory"]
    return entries[0]


@pytest.mark.parametrize("stage", [0, 1])
def test_stash_differs_by_the_chunk_inputs_the_planner_counts(runs, stage):
    """Each method checkpoints every layer of both stages here (uniform always; block
    3 >= 2 and 3), so the stashes differ only in the chunk inputs kept, one float64
    [s, b, h] hidden state each: uniform 2 keeps 1 on the 2-layer stage and 2 on the
    3-layer one, uniform 3 keeps 1 on both, block 3 keeps one per layer."""
    hidden = S * B * H * 8
    layers = LAYERS[stage]

    def chunks(method: str, n: int) -> int:
        cfg = Config(w=1, d=2, b=B, m=4, schedule="2bw", recompute_method=method,
                     recompute_num_layers=n)
        k, kept, _ = cfg.layer_recompute(layers)
        assert k == layers
        return kept

    u2, u3, b3 = (_stage_stats(runs, f"2bw/{m}", stage) for m in ("u2", "u3", "b3"))
    n = u2["peak_in_flight"]
    assert n == u3["peak_in_flight"] == b3["peak_in_flight"] == (2 if stage == 0 else 1)
    base = u3["peak_stashed_activation_bytes"]
    assert u2["peak_stashed_activation_bytes"] - base == \
        n * hidden * (chunks("uniform", 2) - chunks("uniform", 3))
    assert b3["peak_stashed_activation_bytes"] - base == \
        n * hidden * (chunks("block", 3) - chunks("uniform", 3))
    plain = _stage_stats(runs, "2bw/none", stage)["peak_stashed_activation_bytes"]
    stage_level = _stage_stats(runs, "2bw/stage", stage)["peak_stashed_activation_bytes"]
    assert stage_level < base < plain

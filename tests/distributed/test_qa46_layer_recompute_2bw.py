"""Layer-level recomputation under 2BW at d > 1 (QA pass 46).

``--recompute-granularity full --recompute-method uniform|block`` rebuilds checkpointed
layers during the backward pass from the parameters the module holds *then*.  Under 2BW
a stage's forward of batch t+1 (buffer (t+1) % 2) runs between forwards and backwards
of batch t (buffer t % 2), so a backward must put its own batch's buffer back first, as
stage-level recomputation always did.  Before the fix, batch 1's backward passes
rebuilt their layers from W(1) instead of W(0): its gradient (reported norm) and every
loss from iteration 4 on differed from the run without recomputation.

Recomputation must change nothing but memory: in float64 with dropout on (the rebuilt
layers redraw the same masks), the runs below equal the one without it.
"""
from __future__ import annotations

import math
from typing import List

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

_LAYER = {
    "none": [],
    "uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"],
    "block": ["--recompute-granularity", "full", "--recompute-method", "block",
              "--recompute-num-layers", "1"],
    "stage": ["--recompute-activations"],
}


def _argv(*extra: str) -> List[str]:
    argv = list(TINY)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        argv[argv.index(flag) + 1] = "0.1"
    argv[argv.index("--train-iters") + 1] = "5"
    return argv + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                   *extra]


@pytest.fixture(scope="module")
def runs():
    configs = [(name, _argv(*extra), None) for name, extra in _LAYER.items()]
    return run_distributed(train_configs, 2, args=(configs,), timeout=300)[-1]


def _same(a: List[float], b: List[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("method", ["uniform", "block", "stage"])
def test_recomputation_under_2bw_changes_nothing_but_memory(runs, method):
    plain, recomputed = runs["none"], runs[method]
    assert recomputed["versions"] == plain["versions"] == [0, 0, 1, 2, 3]
    assert _same(recomputed["grad_norms"], plain["grad_norms"]), (
        method, recomputed["grad_norms"], plain["grad_norms"])
    losses = [recomputed["losses"][t] for t in sorted(recomputed["losses"])]
    assert _same(losses, [plain["losses"][t] for t in sorted(plain["losses"])])

"""Microbatch counts the other pipeline tests leave out (QA pass 46), float64, d = 2.

* m = 1 < d under flush, gpipe and none: the same losses as one process;
* m = 3, not a multiple of d, under flush, gpipe and 2BW: the same losses as one process
  under the same schedule (2BW: the delayed update, versions 0, 0, 1, 2);
* the executor's in-flight counts are the paper's, capped by m: stage s holds
  min(m, d - s) under 1F1B (flush, 2bw) and m under GPipe.
"""
from __future__ import annotations

import math
from typing import List

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs


def _argv(d: int, schedule: str, batch: int) -> List[str]:
    argv = list(TINY)
    argv[argv.index("--global-batch-size") + 1] = str(batch)  # micro batch 2: m = batch / 2
    return argv + ["--pipeline-model-parallel-size", str(d), "--pipeline-schedule", schedule]


_RUNS = [("flush", 2), ("gpipe", 2), ("none", 2), ("flush", 6), ("gpipe", 6), ("2bw", 6)]


@pytest.fixture(scope="module")
def runs():
    single = run_distributed(train_configs, 1, args=(
        [("flush_m1", _argv(1, "flush", 2), None), ("flush_m3", _argv(1, "flush", 6), None),
         ("2bw_m3", _argv(1, "2bw", 6), None)],), timeout=300)[0]
    piped = run_distributed(train_configs, 2, args=(
        [(f"{s}_m{b // 2}", _argv(2, s, b), None) for s, b in _RUNS],), timeout=300)[-1]
    return single, piped


def _losses(summary) -> List[float]:
    return [summary["losses"][t] for t in sorted(summary["losses"])]


def _same(a: List[float], b: List[float]) -> bool:
    return len(a) == len(b) == 4 and all(math.isclose(x, y, rel_tol=1e-10, abs_tol=1e-10)
                                         for x, y in zip(a, b))


@pytest.mark.parametrize("name,reference", [
    ("flush_m1", "flush_m1"), ("gpipe_m1", "flush_m1"), ("none_m1", "flush_m1"),
    ("flush_m3", "flush_m3"), ("gpipe_m3", "flush_m3"), ("2bw_m3", "2bw_m3")])
def test_losses_equal_one_process(runs, name, reference):
    single, piped = runs
    assert _same(_losses(piped[name]), _losses(single[reference]))
    assert piped[name]["versions"] == ([0, 0, 1, 2] if name.startswith("2bw") else [0, 1, 2, 3])


@pytest.mark.parametrize("name,in_flight", [
    ("flush_m1", [1, 1]), ("gpipe_m1", [1, 1]), ("none_m1", [1, 1]),
    ("flush_m3", [2, 1]), ("2bw_m3", [2, 1]), ("gpipe_m3", [3, 3])])
def test_in_flight_counts_are_the_papers_capped_by_m(runs, name, in_flight):
    _, piped = runs
    per_rank = sorted(piped[name]["memory"]["per_rank"], key=lambda r: r["stage"])
    assert [r["peak_in_flight"] for r in per_rank] == in_flight
    assert [r["peak_weight_versions"] for r in per_rank] == [2 if name.startswith("2bw")
                                                             else 1] * 2

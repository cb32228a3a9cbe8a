"""bench/pipeline_breakdown.py: the simulator's period for measured per-stage costs."""
from __future__ import annotations

import pytest

from bench.pipeline_breakdown import simulated_period


@pytest.mark.parametrize("d", [2, 4])
def test_equal_stages_give_the_textbook_periods(d):
    m, f, b = 8, 1.0, 2.0
    stages = [{"F_ms": f, "B_ms": b}] * d
    flush = simulated_period("flush", stages, m, 8) * 1e3
    tbw = simulated_period("2bw", stages, m, 8) * 1e3
    assert flush == pytest.approx((m + d - 1) * (f + b))
    assert tbw == pytest.approx(m * (f + b))


def test_a_heavy_last_stage_sets_the_2bw_period_and_step_cost_counts():
    m = 8
    stages = [{"F_ms": 1.0, "B_ms": 1.0}, {"F_ms": 1.5, "B_ms": 1.5, "other_ms": 4.0}]
    tbw = simulated_period("2bw", stages, m, 8) * 1e3
    assert tbw == pytest.approx(m * 3.0 + 4.0)
    assert simulated_period("flush", stages, m, 8) > simulated_period("2bw", stages, m, 8)

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


def test_on_half_the_cores_2bw_runs_at_the_serial_work_over_the_cores():
    # d = 4 equal stages on 2 cores: 2BW keeps all four busy, so a batch takes its whole
    # work over 2; flush's bubble is filled by the other stages' work, so it gains little
    # on this machine and the predicted 2BW/Flush ratio falls well below a core per stage's.
    m, d = 8, 4
    stages = [{"F_ms": 1.0, "B_ms": 2.0}] * d
    tbw = simulated_period("2bw", stages, m, 8, cores=2) * 1e3
    assert tbw == pytest.approx(d * m * 3.0 / 2)
    flush = simulated_period("flush", stages, m, 8, cores=2) * 1e3
    assert d * m * 3.0 / 2 <= flush + 1e-9
    own = simulated_period("flush", stages, m, 8) / simulated_period("2bw", stages, m, 8)
    assert flush / tbw < own

"""The event-driven simulator against closed-form pipeline timings.

Unit costs are the paper's (forward F = 1, backward B = 2).  The closed forms are
derived by hand from the schedule definitions, not from the simulator.
"""
from __future__ import annotations

import pytest

from megatron.pipeline.actions import Action, Op
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.simulator import DeadlockError, simulate, unit_cost

F, B = 1.0, 2.0


@pytest.mark.parametrize("name", ["gpipe", "flush"])
def test_flush_schedules_one_batch_makespan_and_bubble(name: str) -> None:
    for d in range(1, 7):
        for m in range(1, 3 * d + 1):
            result = simulate(build_schedule(name, d, m), unit_cost(F, B))
            assert result.makespan == (m + d - 1) * (F + B), (name, d, m)
            assert result.bubble_fraction == pytest.approx((d - 1) / (m + d - 1))
            assert result.busy_time == [m * (F + B)] * d


@pytest.mark.parametrize("name", ["gpipe", "flush"])
def test_flush_per_batch_repeats_and_step_barrier_costs_nothing(name: str) -> None:
    d, m, batches = 4, 6, 3
    one = (m + d - 1) * (F + B)
    for barrier in (True, False):
        result = simulate(build_schedule(name, d, m, batches), unit_cost(F, B),
                          step_barrier=barrier)
        assert result.makespan == batches * one


def test_no_pipelining_makespan_with_latency() -> None:
    # One microbatch at a time: d forwards, d backwards and 2(d-1) messages in series.
    d, m, lat = 3, 4, 0.25
    result = simulate(build_schedule("none", d, m, 2), unit_cost(F, B), comm_latency=lat)
    assert result.makespan == pytest.approx(2 * m * (d * (F + B) + 2 * (d - 1) * lat))
    assert result.bubble_fraction == pytest.approx(
        1 - 2 * m * d * (F + B) / (d * result.makespan))
    assert result.peak_in_flight == [1, 1, 1]


def test_comm_latency_as_function_of_the_send() -> None:
    # Only gradient messages are slow: gpipe's forward ramp is unaffected, the backward
    # ramp pays (d-1) latencies once (steady-state backwards of later microbatches overlap).
    d, m = 3, 4

    def lat(send: Action) -> float:
        return 0.5 if send.op is Op.SEND_GRAD else 0.0

    result = simulate(build_schedule("gpipe", d, m), unit_cost(F, B), comm_latency=lat)
    assert result.makespan == pytest.approx((m + d - 1) * (F + B) + (d - 1) * 0.5)


def test_2bw_without_barrier_has_only_the_ramp_bubble() -> None:
    # One continuous 1F1B over all microbatches: makespan (N + d - 1)(F + B), N = batches*m,
    # so throughput approaches the ideal 1 / (F + B) microbatches per unit as N grows.
    for d, m, batches in [(2, 2, 5), (4, 4, 6), (4, 8, 10), (6, 9, 4)]:
        n = batches * m
        result = simulate(build_schedule("2bw", d, m, batches), unit_cost(F, B),
                          step_barrier=False)
        assert result.makespan == (n + d - 1) * (F + B)
        assert result.throughput(samples_per_microbatch=3) == pytest.approx(
            3 * n / ((n + d - 1) * (F + B)))
    long = simulate(build_schedule("2bw", 4, 8, 40), unit_cost(F, B), step_barrier=False)
    assert long.throughput() > 0.99 / (F + B)


def test_2bw_with_step_barrier_loses_at_most_one_action_per_batch() -> None:
    # The STEP all-reduce syncs all stages once per batch.  Aligned STEP placement costs
    # at most one backward per batch; eager placement (right after the batch's last
    # backward) stalls the downstream stages for ~(d - 1) backwards every batch.
    for d, m, batches in [(2, 2, 6), (4, 4, 6), (4, 8, 6), (8, 8, 4), (8, 16, 3)]:
        ideal = (batches * m + d - 1) * (F + B)
        aligned = simulate(build_schedule("2bw", d, m, batches), unit_cost(F, B)).makespan
        eager = simulate(build_schedule("2bw", d, m, batches, step_placement="eager"),
                         unit_cost(F, B)).makespan
        assert ideal <= aligned <= ideal + (batches - 1) * B, (d, m, aligned, ideal)
        assert aligned <= eager
        if d >= 4:
            assert eager - ideal >= (batches - 1) * (d - 1) * B / 2
        flush = simulate(build_schedule("flush", d, m, batches), unit_cost(F, B)).makespan
        assert aligned < flush


def test_2bw_steady_state_period_is_m_times_f_plus_b() -> None:
    d, m, batches = 4, 8, 8
    result = simulate(build_schedule("2bw", d, m, batches), unit_cost(F, B),
                      step_barrier=False)
    ends = sorted(e.end for e in result.events if e.op == "B" and e.stage == 0
                  and e.microbatch % m == m - 1)
    periods = [b - a for a, b in zip(ends, ends[1:])]
    assert periods == [m * (F + B)] * (batches - 1)


def test_bottleneck_stage_sets_2bw_throughput() -> None:
    slow = [1.0, 1.5, 1.0, 1.0]

    def cost(a: Action) -> float:
        if a.op is Op.FORWARD:
            return slow[a.stage] * F
        return slow[a.stage] * B if a.op is Op.BACKWARD else 0.0

    result = simulate(build_schedule("2bw", 4, 8, 20), cost, step_barrier=False)
    bound = 1 / (1.5 * (F + B))
    assert 0.95 * bound < result.throughput() <= bound


def test_memory_counters() -> None:
    d, m = 4, 8
    flush = simulate(build_schedule("flush", d, m, 2), unit_cost())
    assert flush.peak_in_flight == [4, 3, 2, 1]
    assert flush.peak_weight_versions == [1] * d
    gpipe = simulate(build_schedule("gpipe", d, m), unit_cost())
    assert gpipe.peak_in_flight == [m] * d
    two = simulate(build_schedule("2bw", d, m, 3), unit_cost())
    assert two.peak_in_flight == [4, 3, 2, 1]
    assert two.peak_weight_versions == [2] * d
    assert simulate(build_schedule("2bw", d, m, 1), unit_cost()).peak_weight_versions == [1] * d
    assert two.peak_stashed(10.0) == [40.0, 30.0, 20.0, 10.0]
    assert two.peak_stashed(lambda s: 1.0 + s) == [4.0, 6.0, 6.0, 4.0]
    fwd = simulate(build_schedule("flush", d, m, forward_only=True), unit_cost())
    assert fwd.peak_in_flight == [0] * d
    assert fwd.makespan == (m + d - 1) * F


def test_events_cover_every_action_once_in_stage_order() -> None:
    schedule = build_schedule("flush", 3, 4, 2)
    result = simulate(schedule, unit_cost(), comm_latency=0.1)
    for s in range(3):
        mine = [e for e in result.events if e.stage == s]
        assert [e.action for e in mine] == [str(a) for a in schedule[s]]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
        steps = [e for e in mine if e.op == "S@"]
        assert [e.batch for e in steps] == [0, 1]
    # Barrier: every stage leaves STEP(b) at the same moment.
    for b in (0, 1):
        starts = {e.start for e in result.events if e.op == "S@" and e.batch == b}
        assert len(starts) == 1


def test_deadlock_is_reported_with_the_grid() -> None:
    schedule = [list(x) for x in build_schedule("gpipe", 2, 2)]
    # Stage 1 receives microbatch 1 before 0 although they were sent in order 0, 1.
    i = [str(a) for a in schedule[1]].index("1RA0")
    j = [str(a) for a in schedule[1]].index("1RA1")
    schedule[1][i], schedule[1][j] = schedule[1][j], schedule[1][i]
    with pytest.raises(Exception, match="message mismatch: 1RA1"):
        simulate(schedule, unit_cost())
    stuck = [list(x) for x in build_schedule("flush", 2, 2)]
    rg0 = stuck[0].pop([str(a) for a in stuck[0]].index("0RG0"))
    stuck[0].insert(1, rg0)  # stage 0 waits for a gradient before sending activation 0
    with pytest.raises(DeadlockError) as info:
        simulate(stuck, unit_cost())
    text = str(info.value)
    assert "stage 0: 0RG0 (index 1) waits for a message from stage 1" in text
    assert "stage 1: 1RA0 (index 0) waits for a message from stage 0" in text
    assert "stage  0 | F0" in text


def test_deferred_steps_remove_the_barrier_stall_of_2bw() -> None:
    """The executor leaves 2BW's step agreement in flight until batch b+2 starts: the
    simulated 2BW then loses nothing to steps, while a barrier at every step does."""
    d, m, nb = 4, 4, 8
    sched = build_schedule("2bw", d, m, nb)
    ideal = (m * nb + d - 1) * 3.0
    barrier = simulate(sched, unit_cost(1.0, 2.0)).makespan
    deferred = simulate(sched, unit_cost(1.0, 2.0), deferred_steps=True).makespan
    assert deferred == ideal
    assert barrier > deferred
    # and a forward of batch b+2 never starts before every stage's STEP(b) ended
    res = simulate(sched, unit_cost(1.0, 2.0), deferred_steps=True)
    step_end = {}
    for e in res.events:
        if e.op == "S@":
            step_end[e.batch] = max(step_end.get(e.batch, 0.0), e.end)
    for e in res.events:
        if e.op == "F" and e.batch >= 2:
            assert e.start >= step_end[e.batch - 2]


# --- stages sharing fewer processors (``cores``) ---------------------------------------
def _uneven_cost(a: Action) -> float:
    """Per-stage costs that differ, and sends/STEP that take time, so no tie hides a bug."""
    if a.op is Op.FORWARD:
        return 1.0 + 0.25 * a.stage
    if a.op is Op.BACKWARD:
        return 2.0 + 0.5 * (a.stage % 2)
    if a.op is Op.STEP:
        return 0.75
    if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
        return 0.125
    return 0.0


@pytest.mark.parametrize("name,deferred", [("none", False), ("gpipe", False), ("flush", False),
                                           ("2bw", False), ("2bw", True)])
def test_shared_processor_loop_with_a_core_per_stage_equals_the_default(
        name: str, deferred: bool) -> None:
    """The processor-sharing loop, given as many cores as stages, must reproduce every
    start and end of the one-processor-per-stage loop (it never runs slower than 1)."""
    from megatron.pipeline.simulator import _run_shared, run_schedule

    for d, m, nb in ((2, 3, 2), (4, 4, 3), (3, 5, 2)):
        sched = build_schedule(name, d, m, nb)
        for lat in (0.0, 0.3):
            ref = run_schedule(sched, _uneven_cost, lat, deferred_steps=deferred)
            shared = _run_shared(sched, _uneven_cost, lambda _a, c=lat: c,
                                 d > 1 and not deferred, deferred, float(d))
            assert not ref.blocked and not shared.blocked
            for s in range(d):
                want = [(e.index, e.start, e.end) for e in ref.executed[s]]
                got = [(e.index, e.start, e.end) for e in shared.executed[s]]
                assert [g[0] for g in got] == [w[0] for w in want], (name, d, s)
                for (_, a0, a1), (_, b0, b1) in zip(want, got):
                    assert b0 == pytest.approx(a0) and b1 == pytest.approx(a1), (name, d, m, s)


@pytest.mark.parametrize("name", ["none", "gpipe", "flush", "2bw"])
def test_one_core_runs_all_the_work_back_to_back(name: str) -> None:
    # With one core and free messages some stage always has work, so the makespan is the
    # serial sum of every action's cost.
    for d, m, nb in ((2, 4, 2), (4, 5, 3)):
        sched = build_schedule(name, d, m, nb)
        total = sum(_uneven_cost(a) for actions in sched for a in actions)
        res = simulate(sched, _uneven_cost, cores=1, deferred_steps=name == "2bw")
        assert res.makespan == pytest.approx(total), (name, d, m)


def test_no_pipelining_needs_one_core() -> None:
    # One microbatch at a time on one stage at a time: a single core changes nothing.
    sched = build_schedule("none", 4, 3, 2)
    assert simulate(sched, unit_cost(F, B), cores=1).makespan == \
        simulate(sched, unit_cost(F, B)).makespan


def test_saturated_2bw_on_half_the_cores_takes_twice_as_long_per_batch() -> None:
    # In 2BW's steady state all d stages have work, so they run at cores / d each: a batch
    # takes its total work d m (F + B) / cores = 2 m (F + B) for d = 4 on 2 cores.
    d, m = 4, 4
    span = [simulate(build_schedule("2bw", d, m, nb), unit_cost(F, B), cores=2,
                     deferred_steps=True).makespan for nb in (8, 9)]
    assert span[1] - span[0] == pytest.approx(d * m * (F + B) / 2)


def test_shared_cores_bound_flush_between_the_serial_and_the_parallel_timing() -> None:
    d, m = 4, 8
    sched = build_schedule("flush", d, m, 2)
    own = simulate(sched, unit_cost(F, B)).makespan
    total = 2 * d * m * (F + B)
    for cores in (1, 1.5, 2, 3):
        got = simulate(sched, unit_cost(F, B), cores=cores).makespan
        assert max(own, total / cores) - 1e-9 <= got <= own * d / cores + 1e-9, cores
    # the bubble a core per stage would waste is used by the other stages' work
    assert simulate(sched, unit_cost(F, B), cores=2).makespan < own * 2


def test_shared_cores_report_deadlocks_and_bad_core_counts() -> None:
    stuck = [list(x) for x in build_schedule("flush", 2, 2)]
    rg0 = stuck[0].pop([str(a) for a in stuck[0]].index("0RG0"))
    stuck[0].insert(1, rg0)
    with pytest.raises(DeadlockError, match="0RG0 .index 1. waits for a message from stage 1"):
        simulate(stuck, unit_cost(), cores=1)
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="cores must be a positive number"):
            simulate(build_schedule("flush", 2, 2), unit_cost(), cores=bad)

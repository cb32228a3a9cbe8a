"""Pipeline schedules as data: structure, validator, goldens, corrupted schedules.

No process group: everything here runs on the action lists and the unit-cost dry run.
The explicit checks below are written independently of ``validate.py`` so that a bug in
the validator cannot hide a bug in the schedules.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import pytest

from megatron.pipeline.actions import Action, Op, ScheduleError, is_compute, parse_action
from megatron.pipeline.schedules import (SCHEDULES, build_schedule, compute_order,
                                         format_grid, format_schedule, weight_version_2bw)
from megatron.pipeline.simulator import DeadlockError, simulate, unit_cost
from megatron.pipeline.validate import validate_schedule


def _grid(name: str, d: int):
    """(m, num_batches) pairs for one (schedule, d): every m in 1..4d, batches cycling 1..3."""
    for m in range(1, 4 * d + 1):
        if name == "2bw" and m < d:
            continue
        yield m, 1 + m % 3


def _independent_checks(name: str, schedule: List[List[Action]], d: int, m: int,
                        batches: int) -> None:
    n = m * batches
    for s, actions in enumerate(schedule):
        order = [(a.op, a.microbatch) for a in actions if is_compute(a)]
        # Every microbatch exactly once forward and once backward, forward first.
        assert sorted(k for op, k in order if op is Op.FORWARD) == list(range(n))
        assert sorted(k for op, k in order if op is Op.BACKWARD) == list(range(n))
        first = {(op, k): i for i, (op, k) in enumerate(order)}
        assert all(first[(Op.FORWARD, k)] < first[(Op.BACKWARD, k)] for k in range(n))
        # In-flight (forward done, backward not) per stage.
        live = peak = 0
        for op, _ in order:
            live += 1 if op is Op.FORWARD else -1
            peak = max(peak, live)
        limit = {"flush": min(d - s, m), "2bw": d - s, "gpipe": m, "none": 1}[name]
        assert peak <= limit, (name, d, m, s, peak)
        if name in ("flush", "2bw") and d - s <= m:
            assert peak == d - s  # 1F1B really fills the pipeline
        # One STEP per batch, after all that batch's backwards.
        steps = [i for i, a in enumerate(actions) if a.op is Op.STEP]
        assert [actions[i].batch for i in steps] == list(range(batches))
        for b, i in enumerate(steps):
            last_b = max(j for j, a in enumerate(actions)
                         if a.op is Op.BACKWARD and a.batch == b)
            assert last_b < i
        for a in actions:
            if is_compute(a):
                want = weight_version_2bw(a.microbatch, m) if name == "2bw" else a.batch
                assert a.version == want and a.batch == a.microbatch // m
                assert a.buffer == (a.batch % 2 if name == "2bw" else 0)
    # Channels: the k-th send on a channel is received as the k-th receive.
    for s in range(d - 1):
        sends = [a.microbatch for a in schedule[s] if a.op is Op.SEND_ACT]
        recvs = [a.microbatch for a in schedule[s + 1] if a.op is Op.RECV_ACT]
        assert sends == recvs == sorted(sends) and len(sends) == n
        gsends = [a.microbatch for a in schedule[s + 1] if a.op is Op.SEND_GRAD]
        grecvs = [a.microbatch for a in schedule[s] if a.op is Op.RECV_GRAD]
        assert gsends == grecvs and len(gsends) == n
    # No deadlock, and forwards flow down / backwards flow up in simulated time.
    result = simulate(schedule, unit_cost())
    times: Dict[Tuple[str, int, int], Tuple[float, float]] = {
        (e.op, e.stage, e.microbatch): (e.start, e.end) for e in result.events
        if e.op in ("F", "B")}
    for k in range(n):
        for s in range(1, d):
            assert times[("F", s, k)][0] >= times[("F", s - 1, k)][1]
            assert times[("B", s - 1, k)][0] >= times[("B", s, k)][1]
    if name == "none":
        spans = sorted((times[("F", 0, k)][0], times[("B", 0, k)][1]) for k in range(n))
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(n - 1))  # 1 in pipeline


@pytest.mark.parametrize("d", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_grid(name: str, d: int) -> None:
    for m, batches in _grid(name, d):
        schedule = build_schedule(name, d, m, batches)
        stats = validate_schedule(schedule, name, d, m, batches)
        assert len(stats.max_in_flight) == d
        _independent_checks(name, schedule, d, m, batches)
        fwd = build_schedule(name, d, m, batches, forward_only=True)
        validate_schedule(fwd, name, d, m, batches, forward_only=True)
        assert all(a.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT) for st in fwd for a in st)
        assert [compute_order(st) for st in fwd] == [
            " ".join(f"F{k}" for k in range(m * batches))] * d


@pytest.mark.parametrize("d,m", [(2, 1), (4, 3), (8, 7)])
def test_2bw_needs_m_at_least_d(d: int, m: int) -> None:
    with pytest.raises(ValueError, match="PipeDream-2BW needs m >= d"):
        build_schedule("2bw", d, m, 2)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="num_stages must be a positive int"):
        build_schedule("flush", 0, 2)
    with pytest.raises(ValueError, match="step_placement"):
        build_schedule("2bw", 2, 2, step_placement="late")


def test_action_text_round_trip() -> None:
    assert str(Action(2, Op.FORWARD, 5)) == "2F5"
    assert str(Action(2, Op.REDUCE_GRADS, batch=1)) == "2R@1"
    assert str(Action(12, Op.STEP, batch=3)) == "12S@3"
    assert parse_action("2SA5") == Action(2, Op.SEND_ACT, 5, peer=3)
    assert parse_action("2RG5") == Action(2, Op.RECV_GRAD, 5, peer=3)
    assert parse_action("2SG5") == Action(2, Op.SEND_GRAD, 5, peer=1)
    assert parse_action("0S@4") == Action(0, Op.STEP, batch=4)
    for a in build_schedule("2bw", 3, 3, 2)[1]:
        back = parse_action(str(a))
        assert str(back) == str(a) and back.op is a.op and back.peer == a.peer
    with pytest.raises(ValueError, match="cannot read 'F5'"):
        parse_action("F5")


def test_golden_flush_d2_m3() -> None:
    assert format_schedule(build_schedule("flush", 2, 3)) == (
        "stage 0: 0F0 0SA0 0F1 0SA1 0RG0 0B0 0F2 0SA2 0RG1 0B1 0RG2 0B2 0R@0 0S@0\n"
        "stage 1: 1RA0 1F0 1B0 1SG0 1RA1 1F1 1B1 1SG1 1RA2 1F2 1B2 1SG2 1R@0 1S@0")


def test_golden_2bw_d2_m2_b2() -> None:
    # Stage 1 steps batch 0 after B2, when stage 0 has finished batch 0 (aligned STEP).
    assert format_schedule(build_schedule("2bw", 2, 2, 2)) == (
        "stage 0: 0F0 0SA0 0F1 0SA1 0RG0 0B0 0F2 0SA2 0RG1 0B1 0R@0 0S@0 0F3 0SA3 0RG2 0B2 "
        "0RG3 0B3 0R@1 0S@1\n"
        "stage 1: 1RA0 1F0 1B0 1SG0 1RA1 1F1 1B1 1SG1 1R@0 1RA2 1F2 1B2 1SG2 1S@0 1RA3 1F3 "
        "1B3 1SG3 1R@1 1S@1")
    eager = build_schedule("2bw", 2, 2, 2, step_placement="eager")
    assert "1SG1 1R@0 1S@0 1RA2" in format_schedule(eager)
    validate_schedule(eager, "2bw", 2, 2, 2)


def test_compute_orders() -> None:
    flush = build_schedule("flush", 4, 6)
    assert compute_order(flush[1]) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert compute_order(flush[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert compute_order(build_schedule("flush", 4, 2)[0]) == "F0 F1 B0 B1"
    assert compute_order(build_schedule("gpipe", 3, 3, 2)[0]) == (
        "F0 F1 F2 B0 B1 B2 F3 F4 F5 B3 B4 B5")
    assert compute_order(build_schedule("none", 3, 2, 2)[2]) == "F0 B0 F1 B1 F2 B2 F3 B3"
    # 2BW: no flush between batches, so batch 1's forwards start before batch 0 is done.
    assert compute_order(build_schedule("2bw", 3, 3, 2)[0]) == (
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5")


def test_2bw_versions_and_buffers_follow_the_paper() -> None:
    # Paper: input k (1-indexed) uses max(floor((k-1)/m) - 1, 0); ours is 0-indexed.
    m = 4
    for k_paper in range(1, 25):
        assert weight_version_2bw(k_paper - 1, m) == max((k_paper - 1) // m - 1, 0)
    schedule = build_schedule("2bw", 4, m, 5)
    fwd = {a.microbatch: a for a in schedule[2] if a.op is Op.FORWARD}
    assert [fwd[k].version for k in (0, 3, 4, 7, 8, 11, 12, 19)] == [0, 0, 0, 0, 1, 1, 2, 3]
    assert [fwd[k].buffer for k in (0, 4, 8, 12, 16)] == [0, 1, 0, 1, 0]
    for actions in schedule:
        # STEP(b) sits after batch b's REDUCE_GRADS and before batch b+2's first action.
        pos = {(a.op, a.batch if a.op in (Op.STEP, Op.REDUCE_GRADS) else a.microbatch): i
               for i, a in enumerate(actions)}
        for b in range(5):
            assert pos[(Op.REDUCE_GRADS, b)] < pos[(Op.STEP, b)]
            if b + 2 < 5:
                assert pos[(Op.STEP, b)] < pos[(Op.FORWARD, (b + 2) * m)]
    assert {a.buffer for a in build_schedule("flush", 2, 2, 3)[0] if is_compute(a)} == {0}


def test_format_grid_marks_the_failed_action() -> None:
    schedule = build_schedule("flush", 2, 2)
    assert format_grid(schedule) == (
        "stage  0 | F0 F1  .  .   B0   .   B1\n"
        "stage  1 |  . F0   B0  F1   B1   .  .")
    index = [str(a) for a in schedule[1]].index("1B0")
    text = format_grid(schedule, mark=(1, index))
    assert ">>B0<<" in text.splitlines()[1] and "marked: stage 1, action index 2 (1B0)" in text
    # A send marks the compute action it belongs to.
    text = format_grid(schedule, mark=(0, 1))
    assert ">>F0<<" in text.splitlines()[0] and "(0SA0)" in text


# ---- corrupted schedules are rejected with the right message --------------------------

def _copy(schedule):
    return [list(actions) for actions in schedule]


def _index(actions: List[Action], text: str) -> int:
    return [str(a) for a in actions].index(text)


def test_reject_backward_before_forward() -> None:
    bad = _copy(build_schedule("flush", 2, 3))
    i, j = _index(bad[1], "1F1"), _index(bad[1], "1B1")
    bad[1][i], bad[1][j] = bad[1][j], bad[1][i]
    with pytest.raises(ScheduleError, match="backward of microbatch 1 precedes its forward"):
        validate_schedule(bad, "flush", 2, 3)


def test_reject_dropped_recv() -> None:
    bad = _copy(build_schedule("gpipe", 3, 4))
    del bad[2][_index(bad[2], "2RA3")]
    with pytest.raises(ScheduleError, match="stage 2: no RECV_ACT for microbatch 3"):
        validate_schedule(bad, "gpipe", 3, 4)


def test_reject_reordered_sends() -> None:
    bad = _copy(build_schedule("gpipe", 2, 3))
    sa1 = bad[0].pop(_index(bad[0], "0SA1"))
    bad[0].insert(_index(bad[0], "0SA2") + 1, sa1)  # F0 SA0 F1 F2 SA2 SA1: still locally fine
    with pytest.raises(ScheduleError, match="send order and receive order differ at message 1"):
        validate_schedule(bad, "gpipe", 2, 3)


def test_reject_deadlock() -> None:
    bad = _copy(build_schedule("flush", 2, 2))
    rg0 = bad[0].pop(_index(bad[0], "0RG0"))
    bad[0].insert(_index(bad[0], "0SA0"), rg0)  # waits for a gradient before sending F0
    with pytest.raises(DeadlockError, match="deadlock"):
        validate_schedule(bad, "flush", 2, 2)
    with pytest.raises(DeadlockError, match="0RG0 \\(index 1\\) waits for a message from stage 1"):
        simulate(bad, unit_cost())


def test_reject_step_barrier_deadlock() -> None:
    # Stage 1 steps batch 0 before batch 0 is done there: stage 0 can never reach STEP(0)
    # because it needs stage 1's gradients, so the barrier never opens.
    bad = _copy(build_schedule("flush", 2, 2, 2))
    step = bad[1].pop(_index(bad[1], "1S@0"))
    bad[1].insert(0, step)
    with pytest.raises(ScheduleError, match="STEP of batch 0 comes before its REDUCE_GRADS"):
        validate_schedule(bad, "flush", 2, 2, 2)
    with pytest.raises(DeadlockError, match="waits at the step barrier"):
        simulate(bad, unit_cost())


def test_reject_wrong_2bw_version() -> None:
    bad = _copy(build_schedule("2bw", 2, 2, 3))
    i = _index(bad[0], "0F4")
    bad[0][i] = dataclasses.replace(bad[0][i], version=2)
    with pytest.raises(ScheduleError, match="uses weight version 2, expected 1"):
        validate_schedule(bad, "2bw", 2, 2, 3)


def test_reject_step_too_late_for_2bw() -> None:
    bad = _copy(build_schedule("2bw", 2, 2, 3))
    step = bad[0].pop(_index(bad[0], "0S@0"))
    bad[0].insert(_index(bad[0], "0F4") + 1, step)
    with pytest.raises(ScheduleError, match="forward of microbatch 4 needs weight version 1 "
                                            "but comes before STEP of batch 0"):
        validate_schedule(bad, "2bw", 2, 2, 3)


def test_reject_missing_step_and_extra_actions() -> None:
    bad = _copy(build_schedule("flush", 2, 2, 2))
    del bad[0][_index(bad[0], "0S@1")]
    with pytest.raises(ScheduleError, match="stage 0: no STEP for batch 1"):
        validate_schedule(bad, "flush", 2, 2, 2)
    bad = _copy(build_schedule("flush", 2, 2))
    bad[0].append(Action(0, Op.RECV_ACT, 0, batch=0, peer=-1))
    with pytest.raises(ScheduleError, match="0RA0 is not allowed on this stage"):
        validate_schedule(bad, "flush", 2, 2)


def test_reject_in_flight_over_limit() -> None:
    # A GPipe order is a valid schedule, but not a PipeDream-Flush one: too many stashes.
    with pytest.raises(ScheduleError, match="stage 0 holds 4 microbatches in flight, "
                                            "limit for flush is 2"):
        validate_schedule(build_schedule("gpipe", 2, 4), "flush", 2, 4)
    with pytest.raises(ScheduleError, match="limit for none is 1"):
        validate_schedule(build_schedule("flush", 3, 3), "none", 3, 3)


def test_2bw_steps_sit_one_pair_before_stage_0_needs_them() -> None:
    """Aligned 2BW placement: STEP(b) on every stage, in a unit-cost run, no earlier than
    one forward/backward pair (3 units) before stage 0 starts batch b+2, nor than stage 0
    ends batch b, and before anything of batch b+2 on its own stage; the gradient
    all-reduce a stage waits for there runs beside its compute until then."""
    from megatron.pipeline.simulator import run_schedule

    for d in range(2, 7):
        for m in range(d, 3 * d + 1):
            schedule = build_schedule("2bw", d, m, 4)
            validate_schedule(schedule, "2bw", d, m, 4)
            runs = run_schedule(schedule, unit_cost(), step_barrier=False).executed
            zero = {(e.action.op, e.action.batch if e.action.microbatch is None
                     else e.action.microbatch): e.start for e in runs[0]}
            for b in range(2):  # batches whose b+2 is in the segment
                need = zero[(Op.FORWARD, (b + 2) * m)]
                floor = max(zero[(Op.REDUCE_GRADS, b)], need - 3.0)
                for s, executed in enumerate(runs):
                    at = next(e.start for e in executed
                              if e.action.op is Op.STEP and e.action.batch == b)
                    assert floor <= at, (d, m, b, s, at, floor)
                    first = min(e.start for e in executed if e.action.op is Op.FORWARD
                                and e.action.batch == b + 2)
                    assert at <= first, (d, m, b, s)

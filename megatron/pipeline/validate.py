"""Check a schedule against every rule the executor relies on, with no process group.

``validate_schedule(schedule, name, d, m, num_batches)`` raises ``ScheduleError`` naming
the first broken rule, in this order:

1. shape: d lists, each action on its own stage's list, sends/recvs to the right peer;
2. counts: every microbatch has exactly one F and one B per stage, with exactly the
   sends/recvs it needs; one REDUCE_GRADS and one STEP per batch per stage;
3. per-stage order: RECV_ACT(k) < F(k) < SEND_ACT(k), RECV_GRAD(k) < B(k) < SEND_GRAD(k),
   F(k) < B(k); REDUCE_GRADS(b) after batch b's backwards, STEP(b) after it and before
   any forward that needs version b+1;
4. fields: batch = k // m; version and buffer as ``schedules.weight_version/buffer``;
5. channels: per (sender, receiver) pair the receive order equals the send order, since
   point-to-point messages are matched first-in first-out;
6. dry run (unit costs, non-blocking sends, blocking receives, STEP barrier): no deadlock,
   stage s forwards k only after stage s-1 did, backwards the other way round;
7. in-flight microbatches (activation stashes) per stage: <= min(d - s, m) for flush and
   2bw, <= m for gpipe, 1 for none, and for none also 1 in the whole pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron.pipeline.actions import Action, Op, ScheduleError, peer_of
from megatron.pipeline.schedules import SCHEDULES, weight_buffer, weight_version
from megatron.pipeline.simulator import DeadlockError, render_grid, run_schedule, unit_cost

__all__ = ["ScheduleError", "ScheduleStats", "validate_schedule"]

# For each microbatch op: (op that must come before it, op that must come after it).
_NEIGHBOURS = {Op.FORWARD: (Op.RECV_ACT, Op.SEND_ACT), Op.BACKWARD: (Op.RECV_GRAD, Op.SEND_GRAD)}


@dataclass
class ScheduleStats:
    """What the validator measured (unit-cost dry run: F = 1, B = 2)."""

    max_in_flight: List[int]
    """Most microbatches with forward done and backward pending, per stage."""
    pipeline_in_flight: int
    """Most microbatches between their first forward and last backward, whole pipeline."""
    makespan: float
    bubble_fraction: float


def _expected_ops(s: int, d: int, forward_only: bool) -> List[Op]:
    ops = [Op.FORWARD]
    if s > 0:
        ops.append(Op.RECV_ACT)
    if s < d - 1:
        ops.append(Op.SEND_ACT)
    if not forward_only:
        ops.append(Op.BACKWARD)
        if s < d - 1:
            ops.append(Op.RECV_GRAD)
        if s > 0:
            ops.append(Op.SEND_GRAD)
    return ops


def validate_schedule(schedule: Sequence[Sequence[Action]], name: str, d: int, m: int,
                      num_batches: int = 1, forward_only: bool = False) -> ScheduleStats:
    """Raise ``ScheduleError`` on the first broken rule (module docstring); else stats."""
    where = f"{name} schedule (d={d}, m={m}, batches={num_batches})"

    def fail(msg: str) -> None:
        raise ScheduleError(f"{where}: {msg}")

    if name not in SCHEDULES:
        fail(f"unknown schedule name, expected one of {SCHEDULES}")
    if len(schedule) != d:
        fail(f"has {len(schedule)} stage lists, expected {d}")
    n = num_batches * m
    for s, actions in enumerate(schedule):
        _check_stage(s, actions, name, d, m, num_batches, forward_only, fail)
    for s in range(d - 1):
        _check_channel(schedule, s, s + 1, Op.SEND_ACT, Op.RECV_ACT, fail)
        if not forward_only:
            _check_channel(schedule, s + 1, s, Op.SEND_GRAD, Op.RECV_GRAD, fail)
    stats = _dry_run(schedule, d, n, forward_only, where, fail,
                     deferred_steps=name == "2bw" and not forward_only)
    _check_in_flight(stats, name, d, m, forward_only, fail)
    return stats


def _check_stage(s: int, actions: Sequence[Action], name: str, d: int, m: int,
                 num_batches: int, forward_only: bool, fail) -> None:
    n = num_batches * m
    allowed = set(_expected_ops(s, d, forward_only))
    pos: Dict[Tuple[Op, int], int] = {}
    for i, a in enumerate(actions):
        if a.stage != s:
            fail(f"action {a} (index {i}) is in the list of stage {s}")
        if a.op in (Op.REDUCE_GRADS, Op.STEP):
            if forward_only:
                fail(f"stage {s}: forward-only schedule contains {a}")
            if a.batch is None or not 0 <= a.batch < num_batches:
                fail(f"stage {s}: {a} names batch {a.batch}, expected 0..{num_batches - 1}")
            key = (a.op, a.batch)
        else:
            if a.op not in allowed:
                fail(f"stage {s}: {a} is not allowed on this stage (stage {s} of {d})")
            if a.microbatch is None or not 0 <= a.microbatch < n:
                fail(f"stage {s}: {a} names microbatch {a.microbatch}, expected 0..{n - 1}")
            if peer_of(s, a.op) != a.peer:
                fail(f"stage {s}: {a} has peer {a.peer}, expected {peer_of(s, a.op)}")
            _check_fields(s, a, name, m, forward_only, fail)
            key = (a.op, a.microbatch)
        if key in pos:
            fail(f"stage {s}: {a} appears twice (indices {pos[key]} and {i})")
        pos[key] = i
    for k in range(n):
        for op in _expected_ops(s, d, forward_only):
            if (op, k) not in pos:
                fail(f"stage {s}: no {op.name} for microbatch {k}")
        for op, (before, after) in _NEIGHBOURS.items():
            if (op, k) not in pos:
                continue
            i = pos[(op, k)]
            if (before, k) in pos and pos[(before, k)] > i:
                fail(f"stage {s}: {before.name} of microbatch {k} comes after its {op.name}")
            if (after, k) in pos and pos[(after, k)] < i:
                fail(f"stage {s}: {after.name} of microbatch {k} comes before its {op.name}")
        if not forward_only and pos[(Op.BACKWARD, k)] < pos[(Op.FORWARD, k)]:
            fail(f"stage {s}: backward of microbatch {k} precedes its forward")
    if not forward_only:
        _check_batches(s, pos, name, m, num_batches, fail)


def _check_fields(s: int, a: Action, name: str, m: int, forward_only: bool, fail) -> None:
    k = a.microbatch
    if a.batch != k // m:
        fail(f"stage {s}: {a} has batch {a.batch}, expected {k // m} (= {k} // m)")
    if a.op not in (Op.FORWARD, Op.BACKWARD):
        return
    if forward_only:
        if a.version is not None or a.buffer is not None:
            fail(f"stage {s}: forward-only {a} carries version/buffer, expected None")
        return
    version, buffer = weight_version(name, k, m), weight_buffer(name, k // m)
    if a.version != version:
        rule = "max(k // m - 1, 0)" if name == "2bw" else "k // m"
        fail(f"stage {s}: {a} uses weight version {a.version}, expected {version} = {rule}")
    if a.buffer != buffer:
        fail(f"stage {s}: {a} uses weight buffer {a.buffer}, expected {buffer}")


def _check_batches(s: int, pos: Dict[Tuple[Op, int], int], name: str, m: int,
                   num_batches: int, fail) -> None:
    last_step = -1
    for b in range(num_batches):
        for op in (Op.REDUCE_GRADS, Op.STEP):
            if (op, b) not in pos:
                fail(f"stage {s}: no {op.name} for batch {b}")
        reduce_at, step_at = pos[(Op.REDUCE_GRADS, b)], pos[(Op.STEP, b)]
        last_backward = max(pos[(Op.BACKWARD, k)] for k in range(b * m, (b + 1) * m))
        if reduce_at < last_backward:
            fail(f"stage {s}: REDUCE_GRADS of batch {b} comes before the batch's last backward")
        if step_at < reduce_at:
            fail(f"stage {s}: STEP of batch {b} comes before its REDUCE_GRADS")
        if step_at < last_step:
            fail(f"stage {s}: STEP of batch {b} comes before the STEP of batch {b - 1}")
        last_step = step_at
        # Version b+1, which this STEP creates, must exist before any forward using it.
        for k in range(num_batches * m):
            if weight_version(name, k, m) > b and pos[(Op.FORWARD, k)] < step_at:
                fail(f"stage {s}: forward of microbatch {k} needs weight version "
                     f"{weight_version(name, k, m)} but comes before STEP of batch {b}")


def _check_channel(schedule: Sequence[Sequence[Action]], src: int, dst: int, send: Op,
                   recv: Op, fail) -> None:
    sent = [a.microbatch for a in schedule[src] if a.op is send]
    received = [a.microbatch for a in schedule[dst] if a.op is recv]
    if sent != received:
        first = next((i for i, (x, y) in enumerate(zip(sent, received)) if x != y),
                     min(len(sent), len(received)))
        fail(f"channel stage {src} -> stage {dst} ({send.name}/{recv.name}): send order and "
             f"receive order differ at message {first}: sends {sent[first:first + 4]} ... "
             f"vs receives {received[first:first + 4]} ... (messages match first-in first-out)")


def _dry_run(schedule: Sequence[Sequence[Action]], d: int, n: int, forward_only: bool,
             where: str, fail, deferred_steps: bool = False) -> ScheduleStats:
    # The executor's step semantics: a barrier for flushing schedules; under 2BW the
    # step's agreement is deferred until batch b+2 needs it.  Check both for 2BW.
    deferred = (run_schedule(schedule, unit_cost(), deferred_steps=True)
                if deferred_steps else None)
    if deferred is not None and deferred.blocked:
        stuck = "; ".join(f"stage {s}: {why}" for s, why in sorted(deferred.blocked.items()))
        raise DeadlockError(f"{where}: deadlock in dry run with deferred steps: {stuck}\n"
                            f"{render_grid(deferred, d)}")
    state = run_schedule(schedule, unit_cost(), step_barrier=True)
    if state.mismatch:
        fail("; ".join(why for _, why in sorted(state.mismatch.items())))
    if state.blocked:
        stuck = "; ".join(f"stage {s}: {why}" for s, why in sorted(state.blocked.items()))
        raise DeadlockError(f"{where}: deadlock in dry run: {stuck}\n{render_grid(state, d)}")
    times: Dict[Tuple[Op, int, int], Tuple[float, float]] = {}
    for s, executed in enumerate(state.executed):
        for e in executed:
            if e.action.op in (Op.FORWARD, Op.BACKWARD):
                times[(e.action.op, s, e.action.microbatch)] = (e.start, e.end)
    for k in range(n):
        for s in range(1, d):
            if times[(Op.FORWARD, s, k)][0] < times[(Op.FORWARD, s - 1, k)][1]:
                fail(f"stage {s} starts the forward of microbatch {k} before stage {s - 1} "
                     "finished it")
            if not forward_only and times[(Op.BACKWARD, s - 1, k)][0] < times[
                    (Op.BACKWARD, s, k)][1]:
                fail(f"stage {s - 1} starts the backward of microbatch {k} before stage {s} "
                     "finished it")
    max_in_flight = []
    for executed in state.executed:
        live = peak = 0
        for e in executed:
            if e.action.op is Op.FORWARD and not forward_only:
                live += 1
                peak = max(peak, live)
            elif e.action.op is Op.BACKWARD:
                live -= 1
        max_in_flight.append(peak)
    pipeline = 0
    if not forward_only:
        # A microbatch occupies the pipeline from its first forward to its last backward.
        spans = sorted((times[(Op.FORWARD, 0, k)][0], times[(Op.BACKWARD, 0, k)][1])
                       for k in range(n))
        ends: List[float] = []
        for start, end in spans:
            ends = [x for x in ends if x > start] + [end]
            pipeline = max(pipeline, len(ends))
    makespan = max((e.end for ex in state.executed for e in ex), default=0.0)
    busy = sum(e.end - e.start for ex in state.executed for e in ex
               if e.action.op in (Op.FORWARD, Op.BACKWARD))
    bubble = 1.0 - busy / (d * makespan) if makespan > 0 else 0.0
    return ScheduleStats(max_in_flight, pipeline, makespan, bubble)


def _check_in_flight(stats: ScheduleStats, name: str, d: int, m: int, forward_only: bool,
                     fail) -> None:
    if forward_only:
        return
    for s, count in enumerate(stats.max_in_flight):
        limit = {"flush": min(d - s, m), "2bw": d - s, "gpipe": m, "none": 1}[name]
        if count > limit:
            fail(f"stage {s} holds {count} microbatches in flight, limit for {name} is {limit}")
    if name == "none" and stats.pipeline_in_flight > 1:
        fail(f"{stats.pipeline_in_flight} microbatches in the pipeline at once, "
             "expected 1 without pipelining")

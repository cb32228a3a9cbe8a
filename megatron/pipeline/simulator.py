"""Event-driven simulation of a pipeline schedule against a cost model.

``simulate(schedule, cost)`` runs every stage's action list in order, with the same
blocking rules as the real executor:

* compute, REDUCE_GRADS and sends start as soon as the stage is free (sends are
  non-blocking ``isend``; ``cost`` of a send is the time the stage spends posting it);
* a receive starts when the stage is free *and* the matching send has been posted, plus
  ``comm_latency``; point-to-point messages on one (sender, receiver) channel are
  matched first-in first-out, as NCCL and gloo do;
* ``STEP(b)`` is a barrier across all stages (it contains the all-reduces of the global
  gradient norm, of the fp16 overflow flag and of tied embedding gradients): a stage
  leaves it only when every stage has reached its ``STEP(b)``.

If no stage can move and some are not finished, ``DeadlockError`` is raised with the
stage-by-step grid of what ran and where each stage is stuck.

By default every stage has a processor of its own (a GPU per stage).  ``cores=c`` with
``c < d`` models d stages sharing c processors (CPU ranks on a smaller machine): at every
instant the k stages that have work to do share the c cores equally (processor sharing,
speed min(1, c / k) each), while a stage waiting in a receive, at the step barrier or
for a deferred step uses none.  ``cost`` is then the work of an action at full speed.

Usage by the planner::

    result = simulate(build_schedule("2bw", d, m, num_batches=8),
                      cost=lambda a: t_fwd[a.stage] if a.op is Op.FORWARD else ...,
                      comm_latency=activation_bytes / bandwidth)
    result.throughput(samples_per_microbatch=b * w), result.bubble_fraction,
    result.peak_in_flight, result.peak_weight_versions
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

from megatron.pipeline.actions import (Action, Op, RECV_OPS, ScheduleError, is_compute)
from megatron.pipeline.trace import TraceEvent

Schedule = Sequence[Sequence[Action]]
CostFn = Callable[[Action], float]


class DeadlockError(ScheduleError):
    """No stage can make progress but some have actions left."""


def unit_cost(forward: float = 1.0, backward: float = 2.0, other: float = 0.0) -> CostFn:
    """The paper's figure costs: F = 1, B = 2 (backward twice the forward), rest free."""
    def cost(action: Action) -> float:
        if action.op is Op.FORWARD:
            return forward
        if action.op is Op.BACKWARD:
            return backward
        return other
    return cost


@dataclass(slots=True)
class _Executed:
    """An action that ran in the simulation, with its position in its stage's list."""

    index: int
    action: Action
    start: float
    end: float


@dataclass
class _RunState:
    executed: List[List[_Executed]]
    blocked: Dict[int, str] = field(default_factory=dict)
    """stage -> why it is stuck (only stages with actions left)."""
    mismatch: Dict[int, str] = field(default_factory=dict)
    """stage -> a receive that would take another microbatch's message (stage stopped)."""


def _channel(action: Action) -> Tuple[int, int]:
    """(sender, receiver) of the message a send produces or a receive consumes."""
    if action.op in (Op.SEND_ACT, Op.SEND_GRAD):
        return (action.stage, action.peer)
    return (action.peer, action.stage)


def run_schedule(schedule: Schedule, cost: CostFn, comm_latency: Union[CostFn, float] = 0.0,
                 step_barrier: bool = True, deferred_steps: bool = False,
                 cores: Optional[float] = None) -> _RunState:
    """Simulate as far as possible; reports instead of raising (``simulate`` raises).

    ``deferred_steps`` models the executor under 2BW: STEP(b) does not block, but a
    forward of batch b + 2 waits until every stage has done STEP(b) (the new weight
    version needs the agreed norm/overflow of all stages).  It overrides ``step_barrier``.

    A stage stops where it is stuck (``blocked``) or where a receive would be matched
    with a message meant for another microbatch (``mismatch``: the real executor would
    silently use the wrong tensor).

    ``cores`` (fewer than the stages): the stages share that many processors (see the
    module docstring).
    """
    if callable(comm_latency):
        latency = lambda a: float(comm_latency(a))  # noqa: E731
    else:
        latency = lambda _a, c=float(comm_latency): c  # noqa: E731
    d = len(schedule)
    for s, actions in enumerate(schedule):
        for a in actions:
            if a.stage != s:
                raise ScheduleError(f"action {a} is in the list of stage {s}")
            if (a.op in RECV_OPS or a.op in (Op.SEND_ACT, Op.SEND_GRAD)) and (
                    a.peer is None or not 0 <= a.peer < d):
                raise ScheduleError(f"action {a} on stage {s} has peer {a.peer}, "
                                    f"expected a stage in 0..{d - 1}")
    if cores is not None and not cores > 0:
        raise ValueError(f"cores must be a positive number, got {cores}")
    barrier = step_barrier and d > 1 and not deferred_steps
    if cores is not None and cores < d:
        return _run_shared(schedule, cost, latency, barrier, deferred_steps, float(cores))
    ptr = [0] * d
    free = [0.0] * d
    channels: Dict[Tuple[int, int], Deque[Tuple[Action, float]]] = {}
    state = _RunState(executed=[[] for _ in range(d)])
    step_ends: Dict[int, List[float]] = {}

    recv_act, recv_grad, send_act, send_grad = (Op.RECV_ACT, Op.RECV_GRAD, Op.SEND_ACT,
                                                Op.SEND_GRAD)
    step = Op.STEP
    progress = True
    while progress:
        progress = False
        for s in range(d):
            actions, executed = schedule[s], state.executed[s]
            i, t = ptr[s], free[s]
            while i < len(actions):
                a = actions[i]
                op = a.op
                start = t
                if op is recv_act or op is recv_grad:
                    queue = channels.get((a.peer, s))
                    if not queue:
                        break
                    sent, arrival = queue[0]
                    why = _mismatch(a, i, sent)
                    if why:
                        state.mismatch.setdefault(s, why)
                        break
                    queue.popleft()
                    start = arrival if arrival > t else t
                elif op is step and barrier:
                    break
                elif (deferred_steps and op is Op.FORWARD and a.batch is not None
                      and a.batch >= 2):
                    ends = step_ends.get(a.batch - 2, ())
                    if len(ends) < d:
                        break
                    start = max(t, max(ends))
                t = start + float(cost(a))
                executed.append(_Executed(i, a, start, t))
                if op is step and deferred_steps:
                    step_ends.setdefault(a.batch, []).append(t)
                if op is send_act or op is send_grad:
                    key = (s, a.peer)
                    if key not in channels:
                        channels[key] = deque()
                    channels[key].append((a, t + latency(a)))
                i += 1
                progress = True
            ptr[s], free[s] = i, t
        if barrier and _barrier_ready(schedule, ptr):
            start = max(free)
            for s in range(d):
                a = schedule[s][ptr[s]]
                free[s] = start + float(cost(a))
                state.executed[s].append(_Executed(ptr[s], a, start, free[s]))
                ptr[s] += 1
            progress = True
    for s in range(d):
        if ptr[s] < len(schedule[s]):
            state.blocked[s] = state.mismatch.get(s) or _why_blocked(
                schedule, ptr, s, step_barrier)
    return state


def _run_shared(schedule: Schedule, cost: CostFn, latency: Callable[[Action], float],
                barrier: bool, deferred_steps: bool, cores: float) -> _RunState:
    """``run_schedule`` for d stages on ``cores`` < d processors (processor sharing).

    Time advances from event to event: an action's completion or a message's arrival.
    Between two events the set of running stages is fixed and each runs at
    min(1, cores / running); the same readiness rules as the one-processor-per-stage
    loop decide when an action may start."""
    d = len(schedule)
    ptr = [0] * d
    running: Dict[int, List] = {}  # stage -> [action, start, remaining work]
    channels: Dict[Tuple[int, int], Deque[Tuple[Action, float]]] = {}
    state = _RunState(executed=[[] for _ in range(d)])
    step_ends: Dict[int, List[float]] = {}
    now = 0.0

    def finish(s: int, a: Action, start: float, end: float) -> None:
        state.executed[s].append(_Executed(ptr[s], a, start, end))
        if a.op is Op.STEP and deferred_steps:
            step_ends.setdefault(a.batch, []).append(end)
        if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
            channels.setdefault((s, a.peer), deque()).append((a, end + latency(a)))
        ptr[s] += 1

    def start(s: int, a: Action) -> None:
        work = float(cost(a))
        if work > 0:
            running[s] = [a, now, work]
        else:
            finish(s, a, now, now)

    def ready(s: int) -> bool:
        """Whether stage ``s``'s next action may start at ``now``."""
        a = schedule[s][ptr[s]]
        if a.op in RECV_OPS:
            queue = channels.get((a.peer, s))
            if not queue or queue[0][1] > now:
                return False
            why = _mismatch(a, ptr[s], queue[0][0])
            if why:
                state.mismatch.setdefault(s, why)
                return False
            queue.popleft()
            return True
        if a.op is Op.STEP and barrier:
            return False
        if deferred_steps and a.op is Op.FORWARD and a.batch is not None and a.batch >= 2:
            return len(step_ends.get(a.batch - 2, ())) >= d
        return True

    while True:
        moved = True
        while moved:  # start all that can start now (zero-cost actions finish at once)
            moved = False
            for s in range(d):
                while (s not in running and s not in state.mismatch
                       and ptr[s] < len(schedule[s]) and ready(s)):
                    start(s, schedule[s][ptr[s]])
                    moved = True
            if barrier and not running and _barrier_ready(schedule, ptr):
                for s in range(d):
                    start(s, schedule[s][ptr[s]])
                moved = True
        arrivals = [t for q in channels.values() for _, t in q if t > now]
        if not running and not arrivals:
            break
        speed = min(1.0, cores / len(running)) if running else 0.0
        step = min((r[2] / speed for r in running.values()), default=float("inf"))
        if arrivals:
            step = min(step, min(arrivals) - now)
        now += step
        for s in sorted(running):
            r = running[s]
            r[2] -= step * speed
            if r[2] <= 1e-12 * max(1.0, step):
                del running[s]
                finish(s, r[0], r[1], now)
    for s in range(d):
        if ptr[s] < len(schedule[s]):
            state.blocked[s] = state.mismatch.get(s) or _why_blocked(schedule, ptr, s, barrier)
    return state


def _mismatch(recv: Action, index: int, sent: Action) -> Optional[str]:
    """Why receive ``recv`` (at ``index`` in its stage's list) must not take the message
    of ``sent``, the oldest on its channel; None when they match."""
    if sent.microbatch == recv.microbatch and (sent.op is Op.SEND_ACT) == (
            recv.op is Op.RECV_ACT):
        return None
    return (f"message mismatch: {recv} (index {index}) on stage {recv.stage} would receive "
            f"the message of {sent} (messages on a channel are matched in send order)")


def _barrier_ready(schedule: Schedule, ptr: List[int]) -> bool:
    heads = []
    for s, actions in enumerate(schedule):
        if ptr[s] >= len(actions) or actions[ptr[s]].op is not Op.STEP:
            return False
        heads.append(actions[ptr[s]].batch)
    return all(h == heads[0] for h in heads)


def _why_blocked(schedule: Schedule, ptr: List[int], s: int, step_barrier: bool) -> str:
    a = schedule[s][ptr[s]]
    if a.op in RECV_OPS:
        src = _channel(a)[0]
        return f"{a} (index {ptr[s]}) waits for a message from stage {src}"
    if a.op is Op.STEP and step_barrier:
        elsewhere = []
        for t, actions in enumerate(schedule):
            if t == s:
                continue
            where = str(actions[ptr[t]]) if ptr[t] < len(actions) else "finished"
            elsewhere.append(f"stage {t} at {where}")
        return f"{a} (index {ptr[s]}) waits at the step barrier; " + ", ".join(elsewhere)
    return f"{a} (index {ptr[s]})"


@dataclass
class SimResult:
    """What a simulated run did and how well.

    ``busy_time[s]`` counts forward/backward time only; ``peak_in_flight[s]`` is the most
    microbatches whose forward ran on stage ``s`` and whose backward had not yet
    (activation stashes); ``peak_weight_versions[s]`` the number of distinct weight
    buffers stage ``s`` used (2 for 2BW over two or more batches, else 1).
    """

    events: List[TraceEvent]
    makespan: float
    busy_time: List[float]
    peak_in_flight: List[int]
    peak_weight_versions: List[int]
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.busy_time)

    @property
    def bubble_fraction(self) -> float:
        """1 - (forward+backward time summed over stages) / (d * makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy_time) / (self.num_stages * self.makespan)

    def throughput(self, samples_per_microbatch: float = 1.0) -> float:
        """Samples per time unit: microbatches through the pipeline x their size / makespan."""
        if self.makespan <= 0:
            return float("inf")
        return self.num_microbatches * samples_per_microbatch / self.makespan

    def peak_stashed(self, bytes_per_microbatch: Union[Callable[[int], float], float]
                     ) -> List[float]:
        """Peak activation-stash memory per stage (``bytes_per_microbatch(stage)`` each)."""
        per = bytes_per_microbatch if callable(bytes_per_microbatch) else (
            lambda _s, b=float(bytes_per_microbatch): b)
        return [n * float(per(s)) for s, n in enumerate(self.peak_in_flight)]


def simulate(schedule: Schedule, cost: CostFn, *, comm_latency: Union[CostFn, float] = 0.0,
             step_barrier: bool = True, deferred_steps: bool = False,
             cores: Optional[float] = None) -> SimResult:
    """Run all stages' action lists against ``cost`` (see the module docstring).

    ``cost(action)`` is the time the stage is occupied by the action; ``comm_latency`` (a
    number, or a function of the send action) the delay between a send being posted and
    the message being available to the receiver.  ``cores`` (fewer than the stages):
    the stages share that many processors.  Raises ``DeadlockError`` when stuck.
    """
    state = run_schedule(schedule, cost, comm_latency, step_barrier, deferred_steps, cores)
    if state.mismatch:
        lines = [why for _, why in sorted(state.mismatch.items())]
        raise ScheduleError("\n".join(lines) + "\n" + render_grid(state, len(schedule)))
    if state.blocked:
        lines = [f"stage {s}: {why}" for s, why in sorted(state.blocked.items())]
        raise DeadlockError("schedule deadlocks:\n" + "\n".join(lines) + "\n"
                            + render_grid(state, len(schedule)))
    return _result(schedule, state)


def _result(schedule: Schedule, state: _RunState) -> SimResult:
    events: List[TraceEvent] = []
    busy, peaks, buffers_used = [], [], []
    for s, executed in enumerate(state.executed):
        has_backward = {e.action.microbatch for e in executed if e.action.op is Op.BACKWARD}
        live = peak = 0
        buffers: Set[Optional[int]] = set()
        for e in executed:
            a = e.action
            events.append(TraceEvent(rank=s, stage=s, action=str(a), op=a.op.value,
                                     microbatch=a.microbatch, batch=a.batch, start=e.start,
                                     end=e.end, version=a.version))
            if a.op is Op.FORWARD:
                buffers.add(a.buffer)
                if a.microbatch in has_backward:
                    live += 1
                    peak = max(peak, live)
            elif a.op is Op.BACKWARD:
                live -= 1
        busy.append(sum(e.end - e.start for e in executed if is_compute(e.action)))
        peaks.append(peak)
        buffers_used.append(len(buffers))
    makespan = max((e.end for e in events), default=0.0)
    num_mb = len({a.microbatch for a in schedule[0] if a.op is Op.FORWARD}) if schedule else 0
    return SimResult(events=events, makespan=makespan, busy_time=busy, peak_in_flight=peaks,
                     peak_weight_versions=buffers_used, num_microbatches=num_mb)


def _find_mark(state: _RunState, mark: Tuple[int, int]) -> Tuple[Optional[_Executed], str]:
    """The compute box to highlight for ``mark`` and a line naming the marked action."""
    stage, index = mark
    if not 0 <= stage < len(state.executed):
        return None, f"marked: stage {stage} does not exist"
    executed = state.executed[stage]
    target = next((e for e in executed if e.index == index), None)
    if target is None:
        return None, f"marked: stage {stage}, action index {index} (never ran)"
    a = target.action
    note = f"marked: stage {stage}, action index {index} ({a})"
    if is_compute(a):
        return target, note
    if a.op in RECV_OPS or a.op in (Op.SEND_ACT, Op.SEND_GRAD):
        op = Op.FORWARD if a.op in (Op.SEND_ACT, Op.RECV_ACT) else Op.BACKWARD
        owner = next((e for e in executed
                      if e.action.op is op and e.action.microbatch == a.microbatch), None)
        return owner, note
    before = [e for e in executed if e.index < index and is_compute(e.action)]
    return (before[-1] if before else None), note


def render_grid(state: _RunState, num_stages: int,
                mark: Optional[Tuple[int, int]] = None) -> str:
    """Stage-by-time text grid of the compute actions of a (possibly partial) run.

    Each column is one time unit (meant for integer unit costs: a backward of cost 2 is
    one box two columns wide); ``.`` is idle.  ``mark=(stage, index)`` surrounds that
    action with ``>>`` ``<<``; a send/recv marks the F or B it belongs to, a
    REDUCE_GRADS/STEP the compute action before it; a note under the grid names it.
    """
    compute = [[e for e in ex if is_compute(e.action)] for ex in state.executed]
    flat = [e for row in compute for e in row]
    horizon = int(round(max((e.end for e in flat), default=0.0)))
    marked: Optional[_Executed] = None
    notes: List[str] = []
    if mark is not None:
        marked, note = _find_mark(state, mark)
        notes.append(note)
    width = max((len(e.action.short) for e in flat), default=2) + (4 if marked else 0)
    lines = []
    for s in range(num_stages):
        cells = [" " * (width - 1) + "." for _ in range(horizon)]
        for e in compute[s]:
            lo, hi = int(round(e.start)), max(int(round(e.end)), int(round(e.start)) + 1)
            label = e.action.short
            if e is marked:
                label = f">>{label}<<"
            span = (hi - lo) * (width + 1) - 1
            cells[lo] = label.center(span) if hi - lo > 1 else label.rjust(width)
            for t in range(lo + 1, min(hi, horizon)):
                cells[t] = None
        lines.append((f"stage {s:>2} | " + " ".join(c for c in cells if c is not None)).rstrip())
    for s, why in sorted(state.blocked.items()):
        notes.append(f"stage {s} stuck: {why}")
    return "\n".join(lines + notes)

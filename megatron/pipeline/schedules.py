"""Pipeline schedules as data: one ordered action list per stage.

``build_schedule(name, d, m, num_batches)`` returns ``schedule[s]``, the actions stage
``s`` performs over one *segment* of ``num_batches`` batches of ``m`` microbatches each
(a segment ends with a drain: evaluation, checkpoint or exit).  Microbatch ids are
0-indexed and global in the segment; microbatch ``k`` is in batch ``k // m``.  The paper
numbers inputs from 1: its input ``k`` is our microbatch ``k - 1``.

Schedules (d stages, m microbatches per batch):

``none``   no pipelining: each stage runs F0 B0 F1 B1 ...; the data dependencies let only
           one microbatch be in the pipeline at a time.
``gpipe``  per batch all m forwards, then all m backwards *in the same order* 0..m-1 (as
           GPipe and Megatron do), then REDUCE_GRADS and STEP: a flush per batch.
``flush``  PipeDream-Flush (1F1B): per batch, stage s runs min(d-s-1, m) warm-up forwards,
           then forward/backward pairs, then the cool-down backwards; flush per batch.
``2bw``    PipeDream-2BW: one 1F1B over all microbatches of the segment, no flush between
           batches.  Microbatch k uses weight version ``max(k // m - 1, 0)`` for forward
           and backward; batch b's weights live in executor buffer ``b % 2`` and
           ``STEP(b)`` overwrites that buffer with version b+1.  Needs m >= d.

Communication is explicit: RECV_ACT(k) right before F(k) on s > 0, SEND_ACT(k) right after
it on s < d-1, RECV_GRAD(k) right before B(k) on s < d-1, SEND_GRAD(k) right after it on
s > 0.  REDUCE_GRADS(b) follows the last backward of batch b on the stage.

Where STEP goes.  STEP(b) is a barrier across all stages (global gradient norm, fp16
overflow flag, tied embeddings are all-reduced in it).  With a flush the barrier costs
nothing: every stage waits for the flush anyway.  Under 2BW, putting STEP(b) right after
batch b's last backward on every stage (``step_placement="eager"``) would stall the
last stage at every batch until the backward wave reaches stage 0, ~(d-1) backward times.
But version b+1 is first needed by batch b+2, so STEP(b) may be anywhere between batch
b's REDUCE_GRADS and batch b+2's first forward.  The default ``"aligned"`` placement
puts it, on each stage, at the first point that stage reaches no earlier than one
forward/backward pair (3 units) before stage 0 starts batch b+2 (times from a unit-cost
run, F=1, B=2; the moment stage 0 finishes batch b where that is later, as when m = d,
and at the end of the segment).  Every stage then arrives at the step's agreement about
one pair before stage 0 needs it, and a stage's gradient all-reduce, waited on at its
STEP, has until then to run beside its compute (the executor begins stage 0's update
just before batch b+2 whatever its STEP's place: ``Updater.step`` in
``megatron.pipeline.update``).  Before 2026-11-24 the target was the moment stage 0
finishes batch b, which left the later stages' all-reduces only the earlier stages'
remaining backward passes to hide behind.
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.pipeline.actions import Action, Op, is_compute
from megatron.pipeline.simulator import render_grid, run_schedule, unit_cost

SCHEDULES = ("none", "gpipe", "flush", "2bw")
STEP_PLACEMENTS = ("aligned", "eager")

Schedule = List[List[Action]]
# A stage's plan before communication is added: (op, microbatch or batch).
_Plan = List[Tuple[Op, int]]


def weight_version_2bw(k: int, m: int) -> int:
    """Weight version used by microbatch ``k`` (0-indexed) under 2BW with m per batch.

    Paper: input k (1-indexed) uses max(floor((k-1)/m) - 1, 0).
    """
    return max(k // m - 1, 0)


def weight_version(name: str, k: int, m: int) -> int:
    """Weight version microbatch ``k`` uses (segment-relative: 0 = weights at its start)."""
    return weight_version_2bw(k, m) if name == "2bw" else k // m


def weight_buffer(name: str, batch: int) -> int:
    """Executor weight buffer of ``batch``: ``batch % 2`` under 2BW, else always 0."""
    return batch % 2 if name == "2bw" else 0


def _check_args(name: str, d: int, m: int, num_batches: int) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"build_schedule: unknown schedule {name!r} (--pipeline-schedule); "
                         f"expected one of {', '.join(SCHEDULES)}")
    for label, value in (("num_stages", d), ("num_microbatches", m),
                         ("num_batches", num_batches)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"build_schedule: {label} must be a positive int, got {value!r}")
    if name == "2bw" and m < d:
        raise ValueError(
            f"PipeDream-2BW needs m >= d (microbatches per batch >= pipeline stages), got "
            f"m={m}, d={d}: raise the global batch size or gradient-accumulation steps, or "
            f"use fewer stages")


def _one_f_one_b(first: int, count: int, warmup: int) -> _Plan:
    """Warm-up forwards, then forward/backward pairs, then cool-down backwards."""
    warmup = min(warmup, count)
    plan: _Plan = [(Op.FORWARD, first + i) for i in range(warmup)]
    for i in range(count - warmup):
        plan += [(Op.FORWARD, first + warmup + i), (Op.BACKWARD, first + i)]
    plan += [(Op.BACKWARD, first + i) for i in range(count - warmup, count)]
    return plan


def _stage_plan(name: str, d: int, m: int, num_batches: int, s: int) -> _Plan:
    """Compute and batch actions of stage ``s`` in order (STEP right after REDUCE_GRADS)."""
    plan: _Plan = []
    if name == "2bw":
        for op, k in _one_f_one_b(0, num_batches * m, d - s - 1):
            plan.append((op, k))
            if op is Op.BACKWARD and k % m == m - 1:
                plan += [(Op.REDUCE_GRADS, k // m), (Op.STEP, k // m)]
        return plan
    for b in range(num_batches):
        first = b * m
        if name == "none":
            for k in range(first, first + m):
                plan += [(Op.FORWARD, k), (Op.BACKWARD, k)]
        elif name == "gpipe":
            plan += [(Op.FORWARD, k) for k in range(first, first + m)]
            plan += [(Op.BACKWARD, k) for k in range(first, first + m)]
        else:
            plan += _one_f_one_b(first, m, d - s - 1)
        plan += [(Op.REDUCE_GRADS, b), (Op.STEP, b)]
    return plan


def _materialize(name: str, d: int, m: int, s: int, plan: _Plan,
                 forward_only: bool) -> List[Action]:
    """Turn a plan into actions with communication, batch, version and buffer filled in."""
    out: List[Action] = []
    for op, n in plan:
        if op in (Op.REDUCE_GRADS, Op.STEP):
            out.append(Action(s, op, batch=n))
            continue
        b = n // m
        version = None if forward_only else weight_version(name, n, m)
        buffer = None if forward_only else weight_buffer(name, b)
        compute = Action(s, op, microbatch=n, batch=b, version=version, buffer=buffer)
        if op is Op.FORWARD:
            if s > 0:
                out.append(Action(s, Op.RECV_ACT, microbatch=n, batch=b, peer=s - 1))
            out.append(compute)
            if s < d - 1:
                out.append(Action(s, Op.SEND_ACT, microbatch=n, batch=b, peer=s + 1))
        else:
            if s < d - 1:
                out.append(Action(s, Op.RECV_GRAD, microbatch=n, batch=b, peer=s + 1))
            out.append(compute)
            if s > 0:
                out.append(Action(s, Op.SEND_GRAD, microbatch=n, batch=b, peer=s - 1))
    return out


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_batches: int = 1,
                   forward_only: bool = False, *,
                   step_placement: str = "aligned") -> Schedule:
    """Action lists, one per stage, for one segment (see the module docstring).

    ``forward_only=True`` (evaluation) gives every stage its forwards 0..B*m-1 in order
    with their sends/receives and nothing else; F actions then carry no version/buffer
    (use the current weights).  ``step_placement`` only matters for ``2bw``.
    """
    d, m = num_stages, num_microbatches
    _check_args(name, d, m, num_batches)
    if step_placement not in STEP_PLACEMENTS:
        raise ValueError(f"build_schedule: step_placement must be one of {STEP_PLACEMENTS}, "
                         f"got {step_placement!r}")
    if forward_only:
        plan: _Plan = [(Op.FORWARD, k) for k in range(num_batches * m)]
        return [_materialize(name, d, m, s, plan, True) for s in range(d)]
    schedule = [_materialize(name, d, m, s, _stage_plan(name, d, m, num_batches, s), False)
                for s in range(d)]
    if name == "2bw" and step_placement == "aligned" and d > 1:
        schedule = _align_steps(schedule, m)
    return schedule


def _align_steps(schedule: Schedule, m: int) -> Schedule:
    """Move each STEP(b) to where every stage is at about the same (unit-cost) time.

    Legal window on each stage: after REDUCE_GRADS(b), before anything of batch b+2.
    A send is never delayed behind a STEP (the receiving stage would stall).
    """
    without = [[a for a in actions if a.op is not Op.STEP] for actions in schedule]
    state = run_schedule(without, unit_cost(), step_barrier=False)
    starts = [[e.start for e in executed] for executed in state.executed]
    # Stage 0 is the last to finish a batch's backwards (the wave runs downstream-up).
    finished: Dict[int, float] = {}
    first_forward: Dict[int, float] = {}
    for e in state.executed[0]:
        if e.action.op is Op.REDUCE_GRADS:
            finished[e.action.batch] = e.start
        elif e.action.op is Op.FORWARD and e.action.microbatch % m == 0:
            first_forward[e.action.batch] = e.start
    pair = 3.0  # one forward (1) and one backward (2) in unit costs
    done_at = {b: max(t, first_forward[b + 2] - pair) if b + 2 in first_forward else t
               for b, t in finished.items()}
    aligned: Schedule = []
    for s, actions in enumerate(without):
        out: List[Action] = []
        pending = deque(sorted(done_at))
        reduced = set()
        for a, start in zip(actions, starts[s]):
            # Never between a compute action and its send: the neighbour waits for it.
            can_insert = a.op is not Op.SEND_ACT and a.op is not Op.SEND_GRAD
            while can_insert and pending and pending[0] in reduced and (
                    start >= done_at[pending[0]]
                    or (a.op is not Op.REDUCE_GRADS and a.batch >= pending[0] + 2)):
                out.append(Action(s, Op.STEP, batch=pending.popleft()))
            out.append(a)
            if a.op is Op.REDUCE_GRADS:
                reduced.add(a.batch)
        out += [Action(s, Op.STEP, batch=b) for b in pending]
        aligned.append(out)
    return aligned


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """Compact text, one line per stage: ``stage 0: 0F0 0SA0 0F1 ...``."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in actions)
                     for s, actions in enumerate(schedule))


def format_grid(schedule: Sequence[Sequence[Action]],
                mark: Optional[Tuple[int, int]] = None, window: Optional[int] = None) -> str:
    """Stage-by-time grid of the compute actions (unit-cost run: F=1, B=2).

    ``mark=(stage, index into that stage's list)`` is shown as ``>>F5<<`` (a marked
    send/recv/step highlights the next compute action of its stage and is named below
    the grid): the executor prints this when an action fails.  Works on schedules that
    deadlock too; the stuck stages are listed under the grid.

    ``window``: show only about that many time units either side of the marked action
    (of the end of the run when nothing is marked), all stages, with a note of how many
    units were cut; a long segment's full grid is tens of kilobytes per line.
    """
    state = run_schedule(schedule, unit_cost(), step_barrier=True)
    text = render_grid(state, len(schedule), mark)
    if window is None:
        return text
    labels = [len(a.short) for actions in schedule for a in actions if is_compute(a)]
    unit = max(labels, default=2) + (4 if mark is not None else 0) + 1
    return _crop_grid(text, window, unit)


def _crop_grid(text: str, window: int, unit: int) -> str:
    """Cut every ``stage NN | ...`` line of a rendered grid to the same column range:
    ``window`` units of ``unit`` characters either side of the ``>>`` mark."""
    lines = text.split("\n")
    rows = [i for i, line in enumerate(lines) if line.startswith("stage ") and " | " in line]
    if not rows:
        return text
    prefix = lines[rows[0]].index(" | ") + 3
    length = max(len(lines[i]) for i in rows)
    marked = next((lines[i].index(">>") for i in rows if ">>" in lines[i]), length)
    lo = max(prefix, marked - window * unit)
    hi = min(length, marked + (window + 1) * unit)
    if lo == prefix and hi == length:
        return text
    for i in rows:
        body = lines[i].ljust(length)[lo:hi]
        # Do not start or end inside a label cut in two.
        if lo > prefix and lines[i][lo - 1:lo].strip() and body[:1].strip():
            body = " " * (len(body.split(" ", 1)[0])) + body[len(body.split(" ", 1)[0]):]
        if hi < length and lines[i][hi:hi + 1].strip() and body[-1:].strip():
            tail = body.rsplit(" ", 1)[-1]
            body = body[:len(body) - len(tail)] + " " * len(tail)
        lines[i] = (lines[i][:prefix] + ("... " if lo > prefix else "")
                    + body + (" ..." if hi < length else "")).rstrip()
    left, right = (lo - prefix) // unit, max(0, length - hi) // unit
    around = "the marked action" if marked < length else "the end of the run"
    lines.insert(rows[-1] + 1, f"(grid cut to {window} time units either side of {around}: "
                               f"about {left} units left and {right} right not shown)")
    return "\n".join(lines)


def compute_order(actions: Sequence[Action]) -> str:
    """Only the compute actions of one stage, short form: ``F0 F1 B0 F2 B1 ...``."""
    return " ".join(a.short for a in actions if is_compute(a))

"""One stage's action list for a segment, built once per segment shape.

A training run asks for the same segments over and over: the training loop ends a
segment at every drain point (2BW: every 100 batches by default; flush/gpipe/none: every
10, where the skip monitor could first stop the run), and every evaluation runs the same
forward-only schedule.  ``build_schedule`` makes every stage's list and, for 2BW, places
the optimizer steps by simulating them: a 100-batch 2BW segment took 1.2 s of CPU on
each rank at d=8, m=64 and 6.1 s at d=16, m=128 before its first action
(``bench/segment_setup.py``, bench/results/segment_setup.json).  The
schedule of a segment depends only on (schedule, d, m, batches, forward-only), and its
actions are immutable with batch-relative indices, so the executor keeps this stage's
list of the last few shapes (``StagePlans``) and builds each shape once.  Only this
stage's list is kept (about 110 bytes an action); the failure report, which draws every
stage, builds the whole schedule again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Tuple

from megatron.pipeline.actions import Action, Op
from megatron.pipeline.schedules import Schedule, build_schedule

PlanKey = Tuple[str, int, int, int, bool]
"""(schedule name, stages d, microbatches m, batches, forward only)."""


@dataclass(frozen=True)
class StagePlan:
    """This stage's actions of one segment shape, with the counts the executor announces
    to its data reader, updater and receiver before running them."""

    key: PlanKey
    actions: Tuple[Action, ...]
    forwards: int
    reduces: int
    steps: int
    act_receives: int
    grad_receives: int

    @classmethod
    def of(cls, key: PlanKey, actions: Tuple[Action, ...]) -> "StagePlan":
        counts = {op: 0 for op in Op}
        for a in actions:
            counts[a.op] += 1
        return cls(key=key, actions=actions, forwards=counts[Op.FORWARD],
                   reduces=counts[Op.REDUCE_GRADS], steps=counts[Op.STEP],
                   act_receives=counts[Op.RECV_ACT], grad_receives=counts[Op.RECV_GRAD])

    def full_schedule(self) -> Schedule:
        """Every stage's lists of this shape (built again: for failure reports)."""
        name, d, m, batches, forward_only = self.key
        return build_schedule(name, d, m, batches, forward_only=forward_only)


class StagePlans:
    """The ``StagePlan`` of one stage for the last ``size`` segment shapes asked for."""

    def __init__(self, stage: int, size: int = 4) -> None:
        if size < 1:
            raise ValueError(f"StagePlans: size must be at least 1, got {size}")
        self.stage = stage
        self.size = size
        self._plans: "OrderedDict[PlanKey, StagePlan]" = OrderedDict()
        self.builds = 0
        """Schedules built so far (a test and the bench read it)."""

    def get(self, name: str, num_stages: int, num_microbatches: int, num_batches: int,
            forward_only: bool = False) -> StagePlan:
        key: PlanKey = (name, num_stages, num_microbatches, num_batches, forward_only)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        schedule = build_schedule(name, num_stages, num_microbatches, num_batches,
                                  forward_only=forward_only)
        self.builds += 1
        plan = StagePlan.of(key, tuple(schedule[self.stage]))
        self._plans[key] = plan
        if len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan

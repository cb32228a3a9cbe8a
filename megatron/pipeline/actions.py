"""The vocabulary of pipeline schedules: small, immutable, printable actions.

A schedule is a list of actions per pipeline stage (see ``schedules.py``).  The same
lists are run by the executor on real process groups, by the simulator against a cost
model, checked by the validator and drawn by the timeline plotter, so an action carries
everything each of them needs and nothing else.

Microbatch ids are 0-indexed and global within a *segment* (the stretch of training
between two pipeline drains): microbatch ``k`` belongs to batch ``k // m``.  The paper
counts microbatches from 1; its input ``k`` is our microbatch ``k - 1``.

Compact text form (stage first, then the kind, then the microbatch or ``@batch``):

=========  ===========================================================
``2F5``    stage 2, forward of microbatch 5
``2B5``    stage 2, backward of microbatch 5
``2SA5``   stage 2 sends the output activation of microbatch 5 to stage 3
``2RA5``   stage 2 receives the input activation of microbatch 5 from stage 1
``2SG5``   stage 2 sends the input gradient of microbatch 5 to stage 1
``2RG5``   stage 2 receives the output gradient of microbatch 5 from stage 3
``2R@1``   stage 2 all-reduces its weight gradients of batch 1 over data-parallel replicas
``2S@1``   stage 2 optimizer step closing batch 1 (a new weight version)
=========  ===========================================================
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional


class Op(enum.Enum):
    """What one action does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    REDUCE_GRADS = "R@"
    STEP = "S@"

    # Members are singletons, so identity hashing is correct; Enum's default hashes the
    # name in Python code, which dominated the cost of simulating large schedules.
    __hash__ = object.__hash__


COMPUTE_OPS = frozenset({Op.FORWARD, Op.BACKWARD})
SEND_OPS = frozenset({Op.SEND_ACT, Op.SEND_GRAD})
RECV_OPS = frozenset({Op.RECV_ACT, Op.RECV_GRAD})
COMM_OPS = SEND_OPS | RECV_OPS
BATCH_OPS = frozenset({Op.REDUCE_GRADS, Op.STEP})


class ScheduleError(ValueError):
    """A schedule breaks a rule the executor relies on (order, matching, versions...)."""

_CODE_TO_OP = {op.value: op for op in Op}
# Enum's ``.value`` is a Python-level property; a plain dict keeps __str__ cheap.
_OP_CODE = {op: op.value for op in Op}
_ACTION_RE = re.compile(r"^(\d+)(F|B|SA|RA|SG|RG|R@|S@)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one pipeline stage.

    ``microbatch`` is set for compute and communication actions, ``batch`` for all
    actions of a training schedule (``k // m`` for microbatch actions).  ``version`` (the
    weight version the forward/backward must use) and ``buffer`` (which of the
    executor's weight buffers holds it) are set on F/B only; forward-only schedules
    leave them ``None``, meaning "the current weights".  ``peer`` is the other stage of
    a send/recv.
    """

    stage: int
    op: Op
    microbatch: Optional[int] = None
    batch: Optional[int] = None
    version: Optional[int] = None
    buffer: Optional[int] = None
    peer: Optional[int] = None

    def __str__(self) -> str:
        number = self.batch if self.op in BATCH_OPS else self.microbatch
        return f"{self.stage}{_OP_CODE[self.op]}{number}"

    @property
    def short(self) -> str:
        """The form without the stage prefix (``F5``, ``S@1``), for per-stage pictures."""
        return str(self)[len(str(self.stage)):]


def is_compute(action: Action) -> bool:
    """True for forward and backward passes (the actions that occupy the accelerator)."""
    return action.op in COMPUTE_OPS


def is_comm(action: Action) -> bool:
    """True for point-to-point sends and receives."""
    return action.op in COMM_OPS


def peer_of(stage: int, op: Op) -> Optional[int]:
    """The stage on the other end of a send/recv of kind ``op`` issued by ``stage``."""
    if op in (Op.SEND_ACT, Op.RECV_GRAD):
        return stage + 1
    if op in (Op.RECV_ACT, Op.SEND_GRAD):
        return stage - 1
    return None


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``: ``"2SA5"`` -> ``Action(2, Op.SEND_ACT, 5, peer=3)``.

    Only what the text holds comes back: stage, op, microbatch (or batch for ``R@``/``S@``)
    and the peer implied by the op.  ``batch``/``version``/``buffer`` of microbatch
    actions depend on the schedule and are left ``None``.
    """
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(
            f"parse_action: cannot read {text!r}; expected <stage><F|B|SA|RA|SG|RG><microbatch>"
            " or <stage><R@|S@><batch>, e.g. '2F5' or '0S@1'")
    stage, op = int(match.group(1)), _CODE_TO_OP[match.group(2)]
    number = int(match.group(3))
    if op in BATCH_OPS:
        return Action(stage, op, batch=number)
    return Action(stage, op, microbatch=number, peer=peer_of(stage, op))

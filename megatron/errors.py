"""Errors a user can fix, and how entry points report them.

``UserError`` is raised for a problem with the user's input: a flag, a data file, a
checkpoint.  Its message is ONE line that names the flag or file, what was expected
and what was found.  Entry points catch it (see ``megatron.training.run_entry_point``
once it exists) and print ``error: <message>`` without a traceback; ``--debug`` shows
the traceback too.
"""
from __future__ import annotations

import os
import time


class UserError(Exception):
    """A problem with the user's flags, data or checkpoint; the message is one line."""

    every_rank_alike = False
    """True where every rank of a job raises the same error (it depends on the command
    line, the world size and what a node sees: its files, its GPUs): only local rank 0
    of each node prints it (``prints_for_its_node``), instead of one copy per rank in
    torchrun's output.  The other ranks exit with the same code, silently."""


def alike_on_every_rank(err: UserError) -> UserError:
    """``err``, marked ``every_rank_alike`` (one line per node prints it); returned, so
    ``raise alike_on_every_rank(UserError(...))`` reads as one statement."""
    err.every_rank_alike = True
    return err


def prints_for_its_node() -> bool:
    """True on local rank 0 (LOCAL_RANK, else RANK, else no launcher): the rank that
    prints an error every rank of its node raises.  One line per node, so a cause only
    one node has (a missing file, an unwritable directory) is still printed."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


SILENT_RANK_WAIT_S = 5.0
"""How long a rank that leaves an error to its node's local rank 0 waits before exiting."""


def let_the_printing_rank_go_first() -> None:
    """Called by a rank about to exit silently on an error its node's local rank 0 prints:
    under torchrun (LOCAL_WORLD_SIZE > 1) it waits up to ``SILENT_RANK_WAIT_S`` first.
    torchrun stops the other workers (SIGTERM) as soon as one fails, so a silent rank
    that got there first killed local rank 0 before it printed: a float ``.idx`` given
    to 2 ranks printed no error line in 2 of 6 runs.  Local rank 0 meets the same error
    and exits, and torchrun then ends this wait, so the run does not take longer."""
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_ranks = 1
    if local_ranks > 1 and not prints_for_its_node():
        time.sleep(SILENT_RANK_WAIT_S)


def exit_once_per_node(*lines: str, code: int = 2) -> None:
    """Exit with ``code`` on an error every rank meets alike (flags, task files): its node's
    local rank 0 prints ``lines`` to stderr, the other ranks print nothing and first let
    it do so (``let_the_printing_rank_go_first``)."""
    import sys

    if prints_for_its_node():
        for line in lines:
            print(line, file=sys.stderr, flush=True)
    else:
        let_the_printing_rank_go_first()
    sys.exit(code)


class DataError(UserError):
    """A dataset file (.bin/.idx, index cache, JSON corpus) is missing, corrupt or empty."""


class CheckpointError(UserError):
    """A checkpoint is missing, corrupt, unsafe to load, or does not fit this run."""


def check_parents_are_directories(flag: str, path: str) -> None:
    """Something will be created at ``path``: a file where one of its parent directories
    should be is one error naming ``flag`` now, not an OSError traceback later."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {path}: {parent} is a file; expected a directory path")

"""Errors a user can fix, and how entry points report them.

``UserError`` is raised for a problem with the user's input: a flag, a data file, a
checkpoint.  Its message is ONE line that names the flag or file, what was expected
and what was found.  Entry points catch it (see ``megatron.training.run_entry_point``
once it exists) and print ``error: <message>`` without a traceback; ``--debug`` shows
the traceback too.
"""
from __future__ import annotations

import os


class UserError(Exception):
    """A problem with the user's flags, data or checkpoint; the message is one line."""

    every_rank_alike = False
    """True where every rank of a job raises the same error (it depends only on the
    command line and the world size): only rank 0 prints it, instead of one copy per
    rank in torchrun's output.  The other ranks exit with the same code, silently."""


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

"""``ArgumentError`` and the small helpers every argument check raises through (the
``megatron.argument_checks`` package and the entry-point checks of
``megatron.arguments``)."""
from __future__ import annotations

import argparse

from megatron.errors import UserError


class ArgumentError(UserError, ValueError):
    """An inconsistent or incomplete command line; the message names the flag(s)."""

    every_rank_alike = True


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ArgumentError(message)


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def require_positive(args: argparse.Namespace, *dests: str, allow_none: bool = True) -> None:
    for dest in dests:
        value = getattr(args, dest)
        if value is None and allow_none:
            continue
        require(value is not None and value > 0,
                f"{flag_of(dest)} must be a positive number, got {value}")

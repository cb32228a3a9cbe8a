"""Checks shared by the argument tests: a bad command line is one ``error:`` line."""
from __future__ import annotations

from typing import List

import pytest

from megatron.arguments import ArgumentError, parse_and_validate, parse_args, validate_args


def assert_one_line_error(argv: List[str], expected: str, capsys, monkeypatch) -> None:
    """``validate_args`` raises an ArgumentError starting with ``expected`` on one line,
    and the entry point prints it as one ``error:`` line and exits 2."""
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(argv), 1)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + expected) and err.count("\n") == 1

"""The command-line surface is frozen in golden_cli_flags.txt.

Adding, removing or regrouping a flag must be a conscious change: update the golden
file in the same commit.  Regenerate it with

    PYTHONPATH=. python tests/unit/test_cli_surface.py --regenerate
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

GOLDEN = Path(__file__).resolve().parent / "golden_cli_flags.txt"
REGENERATE = "PYTHONPATH=. python tests/unit/test_cli_surface.py --regenerate"


def cli_surface() -> List[str]:
    """One line per flag: 'group | --flag | choices', in parser order."""
    from megatron.arguments import build_parser

    parser = build_parser()
    lines = []
    for group in parser._action_groups:  # argparse exposes groups only privately
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            choices = ",".join(str(c) for c in action.choices) if action.choices else ""
            for flag in action.option_strings:
                lines.append(f"{group.title} | {flag} | {choices}".rstrip(" |"))
    return lines


def test_cli_flags_match_golden():
    current = cli_surface()
    golden = GOLDEN.read_text().splitlines()
    added = sorted(set(current) - set(golden))
    removed = sorted(set(golden) - set(current))
    assert current == golden, (
        f"CLI surface changed.\n  added: {added}\n  removed: {removed}\n"
        f"If intended, regenerate the golden file:\n  {REGENERATE}")


def test_required_flags_present():
    flags = {line.split(" | ")[1] for line in cli_surface()}
    for flag in ("--num-layers", "--pipeline-schedule", "--recompute-activations", "--fp64",
                 "--timeline-file", "--mock-data", "--tokenizer-type", "--lr-warmup-fraction"):
        assert flag in flags
    assert len(flags) == len(cli_surface()), "a flag is registered twice"


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {REGENERATE}")
    GOLDEN.write_text("\n".join(cli_surface()) + "\n")
    print(f"wrote {GOLDEN}")

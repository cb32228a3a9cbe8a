"""Shared by checkpoint_util.py's exports (``--to-hf``: ``megatron.hf_interop``;
``--to-megatron``: ``megatron.megatron_lm_export``): the output directory's checks
(new or empty, outside --load) and the final rename of the staging directory into place;
and ``say``, the script's one-line notes on stderr (the imports use it too).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from megatron.checkpoint_convert import check_not_a_file, check_outside
from megatron.errors import UserError


def say(line: str) -> None:
    print(f"checkpoint_util.py: {line}", file=sys.stderr)


def check_export_path(load: Optional[str], out_dir: str, flag: str = "--to-hf") -> None:
    """``flag``'s directory (--to-hf, --to-megatron) must be new or empty and outside
    --load: the export replaces it as a whole, so nothing of another model (stale
    tokenizer files, another checkpoint's shards) can stay behind."""
    check_outside(load, out_dir, "--load", flag)
    check_not_a_file(flag, out_dir)
    try:
        entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    except OSError as exc:
        raise UserError(f"{flag} {out_dir}: cannot list it ({exc.strerror}); expected a new "
                        f"or empty directory") from None
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"{flag} {out_dir}: expected a new or empty directory, found one "
                        f"holding {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                        f"({shown}); remove it or choose another {flag}")


def publish_export(staging: str, out_dir: str, flag: str = "--to-hf") -> None:
    """Rename the finished ``staging`` directory to ``out_dir`` (new or empty)."""
    try:
        os.replace(staging, out_dir)  # replaces an empty directory; never a non-empty one
    except OSError as exc:
        raise UserError(f"{flag} {out_dir}: cannot move the export into place "
                        f"({exc.strerror or type(exc).__name__}); expected a new or empty "
                        f"directory") from None

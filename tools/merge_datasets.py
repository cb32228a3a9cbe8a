"""Concatenate every ``.bin``/``.idx`` dataset in a directory into one, as Megatron-LM's
``tools/merge_datasets.py``.

    python tools/merge_datasets.py --input DIR --output-prefix OUT

reads each prefix of DIR in sorted order (every ``.bin`` needs its ``.idx`` and the other
way round) and writes ``OUT.bin``/``OUT.idx``: their sequences and documents back to back,
in the dtype of the first (all must share it).  Nothing is written when an input is
missing its pair, is corrupt or has another dtype.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments import OneLineParser  # noqa: E402
from megatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,  # noqa: E402
                                           data_file_path, index_file_path)
from megatron.entry import exit_with_user_error  # noqa: E402
from megatron.errors import DataError, UserError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True,
                   help="directory holding the .bin/.idx pairs to merge")
    p.add_argument("--output-prefix", required=True,
                   help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    return p


def input_prefixes(directory: str) -> List[str]:
    """Sorted prefixes of the ``.bin``/``.idx`` pairs in ``directory``."""
    if not os.path.isdir(directory):
        raise UserError(f"--input {directory}: not a directory (expected one holding "
                        f".bin/.idx pairs)")
    prefixes = set()
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext not in (".bin", ".idx") or not os.path.isfile(os.path.join(directory, name)):
            continue
        other = os.path.join(directory, stem + (".idx" if ext == ".bin" else ".bin"))
        if not os.path.isfile(other):
            raise DataError(f"--input {directory}: {name} has no {os.path.basename(other)} "
                            f"beside it")
        prefixes.add(stem)
    if not prefixes:
        raise DataError(f"--input {directory}: no .bin/.idx pairs to merge")
    return [os.path.join(directory, s) for s in sorted(prefixes)]


def merge(prefixes: List[str], output_prefix: str) -> None:
    first = IndexedDataset(prefixes[0])
    for prefix in prefixes[1:]:
        ds = IndexedDataset(prefix)  # every input checked before anything is written
        if ds.dtype != first.dtype:
            raise DataError(f"{index_file_path(prefix)}: dtype {ds.dtype}; expected "
                            f"{first.dtype} as {index_file_path(prefixes[0])} (datasets of "
                            f"one tokenizer share it)")
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(data_file_path(output_prefix), first.dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(output_prefix))
    except BaseException:
        builder.abort()
        raise
    print(f"Merged {len(prefixes)} datasets into {output_prefix}.bin/.idx", flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        prefixes = input_prefixes(args.input)
        out = os.path.abspath(args.output_prefix)
        if any(os.path.abspath(p) == out for p in prefixes):
            raise UserError(f"--output-prefix {args.output_prefix}: is one of the inputs")
        merge(prefixes, args.output_prefix)
    except (UserError, OSError) as exc:
        exit_with_user_error(exc)


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

"""Checks of the training data (--data-path and the per-split paths, their .bin/.idx
files, --split) and of the tokenizer and the files it needs; a bare --vocab-size or the
entry point's default fills tokenizer_type.  Run by
``megatron.argument_checks.validate_args``.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path
from typing import List, Optional, Sequence

from megatron.argument_checks.errors import require
from megatron.config import SPLIT_PATH_FLAGS
from megatron.data.dataset_utils import is_number  # what --data-path reads as a weight


def _data_prefixes(data_path: Sequence[str], flag: str = "--data-path") -> List[str]:
    """Prefixes named by --data-path (or ``flag``, a per-split path flag), checking the
    weighted 'w1 p1 w2 p2' form."""
    if not any(is_number(item) for item in data_path):
        return list(data_path)
    require(len(data_path) % 2 == 0,
            f"{flag} in weighted form must alternate weight and prefix "
            f"('0.3 a 0.7 b'), got {len(data_path)} entries: {' '.join(data_path)}")
    prefixes = []
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        require(is_number(weight) and not is_number(prefix),
                f"{flag} in weighted form must alternate weight and prefix "
                f"('0.3 a 0.7 b'), got '{weight} {prefix}'")
        require(float(weight) > 0 and math.isfinite(float(weight)),
                f"{flag} weights must be positive, got {weight} for {prefix}")
        prefixes.append(prefix)
    return prefixes


def _parse_split(split: str) -> List[float]:
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    require(1 <= len(parts) <= 3 and all(is_number(p) for p in parts),
            f"--split must be up to three numbers 'train, valid, test' (e.g. '969, 30, 1'), "
            f"got '{split}'")
    values = [float(p) for p in parts]
    require(all(v >= 0 for v in values) and sum(values) > 0,
            f"--split parts must be >= 0 with a positive sum, got '{split}'")
    return values


def check_data(args: argparse.Namespace) -> None:
    require(args.num_workers >= 0, f"--num-workers must be >= 0, got {args.num_workers}")
    require(args.data_path != [], "--data-path was given without any prefix")
    paths = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in
             ("--data-path",) + SPLIT_PATH_FLAGS}
    per_split = [flag for flag in SPLIT_PATH_FLAGS if paths[flag] is not None]
    for flag in per_split:
        require(paths[flag] != [], f"{flag} was given without any prefix")
    has_paths = bool(args.data_path)
    require(not (has_paths and args.mock_data), "--data-path and --mock-data are mutually exclusive")
    if per_split:
        # Megatron-LM's per-split datasets replace --data-path and --split
        require(not has_paths, f"--data-path and {per_split[0]} are mutually exclusive: give "
                f"one dataset (or blend) split by --split, or one per split with "
                f"--train-data-path/--valid-data-path/--test-data-path")
        require(not args.mock_data, f"{per_split[0]} and --mock-data are mutually exclusive")
        require(args.skip_train or args.train_data_path,
                f"training needs data: {' and '.join(per_split)} without --train-data-path "
                f"has no training split; add --train-data-path PREFIX (or --skip-train to "
                f"only evaluate)")
        if "--split" in getattr(args, "flags_given", set()):
            args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
                f"note: --split '{args.split}' is ignored with {' and '.join(per_split)}: each "
                f"split reads its own datasets whole (as in Megatron-LM)"]
    else:
        _parse_split(args.split)
        if not args.skip_train:
            require(has_paths or args.mock_data,
                    "training needs data: give --data-path PREFIX (prefix.bin/.idx made by "
                    "tools/preprocess_data.py) or --mock-data")
    for flag in ["--data-path"] + per_split:
        for prefix in _data_prefixes(paths[flag] or [], flag):
            for suffix in (".bin", ".idx"):
                path = Path(prefix + suffix)
                stem, ext = os.path.splitext(prefix)
                hint = (f"; a prefix names the pair without its extension: {flag} {stem}"
                        if ext in (".bin", ".idx") and not path.exists()
                        and Path(stem + suffix).is_file() else "")
                require(path.is_file(), f"{flag} prefix '{prefix}': file {path} "
                        f"{'is not a regular file' if path.exists() else 'does not exist'}"
                        f"{hint}")


def _require_file(flag: str, path: Optional[str], tokenizer: str) -> None:
    require(path is not None, f"--tokenizer-type {tokenizer} needs {flag}")
    require(Path(path).is_file(), f"{flag} {path} does not exist (needed by --tokenizer-type {tokenizer})")


def check_tokenizer(args: argparse.Namespace, default: Optional[str] = None) -> None:
    # A bare --vocab-size means the synthetic NullTokenizer (handy with --mock-data).
    if args.tokenizer_type is None and args.vocab_size is not None and args.vocab_file is None:
        args.tokenizer_type = "NullTokenizer"
    elif args.tokenizer_type is None and default is not None and (
            args.vocab_file is not None or args.tokenizer_model is not None):
        # Megatron-LM's pretrain_gpt.py / pretrain_bert.py default, which its example
        # scripts rely on (they pass --vocab-file without --tokenizer-type)
        args.tokenizer_type = default
        args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
            f"note: --tokenizer-type {default} (this entry point's default, as in Megatron-LM)"]
    kind = args.tokenizer_type
    if kind is None:
        require(args.skip_train, "--tokenizer-type is required for training (e.g. "
                "GPT2BPETokenizer with --vocab-file and --merge-file, or NullTokenizer with "
                "--vocab-size for --mock-data)")
    elif kind == "GPT2BPETokenizer":
        _require_file("--vocab-file", args.vocab_file, kind)
        _require_file("--merge-file", args.merge_file, kind)
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        _require_file("--tokenizer-model", args.tokenizer_model, kind)
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import is_hub_name

        spec = args.tokenizer_model
        require(spec is not None, f"--tokenizer-type {kind} needs --tokenizer-model (a "
                "tokenizer directory save_pretrained wrote, or a model name)")
        require(Path(spec).is_dir() or is_hub_name(spec),
                f"--tokenizer-model {spec} is not a directory (needed by --tokenizer-type "
                f"{kind}: the directory save_pretrained wrote, or a model name)")
        require(importlib.util.find_spec("transformers") is not None,
                f"--tokenizer-type {kind} needs the transformers package, which is not "
                "installed: pip install transformers")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        _require_file("--vocab-file", args.vocab_file, kind)
    elif kind == "NullTokenizer":
        require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    elif kind == "CharTokenizer" and args.vocab_file is not None:
        _require_file("--vocab-file", args.vocab_file, kind)
    if args.vocab_size is not None:
        require(args.vocab_size > 0, f"--vocab-size must be positive, got {args.vocab_size}")

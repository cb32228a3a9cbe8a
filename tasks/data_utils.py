"""Pieces shared by the finetuning datasets: read reports, BERT pair layout, datasets."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.config import SPLIT_PATH_FLAGS
from megatron.errors import DataError, exit_once_per_node


class TaskDataError(DataError):
    """A --train-data/--valid-data file that cannot be used.  Every rank reads the same
    files from the same flags, so each would print the same line: only local rank 0 of
    each node does (``every_rank_alike``), as for a bad flag."""

    every_rank_alike = True


def fail(message: str) -> None:
    """``error: message`` on stderr and exit 2, for a problem every rank finds alike (the
    flags, the task files): one line per node, as ``megatron.entry`` prints an error
    ``every_rank_alike``, not one per rank in torchrun's output."""
    exit_once_per_node(f"error: {message}")


def refuse_corpus_flags(raw, task: str) -> None:
    """--data-path and --train/--valid/--test-data-path name a pretraining corpus, which
    a task does not read; the trainer's validation blamed --mock-data (the tasks' default,
    which the user never gave): '--data-path and --mock-data are mutually exclusive'."""
    for flag in ("--data-path",) + SPLIT_PATH_FLAGS:
        if getattr(raw, flag[2:].replace("-", "_"), None) is not None:
            fail(f"{flag} names a pretraining corpus (.bin/.idx), which --task {task} does not "
                 f"read: it reads its own files from --train-data and --valid-data")


_IGNORED_WHY = {"--overlapping-eval": " (it is for --task WIKITEXT103)",
                "--strict-lambada": " (it is for --task LAMBADA)"}
_TRAINING_ONLY = " (zero-shot evaluation: nothing is trained)"


def warn_ignored_task_flags(raw, task: str, flags: Sequence[str]) -> List[str]:
    """One ``warning:`` line (per node and reason) naming the flags of ``flags`` that
    were given but that ``task`` does not read (Megatron-LM ignores them silently);
    returns them."""
    from megatron.errors import prints_for_its_node

    values = [(f, getattr(raw, f[2:].replace("-", "_"), None)) for f in flags]
    given = [f for f, v in values if v is not None and v is not False]  # --epochs 0 counts
    if given and prints_for_its_node():
        groups: Dict[str, List[str]] = {}
        for f in given:
            groups.setdefault(_IGNORED_WHY.get(f, _TRAINING_ONLY), []).append(f)
        for why, names in groups.items():
            print(f"warning: {', '.join(names)} {'is' if len(names) == 1 else 'are'} ignored "
                  f"by --task {task}{why}", file=sys.stderr, flush=True)
    return given


@dataclass
class ReadReport:
    """What a reader found: samples kept and malformed rows (with file and line)."""

    what: str
    files: List[str] = field(default_factory=list)
    samples: int = 0
    malformed: List[str] = field(default_factory=list)

    def bad(self, path: str, line: int, reason: str) -> None:
        self.malformed.append(f"{path}:{line}: {reason}")

    def merge(self, other: "ReadReport") -> "ReadReport":
        self.files += other.files
        self.samples += other.samples
        self.malformed += other.malformed
        return self

    def summary(self) -> str:
        names = ", ".join(self.files[:3]) + (f" and {len(self.files) - 3} more"
                                             if len(self.files) > 3 else "")
        return (f"{self.what}: {self.samples} samples from {names}; "
                f"{len(self.malformed)} malformed rows skipped")

    def print(self, show: int = 10, file=None) -> None:
        """The summary line and the first ``show`` malformed rows (to stderr)."""
        out = file or sys.stderr
        for line in self.malformed[:show]:
            print(f"WARNING: malformed {self.what} row skipped: {line}", file=out)
        if len(self.malformed) > show:
            print(f"WARNING: ... and {len(self.malformed) - show} more malformed rows",
                  file=out)
        print(self.summary(), file=out, flush=True)


def read_text(path: str, expected: str) -> str:
    """The UTF-8 text of ``path``; a missing, unreadable or binary file is one ValueError
    naming it and what was ``expected`` (the task adds the flag)."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); expected "
                         f"{expected}") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc}); expected "
                         f"{expected}") from None


def clean_text(text: str) -> str:
    """Collapse whitespace runs (tabs, newlines) to single spaces."""
    return " ".join(text.split())


def truncate_pair_from_end(a: List[int], b: List[int], max_tokens: int) -> None:
    """Drop tokens from the end of the longer sequence until both fit (deterministic)."""
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()


def build_pair_sample(ids_a: Sequence[int], ids_b: Optional[Sequence[int]], max_seq_length: int,
                      cls: int, sep: int, pad: int) -> Dict[str, np.ndarray]:
    """``[CLS] a [SEP] b [SEP]`` padded to ``max_seq_length``: text, types, padding_mask."""
    a = list(ids_a)
    b = list(ids_b) if ids_b is not None else []
    specials = 3 if ids_b is not None else 2
    truncate_pair_from_end(a, b, max_seq_length - specials)
    tokens = [cls] + a + [sep]
    types = [0] * len(tokens)
    if ids_b is not None:
        tokens += b + [sep]
        types += [1] * (len(b) + 1)
    pad_n = max_seq_length - len(tokens)
    return {"text": np.asarray(tokens + [pad] * pad_n, dtype=np.int64),
            "types": np.asarray(types + [0] * pad_n, dtype=np.int64),
            "padding_mask": np.asarray([1] * len(tokens) + [0] * pad_n, dtype=np.int64)}


class ListDataset(torch.utils.data.Dataset):
    """Samples held in memory (finetuning sets are small)."""

    def __init__(self, name: str, samples: List[Dict[str, np.ndarray]]) -> None:
        self.name = name
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        return self.samples[idx]


def special_ids(tokenizer):
    """(cls, sep, pad) of a BERT tokenizer, with a clear error for other tokenizers."""
    try:
        return int(tokenizer.cls), int(tokenizer.sep), int(tokenizer.pad)
    except NotImplementedError:
        raise ValueError(f"--tokenizer-type: finetuning BERT needs a WordPiece tokenizer with "
                         f"[CLS]/[SEP]/[PAD] (BertWordPieceLowerCase or BertWordPieceCase), "
                         f"got {type(tokenizer).__name__}") from None

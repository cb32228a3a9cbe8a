"""Shared pieces of the dataset builders: flag parsing, index caching, Python references.

``build_sample_idx_py`` and ``build_blending_indices_py`` define what the C++ helpers
in ``helpers.cpp`` compute; tests compare the two on random inputs.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.config import SPLIT_PATH_FLAGS  # in the order of SPLIT_NAMES
from megatron.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path
from megatron.errors import DataError


def alike_on_every_rank(build: Callable) -> Callable:
    """``build``'s DataErrors come from the flags and files every rank reads alike (each
    rank builds its datasets at start-up): they are marked ``every_rank_alike``, so local
    rank 0 of each node prints the one line, not every rank in torchrun's output.  A
    problem in one sample (a token id outside the vocabulary), which only the rank that
    reads it meets, is raised by ``__getitem__``, outside ``build``, and still prints on
    that rank."""
    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        try:
            return build(*args, **kwargs)
        except DataError as exc:
            exc.every_rank_alike = True
            raise
    return wrapper


def parse_split(split: str) -> List[float]:
    """``--split`` ("969,30,1", "98, 2, 0", "90/10") -> three fractions summing to 1.

    Missing trailing parts are zero.
    """
    text = str(split).strip()
    parts = [p.strip() for p in text.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three comma-separated "
                         f"non-negative numbers such as '969,30,1'") from None
    if len(values) > 3 or any(v < 0 or not np.isfinite(v) for v in values):
        raise ValueError(f"--split {split!r}: expected up to three comma-separated "
                         f"non-negative numbers (train, valid, test) such as '969,30,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the weights must not all be zero")
    return [v / total for v in values]


def split_boundaries(split: str, size: int) -> List[int]:
    """Document boundaries [0, a, b, size] of the train/valid/test ranges."""
    fractions = parse_split(split)
    cumulative = np.cumsum(fractions)
    # Rounding the cumulative (not each part) keeps the ranges contiguous, ordered and
    # ending exactly at `size`.
    bounds = [0] + [int(round(c * size)) for c in cumulative[:-1]] + [size]
    return [min(max(b, 0), size) for b in bounds]


def is_number(text: str) -> bool:
    """True for a --data-path weight (or a --split share): what float() reads."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path"
                    ) -> Tuple[List[str], List[float]]:
    """``--data-path`` ("p", "w1 p1 w2 p2 ..." or "p1 p2 ...") -> (prefixes, normalised
    weights).  Prefixes without weights (no item is a number) are weighted by their
    token counts, as Megatron-LM blends such a list: it uses each dataset whole, so each
    one's share is its size (``size_weights``; the files are opened here).  ``flag``:
    the flag the list came from (``--train-data-path`` ...), named by the errors."""
    items = [str(p) for p in data_path]
    if not items:
        raise DataError(f"{flag}: no dataset prefix given")
    if len(items) == 1:
        return items, [1.0]
    if not any(is_number(p) for p in items):
        prefixes = [p.strip() for p in items]
        return prefixes, size_weights(prefixes, flag)
    if len(items) % 2:
        raise DataError(f"{flag} {' '.join(items)}: expected a single prefix or "
                         f"'weight prefix' pairs such as '0.3 a 0.7 b'")
    weights, prefixes = [], []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"{flag}: {w!r} should be a weight before prefix {p!r} "
                             f"(pairs such as '0.3 a 0.7 b')") from None
        if weight < 0 or not np.isfinite(weight):
            raise DataError(f"{flag}: weight {w} of {p} must be a non-negative number")
        weights.append(weight)
        prefixes.append(p.strip())
    total = sum(weights)
    if total <= 0:
        raise DataError(f"{flag}: the weights must not all be zero")
    return prefixes, [w / total for w in weights]


def size_weights(prefixes: Sequence[str], flag: str = "--data-path") -> List[float]:
    """Each prefix's share of the tokens of all of them: the weights of an unweighted
    ``--data-path`` list."""
    tokens = [int(open_prefix(p, flag).sizes.sum(dtype=np.int64)) for p in prefixes]
    total = sum(tokens)
    if total <= 0:
        raise DataError(f"{flag} {' '.join(prefixes)}: the datasets hold no tokens")
    return [t / total for t in tokens]


def open_prefix(prefix: str, flag: str = "--data-path") -> IndexedDataset:
    """Open a dataset named on ``flag``, with a flag-level message when it is missing."""
    if not IndexedDataset.exists(prefix):
        raise DataError(
            f"{flag}: dataset prefix {prefix!r} not found; expected both "
            f"{data_file_path(prefix)} and {index_file_path(prefix)} "
            f"(create them with tools/preprocess_data.py)")
    ds = IndexedDataset(prefix)
    if ds.dtype.kind not in "iu":
        # Float codes are valid in the format, but token ids cast from floats would
        # train silently on garbage.
        raise DataError(f"{flag} {prefix}: {index_file_path(prefix)} declares {ds.dtype} "
                        f"data; expected integer token ids (uint16/int32/..., as written by "
                        f"tools/preprocess_data.py)")
    return ds


def build_sample_idx_py(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                        num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """Pure-Python reference of ``helpers.build_sample_idx`` (same values and dtype).

    Row k is (position in doc_idx, offset) of token k * seq_length of the stream made
    by concatenating documents doc_idx[0], doc_idx[1], ...; it is where sample k
    starts (samples are seq_length + 1 tokens, so neighbours share one token).
    """
    if seq_length <= 0 or num_epochs <= 0 or tokens_per_epoch <= 0:
        raise ValueError("build_sample_idx: seq_length, num_epochs and tokens_per_epoch must "
                         "be positive")
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    dtype = np.int32 if len(doc_idx) < 2 ** 31 - 1 else np.int64
    out = np.zeros((num_samples + 1, 2), dtype=dtype)
    pos, offset = 0, 0
    for k in range(1, num_samples + 1):
        advance = seq_length
        while True:
            if pos >= len(doc_idx):
                raise RuntimeError("build_sample_idx: ran out of documents")
            left = int(sizes[doc_idx[pos]]) - offset
            if left > advance:
                offset += advance
                break
            advance -= left
            pos += 1
            offset = 0
        out[k] = (pos, offset)
    return out


def build_blending_indices_py(weights: Sequence[float], size: int
                              ) -> Tuple[np.ndarray, np.ndarray]:
    """Pure-Python reference of ``helpers.build_blending_indices``."""
    w = np.asarray(weights, dtype=np.float64)
    if not np.any(w > 0):
        raise ValueError("build_blending_indices: at least one weight must be positive")
    dataset_index = np.zeros(size, dtype=np.uint8 if w.size <= 255 else np.int32)
    sample_index = np.zeros(size, dtype=np.int64)
    taken = np.zeros(w.size, dtype=np.int64)
    for i in range(size):
        errors = w * max(i, 1) - taken
        errors[w <= 0] = -np.inf  # never draw from a zero-weight dataset
        best = int(np.argmax(errors))  # first maximum, as the C++ loop's strict '>'
        dataset_index[i] = best
        sample_index[i] = taken[best]
        taken[best] += 1
    return dataset_index, sample_index


def empty_split_error(split: str, prefix: str, name: str, needed: int, total: int
                      ) -> DataError:
    """The one-line error for a split that must supply samples but has no tokens."""
    return DataError(f"--split {split!r} with --data-path {prefix}: the {name} split needs "
                     f"{needed} samples but gets no tokens ({total} sequences in the dataset); "
                     f"give it a non-zero share of --split or point --data-path at a "
                     f"non-empty dataset")


SPLIT_NAMES = ("train", "valid", "test")


def build_per_split_datasets(split_paths: Sequence[Optional[Sequence[str]]],
                             num_samples: Sequence[int],
                             build_one: Callable[[str, IndexedDataset, int], object]
                             ) -> Tuple[object, object, object]:
    """(train, valid, test) from ``--train-data-path``, ``--valid-data-path`` and
    ``--test-data-path``: each split reads its own prefix or blend (the ``--data-path``
    forms), every prefix used whole; ``--split`` plays no part.

    A split without paths, or that needs no samples, is None.  ``build_one(name, ds, n)``
    builds ``n`` samples of split ``name`` from all the documents of ``ds``; a blend gets
    a ``BlendableDataset`` whose components hold exactly the samples it draws from them.
    """
    from megatron.data import helpers
    from megatron.data.blendable_dataset import BlendableDataset

    if len(split_paths) != 3 or len(num_samples) != 3:
        raise ValueError("split_paths and num_samples must have three entries")
    out: List[object] = []
    for name, flag, paths, n in zip(SPLIT_NAMES, SPLIT_PATH_FLAGS, split_paths, num_samples):
        n = int(n)
        if not paths or n <= 0:
            out.append(None)
            continue
        prefixes, weights = parse_data_path(paths, flag)
        if len(prefixes) == 1:
            counts = np.array([n], dtype=np.int64)
        else:
            index, _ = helpers.build_blending_indices(np.asarray(weights), n)
            counts = np.bincount(index, minlength=len(prefixes))
        parts = []
        for prefix, count in zip(prefixes, counts):
            ds = open_prefix(prefix, flag)
            if count <= 0:
                parts.append(None)  # a zero weight: the blend never reads it
                continue
            if int(ds.sizes.sum(dtype=np.int64)) == 0:
                raise DataError(f"{flag} {prefix}: the {name} split needs {int(count)} "
                                f"samples from this dataset but it holds no tokens "
                                f"({len(ds)} sequences); point {flag} at a non-empty dataset")
            parts.append(build_one(name, ds, int(count)))
        out.append(parts[0] if len(parts) == 1 else BlendableDataset(parts, weights, n))
    return out[0], out[1], out[2]


def check_token_ids(ds: IndexedDataset, tokens: np.ndarray, vocab_size: int, where: str,
                    locate: Callable[[], Sequence[Tuple[int, np.ndarray]]]) -> None:
    """Raise a DataError naming the file, sequence and id if ``tokens`` leave the vocabulary.

    The common case costs one vectorised max (and a min for signed dtypes);
    ``locate()`` lists the (sequence id, tokens) pieces of the sample and is only
    called once a bad id is known to exist.
    """
    if tokens.size == 0:
        return
    if int(tokens.max()) < vocab_size and (tokens.dtype.kind == "u" or int(tokens.min()) >= 0):
        return
    seq, token = -1, int(tokens.max())
    for seq_id, part in locate():
        bad = np.flatnonzero((part >= vocab_size) | (part < 0)) if part.size else []
        if len(bad):
            seq, token = seq_id, int(part[bad[0]])
            break
    raise DataError(f"{data_file_path(ds.prefix)}: token id {token} in document (sequence) "
                    f"{seq}, {where}, is outside the vocabulary [0, {vocab_size}); the data "
                    f"was tokenized with another vocabulary than --tokenizer-type/--vocab-file")


def load_cached_arrays(paths: Sequence[Path]) -> Optional[List[np.ndarray]]:
    """Memory-map cached index arrays; None when any is missing or unreadable.

    A truncated or corrupt cache file (e.g. from a full disk) is reported on one line,
    deleted and rebuilt by the caller rather than failing inside ``np.load``.
    """
    if not all(p.exists() for p in paths):
        return None
    arrays = []
    for p in paths:
        try:
            arrays.append(np.load(p, mmap_mode="r", allow_pickle=False))
        except (ValueError, OSError, EOFError) as exc:
            print(f"warning: index cache file {p} is unreadable ({exc}); deleting and "
                  f"rebuilding it", file=sys.stderr, flush=True)
            for q in paths:
                try:
                    os.unlink(q)
                except OSError:
                    pass
            return None
    return arrays


def index_cache_dir(prefix: str, data_cache_path: Optional[str]) -> Path:
    """Directory for cached sample indices: --data-cache-path or ``<prefix dir>/cache``."""
    if data_cache_path:
        return Path(data_cache_path)
    return Path(prefix).resolve().parent / "cache"


_UNWRITABLE_CACHES: set = set()
"""Cache directories this process has already warned about."""


def warn_cache_not_written(what: str, cache: Path, exc: OSError) -> None:
    """The index arrays were built but could not be written to ``cache``: one ``warning:``
    line per node (every rank of a node meets the same directory, and each node may
    have a file system of its own), once per directory; it was a Python warning, with
    its source line, on every rank."""
    from megatron.errors import prints_for_its_node

    if str(cache) in _UNWRITABLE_CACHES:
        return
    _UNWRITABLE_CACHES.add(str(cache))
    if prints_for_its_node():
        print(f"warning: could not cache {what} in {cache} ({exc}); they are rebuilt at every "
              f"start. Point --data-cache-path at a writable directory", file=sys.stderr,
              flush=True)


def cache_key(description: Dict) -> str:
    """Stable short hash of the parameters that determine an index."""
    text = json.dumps(description, sort_keys=True)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary name then rename, so readers never see a partial file."""
    with _atomic_file(path) as f:
        np.save(f, array, allow_pickle=False)


def write_text_atomic(path: Path, text: str) -> None:
    with _atomic_file(path) as f:
        f.write(text.encode("utf-8"))


@contextlib.contextmanager
def _atomic_file(path: Path):
    """A binary file written under a name no other writer uses, renamed to ``path`` when
    complete (removed if the write fails).

    Every rank builds the same index arrays and writes them to the same cache directory,
    which on a cluster is often one file system shared by all nodes.  A temporary name
    made of the pid alone is not unique there: nodes run in containers of their own
    start their workers with the same pids, so two nodes wrote into one temporary file
    at once, one truncating what the other had written, and the second's rename failed
    (the file was already gone).  ``mkstemp`` creates the name exclusively (O_EXCL)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide it from other users
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@functools.lru_cache(maxsize=None)
def _umask() -> int:
    """The process's umask (read once: reading it means setting it for a moment)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""GPT pretraining samples: fixed-length token windows over shuffled documents.

For one split (a contiguous range of document ids) three index arrays are built once
and cached as ``.npy`` files:

* ``doc_idx``: the split's documents, repeated for as many epochs as the requested
  number of samples needs and shuffled with ``RandomState(seed)``;
* ``sample_idx``: [n + 1, 2] (position in doc_idx, token offset) where sample k starts,
  from the C++ helper ``build_sample_idx``; a sample is the ``seq_length + 1`` tokens
  from its start to the next sample's start inclusive, crossing document boundaries;
* ``shuffle_idx``: the sample order.

These are Megatron-LM's arrays, value for value, so a run here reads its samples in
the order Megatron-LM would from the same prefix, split and seed.  That includes its
rule for the last epoch: when the samples still needed after the complete epochs are
fewer than 80% of an epoch's, the last epoch is kept apart (its documents shuffled on
their own, its samples after all the others), so a short last epoch does not
over-represent a few documents among the early samples; otherwise every epoch's
documents are shuffled together, and so are all the samples.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.data import helpers
from megatron.data.dataset_utils import (alike_on_every_rank, build_per_split_datasets,
                                         cache_key, check_token_ids, empty_split_error,
                                         index_cache_dir, load_cached_arrays, open_prefix,
                                         parse_data_path, save_npy_atomic, split_boundaries,
                                         warn_cache_not_written, write_text_atomic)
from megatron.data.indexed_dataset import IndexedDataset
from megatron.errors import DataError

_SPLIT_NAMES = ("train", "valid", "test")
_INDEX_VERSION = 2
"""2: Megatron-LM's multi-epoch order (2026-11-25); 1 shuffled each epoch on its own."""


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from ``documents``.

    With ``vocab_size`` every sample is checked to hold ids in [0, vocab_size): a
    vectorised min/max over seq_length + 1 tokens costs microseconds per sample, while
    a once-per-file scan would read the whole corpus on every rank at start-up.
    """

    def __init__(self, name: str, indexed_dataset: IndexedDataset, documents: np.ndarray,
                 num_samples: int, seq_length: int, seed: int,
                 data_cache_path: Optional[str] = None,
                 vocab_size: Optional[int] = None) -> None:
        documents = np.asarray(documents, dtype=np.int64)
        if documents.size == 0:
            raise DataError(f"{indexed_dataset.prefix}: the {name} split has no documents")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise ValueError(f"{indexed_dataset.prefix}: {name} documents outside "
                             f"[0, {len(indexed_dataset)})")
        if num_samples <= 0 or seq_length <= 0:
            raise ValueError(f"{name}: num_samples ({num_samples}) and seq_length "
                             f"({seq_length}) must be positive")
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = vocab_size
        self.doc_idx, self.sample_idx, self.shuffle_idx, self.index_cache_hit = \
            _index_mappings(name, indexed_dataset, documents, self.num_samples,
                            self.seq_length, seed, data_cache_path)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"{self.name}: sample {idx} out of range [0, {self.num_samples})")
        i = int(self.shuffle_idx[idx])
        p0, o0 = (int(v) for v in self.sample_idx[i])
        p1, o1 = (int(v) for v in self.sample_idx[i + 1])
        ds, docs = self.indexed_dataset, self.doc_idx
        if p0 == p1:
            parts = [ds.get(int(docs[p0]), offset=o0, length=o1 - o0 + 1)]
            tokens = parts[0]
        else:
            parts = [ds.get(int(docs[p0]), offset=o0)]
            parts += [ds.get(int(docs[p])) for p in range(p0 + 1, p1)]
            parts.append(ds.get(int(docs[p1]), length=o1 + 1))
            tokens = np.concatenate(parts)
        if self.vocab_size is not None:
            check_token_ids(ds, tokens, self.vocab_size, f"{self.name} sample {idx}",
                            lambda: list(zip((int(docs[p]) for p in range(p0, p1 + 1)),
                                             parts)))
        if tokens.size != self.seq_length + 1:
            raise DataError(f"{self.name}: sample {idx} has {tokens.size} tokens, expected "
                            f"{self.seq_length + 1}; the cached index does not match "
                            f"{ds.prefix} (delete the cache directory)")
        return {"text": tokens.astype(np.int64)}


class MockGPTDataset(torch.utils.data.Dataset):
    """Deterministic random tokens: sample i depends only on (seed, i)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234
                 ) -> None:
        if num_samples < 0 or seq_length <= 0 or vocab_size <= 0:
            raise ValueError("MockGPTDataset: num_samples >= 0, seq_length > 0 and "
                             "vocab_size > 0 required")
        self.num_samples, self.seq_length = int(num_samples), int(seq_length)
        self.vocab_size, self.seed = int(vocab_size), int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockGPTDataset: sample {idx} out of range")
        rng = np.random.default_rng([self.seed, int(idx)])
        return {"text": rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)}


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs whose tokens yield ``num_samples`` samples."""
    # Each sample consumes seq_length new tokens; the +1 shared token is the first one.
    needed_tokens = num_samples * seq_length + 1
    return max(1, -(-needed_tokens // tokens_per_epoch))


def _index_mappings(name: str, ds: IndexedDataset, documents: np.ndarray, num_samples: int,
                    seq_length: int, seed: int, data_cache_path: Optional[str]
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    sizes = ds.sizes
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= 0:
        raise DataError(f"{ds.prefix}: the {name} split's documents hold no tokens")
    description = {
        "class": "GPTDataset", "version": _INDEX_VERSION, "name": name,
        "prefix": os.path.abspath(ds.prefix), "num_sequences": len(ds),
        "tokens_per_epoch": tokens_per_epoch, "num_samples": num_samples,
        "seq_length": seq_length, "seed": int(seed),
        "documents": hashlib.md5(documents.tobytes()).hexdigest(),
    }
    key = cache_key(description)
    cache = index_cache_dir(ds.prefix, data_cache_path)
    paths = {k: cache / f"{key}-{name}_{k}_idx.npy" for k in ("doc", "sample", "shuffle")}
    loaded = load_cached_arrays([paths[k] for k in ("doc", "sample", "shuffle")])
    if loaded is not None:
        if (_cached_shapes_ok(loaded, num_samples)
                and _cached_values_ok(loaded, documents, sizes, seq_length)):
            return loaded[0], loaded[1], loaded[2], True
        print(f"warning: index cache files {paths['doc'].parent}/{key}-{name}_*_idx.npy point "
              f"outside {ds.prefix} or do not fit it (corrupt or from another dataset); "
              f"rebuilding them", file=sys.stderr, flush=True)

    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    separate_last = separate_last_epoch(num_epochs, tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)
    doc_idx = _build_doc_idx(documents, num_epochs, rng, separate_last)
    sample_idx = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs,
                                          tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = _samples_before_last_epoch(num_epochs, tokens_per_epoch, seq_length) \
        if separate_last else total
    shuffle_idx = _build_shuffle_idx(first, total, rng)
    try:
        write_text_atomic(cache / f"{key}-{name}_description.json",
                          json.dumps(description, indent=2, sort_keys=True))
        save_npy_atomic(paths["doc"], doc_idx)
        save_npy_atomic(paths["sample"], sample_idx)
        save_npy_atomic(paths["shuffle"], shuffle_idx)
    except OSError as exc:
        warn_cache_not_written("dataset indices", cache, exc)
    return doc_idx, sample_idx, shuffle_idx, False


def _cached_shapes_ok(arrays: List[np.ndarray], num_samples: int) -> bool:
    doc_idx, sample_idx, shuffle_idx = arrays
    if any(a.dtype.kind not in "iu" for a in arrays):  # float, bool, structured, ...
        return False
    return (doc_idx.ndim == 1 and sample_idx.ndim == 2 and sample_idx.shape[1] == 2
            and shuffle_idx.ndim == 1 and shuffle_idx.size >= num_samples
            and sample_idx.shape[0] == shuffle_idx.size + 1)


def _cached_values_ok(arrays: List[np.ndarray], documents: np.ndarray,
                      sizes: np.ndarray, seq_length: int) -> bool:
    """Every cached index lies inside the dataset, the sample starts run forwards from
    (0, 0) and the shuffle is a permutation (vectorised; milliseconds per million
    samples), so a corrupt cache is rebuilt instead of failing mid-training."""
    doc_idx, sample_idx, shuffle_idx = arrays
    if doc_idx.size == 0 or sample_idx.shape[0] < 2 or shuffle_idx.size == 0:
        return False
    if doc_idx.min() < documents.min() or doc_idx.max() > documents.max():
        return False
    pos, off = sample_idx[:, 0].astype(np.int64), sample_idx[:, 1].astype(np.int64)
    if pos[0] != 0 or off[0] != 0 or pos.min() < 0 or pos.max() >= doc_idx.size \
            or off.min() < 0:
        return False
    # A sample ends inside a document, seq_length tokens after the previous end when
    # both are in the same document.
    step = np.diff(pos)
    if np.any(step < 0) or np.any(np.diff(off)[step == 0] != seq_length):
        return False
    if np.any(off[1:] >= sizes[doc_idx[pos[1:]]]):
        return False
    if shuffle_idx.min() < 0 or shuffle_idx.max() >= shuffle_idx.size:
        return False
    seen = np.zeros(shuffle_idx.size, dtype=bool)
    seen[shuffle_idx] = True
    return bool(seen.all())


def _samples_before_last_epoch(num_epochs: int, tokens_per_epoch: int,
                               seq_length: int) -> int:
    return ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length


def separate_last_epoch(num_epochs: int, tokens_per_epoch: int, seq_length: int,
                        num_samples: int) -> bool:
    """Megatron-LM's rule: keep the last epoch apart when the samples taken from it
    are fewer than 80% of one epoch's samples."""
    if num_epochs == 1:
        return False
    from_last = num_samples - _samples_before_last_epoch(num_epochs, tokens_per_epoch,
                                                         seq_length)
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return from_last < int(0.80 * per_epoch)


def _build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                   separate_last: bool) -> np.ndarray:
    """``num_epochs`` copies of ``documents`` shuffled together, or, with
    ``separate_last``, all but the last shuffled together and then the last alone."""
    dtype = np.int32 if documents.max() < 2 ** 31 - 1 else np.int64
    if separate_last and num_epochs > 1:
        head = _build_doc_idx(documents, num_epochs - 1, rng, False)
        return np.concatenate([head, _build_doc_idx(documents, 1, rng, False)])
    doc_idx = np.tile(documents.astype(dtype), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def _build_shuffle_idx(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Samples [0, first) shuffled, then [first, total) shuffled apart from them."""
    dtype = np.uint32 if total < 2 ** 32 - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate([head, tail])


def _split_tokens(ds: IndexedDataset, split: str, s: int) -> int:
    """Tokens in split ``s`` (0 train, 1 valid, 2 test) of ``ds`` under ``--split``."""
    bounds = split_boundaries(split, len(ds))
    return int(ds.sizes[bounds[s]:bounds[s + 1]].sum(dtype=np.int64))


def _build_split_datasets(prefix: str, split: str, num_samples: Sequence[int],
                          seq_length: int, seed: int, data_cache_path: Optional[str],
                          require: bool, vocab_size: Optional[int] = None
                          ) -> List[Optional[GPTDataset]]:
    ds = open_prefix(prefix)
    # Splits cut the sequence ids; preprocess_data.py writes one sequence per document,
    # so these are document ranges too.
    bounds = split_boundaries(split, len(ds))
    out: List[Optional[GPTDataset]] = []
    for i, name in enumerate(_SPLIT_NAMES):
        documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        n = int(num_samples[i])
        if n <= 0:
            out.append(None)
        elif documents.size == 0 or int(ds.sizes[documents].sum(dtype=np.int64)) == 0:
            # Training needs its split; validation/test without documents are skipped
            # (Megatron's behaviour, e.g. --split 100,0,0) unless a blend needs them.
            if require or name == "train":
                raise empty_split_error(split, prefix, name, n, len(ds))
            out.append(None)
        else:
            out.append(GPTDataset(name, ds, documents, n, seq_length, seed, data_cache_path,
                                  vocab_size))
    return out


@alike_on_every_rank
def build_train_valid_test_datasets(data_prefix: List[str], split: str,
                                    train_valid_test_num_samples: Tuple[int, int, int],
                                    seq_length: int, seed: int,
                                    data_cache_path: Optional[str] = None,
                                    vocab_size: Optional[int] = None):
    """(train, valid, test) datasets from ``--data-path``, ``--split`` and sample counts.

    A split gets None when it needs no samples or is a valid or test split without
    documents (for a blend: in no prefix); a train split that needs samples but has no
    tokens is a ``DataError``.  ``vocab_size`` enables the per-sample token-id check.
    Several weighted prefixes give ``BlendableDataset``s whose components hold exactly
    the samples the blend draws from them.
    """
    from megatron.data.blendable_dataset import BlendableDataset

    prefixes, weights = parse_data_path(data_prefix)
    if len(train_valid_test_num_samples) != 3:
        raise ValueError("train_valid_test_num_samples must have three entries")
    if len(prefixes) == 1:
        return tuple(_build_split_datasets(prefixes[0], split, train_valid_test_num_samples,
                                           seq_length, seed, data_cache_path, require=False,
                                           vocab_size=vocab_size))
    # A valid/test split that no prefix has tokens for is skipped, as with one prefix:
    # Megatron-LM's blends skip a split whose --split share is 0 (--split 100,0,0).
    # One that only some prefixes lack is still an error (naming the prefix) below.
    num_samples = list(train_valid_test_num_samples)
    for s in (1, 2):
        if num_samples[s] > 0 and not any(_split_tokens(open_prefix(p), split, s)
                                          for p in prefixes):
            num_samples[s] = 0
    # Count how many samples the blend takes from each prefix in each split, so every
    # component is built at exactly that size.
    counts = np.zeros((len(prefixes), 3), dtype=np.int64)
    for s, n in enumerate(num_samples):
        if n > 0:
            index, _ = helpers.build_blending_indices(np.asarray(weights), int(n))
            counts[:, s] = np.bincount(index, minlength=len(prefixes))
    per_prefix = [_build_split_datasets(p, split, counts[j], seq_length, seed,
                                        data_cache_path, require=True, vocab_size=vocab_size)
                  for j, p in enumerate(prefixes)]
    blends = []
    for s, n in enumerate(num_samples):
        if n <= 0:
            blends.append(None)
        else:
            blends.append(BlendableDataset([d[s] for d in per_prefix], weights, int(n)))
    return tuple(blends)


@alike_on_every_rank
def build_split_path_datasets(split_paths: Sequence[Optional[Sequence[str]]],
                              train_valid_test_num_samples: Sequence[int], seq_length: int,
                              seed: int, data_cache_path: Optional[str] = None,
                              vocab_size: Optional[int] = None):
    """(train, valid, test) from Megatron-LM's ``--train-data-path``,
    ``--valid-data-path`` and ``--test-data-path`` (``split_paths``, None or [] for a
    split without one): each split's prefix or blend is used whole, so a sample of one
    split never comes from another's files.  Indices are cached and epochs repeated as
    for ``--data-path`` (a ``GPTDataset`` over all of a prefix's documents)."""
    def build_one(name: str, ds: IndexedDataset, n: int) -> GPTDataset:
        documents = np.arange(len(ds), dtype=np.int64)
        return GPTDataset(name, ds, documents, n, seq_length, seed, data_cache_path,
                          vocab_size)

    return build_per_split_datasets(split_paths, train_valid_test_num_samples, build_one)

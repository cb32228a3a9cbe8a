"""BERT pretraining samples: sentence pairs with masked tokens and a sentence-order label.

The corpus is a sentence-level indexed dataset (``tools/preprocess_data.py
--split-sentences``): one sequence per sentence, documents as runs of sentences.
Samples follow Megatron-LM's BERT dataset (legacy ``megatron/data/bert_dataset.py`` and
``megatron/core/datasets/bert_dataset.py``, which agree):

* The **mapping** (built once by the C++ helper ``build_bert_mapping``, cached as .npy)
  lists samples as runs of consecutive sentences of one document with a target length:
  usually ``max_seq_length - 3`` tokens, with probability ``short_seq_prob`` a shorter
  random one so the model also sees short inputs.  A document's last run keeps every
  sentence left; documents with a sentence over 512 tokens are skipped.  Whole epochs
  are shuffled together and the first ``num_samples`` kept, so a run shorter than an
  epoch still samples every document.  ``build_bert_mapping_py`` is the pure Python
  reference the tests compare it with.
* A **sample** (``build_training_sample``) splits its sentences at a random point into
  A and B, swaps them with probability 1/2 (sentence-order prediction: label
  ``is_random``), truncates the longer side (front or back at random) to the target
  length, lays it out as ``[CLS] A [SEP] B [SEP]`` and masks up to 15% of the tokens
  (at most ``mask_prob * target length``): whole words, in n-grams of 1-3 words
  (P ~ 1/n); 80% [MASK], 10% a random non-special id, 10% unchanged.  With the same
  mapping row and seed a sample is Megatron-LM's, but for the random ids (Megatron-LM
  draws them from the whole vocabulary, special tokens included).

Sample i draws its randomness from ``RandomState(seed + i)`` only, so it does not depend
on the order samples are read in, on workers or on resumption.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
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
_MAPPING_VERSION = 2
# Megatron-LM skips documents (of two or more sentences) with a sentence longer than this
# many tokens: one would be cut to pieces by truncation anyway.
LONG_SENTENCE_LEN = 512
_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- vocabulary
@dataclass
class BertVocabInfo:
    """What sample construction needs to know about the vocabulary."""

    cls: int
    sep: int
    mask: int
    pad: int
    vocab_size: int
    random_ids: np.ndarray
    """Ids a masked position may be replaced with (the 10% random case)."""
    is_continuation: Optional[np.ndarray] = None
    """Bool per id: the token continues a word (WordPiece '##'); None = unknown."""

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "BertVocabInfo":
        """Special ids from a WordPiece tokenizer; tokenizers without [CLS]/[SEP]/[MASK]
        (NullTokenizer for --mock-data) get ids 0-3 reserved as [PAD] [CLS] [SEP] [MASK]."""
        size = int(tokenizer.vocab_size)
        try:
            special = (tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad)
        except NotImplementedError:
            special = None
        if special is None:
            if size < 8:
                raise ValueError(f"BERT with {type(tokenizer).__name__} needs 8 or more ids "
                                 f"(--vocab-size 7 or more with NullTokenizer; ids 0-3 are "
                                 f"reserved for [PAD] [CLS] [SEP] [MASK]), got {size}")
            return cls(cls=1, sep=2, mask=3, pad=0, vocab_size=size,
                       random_ids=np.arange(4, size, dtype=np.int64))
        c, s, m, p = (int(x) for x in special)
        exclude = {c, s, m, p}
        random_ids = np.asarray([i for i in range(size) if i not in exclude], dtype=np.int64)
        cont = None
        try:
            inv = tokenizer.inv_vocab
            cont = np.zeros(size, dtype=bool)
            for i, tok in inv.items():
                if 0 <= int(i) < size and str(tok).startswith("##"):
                    cont[int(i)] = True
        except NotImplementedError:
            cont = None
        return cls(cls=c, sep=s, mask=m, pad=p, vocab_size=size, random_ids=random_ids,
                   is_continuation=cont)


# ------------------------------------------------------------------- the sample mapping
class SplitMix64:
    """The C++ helper's random stream, bit for bit (pure Python, for the reference)."""

    def __init__(self, seed: int) -> None:
        self.state = int(seed) & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def uniform(self) -> float:
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)

    def below(self, n: int) -> int:
        return self.next() % n


def build_bert_mapping_py(docs: np.ndarray, sizes: np.ndarray, max_num_samples: int,
                          max_num_tokens: int, short_seq_prob: float, seed: int,
                          min_num_sent: int, long_sentence_len: int = 512) -> np.ndarray:
    """Pure-Python reference of ``helpers.build_bert_mapping`` (identical output)."""
    rng = SplitMix64(seed)

    def target() -> int:
        if rng.uniform() < short_seq_prob:
            return 2 + rng.below(max_num_tokens - 1)
        return max_num_tokens

    rows: List[Tuple[int, int, int]] = []
    while len(rows) < max_num_samples:  # whole epochs
        before = len(rows)
        for d in range(len(docs) - 1):
            first, last = int(docs[d]), int(docs[d + 1])
            if last - first < min_num_sent:
                continue
            if (last - first > 1 and long_sentence_len > 0
                    and int(np.max(sizes[first:last])) > long_sentence_len):
                continue
            tgt, start, length = target(), first, 0
            for s in range(first, last):
                length += int(sizes[s])
                n = s - start + 1
                remaining = last - s - 1
                if (length >= tgt and n >= min_num_sent and remaining > 1) or remaining == 0:
                    if n >= min_num_sent:
                        rows.append((start, s + 1, tgt))
                    start, length, tgt = s + 1, 0, target()
        if len(rows) == before:
            raise RuntimeError(f"build_bert_mapping: no document has enough sentences (need "
                               f"{min_num_sent} per sample, each of at most "
                               f"{long_sentence_len} tokens)")
    for i in range(len(rows) - 1, 0, -1):
        j = rng.below(i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return np.asarray(rows[:max_num_samples], dtype=np.int64).reshape(-1, 3)


# ------------------------------------------------------------------ sample construction
def truncate_pair(a: List[int], b: List[int], max_num_tokens: int,
                  rng: np.random.RandomState) -> bool:
    """Trim the longer of a/b (front or back at random) until both fit; True if trimmed."""
    truncated = False
    while len(a) + len(b) > max_num_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random_sample() < 0.5:
            del longer[0]
        else:
            longer.pop()
        truncated = True
    return truncated


def create_masked_lm_predictions(tokens: List[int], info: BertVocabInfo, masked_lm_prob: float,
                                 max_predictions: float, rng: np.random.RandomState,
                                 whole_word_masking: bool = True, max_ngram: int = 3
                                 ) -> Tuple[List[int], List[int], List[int]]:
    """(tokens with masks applied, masked positions, original ids at those positions).

    Megatron-LM's masking: the candidates are words (a WordPiece token and the ``##``
    pieces after it; single tokens without ``whole_word_masking``), [CLS]/[SEP] never.
    Candidates are visited in random order; each starts an n-gram of n consecutive
    candidates, n drawn from 1..max_ngram with P(n) ~ 1/n and shortened
    while it would pass the budget, ``min(max_predictions, max(1, round(len(tokens) *
    masked_lm_prob)))`` positions (a float budget, as Megatron-LM's).  Each chosen
    position becomes [MASK] (80%), stays (10%) or a random non-special id (10%).
    """
    words: List[List[int]] = []
    for i, tok in enumerate(tokens):
        if tok == info.cls or tok == info.sep:
            continue
        # A '##' piece joins the word before it.  As in Megatron-LM that is also the
        # last word of A when B starts with a '##' piece (B truncated at the front, or
        # swapped): the two are masked together, which keeps samples identical to
        # Megatron-LM's for the same mapping row and seed.
        if (whole_word_masking and words and info.is_continuation is not None
                and info.is_continuation[tok]):
            words[-1].append(i)
        else:
            words.append([i])
    output = list(tokens)
    budget = min(float(max_predictions),
                 float(max(1, int(round(len(tokens) * masked_lm_prob)))))
    sizes = np.arange(1, max(1, int(max_ngram)) + 1, dtype=np.int64)
    # Megatron-LM draws n with the same odds at every start, near the end too, where the
    # n-gram is cut short by the last word.
    p = (1.0 / sizes) / (1.0 / sizes).sum()
    starts = list(range(len(words)))
    rng.shuffle(starts)
    covered = set()
    chosen: List[int] = []
    labels_at: Dict[int, int] = {}
    for w in starts:
        if len(chosen) >= budget:
            break
        n = int(rng.choice(sizes, p=p))
        span = [i for word in words[w:w + n] for i in word]
        while len(chosen) + len(span) > budget and n > 1:
            n -= 1
            span = [i for word in words[w:w + n] for i in word]
        if len(chosen) + len(span) > budget or any(i in covered for i in span):
            continue
        for pos in span:
            covered.add(pos)
            labels_at[pos] = tokens[pos]
            chosen.append(pos)
            if rng.random_sample() < 0.8:
                output[pos] = info.mask
            elif rng.random_sample() >= 0.5:
                output[pos] = int(info.random_ids[rng.randint(len(info.random_ids))])
    chosen.sort()
    return output, chosen, [labels_at[pos] for pos in chosen]


def build_training_sample(sentences: Sequence[np.ndarray], target_seq_length: int,
                          max_seq_length: int, info: BertVocabInfo, masked_lm_prob: float,
                          rng: np.random.RandomState, binary_head: bool = True,
                          whole_word_masking: bool = True,
                          max_ngram: int = 3) -> Dict[str, np.ndarray]:
    """One padded BERT sample from a run of sentences (see the module docstring)."""
    if binary_head and len(sentences) < 2:
        raise ValueError("a sentence-order sample needs at least two sentences")
    if binary_head:
        # A gets sentences [0, a_end), a_end uniform in [1, n - 1] (no draw for n = 2)
        a_end = 1 if len(sentences) == 2 else int(rng.randint(1, len(sentences)))
        a = [int(t) for s in sentences[:a_end] for t in s]
        b = [int(t) for s in sentences[a_end:] for t in s]
        is_random = bool(rng.random_sample() < 0.5)
        if is_random:
            a, b = b, a
    else:
        a = [int(t) for s in sentences for t in s]
        b, is_random = [], False
    specials = 3 if binary_head else 2
    budget = min(int(target_seq_length), max_seq_length - specials)
    truncated = truncate_pair(a, b, max(budget, 2 if binary_head else 1), rng)
    tokens = [info.cls] + a + [info.sep]
    types = [0] * len(tokens)
    if binary_head:
        tokens += b + [info.sep]
        types += [1] * (len(b) + 1)
    # Megatron-LM caps the predictions at mask_prob x the sample's target length (a
    # float), e.g. 18 of 128 tokens (not 19) at --seq-length 128.
    max_predictions = masked_lm_prob * min(int(target_seq_length), max_seq_length - specials)
    masked, positions, labels = create_masked_lm_predictions(
        tokens, info, masked_lm_prob, max_predictions, rng, whole_word_masking, max_ngram)
    n = len(masked)
    pad = max_seq_length - n
    out_labels = np.full(max_seq_length, -1, dtype=np.int64)
    loss_mask = np.zeros(max_seq_length, dtype=np.int64)
    out_labels[positions] = labels
    loss_mask[positions] = 1
    return {
        "text": np.asarray(masked + [info.pad] * pad, dtype=np.int64),
        "types": np.asarray(types + [0] * pad, dtype=np.int64),
        "labels": out_labels,
        "is_random": np.asarray(int(is_random), dtype=np.int64),
        "loss_mask": loss_mask,
        "padding_mask": np.asarray([1] * n + [0] * pad, dtype=np.int64),
        "truncated": np.asarray(int(truncated), dtype=np.int64),
    }


@dataclass
class MaskingConfig:
    """The BERT-specific knobs (flags --mask-prob, --short-seq-prob, ...)."""

    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True
    whole_word_masking: bool = True
    """Mask whole words (Megatron-LM always does)."""
    max_ngram: int = 3
    """Mask n-grams of up to this many words, P(n) ~ 1/n (Megatron-LM's 3); 1 = BERT's."""


# ---------------------------------------------------------------------------- datasets
class BertDataset(torch.utils.data.Dataset):
    """``num_samples`` BERT samples from documents [first_doc, last_doc) of a corpus."""

    def __init__(self, name: str, indexed_dataset: IndexedDataset, first_doc: int,
                 last_doc: int, num_samples: int, max_seq_length: int, seed: int,
                 info: BertVocabInfo, masking: MaskingConfig,
                 data_cache_path: Optional[str] = None) -> None:
        if not 0 <= first_doc < last_doc <= len(indexed_dataset.doc_idx) - 1:
            raise DataError(f"{indexed_dataset.prefix}: the {name} split [{first_doc}, "
                            f"{last_doc}) has no documents")
        if max_seq_length < 8:
            raise ValueError(f"--seq-length {max_seq_length} is too short for BERT samples")
        self.name = name
        self.ds = indexed_dataset
        self.num_samples = int(num_samples)
        self.max_seq_length = int(max_seq_length)
        self.seed = int(seed)
        self.info = info
        self.masking = masking
        docs = np.asarray(indexed_dataset.doc_idx[first_doc:last_doc + 1], dtype=np.int64)
        self.mapping, self.index_cache_hit = _mapping(name, indexed_dataset, docs,
                                                      self.num_samples, self.max_seq_length,
                                                      self.seed, masking, data_cache_path)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"{self.name}: sample {idx} out of range [0, {self.num_samples})")
        start, end, target = (int(v) for v in self.mapping[idx])
        sentences = [self.ds.get(i) for i in range(start, end)]
        # Cheap (a min/max per sentence of one sample) and it names the file and id
        # instead of an IndexError deep in the embedding.
        check_token_ids(self.ds, np.concatenate(sentences), self.info.vocab_size,
                        f"{self.name} sample {idx}",
                        lambda: list(zip(range(start, end), sentences)))
        rng = np.random.RandomState((self.seed + idx) % 2 ** 32)
        m = self.masking
        return build_training_sample(sentences, target, self.max_seq_length, self.info,
                                     m.masked_lm_prob, rng, m.binary_head, m.whole_word_masking,
                                     m.max_ngram)


class MockBertDataset(torch.utils.data.Dataset):
    """Synthetic sentence runs of random ids; sample i depends only on (seed, i)."""

    def __init__(self, num_samples: int, max_seq_length: int, info: BertVocabInfo,
                 masking: MaskingConfig, seed: int = 1234) -> None:
        self.num_samples, self.max_seq_length = int(num_samples), int(max_seq_length)
        self.info, self.masking, self.seed = info, masking, int(seed)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockBertDataset: sample {idx} out of range")
        rng = np.random.RandomState((self.seed + idx) % 2 ** 32)
        budget = self.max_seq_length - 3
        target = budget if rng.random_sample() >= self.masking.short_seq_prob \
            else 2 + rng.randint(budget - 1)
        n_sent = 2 + rng.randint(4)
        sentences = [self.info.random_ids[rng.randint(len(self.info.random_ids),
                                                      size=1 + rng.randint(budget // 2))]
                     for _ in range(n_sent)]
        m = self.masking
        return build_training_sample(sentences, target, self.max_seq_length, self.info,
                                     m.masked_lm_prob, rng, m.binary_head, m.whole_word_masking,
                                     m.max_ngram)


def _mapping(name: str, ds: IndexedDataset, docs: np.ndarray, num_samples: int,
             max_seq_length: int, seed: int, masking: MaskingConfig,
             data_cache_path: Optional[str]) -> Tuple[np.ndarray, bool]:
    max_num_tokens = max_seq_length - (3 if masking.binary_head else 2)
    min_num_sent = 2 if masking.binary_head else 1
    description = {
        "class": "BertDataset", "version": _MAPPING_VERSION, "name": name,
        "prefix": os.path.abspath(ds.prefix), "num_sequences": len(ds),
        "docs": hashlib.md5(docs.tobytes()).hexdigest(), "num_samples": num_samples,
        "max_num_tokens": max_num_tokens, "short_seq_prob": masking.short_seq_prob,
        "min_num_sent": min_num_sent, "seed": seed, "long_sentence_len": LONG_SENTENCE_LEN,
    }
    key = cache_key(description)
    cache = index_cache_dir(ds.prefix, data_cache_path)
    path = cache / f"{key}-{name}_bert_mapping.npy"
    cached = load_cached_arrays([path])
    if cached is not None:
        rows = cached[0]
        # Values too: a corrupt cache must not read sentences outside the split.
        if (rows.dtype.kind in "iu" and rows.shape == (num_samples, 3)
                and rows[:, 0].min() >= docs[0] and rows[:, 1].max() <= docs[-1]
                and (rows[:, 1].astype(np.int64) - rows[:, 0]).min() >= min_num_sent
                and rows[:, 2].min() >= 1 and rows[:, 2].max() <= max_num_tokens):
            return rows, True
        print(f"warning: BERT sample mapping cache {path} points outside {ds.prefix} (corrupt "
              f"or from another dataset); rebuilding it", file=sys.stderr, flush=True)
    try:
        mapping = helpers.build_bert_mapping(docs, ds.sizes, num_samples, max_num_tokens,
                                             masking.short_seq_prob, seed, min_num_sent,
                                             LONG_SENTENCE_LEN)
    except RuntimeError as exc:
        if "enough sentences" not in str(exc):
            raise
        # A corpus without sentence splitting has one sequence per document (none for an
        # empty one).
        if int(np.diff(ds.doc_idx).max(initial=0)) <= 1:
            hint = ("each document is one sequence: preprocess documents of several "
                    "sentences with tools/preprocess_data.py --split-sentences")
        else:
            hint = (f"the dataset is split into sentences, but the split's {len(docs) - 1} "
                    f"documents are too short or have a sentence of more than "
                    f"{LONG_SENTENCE_LEN} tokens (skipped, as by Megatron-LM); give it "
                    f"documents of several sentences")
        raise DataError(f"{ds.prefix}: the {name} split has no document with {min_num_sent} "
                        f"or more sentences, which sentence-pair samples need; {hint}") from None
    try:
        write_text_atomic(cache / f"{key}-{name}_bert_description.json",
                          json.dumps(description, indent=2, sort_keys=True))
        save_npy_atomic(path, mapping)
    except OSError as exc:
        warn_cache_not_written("BERT sample mappings", cache, exc)
    return mapping, False


@alike_on_every_rank
def build_train_valid_test_datasets(data_prefix: List[str], split: str,
                                    train_valid_test_num_samples: Sequence[int],
                                    max_seq_length: int, seed: int, info: BertVocabInfo,
                                    masking: MaskingConfig,
                                    data_cache_path: Optional[str] = None):
    """(train, valid, test) BERT datasets; --split cuts the documents of each prefix.

    Several weighted prefixes give ``BlendableDataset``s, as for GPT.
    """
    from megatron.data.blendable_dataset import BlendableDataset

    prefixes, weights = parse_data_path(data_prefix)
    # A valid/test split that no prefix has documents for is skipped, as with one
    # prefix: Megatron-LM's blends skip a split whose --split share is 0 (--split
    # 100,0,0).  One that only some prefixes lack is still an error (naming the prefix).
    num_samples = list(train_valid_test_num_samples)
    if len(prefixes) > 1:
        bounds = [split_boundaries(split, len(open_prefix(p).doc_idx) - 1) for p in prefixes]
        for s in (1, 2):
            if all(b[s] == b[s + 1] for b in bounds):
                num_samples[s] = 0
    counts = np.zeros((len(prefixes), 3), dtype=np.int64)
    for s, n in enumerate(num_samples):
        if n > 0:
            if len(prefixes) == 1:
                counts[0, s] = n
            else:
                index, _ = helpers.build_blending_indices(np.asarray(weights), int(n))
                counts[:, s] = np.bincount(index, minlength=len(prefixes))
    per_prefix = []
    for j, prefix in enumerate(prefixes):
        ds = open_prefix(prefix)
        bounds = split_boundaries(split, len(ds.doc_idx) - 1)
        splits = []
        for s, name in enumerate(_SPLIT_NAMES):
            n = int(counts[j, s])
            if n <= 0 or bounds[s] == bounds[s + 1]:
                # Training needs its split; an empty valid/test split is skipped
                # (Megatron's behaviour) unless a blend needs samples from it.
                if n > 0 and (len(prefixes) > 1 or name == "train"):
                    raise empty_split_error(split, prefix, name, n, len(ds.doc_idx) - 1)
                splits.append(None)
                continue
            splits.append(BertDataset(name, ds, bounds[s], bounds[s + 1], n, max_seq_length,
                                      seed, info, masking, data_cache_path))
        per_prefix.append(splits)
    if len(prefixes) == 1:
        return tuple(per_prefix[0])
    return tuple(BlendableDataset([d[s] for d in per_prefix], weights, int(n)) if n > 0 else None
                 for s, n in enumerate(num_samples))


@alike_on_every_rank
def build_split_path_datasets(split_paths: Sequence[Optional[Sequence[str]]],
                              train_valid_test_num_samples: Sequence[int],
                              max_seq_length: int, seed: int, info: BertVocabInfo,
                              masking: MaskingConfig, data_cache_path: Optional[str] = None):
    """(train, valid, test) BERT datasets from ``--train-data-path``,
    ``--valid-data-path`` and ``--test-data-path``: each split reads all the documents
    of its own prefix or blend (``dataset_utils.build_per_split_datasets``)."""
    def build_one(name: str, ds: IndexedDataset, n: int) -> BertDataset:
        return BertDataset(name, ds, 0, len(ds.doc_idx) - 1, n, max_seq_length, seed, info,
                           masking, data_cache_path)

    return build_per_split_datasets(split_paths, train_valid_test_num_samples, build_one)

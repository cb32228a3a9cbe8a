"""BERT data: C++ vs Python sample mapping, sample layout, masking statistics, corpus."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.bert_dataset import (BertDataset, BertVocabInfo, MaskingConfig,
                                        MockBertDataset, SplitMix64, build_bert_mapping_py,
                                        build_training_sample)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
REPO = Path(__file__).resolve().parents[2]


def _info(vocab: int = 100, continuation=None) -> BertVocabInfo:
    return BertVocabInfo(cls=1, sep=2, mask=3, pad=0, vocab_size=vocab,
                         random_ids=np.arange(4, vocab), is_continuation=continuation)


def _random_corpus(rng, max_docs=30, max_sent=8):
    counts = rng.randint(0, max_sent, size=rng.randint(1, max_docs))
    docs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = rng.randint(1, 40, size=int(docs[-1])).astype(np.int32)
    return docs, sizes


# ------------------------------------------------------------------------------ mapping
def test_splitmix64_known_values():
    # Reference values of SplitMix64 seeded with 0 (Vigna's generator).
    rng = SplitMix64(0)
    assert [rng.next() for _ in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                              0x06C45D188009454F]


def test_cpp_mapping_equals_python_reference():
    rng = np.random.RandomState(0)
    compared = 0
    for _ in range(25):
        docs, sizes = _random_corpus(rng)
        args = (docs, sizes, int(rng.randint(0, 150)), int(rng.randint(2, 90)),
                float(rng.choice([0.0, 0.1, 0.5, 1.0])), int(rng.randint(0, 2 ** 62)),
                int(rng.randint(1, 3)))
        try:
            expected = build_bert_mapping_py(*args)
        except RuntimeError as exc:
            with pytest.raises(RuntimeError, match="enough sentences"):
                helpers.build_bert_mapping(*args)
            assert "enough sentences" in str(exc)
            continue
        got = helpers.build_bert_mapping(*args)
        assert got.dtype == np.int64 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        compared += 1
    assert compared >= 15


def test_documents_without_sentences_change_no_sample():
    """preprocess_data keeps empty documents (no sequences, as Megatron-LM): the mapping of
    a corpus with them equals that of the same corpus without them, C++ and Python."""
    sizes = np.array([5, 6, 7, 4, 5, 6, 9, 3], dtype=np.int32)
    plain = np.array([0, 3, 6, 8], dtype=np.int64)
    with_empty = np.array([0, 0, 3, 3, 3, 6, 8, 8], dtype=np.int64)
    for build in (helpers.build_bert_mapping, build_bert_mapping_py):
        np.testing.assert_array_equal(build(with_empty, sizes, 40, 30, 0.1, 7, 2),
                                      build(plain, sizes, 40, 30, 0.1, 7, 2))


def test_mapping_properties():
    rng = np.random.RandomState(1)
    docs = np.concatenate([[0], np.cumsum(rng.randint(1, 12, size=200))]).astype(np.int64)
    sizes = rng.randint(3, 30, size=int(docs[-1])).astype(np.int32)
    n, max_tokens = 3000, 61
    mapping = helpers.build_bert_mapping(docs, sizes, n, max_tokens, 0.1, 5, 2)
    assert mapping.shape == (n, 3)
    doc_of = np.searchsorted(docs, mapping[:, 0], side="right") - 1
    # each sample is >= 2 consecutive sentences of one document
    assert np.all(mapping[:, 1] - mapping[:, 0] >= 2)
    assert np.all(mapping[:, 1] <= docs[doc_of + 1])
    targets = mapping[:, 2]
    assert targets.min() >= 2 and targets.max() == max_tokens
    short = np.mean(targets < max_tokens)
    assert 0.05 < short < 0.16, short  # ~short_seq_prob (minus draws equal to the max)
    # shuffled: not in document order
    assert not np.all(np.diff(mapping[:, 0]) >= 0)


def test_mapping_of_single_sentence_documents_needs_no_binary_head():
    docs = np.arange(6, dtype=np.int64)  # five one-sentence documents
    sizes = np.full(5, 7, dtype=np.int32)
    with pytest.raises(RuntimeError, match="enough sentences"):
        helpers.build_bert_mapping(docs, sizes, 4, 20, 0.0, 1, 2)
    ok = helpers.build_bert_mapping(docs, sizes, 12, 20, 0.0, 1, 1)
    # whole epochs shuffled together (as Megatron-LM), the first 12 kept: every document
    # two or three times
    assert ok.shape == (12, 3)
    counts = np.bincount(ok[:, 0], minlength=5)
    assert counts.min() >= 2 and counts.max() <= 3


# ------------------------------------------------------------------------ sample layout
def test_training_sample_layout_and_sentence_order():
    info = _info()
    sentences = [np.array([10, 11, 12]), np.array([20, 21]), np.array([30, 31, 32, 33])]
    swapped = kept = 0
    for seed in range(60):
        rng = np.random.RandomState(seed)
        s = build_training_sample(sentences, 29, 32, info, 0.15, rng)
        n = int(s["padding_mask"].sum())
        assert n == 3 + 9 and np.all(s["padding_mask"][n:] == 0) and np.all(s["text"][n:] == 0)
        labels, mask = s["labels"], s["loss_mask"]
        assert np.array_equal(mask == 1, labels >= 0)
        original = s["text"].copy()
        original[mask == 1] = labels[mask == 1]
        assert original[0] == info.cls and original[n - 1] == info.sep
        sep_a = int(np.flatnonzero(original[:n] == info.sep)[0])
        a, b = original[1:sep_a].tolist(), original[sep_a + 1:n - 1].tolist()
        assert np.all(s["types"][:sep_a + 1] == 0) and np.all(s["types"][sep_a + 1:n] == 1)
        flat = [t for x in sentences for t in x.tolist()]
        if s["is_random"]:
            assert b + a == flat
            swapped += 1
        else:
            assert a + b == flat
            kept += 1
        assert 1 <= mask.sum() <= max(1, round(n * 0.15))
    assert swapped > 15 and kept > 15


def test_truncation_respects_target_length():
    info = _info()
    sentences = [np.arange(4, 40), np.arange(40, 90)]
    for seed in range(10):
        s = build_training_sample(sentences, 20, 64, info, 0.15, np.random.RandomState(seed))
        assert s["padding_mask"].sum() == 23 and s["truncated"] == 1


def test_no_binary_head_is_one_segment():
    info = _info()
    s = build_training_sample([np.array([5, 6, 7])], 30, 32, info, 0.15,
                              np.random.RandomState(0), binary_head=False)
    assert s["padding_mask"].sum() == 5 and s["is_random"] == 0
    assert np.all(s["types"] == 0)


def test_masking_statistics():
    """Up to 15% of tokens predicted (Megatron-LM's cap: 0.15 x the target length, 18 of
    128 here); of those 80% [MASK], 10% random, 10% unchanged."""
    info = _info(vocab=1000)
    rng = np.random.RandomState(0)
    predicted = real = masked = unchanged = randomised = 0
    for i in range(400):
        sentences = [rng.randint(4, 1000, size=rng.randint(20, 60)) for _ in range(4)]
        s = build_training_sample(sentences, 125, 128, info, 0.15, np.random.RandomState(i))
        n = int(s["padding_mask"].sum())
        sel = s["loss_mask"] == 1
        assert not np.any(np.isin(s["labels"][sel], [info.cls, info.sep]))
        predicted += int(sel.sum())
        real += n
        masked += int(np.sum(s["text"][sel] == info.mask))
        unchanged += int(np.sum(s["text"][sel] == s["labels"][sel]))
        randomised += int(np.sum((s["text"][sel] != info.mask) & (s["text"][sel] != s["labels"][sel])))
    assert abs(predicted / real - 18 / 128) < 0.006
    assert abs(masked / predicted - 0.8) < 0.02
    # a random replacement can draw the original id (p = 1/996): count it as unchanged
    assert abs(unchanged / predicted - 0.1) < 0.015
    assert abs(randomised / predicted - 0.1) < 0.015


def test_whole_word_masking_masks_complete_words():
    cont = np.zeros(100, dtype=bool)
    cont[50:100] = True  # ids >= 50 are '##' continuations
    info = _info(continuation=cont)
    rng = np.random.RandomState(0)
    for i in range(100):
        words = [[int(rng.randint(4, 50))] + list(rng.randint(50, 100, size=rng.randint(0, 3)))
                 for _ in range(30)]
        sentences = [np.array([t for w in words[:15] for t in w]),
                     np.array([t for w in words[15:] for t in w])]
        s = build_training_sample(sentences, 125, 128, info, 0.15, np.random.RandomState(i),
                                  whole_word_masking=True)
        original = s["text"].copy()
        sel = s["loss_mask"] == 1
        original[sel] = s["labels"][sel]
        n = int(s["padding_mask"].sum())
        for pos in range(1, n):
            if original[pos] >= 50 and original[pos - 1] not in (info.cls, info.sep):
                # a continuation is predicted iff the token before it is
                assert sel[pos] == sel[pos - 1]


def test_vocab_info_without_special_tokens():
    from megatron.tokenizer.tokenizer import NullTokenizer

    info = BertVocabInfo.from_tokenizer(NullTokenizer(50))
    assert (info.pad, info.cls, info.sep, info.mask) == (0, 1, 2, 3)
    assert info.random_ids.min() == 4 and info.random_ids.max() == 50  # 51 ids, eod 50


def test_mock_dataset_is_deterministic():
    info = _info()
    a = MockBertDataset(5, 32, info, MaskingConfig(), seed=3)
    b = MockBertDataset(5, 32, info, MaskingConfig(), seed=3)
    for i in (4, 0, 2):
        for k, v in a[i].items():
            np.testing.assert_array_equal(v, b[i][k])
    assert not np.array_equal(a[0]["text"], a[1]["text"])


# ------------------------------------------------------------------ a real sentence corpus
def _load_preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_data_for_bert",
                                                  REPO / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dataset_from_split_sentences_corpus(tmp_path):
    vocab = DATA / "bert" / "vocab.txt"
    if not vocab.exists():
        pytest.skip(f"{vocab} not available")
    from megatron.data.indexed_dataset import IndexedDataset
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    docs = ["Mr. Brown met Dr. Green. They talked for 2.5 hours about tea. It was fine!",
            "One sentence only.",
            "Paris is big. Rome is old. Berlin is cold. Oslo is far. Who knows? Not me."]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _load_preprocess().main(["--input", str(tmp_path / "in.jsonl"), "--split-sentences",
                             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                             str(vocab), "--output-prefix", str(tmp_path / "c")])
    ds = IndexedDataset(str(tmp_path / "c_text_sentence"))
    assert ds.doc_idx.tolist() == [0, 3, 4, 10]
    tok = BertWordPieceTokenizer(str(vocab))
    assert ds[1].tolist() == tok.tokenize("They talked for 2.5 hours about tea.")
    info = BertVocabInfo.from_tokenizer(tok)
    kwargs = dict(indexed_dataset=ds, first_doc=0, last_doc=3, num_samples=20,
                  max_seq_length=24, seed=9, info=info, masking=MaskingConfig(),
                  data_cache_path=str(tmp_path / "cache"))
    first = BertDataset("train", **kwargs)
    second = BertDataset("train", **kwargs)
    assert not first.index_cache_hit and second.index_cache_hit
    np.testing.assert_array_equal(first.mapping, second.mapping)
    for i in range(len(first)):
        s = first[i]
        assert s["text"][0] == tok.cls and int(s["padding_mask"].sum()) <= 24
        start, end, _ = first.mapping[i]
        assert end - start >= 2 and start >= 0 and end <= 10
        assert not (start < 3 < end or start < 4 < end)  # never across documents


# ------------------------------------------------------------- issue 12: data errors
def _sentence_corpus(prefix, vocab_top):
    from megatron.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(5)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for _ in range(12):
        for _ in range(4):
            b.add_item(rng.integers(4, vocab_top, 10))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def test_bert_token_id_outside_vocabulary_is_one_error(tmp_path):
    from megatron.data.indexed_dataset import IndexedDataset
    from megatron.errors import DataError

    ds = IndexedDataset(_sentence_corpus(tmp_path / "s", 500))
    bert = BertDataset("train", ds, 0, 12, 10, 32, 1, _info(100), MaskingConfig(),
                       str(tmp_path / "cache"))
    with pytest.raises(DataError) as info:
        bert[0]
    msg = str(info.value)
    assert f"{tmp_path / 's'}.bin: token id" in msg and "vocabulary [0, 100)" in msg
    assert "train sample 0" in msg


def test_bert_empty_train_split_is_one_error(tmp_path):
    from megatron.data.bert_dataset import build_train_valid_test_datasets
    from megatron.errors import DataError

    prefix = _sentence_corpus(tmp_path / "s", 90)
    with pytest.raises(DataError, match=r"--split '0,50,50' with --data-path .*train split"):
        build_train_valid_test_datasets([prefix], "0,50,50", (10, 5, 5), 32, 1, _info(100),
                                        MaskingConfig(), str(tmp_path / "cache"))


def test_bert_corpus_without_sentence_split_is_one_error(tmp_path):
    from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.errors import DataError

    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.int32)
    for _ in range(5):
        b.add_item(np.arange(4, 40))
        b.end_document()  # one sequence per document: no sentence pairs possible
    b.end_document()  # and an empty one, as preprocess_data keeps them
    b.finalize(str(tmp_path / "d.idx"))
    with pytest.raises(DataError, match="--split-sentences"):
        BertDataset("train", IndexedDataset(str(tmp_path / "d")), 0, 6, 10, 32, 1, _info(100),
                    MaskingConfig(), str(tmp_path / "cache"))

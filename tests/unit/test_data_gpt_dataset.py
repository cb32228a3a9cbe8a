"""GPT dataset: split parsing, sample contents, epochs, caching, blending, mock data."""
import os
import re

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_utils import parse_data_path, parse_split, split_boundaries
from megatron.data.gpt_dataset import (GPTDataset, MockGPTDataset,
                                       build_train_valid_test_datasets, num_epochs_needed,
                                       separate_last_epoch)
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.errors import DataError


def _make_corpus(prefix, n_docs, seed=0, base=0, max_len=30):
    """Documents whose tokens encode (doc id, position) so samples can be checked."""
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    docs = []
    for d in range(n_docs):
        length = int(rng.integers(1, max_len))
        tokens = base + d * 1000 + np.arange(length)
        docs.append(tokens)
        b.add_item(tokens)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix), docs


@pytest.mark.parametrize("text,expected", [
    ("969,30,1", [0.969, 0.030, 0.001]),
    ("969, 30, 1", [0.969, 0.030, 0.001]),
    ("98,2,0", [0.98, 0.02, 0.0]),
    (" 90 / 10 ", [0.9, 0.1, 0.0]),
    ("1", [1.0, 0.0, 0.0]),
])
def test_parse_split(text, expected):
    np.testing.assert_allclose(parse_split(text), expected)


@pytest.mark.parametrize("text", ["", "a,b,c", "1,2,3,4", "-1,2,0", "0,0,0", "1,,2"])
def test_parse_split_errors_name_the_flag(text):
    with pytest.raises(ValueError, match="--split"):
        parse_split(text)


def test_split_boundaries_are_contiguous_and_cover_everything():
    assert split_boundaries("969,30,1", 1000) == [0, 969, 999, 1000]
    assert split_boundaries("98,2,0", 10) == [0, 10, 10, 10]
    for size in range(0, 60):
        b = split_boundaries("33,33,34", size)
        assert b[0] == 0 and b[-1] == size and b == sorted(b)


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], [1.0])
    prefixes, weights = parse_data_path(["0.3", "a", "0.7", "b"])
    assert prefixes == ["a", "b"] and np.allclose(weights, [0.3, 0.7])
    prefixes, weights = parse_data_path(["3", "a", "1", "b"])
    assert np.allclose(weights, [0.75, 0.25])
    for bad in (["0.3", "a", "b"], ["x", "a", "0.5", "b"], ["-1", "a", "1", "b"], []):
        with pytest.raises(DataError, match="--data-path"):  # a user error: one line
            parse_data_path(bad)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_prefixes_without_weights_are_weighted_by_their_tokens(tmp_path, kind):
    """Megatron-LM blends an unweighted --data-path list using each dataset whole: here
    each prefix's weight is its share of the tokens, the same blend as those weights
    given explicitly; a missing prefix of such a list is named."""
    from megatron.data.dataset_utils import open_prefix
    from megatron.data.indexed_dataset import IndexedDatasetBuilder
    from tests.unit.test_bert_dataset import _info
    from tests.unit.test_qa30_blend_splits import _corpus

    def sentences(prefix, n_docs):  # documents of four 10-token sentences
        rng = np.random.default_rng(n_docs)
        b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
        for _ in range(n_docs):
            for _ in range(4):
                b.add_item(rng.integers(4, 90, 10))
            b.end_document()
        b.finalize(f"{prefix}.idx")
        return str(prefix)

    if kind == "gpt":
        pa, pb = _corpus(tmp_path / "a", 40, 1), _corpus(tmp_path / "b", 12, 2)
        args = ("1,0,0", (30, 0, 0), 8, 3, str(tmp_path / "cache"))
    else:
        from megatron.data.bert_dataset import MaskingConfig
        from megatron.data.bert_dataset import build_train_valid_test_datasets as build
        pa, pb = sentences(tmp_path / "a", 24), sentences(tmp_path / "b", 8)
        args = ("1,0,0", (30, 0, 0), 32, 1, _info(100), MaskingConfig(),
                str(tmp_path / "cache"))
    build = build_train_valid_test_datasets if kind == "gpt" else build
    tokens = [int(open_prefix(p).sizes.sum()) for p in (pa, pb)]
    prefixes, weights = parse_data_path([pa, pb])
    assert prefixes == [pa, pb] and weights == pytest.approx(
        [tokens[0] / sum(tokens), tokens[1] / sum(tokens)])
    assert 0.55 < weights[0] < 0.95  # the datasets differ in size: not an even split
    plain = build([pa, pb], *args)[0]
    weighted = build([str(tokens[0]), pa, str(tokens[1]), pb], *args)[0]
    assert len(plain) == len(weighted) == 30
    for i in range(30):
        for key, value in plain[i].items():
            assert np.array_equal(value, weighted[i][key]), (i, key)
    with pytest.raises(DataError, match="--data-path: dataset prefix .*nope.* not found"):
        build([pa, str(tmp_path / "nope")], *args)


def test_missing_prefix_names_flag_and_files(tmp_path):
    with pytest.raises(DataError) as info:
        build_train_valid_test_datasets([str(tmp_path / "nope")], "1,0,0", (4, 0, 0), 8, 1)
    msg = str(info.value)
    assert "--data-path" in msg and "nope.bin" in msg and "nope.idx" in msg


def test_samples_are_windows_of_the_shuffled_stream(tmp_path):
    prefix, docs = _make_corpus(tmp_path / "c", 20)
    ds = IndexedDataset(prefix)
    documents = np.arange(3, 17)
    seq, n = 7, 60
    gpt = GPTDataset("train", ds, documents, n, seq, seed=5, data_cache_path=str(tmp_path / "k"))
    tokens_per_epoch = sum(len(docs[d]) for d in documents)
    epochs = num_epochs_needed(tokens_per_epoch, seq, n)
    assert (epochs * tokens_per_epoch - 1) // seq >= n > ((epochs - 1) * tokens_per_epoch - 1) // seq
    separate = separate_last_epoch(epochs, tokens_per_epoch, seq, n)
    assert epochs > 1 and separate  # the case this test is about
    # doc_idx: the complete epochs' documents shuffled together, then the last epoch's.
    doc_idx = np.asarray(gpt.doc_idx)
    head = doc_idx[:(epochs - 1) * documents.size]
    assert doc_idx.size == epochs * documents.size
    assert sorted(head.tolist()) == sorted(documents.tolist() * (epochs - 1))
    assert sorted(doc_idx[head.size:].tolist()) == documents.tolist()
    # Independent reference: the concatenated stream, sliced directly.
    stream = np.concatenate([docs[d] for d in doc_idx])
    shuffle = np.asarray(gpt.shuffle_idx)
    for i in range(n):
        k = int(shuffle[i])
        np.testing.assert_array_equal(gpt[i]["text"], stream[k * seq:k * seq + seq + 1])
        assert gpt[i]["text"].dtype == np.int64
    # The shuffle visits each sample once; complete epochs come before the last one.
    total = np.asarray(gpt.sample_idx).shape[0] - 1
    assert sorted(shuffle.tolist()) == list(range(total))
    full = max(0, ((epochs - 1) * tokens_per_epoch - 1) // seq)
    assert sorted(shuffle[:full].tolist()) == list(range(full))
    with pytest.raises(IndexError):
        gpt[n]


def test_deterministic_and_seed_dependent(tmp_path):
    prefix, _ = _make_corpus(tmp_path / "c", 30)
    ds = IndexedDataset(prefix)
    docs = np.arange(30)
    a = GPTDataset("train", ds, docs, 25, 5, seed=1, data_cache_path=str(tmp_path / "a"))
    b = GPTDataset("train", ds, docs, 25, 5, seed=1, data_cache_path=str(tmp_path / "b"))
    c = GPTDataset("train", ds, docs, 25, 5, seed=2, data_cache_path=str(tmp_path / "c"))
    same = [np.array_equal(a[i]["text"], b[i]["text"]) for i in range(25)]
    other = [np.array_equal(a[i]["text"], c[i]["text"]) for i in range(25)]
    assert all(same) and not all(other)


def test_index_cache_is_reused(tmp_path, monkeypatch):
    prefix, _ = _make_corpus(tmp_path / "c", 15)
    ds = IndexedDataset(prefix)
    first = GPTDataset("train", ds, np.arange(15), 40, 6, seed=3)
    assert not first.index_cache_hit
    cache_files = sorted(os.listdir(tmp_path / "cache"))  # default: beside the prefix
    assert len([f for f in cache_files if f.endswith(".npy")]) == 3
    assert any(f.endswith("description.json") for f in cache_files)

    def must_not_build(*args, **kwargs):
        raise AssertionError("index rebuilt although it is cached")

    monkeypatch.setattr(helpers, "build_sample_idx", must_not_build)
    second = GPTDataset("train", ds, np.arange(15), 40, 6, seed=3)
    assert second.index_cache_hit
    for i in range(40):
        np.testing.assert_array_equal(first[i]["text"], second[i]["text"])
    # Different parameters are a different cache entry, never a stale hit.
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset("train", ds, np.arange(15), 41, 6, seed=3)


def test_build_single_prefix_splits(tmp_path):
    prefix, docs = _make_corpus(tmp_path / "c", 100)
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "80, 20, 0", (50, 10, 5), 8, 7, str(tmp_path / "cache"))
    assert test is None  # the split has no documents
    assert len(train) == 50 and len(valid) == 10
    assert set(np.asarray(train.doc_idx).tolist()) == set(range(80))
    assert set(np.asarray(valid.doc_idx).tolist()) == set(range(80, 100))
    # Every token of a valid sample comes from a valid-split document (ids >= 80000).
    assert all(valid[i]["text"].min() >= 80 * 1000 for i in range(10))
    _, _, none = build_train_valid_test_datasets([prefix], "8,1,1", (5, 5, 0), 8, 7,
                                                 str(tmp_path / "cache"))
    assert none is None  # zero samples requested


def test_blended_datasets(tmp_path):
    pa, _ = _make_corpus(tmp_path / "a", 40, seed=1, base=0)
    pb, _ = _make_corpus(tmp_path / "b", 40, seed=2, base=10 ** 6)
    train, valid, test = build_train_valid_test_datasets(
        ["0.25", pa, "0.75", pb], "90,10,0", (200, 20, 0), 6, 11, str(tmp_path / "cache"))
    assert isinstance(train, BlendableDataset) and test is None
    assert len(train) == 200 and len(valid) == 20
    from_b = [bool(train[i]["text"].min() >= 10 ** 6) for i in range(200)]
    assert sum(from_b) == 150
    assert train.datasets[0].num_samples + train.datasets[1].num_samples == 200
    # Deterministic: a rebuild (from the cache) gives identical samples.
    again, _, _ = build_train_valid_test_datasets(
        ["0.25", pa, "0.75", pb], "90,10,0", (200, 20, 0), 6, 11, str(tmp_path / "cache"))
    assert all(np.array_equal(train[i]["text"], again[i]["text"]) for i in range(200))


def test_blend_with_empty_split_component_errors(tmp_path):
    pa, _ = _make_corpus(tmp_path / "a", 40)
    pb, _ = _make_corpus(tmp_path / "b", 1)
    with pytest.raises(DataError, match="--split"):
        build_train_valid_test_datasets(["0.5", pa, "0.5", pb], "50,50,0", (10, 10, 0), 4,
                                        1, str(tmp_path / "cache"))


def test_mock_dataset():
    ds = MockGPTDataset(10, 16, 50, seed=3)
    assert len(ds) == 10
    a, b = ds[4]["text"], MockGPTDataset(10, 16, 50, seed=3)[4]["text"]
    assert a.shape == (17,) and a.dtype == np.int64 and 0 <= a.min() and a.max() < 50
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, ds[5]["text"])
    assert not np.array_equal(a, MockGPTDataset(10, 16, 50, seed=4)[4]["text"])


# ------------------------------------------------------------- issue 12: data errors
def test_empty_train_split_is_one_error_naming_split_and_data_path(tmp_path):
    prefix, _ = _make_corpus(tmp_path / "c", 20)
    with pytest.raises(DataError) as info:
        build_train_valid_test_datasets([prefix], "0,50,50", (8, 4, 4), 8, 1,
                                        str(tmp_path / "cache"))
    msg = str(info.value)
    assert "--split '0,50,50'" in msg and f"--data-path {prefix}" in msg
    assert "train split needs 8 samples" in msg and "\n" not in msg


def test_empty_dataset_is_an_error_for_training(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e.bin"), np.uint16)
    b.finalize(str(tmp_path / "e.idx"))
    with pytest.raises(DataError, match="train split needs 4 samples but gets no tokens"):
        build_train_valid_test_datasets([str(tmp_path / "e")], "1,0,0", (4, 0, 0), 8, 1)


def test_token_id_outside_vocabulary_names_file_document_and_id(tmp_path):
    prefix, _ = _make_corpus(tmp_path / "c", 20)  # ids are doc * 1000 + position
    train, _, _ = build_train_valid_test_datasets([prefix], "1,0,0", (30, 0, 0), 8, 1,
                                                  str(tmp_path / "cache"), vocab_size=15000)
    with pytest.raises(DataError) as info:
        [train[i] for i in range(len(train))]  # documents 15..19 hold ids >= 15000
    msg = str(info.value)
    assert re.match(r".*c\.bin: token id (1[5-9])\d{3} in document \(sequence\) \1, "
                    r"train sample \d+, is outside the vocabulary \[0, 15000\)", msg), msg
    # Without a vocabulary size (old callers) nothing is checked.
    train, _, _ = build_train_valid_test_datasets([prefix], "1,0,0", (30, 0, 0), 8, 1,
                                                  str(tmp_path / "cache"))
    assert len([train[i] for i in range(len(train))]) == 30


@pytest.mark.parametrize("which", ["doc", "sample", "shuffle"])
def test_truncated_index_cache_is_named_and_rebuilt(tmp_path, capsys, which):
    prefix, _ = _make_corpus(tmp_path / "c", 30)
    ds = IndexedDataset(prefix)
    cache = tmp_path / "cache"
    first = GPTDataset("train", ds, np.arange(30), 40, 6, seed=3, data_cache_path=str(cache))
    expected = [first[i]["text"] for i in range(40)]
    (victim,) = cache.glob(f"*_{which}_idx.npy")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    again = GPTDataset("train", ds, np.arange(30), 40, 6, seed=3, data_cache_path=str(cache))
    err = capsys.readouterr().err
    assert str(victim) in err and "rebuilding" in err and err.count("\n") == 1
    assert not again.index_cache_hit
    for i in range(40):
        np.testing.assert_array_equal(again[i]["text"], expected[i])
    third = GPTDataset("train", ds, np.arange(30), 40, 6, seed=3, data_cache_path=str(cache))
    assert third.index_cache_hit

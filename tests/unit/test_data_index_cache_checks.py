"""Index caches that load but hold the wrong kind of values are rebuilt, not trusted.

A cache file that np.load reads (no pickle) can still be unusable: float or structured
arrays, a sample index whose values lie inside the dataset but out of order, or a
shuffle that is not a permutation.  Each is rebuilt with one warning line, and the
samples are those of a fresh build.
"""
import numpy as np
import pytest

from megatron.data.bert_dataset import BertDataset, BertVocabInfo, MaskingConfig
from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _gpt_corpus(prefix, n_docs=30):
    rng = np.random.default_rng(0)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for d in range(n_docs):
        b.add_item(d * 1000 + np.arange(int(rng.integers(1, 30))))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def _float(a):
    return a.astype(np.float64)


def _structured(a):
    return np.zeros(a.shape[0], dtype=[("a", "<i4")])


def _reversed(a):
    return a[::-1].copy()


def _zeros(a):
    return np.zeros_like(a)


@pytest.mark.parametrize("which,mutate", [
    ("doc", _float), ("sample", _float), ("shuffle", _float),
    ("doc", _structured), ("sample", lambda a: a.astype(np.complex64)),
    ("doc", lambda a: a > 0),
    ("sample", _reversed),  # in range, out of order
    ("sample", _zeros),
    ("shuffle", _zeros),  # in range, not a permutation
])
def test_gpt_cache_with_wrong_values_is_rebuilt(tmp_path, capsys, which, mutate):
    ds = _gpt_corpus(tmp_path / "c")
    cache = tmp_path / "cache"
    first = GPTDataset("train", ds, np.arange(30), 40, 6, seed=3, data_cache_path=str(cache))
    expected = [first[i]["text"] for i in range(40)]
    (victim,) = cache.glob(f"*_{which}_idx.npy")
    np.save(victim, mutate(np.load(victim)), allow_pickle=False)
    capsys.readouterr()
    again = GPTDataset("train", ds, np.arange(30), 40, 6, seed=3, data_cache_path=str(cache))
    err = capsys.readouterr().err
    assert not again.index_cache_hit
    assert "rebuilding" in err and err.count("\n") == 1
    for i in range(40):
        np.testing.assert_array_equal(again[i]["text"], expected[i])
    assert GPTDataset("train", ds, np.arange(30), 40, 6, seed=3,
                      data_cache_path=str(cache)).index_cache_hit


class _Tok:
    vocab_size = 64
    cls, sep, mask, pad = 1, 2, 3, 0
    inv_vocab = {i: f"t{i}" for i in range(64)}


def _bert_corpus(prefix):
    rng = np.random.default_rng(1)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(20):
        for _ in range(int(rng.integers(2, 6))):
            b.add_item(rng.integers(4, 64, int(rng.integers(3, 12))))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


@pytest.mark.parametrize("mutate", [
    lambda a: a.astype(np.complex128),
    lambda a: a.astype(np.float32),
])
def test_bert_mapping_cache_of_another_dtype_is_rebuilt(tmp_path, capsys, mutate):
    ds = _bert_corpus(tmp_path / "s")
    info = BertVocabInfo.from_tokenizer(_Tok())
    cache = tmp_path / "cache"

    def build():
        return BertDataset("train", ds, 0, 20, 30, 32, 5, info, MaskingConfig(),
                           str(cache))
    expected = [build()[i]["text"] for i in range(30)]
    (victim,) = cache.glob("*_bert_mapping.npy")
    np.save(victim, mutate(np.load(victim)), allow_pickle=False)
    capsys.readouterr()
    again = build()
    err = capsys.readouterr().err
    assert not again.index_cache_hit
    assert "rebuilding" in err and err.count("\n") == 1
    for i in range(30):
        np.testing.assert_array_equal(again[i]["text"], expected[i])

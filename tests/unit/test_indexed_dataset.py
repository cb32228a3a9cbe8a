"""Round trip, merge and corruption handling of the .bin/.idx indexed dataset."""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (HEADER_BYTES, MAGIC, IndexedDataset,
                                           IndexedDatasetBuilder, best_fitting_dtype)


def _write(prefix, docs, dtype=np.int32):
    """docs: list of documents, each a list of sequences."""
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def _random_docs(rng, n_docs, vocab):
    return [[rng.integers(0, vocab, rng.integers(0, 20)).tolist()
             for _ in range(rng.integers(1, 4))] for _ in range(n_docs)]


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 65000), (np.int32, 200000),
                                         (np.uint8, 256), (np.int64, 2 ** 40)])
def test_round_trip(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    docs = _random_docs(rng, 30, vocab)
    ds = IndexedDataset(_write(tmp_path / "d", docs, dtype))
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat)
    assert ds.dtype == np.dtype(dtype)
    assert ds.sizes.tolist() == [len(s) for s in flat]
    assert ds.doc_idx.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    for i, seq in enumerate(flat):
        assert ds.get(i).tolist() == seq
        assert ds[i].tolist() == seq
        if len(seq) >= 3:
            assert ds.get(i, offset=1, length=2).tolist() == seq[1:3]
            assert ds.get(i, offset=2).tolist() == seq[2:]
    assert os.path.getsize(tmp_path / "d.bin") == sum(map(len, flat)) * np.dtype(dtype).itemsize


def test_get_out_of_range_raises(tmp_path):
    ds = IndexedDataset(_write(tmp_path / "d", [[[1, 2, 3]]]))
    with pytest.raises(IndexError, match="3 tokens"):
        ds.get(0, offset=2, length=2)


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(_write(tmp_path / "e", []))
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0]


def test_trailing_items_form_a_document(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "t.bin"), np.uint16)
    b.add_item([1]); b.end_document(); b.add_item([2]); b.add_item([3])
    b.finalize(str(tmp_path / "t.idx"))
    assert IndexedDataset(str(tmp_path / "t")).doc_idx.tolist() == [0, 1, 3]


def test_merge(tmp_path):
    rng = np.random.default_rng(1)
    a, b = _random_docs(rng, 5, 1000), _random_docs(rng, 7, 1000)
    pa, pb = _write(tmp_path / "a", a, np.uint16), _write(tmp_path / "b", b, np.uint16)
    m = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    m.add_index(pa)
    m.add_item([42]); m.end_document()
    m.add_index(pb)
    m.finalize(str(tmp_path / "m.idx"))
    merged = IndexedDataset(str(tmp_path / "m"))
    expected_docs = a + [[[42]]] + b
    flat = [s for d in expected_docs for s in d]
    assert [merged[i].tolist() for i in range(len(merged))] == flat
    assert merged.doc_idx.tolist() == np.cumsum([0] + [len(d) for d in expected_docs]).tolist()


def test_merge_rejects_other_dtype(tmp_path):
    pa = _write(tmp_path / "a", [[[1]]], np.int32)
    m = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    with pytest.raises(ValueError, match="dtype"):
        m.add_index(pa)
    m.abort()


def test_nothing_visible_before_finalize_and_abort_cleans(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.int32)
    b.add_item([1, 2, 3])
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()
    assert not IndexedDataset.exists(str(tmp_path / "x"))
    b.abort()
    assert os.listdir(tmp_path) == []


def test_pickle_reopens_by_path(tmp_path):
    ds = IndexedDataset(_write(tmp_path / "d", [[[5, 6, 7]]] * 100))
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the maps are not copied into the pickle
    assert pickle.loads(blob).get(99).tolist() == [5, 6, 7]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(250000) == np.int32


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        IndexedDataset(str(tmp_path / "nope"))
    p = _write(tmp_path / "d", [[[1, 2]]])
    os.unlink(f"{p}.bin")
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(p)


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, nbytes):
    with open(path, "r+b") as f:
        f.truncate(nbytes)


CORRUPTIONS = {
    "short header": (lambda p: _truncate(f"{p}.idx", 20), r"\.idx.*header"),
    "truncated arrays": (lambda p: _truncate(f"{p}.idx", os.path.getsize(f"{p}.idx") - 8),
                         r"\.idx.*truncated"),
    "wrong magic": (lambda p: _patch(f"{p}.idx", 0, b"NOTMAGIC"), r"\.idx.*magic"),
    "wrong version": (lambda p: _patch(f"{p}.idx", 8, struct.pack("<Q", 7)),
                      r"\.idx.*version 7"),
    "bad dtype code": (lambda p: _patch(f"{p}.idx", 16, struct.pack("<Q", 99)),
                       r"\.idx.*dtype code 99"),
    "bin too short": (lambda p: _truncate(f"{p}.bin", os.path.getsize(f"{p}.bin") - 4),
                      r"\.bin.*truncated"),
    "bin too long": (lambda p: open(f"{p}.bin", "ab").write(b"\0" * 4), r"\.bin"),
    "size changed": (lambda p: _patch(f"{p}.idx", HEADER_BYTES, struct.pack("<i", 1)),
                     r"\.idx.*sizes add up"),
    "negative size": (lambda p: _patch(f"{p}.idx", HEADER_BYTES, struct.pack("<i", -3)),
                      r"\.idx.*negative"),
    "pointer changed": (lambda p: _patch(f"{p}.idx", HEADER_BYTES + 12 * 4 + 8,
                                         struct.pack("<q", 3)), r"\.idx.*pointers"),
    "doc_idx changed": (lambda p: _patch(f"{p}.idx", os.path.getsize(f"{p}.idx") - 8,
                                         struct.pack("<q", 99)), r"\.idx.*document index"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_rejected_naming_the_file(tmp_path, kind):
    # 12 sequences in 3 documents, 5 int32 tokens each.
    p = _write(tmp_path / "c", [[[i] * 5 for i in range(4)] for _ in range(3)])
    IndexedDataset(p)  # valid before corruption
    corrupt, pattern = CORRUPTIONS[kind]
    corrupt(p)
    with pytest.raises(ValueError, match=pattern) as info:
        IndexedDataset(p)
    assert str(tmp_path / "c") in str(info.value)


def test_stale_index_never_pairs_with_new_bin(tmp_path):
    """A crash after the new .bin is published but before the .idx must not look valid."""
    p = _write(tmp_path / "s", [[[1, 2, 3]]])
    old_idx = open(f"{p}.idx", "rb").read()
    _write(tmp_path / "s", [[[1, 2, 3, 4, 5]]])
    open(f"{p}.idx", "wb").write(old_idx)  # simulate: new .bin + old .idx
    with pytest.raises(ValueError, match=r"s\.bin"):
        IndexedDataset(p)
    assert MAGIC == old_idx[:8]

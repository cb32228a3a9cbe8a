"""Round trip, merge and corruption handling of the .bin/.idx indexed dataset.

The Megatron-format tests write and parse the layout with their own struct code (not
the module's), so a change to the module cannot silently change the format both sides
agree on.
"""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data.indexed_dataset import (HEADER_BYTES, MAGIC, IndexedDataset,
                                           IndexedDatasetBuilder, best_fitting_dtype, upgrade)
from megatron.errors import DataError

# Megatron-LM core's DType codes, written down independently of the module's table.
MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                  np.float64: 6, np.float32: 7, np.uint16: 8}


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
    with pytest.raises(DataError, match="nope.idx"):
        IndexedDataset(str(tmp_path / "nope"))
    p = _write(tmp_path / "d", [[[1, 2]]])
    os.unlink(f"{p}.bin")
    with pytest.raises(DataError, match=r"d\.bin"):
        IndexedDataset(p)


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, nbytes):
    with open(path, "r+b") as f:
        f.truncate(nbytes)


# 12 sequences of 5 int32 tokens in 3 documents: sizes at 34, pointers at 34 + 48,
# doc_idx at 34 + 144 (4 entries).
SIZES_AT, POINTERS_AT = HEADER_BYTES, HEADER_BYTES + 12 * 4
CORRUPTIONS = {
    "empty idx": (lambda p: _truncate(f"{p}.idx", 0), r"c\.idx: truncated.*found a 0-byte"),
    "short header": (lambda p: _truncate(f"{p}.idx", 20), r"c\.idx: truncated.*header"),
    "truncated arrays": (lambda p: _truncate(f"{p}.idx", os.path.getsize(f"{p}.idx") - 8),
                         r"c\.idx: index is truncated.*requires 210 bytes, found 202"),
    "garbage idx": (lambda p: open(f"{p}.idx", "wb").write(os.urandom(1000)),
                    r"c\.idx: not an indexed-dataset index; expected magic"),
    "garbage arrays": (lambda p: _patch(f"{p}.idx", SIZES_AT, os.urandom(200 - SIZES_AT)),
                       r"c\.idx: corrupt index"),
    "wrong version": (lambda p: _patch(f"{p}.idx", 9, struct.pack("<Q", 7)),
                      r"c\.idx: index version 7; expected 1"),
    "bad dtype code": (lambda p: _patch(f"{p}.idx", 17, struct.pack("<B", 99)),
                       r"c\.idx: unknown dtype code 99"),
    "bin too short": (lambda p: _truncate(f"{p}.bin", os.path.getsize(f"{p}.bin") - 4),
                      r"c\.bin: data file is truncated; .*expects 240 bytes, found 236"),
    "bin too long": (lambda p: open(f"{p}.bin", "ab").write(b"\0" * 4),
                     r"c\.bin: data file is too long"),
    "size changed": (lambda p: _patch(f"{p}.idx", SIZES_AT, struct.pack("<i", 1)),
                     r"c\.idx: corrupt index; sequence pointers.*sequence 1"),
    "negative size": (lambda p: _patch(f"{p}.idx", SIZES_AT, struct.pack("<i", -3)),
                      r"c\.idx: corrupt index; expected sequence sizes >= 0, found -3"),
    "pointer changed": (lambda p: _patch(f"{p}.idx", POINTERS_AT + 8, struct.pack("<q", 3)),
                        r"c\.idx: corrupt index; sequence pointers"),
    "doc_idx changed": (lambda p: _patch(f"{p}.idx", os.path.getsize(f"{p}.idx") - 8,
                                         struct.pack("<q", 99)), r"c\.idx.*document index"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_rejected_naming_the_file(tmp_path, kind):
    p = _write(tmp_path / "c", [[[i] * 5 for i in range(4)] for _ in range(3)])
    IndexedDataset(p)  # valid before corruption
    corrupt, pattern = CORRUPTIONS[kind]
    corrupt(p)
    with pytest.raises(DataError, match=pattern) as info:
        IndexedDataset(p)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- Megatron's format
def _independent_write(prefix, docs, dtype):
    """Megatron's MMIDIDX layout, written with nothing but struct and numpy."""
    seqs = [np.asarray(s, dtype=dtype) for d in docs for s in d]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    sizes = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    doc_idx = [0]
    for d in docs:
        doc_idx.append(doc_idx[-1] + len(d))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    return str(prefix)


def _independent_read(prefix):
    """Parse a Megatron .idx/.bin pair with struct only -> (dtype, docs)."""
    raw = open(f"{prefix}.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    n, m = struct.unpack_from("<QQ", raw, 18)
    assert version == 1
    off = 34
    sizes = struct.unpack_from(f"<{n}i", raw, off); off += 4 * n
    pointers = struct.unpack_from(f"<{n}q", raw, off); off += 8 * n
    doc_idx = struct.unpack_from(f"<{m}q", raw, off); off += 8 * m
    assert off == len(raw)
    dtype = {c: t for t, c in MEGATRON_CODES.items()}[code]
    data = open(f"{prefix}.bin", "rb").read()
    width = np.dtype(dtype).itemsize
    seqs = [np.frombuffer(data, dtype=dtype, count=s, offset=p).tolist()
            for s, p in zip(sizes, pointers)]
    return dtype, [seqs[doc_idx[i]:doc_idx[i + 1]] for i in range(m - 1)], len(data) // width


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 50257), (np.int32, 250000)])
def test_reads_megatron_files_written_independently(tmp_path, dtype, vocab):
    docs = _random_docs(np.random.default_rng(3), 25, vocab)
    ds = IndexedDataset(_independent_write(tmp_path / "mg", docs, dtype))
    assert not ds.legacy and ds.dtype == np.dtype(dtype)
    flat = [s for d in docs for s in d]
    assert [ds[i].tolist() for i in range(len(ds))] == flat
    assert ds.doc_idx.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 50257), (np.int32, 250000)])
def test_our_files_parse_with_an_independent_megatron_reader(tmp_path, dtype, vocab):
    docs = _random_docs(np.random.default_rng(4), 25, vocab)
    p = _write(tmp_path / "ours", docs, dtype)
    assert open(f"{p}.idx", "rb").read(9) == MAGIC == b"MMIDIDX\x00\x00"
    got_dtype, got_docs, n_tokens = _independent_read(p)
    assert got_dtype == dtype and got_docs == docs
    assert n_tokens == sum(len(s) for d in docs for s in d)
    # Byte-identical to the independent writer's files.
    q = _independent_write(tmp_path / "theirs", docs, dtype)
    for ext in (".idx", ".bin"):
        assert open(p + ext, "rb").read() == open(q + ext, "rb").read()


def test_multimodal_mode_bytes_are_accepted(tmp_path):
    p = _independent_write(tmp_path / "mm", [[[1, 2], [3]]], np.uint16)
    open(f"{p}.idx", "ab").write(b"\x00\x00")  # one int8 mode per sequence
    assert IndexedDataset(p)[1].tolist() == [3]


def _legacy_write(prefix, seqs, dtype=np.int32):
    """The PD2BWIDX layout this project wrote before adopting Megatron's."""
    arr = [np.asarray(s, dtype=dtype) for s in seqs]
    data = b"".join(a.tobytes() for a in arr)
    open(f"{prefix}.bin", "wb").write(data)
    sizes = [len(a) for a in arr]
    ptr = np.concatenate([[0], np.cumsum(sizes[:-1]) * np.dtype(dtype).itemsize]).astype("<i8")
    doc_idx = np.arange(len(seqs) + 1, dtype="<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<8sQQQQQ", b"PD2BWIDX", 1, MEGATRON_CODES[dtype], len(seqs),
                            len(doc_idx), len(data)))
        f.write(np.asarray(sizes, "<i4").tobytes() + ptr.tobytes() + doc_idx.tobytes())
    return str(prefix)


def test_legacy_files_still_read_with_one_warning_and_upgrade(tmp_path, capsys):
    p = _legacy_write(tmp_path / "old", [[1, 2, 3], [4], [5, 6]])
    ds = IndexedDataset(p)
    IndexedDataset(p)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "old.idx" in err and "deprecated" in err
    assert ds.legacy and [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6]]
    upgrade(p)  # what `python -m megatron.data.indexed_dataset upgrade PREFIX` runs
    _, docs, _ = _independent_read(p)
    assert docs == [[[1, 2, 3]], [[4]], [[5, 6]]]


def test_stale_index_never_pairs_with_new_bin(tmp_path):
    """A crash after the new .bin is published but before the .idx must not look valid."""
    p = _write(tmp_path / "s", [[[1, 2, 3]]])
    old_idx = open(f"{p}.idx", "rb").read()
    _write(tmp_path / "s", [[[1, 2, 3, 4, 5]]])
    open(f"{p}.idx", "wb").write(old_idx)  # simulate: new .bin + old .idx
    with pytest.raises(DataError, match=r"s\.bin"):
        IndexedDataset(p)
    assert MAGIC == old_idx[:9]

"""helper-63: tools/merge_datasets.py (Megatron-LM's tool of that name, missing here
before) and the GPT index arrays against a port of Megatron-LM's construction."""
from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data.gpt_dataset import GPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("merge_datasets_under_test",
                                                  ROOT / "tools" / "merge_datasets.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _build(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    b.finalize(f"{prefix}.idx")


def _spec_idx(sizes, doc_idx, code=8, itemsize=2):
    """An .idx written from Megatron-LM's layout, independently of indexed_dataset.py."""
    ptr = np.concatenate([[0], np.cumsum(np.asarray(sizes[:-1], np.int64) * itemsize)])
    return (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sizes), len(doc_idx))
            + np.asarray(sizes, "<i4").tobytes() + ptr.astype("<i8").tobytes()
            + np.asarray(doc_idx, "<i8").tobytes())


def test_merge_tool_concatenates_sorted_prefixes(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "b", [[[5, 6]], [], [[7], [8, 9]]])
    _build(d / "a", [[[1, 2, 3]], [[4]]])
    _tool().main(["--input", str(d), "--output-prefix", str(tmp_path / "out" / "m")])
    ds = IndexedDataset(str(tmp_path / "out" / "m"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4], [5, 6], [7], [8, 9]]
    assert ds.doc_idx.tolist() == [0, 1, 2, 3, 3, 5]
    assert (tmp_path / "out" / "m.idx").read_bytes() == _spec_idx([3, 1, 2, 1, 2],
                                                                   [0, 1, 2, 3, 3, 5])
    assert (tmp_path / "out" / "m.bin").read_bytes() == \
        np.arange(1, 10, dtype="<u2").tobytes()


@pytest.mark.parametrize("case", ["unpaired", "dtype", "empty", "corrupt"])
def test_merge_tool_errors_name_the_file_and_write_nothing(tmp_path, capsys, case):
    d = tmp_path / "in"
    d.mkdir()
    _build(d / "a", [[[1, 2]]])
    if case == "unpaired":
        (d / "c.bin").write_bytes(b"\0\0")
        where = "c.bin"
    elif case == "dtype":
        _build(d / "b", [[[1, 2]]], np.int32)
        where = "b.idx"
    elif case == "corrupt":
        _build(d / "b", [[[1, 2]]])
        (d / "b.bin").write_bytes(b"\0")
        where = "b.bin"
    else:
        for f in d.iterdir():
            f.unlink()
        where = "no .bin/.idx pairs"
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--input", str(d), "--output-prefix", str(tmp_path / "m")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and where in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("m*"))


# --- Megatron-LM's GPT index construction (megatron/core/datasets/gpt_dataset.py,
# add_extra_token_to_sequence=1, drop_last_partial_sequence=True), ported for comparison.

def _m_document_index(documents, num_epochs, rng, separate_final_epoch):
    if not separate_final_epoch or num_epochs == 1:
        idx = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(idx)
        return idx
    first = _m_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate([first, _m_document_index(documents, 1, rng, False)])


def _m_sample_index(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    n = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((n + 1, 2), np.int32)
    d = off = 0
    for k in range(1, n + 1):
        remaining = seq_length + 1
        while remaining:
            length = int(sizes[doc_idx[d]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            elif d == len(doc_idx) - 1:
                off = int(sizes[doc_idx[d]]) - 1
                break
            else:
                d, off = d + 1, 0
        out[k] = d, off
    return out


def _m_shuffle_index(num_samples, total, rng):
    first = np.arange(num_samples, dtype=np.uint32)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=np.uint32)
    rng.shuffle(last)
    return np.concatenate([first, last])


def _megatron_indices(sizes, documents, num_samples, seq_length, seed):
    tpe = int(sizes[documents].sum())
    epochs = 1
    while epochs * tpe < num_samples * seq_length + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tpe - 1) // seq_length
        separate = num_samples - sans_final < int(0.8 * ((tpe - 1) // seq_length))
    rng = np.random.RandomState(seed)
    doc_idx = _m_document_index(documents, epochs, rng, separate)
    sample_idx = _m_sample_index(sizes, doc_idx, seq_length, epochs, tpe)
    total = sample_idx.shape[0] - 1
    shuffle_idx = _m_shuffle_index(sans_final if separate else total, total, rng)
    return doc_idx, sample_idx, shuffle_idx, epochs, separate


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rs = np.random.RandomState(0)
    prefix = str(tmp_path_factory.mktemp("gpt") / "c")
    _build(prefix, [[rs.randint(0, 100, rs.randint(1, 20))] for _ in range(30)])
    return IndexedDataset(prefix)


# (samples as a fraction of an epoch, seq_length, epochs, last epoch kept apart): one
# epoch; a last epoch holding < 80% of an epoch's samples, which Megatron-LM shuffles
# apart, after one or two complete epochs; and >= 80%, where every epoch's documents
# and samples are shuffled together.
@pytest.mark.parametrize("fraction,seq_length,epochs,separate", [
    (0.3, 16, 1, False), (1.0, 16, 1, False), (1.5, 16, 2, True), (0.9, 4, 1, False),
    (1.95, 16, 2, False), (2.3, 16, 3, True), (2.97, 4, 3, False), (3.5, 4, 4, True)])
def test_gpt_indices_equal_megatron_over_epochs(tmp_path, corpus, fraction, seq_length,
                                                epochs, separate):
    documents = np.arange(25)
    tpe = int(corpus.sizes[documents].sum())
    n = max(1, int(fraction * tpe) // seq_length)
    gpt = GPTDataset("train", corpus, documents, n, seq_length, 1234, str(tmp_path))
    doc_idx, sample_idx, shuffle_idx, m_epochs, m_separate = _megatron_indices(
        np.asarray(corpus.sizes), documents, n, seq_length, 1234)
    assert (m_epochs, m_separate) == (epochs, separate)  # the case is the one named
    np.testing.assert_array_equal(gpt.doc_idx, doc_idx)
    np.testing.assert_array_equal(gpt.sample_idx, sample_idx)
    np.testing.assert_array_equal(gpt.shuffle_idx, shuffle_idx)
    assert (gpt.doc_idx.dtype, gpt.shuffle_idx.dtype) == (np.int32, np.uint32)

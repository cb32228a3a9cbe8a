"""tools/preprocess_data.py against Megatron-LM's preprocess_data.py (helper-63).

* ``--partitions N`` without ``--keep-sequential-samples``: Megatron-LM deals the input
  lines round-robin into N partition files (line i to partition i % N), encodes each and
  merges the outputs in partition order, so its documents come 0, N, 2N, ..., 1, N+1, ...
  The files here said they were "the same as Megatron-LM's partitions merged" but kept
  the input order.
* A JSON value that is a list of strings (pre-split sentences, the form of Megatron-LM's
  own ``--split-sentences`` intermediate ``*_ss.json``) is one document of one sequence
  per non-empty string in Megatron-LM's ``Encoder.encode``; here it was an error.
"""
from __future__ import annotations

import json

import pytest

from megatron.config import DataConfig
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import build_tokenizer
from tests.unit.test_preprocess import _load_module


def _megatron_reference(docs, append_eod, tok):
    """Megatron-LM's Encoder.encode + IndexedDatasetBuilder.add_document, ported."""
    seqs, doc_idx = [], [0]
    for text in docs:
        ids, lens = [], []
        for sentence in (text if isinstance(text, list) else [text]):
            t = tok.tokenize(sentence)
            if t:
                ids += t
                lens.append(len(t))
        if ids and append_eod:
            ids.append(tok.eod)
            lens[-1] += 1
        pos = 0
        for n in lens:
            seqs.append(ids[pos:pos + n])
            pos += n
        doc_idx.append(len(seqs))
    return seqs, doc_idx


def _read(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.doc_idx.tolist()


def _write(path, values):
    with open(path, "w", encoding="utf-8") as f:
        for i, v in enumerate(values):
            f.write(json.dumps({"text": v, "title": f"title {i}"}) + "\n")


@pytest.mark.parametrize("partitions,workers", [(2, 2), (3, 1)])
def test_partitions_merge_in_megatron_order(tmp_path, partitions, workers):
    texts = [f"doc {i} " + "ab" * (i % 4) for i in range(13)]
    texts[4] = ""  # an empty document keeps its place in its partition
    _write(tmp_path / "in.jsonl", texts)
    module = _load_module()
    module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "CharTokenizer",
                 "--json-keys", "text", "title", "--append-eod", "--chunk-size", "2",
                 "--workers", str(workers), "--partitions", str(partitions),
                 "--output-prefix", str(tmp_path / "p")])
    tok = build_tokenizer(DataConfig(tokenizer_type="CharTokenizer"))
    order = [i for p in range(partitions) for i in range(len(texts)) if i % partitions == p]
    assert _read(str(tmp_path / "p_text_document")) == \
        _megatron_reference([texts[i] for i in order], True, tok)
    assert _read(str(tmp_path / "p_title_document")) == \
        _megatron_reference([f"title {i}" for i in order], True, tok)
    # No partition files are left behind.
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "in.jsonl", "p_text_document.bin", "p_text_document.idx",
        "p_title_document.bin", "p_title_document.idx"]


def test_keep_sequential_samples_keeps_the_input_order(tmp_path):
    texts = [f"doc {i}" for i in range(9)]
    _write(tmp_path / "in.jsonl", texts)
    module = _load_module()
    common = ["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "CharTokenizer"]
    module.main(common + ["--output-prefix", str(tmp_path / "a")])
    module.main(common + ["--partitions", "4", "--keep-sequential-samples",
                          "--output-prefix", str(tmp_path / "b")])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_document{ext}").read_bytes() == \
            (tmp_path / f"b_text_document{ext}").read_bytes()


@pytest.mark.parametrize("split", [False, True])
def test_list_values_are_presplit_sentences(tmp_path, split):
    values = ["One doc.", ["First sentence.", "", "Second one."], [], ["Only."], "Last."]
    _write(tmp_path / "in.jsonl", values)
    module = _load_module()
    module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "CharTokenizer",
                 "--append-eod", "--output-prefix", str(tmp_path / "o")]
                + (["--split-sentences"] if split else []))
    tok = build_tokenizer(DataConfig(tokenizer_type="CharTokenizer"))
    level = "sentence" if split else "document"
    assert _read(str(tmp_path / f"o_text_{level}")) == _megatron_reference(values, True, tok)


@pytest.mark.parametrize("value,found", [([1, "a"], "int"), ({"a": "b"}, "dict"),
                                         (["a", ["b"]], "list")])
def test_other_values_are_one_error_naming_the_line(tmp_path, capsys, value, found):
    _write(tmp_path / "in.jsonl", ["fine", value])
    module = _load_module()
    with pytest.raises(SystemExit) as exc:
        module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type",
                     "CharTokenizer", "--output-prefix", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "'text'" in err and found in err
    assert not list(tmp_path.glob("o_*"))

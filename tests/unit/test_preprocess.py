"""tools/preprocess_data.py: tokenize -> .bin/.idx -> read back equals direct tokenization."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.config import DataConfig
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "preprocess_data.py"
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"

TEXTS = ["Hello, world!", "", "naïve café — ünïcödé ✓ 日本語",
         "line one\nline two\n\ttabbed", "x" * 300] + [f"document {i} " * (i % 5) for i in range(40)]


def _write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "title": f"t{i}"}) + "\n")
        f.write("\n")  # a blank line is skipped, not an error


def _run(args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(SCRIPT)] + [str(a) for a in args], env=env,
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _load_module():
    spec = importlib.util.spec_from_file_location("preprocess_data_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # Registered so that pool workers can unpickle its functions by module name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_round_trip_char_tokenizer_two_workers(tmp_path):
    _write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = _run(["--input", tmp_path / "in.jsonl", "--json-keys", "text", "title",
                "--tokenizer-type", "CharTokenizer", "--append-eod", "--workers", 2,
                "--chunk-size", 3, "--log-interval", 10, "--output-prefix", tmp_path / "o/p"])
    assert "docs/s" in out.stderr and "MB/s" in out.stderr and "tokens/s" in out.stderr
    tok = build_tokenizer(DataConfig(tokenizer_type="CharTokenizer"))
    ds = IndexedDataset(str(tmp_path / "o/p_text_document"))
    expected = [tok.tokenize(t) + [tok.eod] for t in TEXTS if t]  # no sequence, no EOD
    assert ds.dtype == np.uint16
    assert len(ds) == len(expected)
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    # An empty document stays a document without sequences (as Megatron-LM), so document i
    # of the text and the title outputs both come from line i.
    seqs_per_doc = [1 if t else 0 for t in TEXTS]
    assert ds.doc_idx.tolist() == [0] + np.cumsum(seqs_per_doc).tolist()
    titles = IndexedDataset(str(tmp_path / "o/p_title_document"))
    assert len(titles.doc_idx) == len(ds.doc_idx) == len(TEXTS) + 1
    assert titles[7].tolist() == tok.tokenize("t7") + [tok.eod]
    assert tok.detokenize(ds[1].tolist()) == TEXTS[2]  # TEXTS[1] is empty
    n_empty = sum(not t for t in TEXTS)
    assert f"{n_empty} empty (kept as documents without tokens)" in out.stdout
    assert not [f for f in os.listdir(tmp_path / "o") if ".tmp" in f]


def test_output_independent_of_workers(tmp_path):
    texts = [f"sample {i} " + "abc" * (i % 17) for i in range(300)]
    _write_jsonl(tmp_path / "in.jsonl", texts)
    module = _load_module()
    for workers in (1, 3):
        module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "CharTokenizer",
                     "--workers", str(workers), "--chunk-size", "7",
                     "--output-prefix", str(tmp_path / f"w{workers}")])
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"w1_text_document{ext}").read_bytes()
        b = (tmp_path / f"w3_text_document{ext}").read_bytes()
        assert a == b


def test_gpt2_bpe_round_trip(tmp_path):
    vocab, merges = DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe"
    corpus = DATA / "corpus" / "tinyshakespeare.txt"
    if not (vocab.exists() and merges.exists() and corpus.exists()):
        pytest.skip(f"shared GPT-2 vocabulary or corpus not found under {DATA}")
    paragraphs = corpus.read_text(encoding="utf-8")[:20000].split("\n\n")
    _write_jsonl(tmp_path / "in.jsonl", paragraphs)
    module = _load_module()
    module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "GPT2BPETokenizer",
                 "--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod",
                 "--workers", "1", "--output-prefix", str(tmp_path / "g")])
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                                     merge_file=str(merges)))
    ds = IndexedDataset(str(tmp_path / "g_text_document"))
    expected = [tok.tokenize(p) + [tok.eod] for p in paragraphs if p]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.dtype == np.uint16 and tok.eod == 50256


@pytest.mark.parametrize("line,match", [
    ('{"other": "x"}', "line 2: no key 'text'"),
    ('not json', "line 2: not valid JSON"),
    ('{"text": 5}', "line 2: 'text' must be a string"),
])
def test_bad_input_lines_are_named(tmp_path, capsys, line, match):
    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n' + line + "\n")
    module = _load_module()
    with pytest.raises(SystemExit):
        module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type",
                     "CharTokenizer", "--output-prefix", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert match in err and "--input" in err
    # A failed run publishes nothing and leaves no temporary files behind.
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_flag_errors(tmp_path, capsys):
    module = _load_module()
    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n')
    base = ["--tokenizer-type", "CharTokenizer", "--output-prefix", str(tmp_path / "x")]
    for argv, match in [(["--input", str(tmp_path / "missing.jsonl")], "--input"),
                        (["--input", str(tmp_path / "in.jsonl"), "--workers", "0"], "--workers")]:
        with pytest.raises(SystemExit):
            module.main(argv + base)
        assert match in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": ""}\n'])
def test_empty_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, content):
    (tmp_path / "in.jsonl").write_text(content)
    module = _load_module()
    with pytest.raises(SystemExit) as info:
        module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type",
                     "CharTokenizer", "--output-prefix", str(tmp_path / "empty")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --input")
    assert "no tokens to write" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_megatron_index_and_chunked_batches(tmp_path):
    """Output is Megatron's MMIDIDX and does not depend on how lines are batched."""
    texts = [f"doc {i}. " * (i % 4) + "end." for i in range(50)]
    _write_jsonl(tmp_path / "in.jsonl", texts)
    module = _load_module()
    for chunk in ("1", "7", "1000"):
        module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "CharTokenizer",
                     "--split-sentences", "--append-eod", "--chunk-size", chunk,
                     "--output-prefix", str(tmp_path / f"c{chunk}")])
    blobs = {(tmp_path / f"c{c}_text_sentence.idx").read_bytes() for c in ("1", "7", "1000")}
    assert len(blobs) == 1 and next(iter(blobs))[:9] == b"MMIDIDX\x00\x00"
    ds = IndexedDataset(str(tmp_path / "c7_text_sentence"))
    assert len(ds.doc_idx) == 51 and ds[len(ds) - 1].tolist()[-1] == 256  # eod at the end


def test_split_sentences_output_is_named_sentence_as_megatron(tmp_path, capsys):
    """Megatron names a sentence-split dataset {prefix}_{key}_sentence, a document one
    {prefix}_{key}_document; the examples and docs read those names."""
    _write_jsonl(tmp_path / "in.jsonl", ["One. Two.", "Three."])
    module = _load_module()
    for split, level in ((True, "sentence"), (False, "document")):
        prefix = tmp_path / ("s" if split else "d")
        module.main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "CharTokenizer",
                     "--output-prefix", str(prefix)] + (["--split-sentences"] if split else []))
        assert f"Wrote {prefix}_text_{level}.bin/.idx" in capsys.readouterr().out
        assert sorted(p.name for p in tmp_path.glob(f"{prefix.name}_*")) == \
            [f"{prefix.name}_text_{level}.bin", f"{prefix.name}_text_{level}.idx"]
    assert len(IndexedDataset(str(tmp_path / "s_text_sentence"))) == 3
    assert len(IndexedDataset(str(tmp_path / "d_text_document"))) == 2
    for script in ("pretrain_bert_cpu.sh", "pretrain_bert_p3_16xlarge.sh"):
        text = (ROOT / "examples" / script).read_text()
        assert "--split-sentences" in text and "_text_sentence" in text, script
        assert "_text_document" not in text, script

"""tools/make_demo_corpus.py and tools/train_tokenizer.py, end to end on small inputs."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron.config import DataConfig
from megatron.tokenizer import SentencePieceTokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
SMALL_MODULES = "json,textwrap,argparse,string,fractions,no_such_module_xyz"


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A demo corpus from a few modules plus one extra text file."""
    tmp = tmp_path_factory.mktemp("corpus")
    extra = tmp / "extra.txt"
    extra.write_text("First paragraph of the extra file.\n\nSecond one, über.\n", encoding="utf-8")
    out = tmp / "sub" / "corpus.jsonl"
    tool = _load_tool("make_demo_corpus")
    assert tool.main(["--output", str(out), "--min-chars", "200", "--modules", SMALL_MODULES,
                      "--no-topics", "--extra-text", str(extra)]) == 0
    return out


def _documents(path: Path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_demo_corpus_is_valid_deterministic_json_lines(corpus, tmp_path, capsys):
    docs = _documents(corpus)
    assert len(docs) > 20
    assert docs[-1] == "First paragraph of the extra file.\n\nSecond one, über."
    docstring_docs = docs[:-1]
    assert all(len(d) >= 200 for d in docstring_docs)
    assert len(set(docs)) == len(docs)
    assert any(d.startswith("module json\n\nJSON (JavaScript Object Notation)") for d in docs)
    assert any(d.startswith("class textwrap.TextWrapper") for d in docs)
    # Same inputs, same bytes.
    again = tmp_path / "again.jsonl"
    tool = _load_tool("make_demo_corpus")
    tool.main(["--output", str(again), "--min-chars", "200", "--modules", SMALL_MODULES, "--no-topics"])
    assert again.read_text(encoding="utf-8").splitlines() == corpus.read_text(encoding="utf-8").splitlines()[:-1]
    assert "documents" in capsys.readouterr().out


def test_demo_corpus_leaks_no_environment(tmp_path, monkeypatch):
    # cgi.parse's default argument is os.environ itself; signatures must not print it.
    marker = "SECRET_MARKER_3141592653"
    monkeypatch.setenv("DEMO_CORPUS_TEST_VAR", marker)
    out = tmp_path / "env.jsonl"
    tool = _load_tool("make_demo_corpus")
    tool.main(["--output", str(out), "--min-chars", "0", "--modules", "cgi,os,subprocess", "--no-topics"])
    text = out.read_text(encoding="utf-8")
    assert "subprocess.run(" in text
    assert marker not in text and " at 0x" not in text


def test_demo_corpus_missing_extra_file(tmp_path):
    tool = _load_tool("make_demo_corpus")
    with pytest.raises(FileNotFoundError, match="--extra-text.*missing.txt"):
        tool.main(["--output", str(tmp_path / "c.jsonl"), "--modules", "json", "--no-topics",
                   "--extra-text", str(tmp_path / "missing.txt")])


def test_train_and_load_sentencepiece(corpus, tmp_path, capsys):
    tool = _load_tool("train_tokenizer")
    prefix = tmp_path / "sp" / "demo"
    assert tool.main(["--input", str(corpus), "--json-keys", "text", "--vocab-size", "1000",
                      "--model-type", "bpe", "--output-prefix", str(prefix)]) == 0
    printed = capsys.readouterr().out
    assert f"{prefix}.model" in printed and "vocab size 1000" in printed
    tok = build_tokenizer(DataConfig(tokenizer_type="SentencePieceTokenizer",
                                     tokenizer_model=f"{prefix}.model"), tensor_model_parallel_size=2)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 1000 and tok.padded_vocab_size == 1024
    assert tok.inv_vocab[tok.eod] == "<eod>"
    # Byte fallback + identity normalisation: any text, even unseen characters, round-trips.
    for doc in _documents(corpus)[:50] + ["  two  spaces\nnew line\ttab 東京 🙂 <eod> end"]:
        ids = tok.tokenize(doc)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == doc
    assert tok.eod in tok.tokenize("a<eod>b")
    # Trained subwords actually compress the training text.
    sample = _documents(corpus)[0]
    assert len(tok.tokenize(sample)) < len(sample.encode("utf-8")) / 2


def test_train_tokenizer_plain_text_and_errors(tmp_path, capsys):
    text = tmp_path / "plain.txt"
    text.write_text("\n".join(f"line {i} of the tiny corpus, words words" for i in range(300)))
    tool = _load_tool("train_tokenizer")
    prefix = tmp_path / "u"
    assert tool.main(["--input", str(text), "--vocab-size", "60", "--model-type", "unigram",
                      "--no-byte-fallback", "--no-hard-vocab-limit", "--output-prefix", str(prefix)]) == 0
    tok = SentencePieceTokenizer(f"{prefix}.model")
    assert tok.detokenize(tok.tokenize("line 7 of the tiny corpus")) == "line 7 of the tiny corpus"
    with pytest.raises(FileNotFoundError, match="--input.*absent.txt"):
        tool.main(["--input", str(tmp_path / "absent.txt"), "--output-prefix", str(prefix)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="no key 'text'"):
        tool.main(["--input", str(bad), "--output-prefix", str(prefix)])
    with pytest.raises(SystemExit):
        tool.main(["--input", str(text), "--vocab-size", "100", "--output-prefix", str(prefix)])
    assert "byte fallback" in capsys.readouterr().err


def test_sentencepiece_model_without_eod_is_rejected(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"some words {i} here" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "noeod"),
                                   vocab_size=40, eos_id=-1, minloglevel=2, hard_vocab_limit=False)
    with pytest.raises(ValueError, match="--tokenizer-model.*<eod>"):
        SentencePieceTokenizer(str(tmp_path / "noeod.model"))

"""QA pass 47: ``HuggingFaceTokenizer.tokenize_batch([])`` raised transformers' IndexError.

tools/preprocess_data.py sends every chunk's sentences to ``tokenize_batch`` in one call;
with ``--split-sentences`` a chunk whose documents are all empty has no sentences, so the
call gets an empty list, and a run over such input ended in a traceback instead of the
tool's own "no tokens to write" line (GPT2BPETokenizer, WordPiece and SentencePiece
return ``[]``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from megatron.tokenizer.huggingface import HuggingFaceTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
GPT2_FILES = (DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    missing = [str(p) for p in GPT2_FILES if not p.exists()]
    if missing:
        pytest.skip(f"shared data not found: {missing}")
    d = tmp_path_factory.mktemp("gpt2_tokenizer")
    shutil.copyfile(GPT2_FILES[0], d / "vocab.json")
    shutil.copyfile(GPT2_FILES[1], d / "merges.txt")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return d


def test_tokenize_batch_of_nothing_is_nothing(gpt2_dir):
    tok = HuggingFaceTokenizer(str(gpt2_dir))
    assert tok.tokenize_batch([]) == []
    assert tok.tokenize_batch(()) == []
    assert tok.tokenize_batch(["", "a b"]) == [[], tok.tokenize("a b")]


def test_preprocess_split_sentences_of_empty_documents_is_one_error_line(gpt2_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
         str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"), "--split-sentences",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(gpt2_dir)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "IndexError" not in out.stderr

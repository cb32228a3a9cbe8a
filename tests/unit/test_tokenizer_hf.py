"""``--tokenizer-type HuggingFaceTokenizer``: transformers' AutoTokenizer behind our
tokenizer interface, with Megatron-LM's ids.  A directory holding GPT-2's vocabulary as
transformers names it (what ``checkpoint_util --to-hf`` exports) gives exactly the ids of
our GPT2BPETokenizer, and a BERT one our WordPiece ids between [CLS] and [SEP]."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")

from megatron.tokenizer import BertWordPieceTokenizer, GPT2BPETokenizer  # noqa: E402
from megatron.tokenizer.huggingface import HuggingFaceTokenizer, is_hub_name  # noqa: E402
from tests.unit.test_tokenizer_fast import (BERT_VOCAB, GPT2_FILES, ROOT,  # noqa: E402
                                            SHAKESPEARE)

pytestmark = pytest.mark.skipif(
    not all(p.exists() for p in (*GPT2_FILES, BERT_VOCAB, SHAKESPEARE)),
    reason="../shared/data (GPT-2 and BERT vocabularies, tinyshakespeare) absent")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2_tokenizer")
    shutil.copyfile(GPT2_FILES[0], d / "vocab.json")
    shutil.copyfile(GPT2_FILES[1], d / "merges.txt")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1024}))
    return d


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert_tokenizer")
    shutil.copyfile(BERT_VOCAB, d / "vocab.txt")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True}))
    return d


def test_gpt2_directory_gives_our_gpt2_ids(gpt2_dir):
    hf = HuggingFaceTokenizer(str(gpt2_dir))
    ours = GPT2BPETokenizer(*map(str, GPT2_FILES), fast=False)
    text = SHAKESPEARE.read_text(encoding="utf-8")[:30000]
    ids = hf.tokenize(text)
    assert ids == ours.tokenize(text) and len(ids) > 5000
    assert (hf.vocab_size, hf.eod) == (ours.vocab_size, ours.eod) == (50257, 50256)
    assert hf.detokenize(ids) == text
    lines = text.split("\n")[:200]
    assert hf.tokenize_batch(lines) == [ours.tokenize(t) for t in lines]
    assert hf.vocab["Ġthe"] == ours.vocab["Ġthe"] and hf.inv_vocab[262] == "Ġthe"


def test_bert_directory_adds_cls_and_sep_as_megatron(bert_dir):
    hf = HuggingFaceTokenizer(str(bert_dir))
    ours = BertWordPieceTokenizer(str(BERT_VOCAB), lower_case=True, fast=False)
    text = "The Quick brown fox, naïvely unaffable, jumps."
    assert hf.tokenize(text) == [ours.cls] + ours.tokenize(text) + [ours.sep]
    assert (hf.cls, hf.sep, hf.pad, hf.mask) == (ours.cls, ours.sep, ours.pad, ours.mask)
    from megatron.errors import UserError

    with pytest.raises(UserError, match="has no end-of-document \\(EOS\\) token"):
        hf.eod  # noqa: B018 - the property raises: one error line, not a traceback


def test_build_tokenizer_pads_the_vocabulary(gpt2_dir):
    from types import SimpleNamespace

    from megatron.tokenizer import build_tokenizer

    cfg = SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(gpt2_dir),
                          vocab_file=None, merge_file=None, make_vocab_size_divisible_by=128)
    tok = build_tokenizer(cfg, 2)
    assert tok.padded_vocab_size == 50432  # a multiple of 128 x 2


def test_preprocess_writes_the_bytes_gpt2bpe_writes(gpt2_dir, tmp_path):
    docs = [json.dumps({"text": t}) for t in
            SHAKESPEARE.read_text(encoding="utf-8")[:20000].split("\n\n") if t.strip()]
    (tmp_path / "in.jsonl").write_text("\n".join(docs) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, tok in (("ours", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                str(GPT2_FILES[0]), "--merge-file", str(GPT2_FILES[1])]),
                      ("hf", ["--tokenizer-type", "HuggingFaceTokenizer",
                              "--tokenizer-model", str(gpt2_dir)])):
        subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"),
                        "--input", str(tmp_path / "in.jsonl"), "--json-keys", "text",
                        "--append-eod", "--workers", "1", "--output-prefix",
                        str(tmp_path / name), *tok], check=True, env=env, capture_output=True,
                       timeout=300)
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"ours_text_document.{ext}").read_bytes()
        assert ours == (tmp_path / f"hf_text_document.{ext}").read_bytes()
    tokens = np.frombuffer((tmp_path / "hf_text_document.bin").read_bytes(), dtype=np.uint16)
    assert len(tokens) > 4000 and (tokens == 50256).sum() == len(docs)  # one EOD a document


def test_export_writes_a_tokenizer_that_loads_back(gpt2_dir, tmp_path):
    from megatron.hf_tokenizer_files import tokenizer_files

    note = tokenizer_files({"tokenizer_type": "HuggingFaceTokenizer",
                             "tokenizer_model": str(gpt2_dir)}, str(tmp_path), 64)
    assert note.startswith("tokenizer files (HuggingFaceTokenizer") and "tokenizer_config.json" in note
    back = HuggingFaceTokenizer(str(tmp_path))
    assert back.tokenize("Hello world, again.") == HuggingFaceTokenizer(str(gpt2_dir)).tokenize(
        "Hello world, again.")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] == 64


def test_bad_tokenizer_model_is_one_line(tmp_path, gpt2_dir):
    from megatron.arguments import ArgumentError, parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--micro-batch-size", "2", "--seq-length", "32", "--max-position-embeddings", "32",
            "--train-iters", "4", "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "HuggingFaceTokenizer"]
    with pytest.raises(ArgumentError, match="needs --tokenizer-model"):
        validate_args(parse_args(base), 1)
    missing = str(tmp_path / "no" / "such")
    with pytest.raises(ArgumentError, match=f"--tokenizer-model {missing} is not a directory"):
        validate_args(parse_args(base + ["--tokenizer-model", missing]), 1)
    args = validate_args(parse_args(base + ["--tokenizer-model", str(gpt2_dir)]), 1)
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert is_hub_name("gpt2") and is_hub_name("openai-community/gpt2")
    assert not is_hub_name(missing) and not is_hub_name("./tok") and not is_hub_name("a/b/c")
    with pytest.raises(ValueError, match="expected the directory holding it"):
        HuggingFaceTokenizer(str(gpt2_dir / "vocab.json"))
    with pytest.raises(ValueError) as info:
        HuggingFaceTokenizer("no-such-model-anywhere-xyz")
    text = str(info.value)
    assert text.startswith("--tokenizer-model no-such-model-anywhere-xyz: no such directory, "
                           "and no model of that name in the local Hugging Face cache "
                           "(nothing is downloaded")
    assert "\n" not in text
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="AutoTokenizer cannot load this directory"):
        HuggingFaceTokenizer(str(empty))

"""GPT-2 BPE exactness, the factory, vocabulary padding and the small tokenizers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import regex

from megatron.config import DataConfig
from megatron.tokenizer import (
    CharTokenizer,
    GPT2BPETokenizer,
    NullTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron.tokenizer.gpt2_bpe import bytes_to_unicode

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
VOCAB = DATA / "gpt2" / "encoder.json"
MERGES = DATA / "gpt2" / "vocab.bpe"
WIKI = DATA / "wikitext" / "wikitext-2-raw" / "wiki.test.raw"
SHAKESPEARE = DATA / "corpus" / "tinyshakespeare.txt"

# Ids of OpenAI's GPT-2 encoding.  The multi-token cases were produced with tiktoken
# (an independent implementation) over the same encoder.json/vocab.bpe.
KNOWN_IDS = {
    "Hello world": [15496, 995],
    " the": [262],
    "\n": [198],
    "<|endoftext|>": [27, 91, 437, 1659, 5239, 91, 29],
    "I can't believe it's 2023!": [40, 460, 470, 1975, 340, 338, 1160, 1954, 0],
    " naïve café 東京 🙂": [41492, 40304, 10545, 251, 109, 12859, 105, 32485],
    "unaffable": [403, 2001, 540],
    "   multiple   spaces\n\n": [220, 220, 3294, 220, 220, 9029, 628],
    "GPT-2 tokenizer": [38, 11571, 12, 17, 11241, 7509],
}


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    if not (VOCAB.is_file() and MERGES.is_file()):
        pytest.skip(f"GPT-2 vocab not found under {DATA}")
    return GPT2BPETokenizer(str(VOCAB), str(MERGES))


def _read(path: Path) -> str:
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path.read_text(encoding="utf-8")


def test_byte_table_is_a_bijection_onto_printable_chars():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120"  # the famous "Ġ"


def test_known_gpt2_ids(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.eod == 50256
    assert gpt2.inv_vocab[gpt2.eod] == "<|endoftext|>"
    for text, ids in KNOWN_IDS.items():
        assert gpt2.tokenize(text) == ids, text
        assert gpt2.detokenize(ids) == text


@pytest.mark.parametrize("path", [WIKI, SHAKESPEARE], ids=["wikitext", "shakespeare"])
def test_round_trip_whole_file(gpt2, path):
    text = _read(path)
    ids = gpt2.tokenize(text)
    assert gpt2.detokenize(ids) == text
    # BPE compresses English to over 3 characters per token (bytes alone would be 1).
    assert len(ids) < len(text) / 3


def test_detokenize_of_a_cut_character_does_not_fail(gpt2):
    ids = gpt2.tokenize(" 東")
    assert len(ids) > 1
    assert "\ufffd" in gpt2.detokenize(ids[:-1])


def naive_bpe_ids(text: str, encoder: dict, merges: list) -> list:
    """Reference: merge one leftmost occurrence of the lowest-ranked pair at a time.

    No cache, no merging of all occurrences per round, its own byte table and its own
    reading of the split regex; only the data files are shared with the tokenizer.
    """
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    others = [b for b in range(256) if b not in printable]
    byte_char = {b: chr(b) for b in printable}
    byte_char.update({b: chr(256 + k) for k, b in enumerate(others)})
    rank = {pair: r for r, pair in enumerate(merges)}
    pattern = (
        r"'(?:s|t|re|ve|m|ll|d)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )
    out = []
    for word in regex.findall(pattern, text):
        symbols = [byte_char[b] for b in word.encode("utf-8")]
        while True:
            candidates = [
                (rank[(symbols[i], symbols[i + 1])], i)
                for i in range(len(symbols) - 1)
                if (symbols[i], symbols[i + 1]) in rank
            ]
            if not candidates:
                break
            _, i = min(candidates)
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        out.extend(encoder[s] for s in symbols)
    return out


def test_matches_naive_reference_on_wikitext(gpt2):
    text = _read(WIKI)
    words = text.split(" ")
    # ~6000 words from three places in the file (headings, numbers, unicode, prose).
    sample = " ".join(words[:2000] + words[60000:62000] + words[-2000:])
    with open(MERGES, encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]
    with open(VOCAB, encoding="utf-8") as f:
        encoder = json.load(f)
    assert gpt2.tokenize(sample) == naive_bpe_ids(sample, encoder, merges)


def test_matches_tiktoken_if_installed(gpt2):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(str(MERGES), str(VOCAB))
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding("gpt2_local", pat_str=pat, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    text = _read(WIKI)[:200_000]
    assert gpt2.tokenize(text) == enc.encode_ordinary(text)


@pytest.mark.parametrize(
    "orig,divisible,tp,expected",
    [(50257, 128, 1, 50304), (50257, 128, 2, 50432), (50257, 128, 8, 51200),
     (30522, 128, 1, 30592), (256, 128, 1, 256), (257, 1, 1, 257), (257, 8, 4, 288)],
)
def test_vocab_padding(orig, divisible, tp, expected):
    padded = vocab_size_with_padding(orig, divisible, tp)
    assert padded == expected
    assert padded % (divisible * tp) == 0 and 0 <= padded - orig < divisible * tp


def test_vocab_padding_rejects_bad_values():
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by"):
        vocab_size_with_padding(100, 0, 1)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
        vocab_size_with_padding(100, 128, 0)


def test_build_gpt2_records_padded_size(gpt2):
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(VOCAB), merge_file=str(MERGES))
    tok = build_tokenizer(cfg, tensor_model_parallel_size=2)
    assert isinstance(tok, GPT2BPETokenizer)
    assert tok.padded_vocab_size == 50432
    assert tok.tokenize("Hello world") == [15496, 995]


def test_build_errors_name_the_flag_and_path(tmp_path):
    missing = str(tmp_path / "nope.json")
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=missing, merge_file=missing)
    with pytest.raises(FileNotFoundError, match="--vocab-file.*nope.json"):
        build_tokenizer(cfg)
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\na b\n")
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=None, merge_file=str(merges))
    with pytest.raises(ValueError, match="--vocab-file is required"):
        build_tokenizer(cfg)
    bad_json = tmp_path / "encoder.json"
    bad_json.write_text("not json")
    cfg = DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=str(bad_json),
                     merge_file=str(tmp_path / "gone.bpe"))
    with pytest.raises(FileNotFoundError, match="--merge-file.*gone.bpe"):
        build_tokenizer(cfg)
    cfg.merge_file = str(merges)
    with pytest.raises(ValueError, match="--vocab-file.*encoder.json"):
        build_tokenizer(cfg)
    cfg = DataConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=missing)
    with pytest.raises(FileNotFoundError, match="--tokenizer-model.*nope.json"):
        build_tokenizer(cfg)
    cfg = DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(bad_json))
    with pytest.raises(ValueError, match="--tokenizer-model.*not a SentencePiece model"):
        build_tokenizer(cfg)
    cfg = DataConfig(tokenizer_type="BertWordPieceCase", vocab_file=missing)
    with pytest.raises(FileNotFoundError, match="--vocab-file.*nope.json"):
        build_tokenizer(cfg)
    with pytest.raises(ValueError, match="--tokenizer-type 'Bogus' is not supported"):
        build_tokenizer(DataConfig(tokenizer_type="Bogus"))
    with pytest.raises(ValueError, match="--tokenizer-type is required"):
        build_tokenizer(DataConfig())
    with pytest.raises(ValueError, match="--vocab-size is required"):
        build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"))


def test_null_tokenizer():
    tok = build_tokenizer(DataConfig(tokenizer_type="NullTokenizer"), 1, vocab_size=1000)
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 1001 and tok.eod == 1000 and tok.padded_vocab_size == 1024
    assert tok.tokenize(" 3 1  4\n999 ") == [3, 1, 4, 999]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    assert tok.tokenize("1 1000") == [1, 1000]  # the end-of-document id, as in Megatron-LM
    with pytest.raises(ValueError, match=r"\[0, 1000\] \(--vocab-size 1000: data ids 0 to 999"):
        tok.tokenize("1 1001")
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("1 two")
    with pytest.raises(NotImplementedError, match="CLS"):
        _ = tok.cls


def test_char_tokenizer():
    tok = build_tokenizer(DataConfig(tokenizer_type="CharTokenizer", make_vocab_size_divisible_by=64))
    assert isinstance(tok, CharTokenizer)
    assert tok.vocab_size == 257 and tok.eod == 256 and tok.padded_vocab_size == 320
    text = "héllo\n東京 🙂"
    ids = tok.tokenize(text)
    assert ids[:2] == [104, 0xC3] and len(ids) == len(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod]) == text


def test_gpt2_bpe_files_of_two_tokenizers_are_a_value_error(tmp_path):
    """A merge whose result the vocabulary lacks: one error naming both flags, not a
    KeyError from inside the encoder (helper-43)."""
    import json

    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"<|endoftext|>": 0, "a": 1, "b": 2, "c": 3}))
    merges.write_text("#version: 0.2\na b\n")
    tok = GPT2BPETokenizer(str(vocab), str(merges), fast=False)
    assert tok.tokenize("cba") == [3, 2, 1]
    with pytest.raises(ValueError, match="the merges make the token 'ab', which --vocab-file "
                                         "lacks.*--vocab-file, --merge-file"):
        tok.tokenize("cab")


def test_null_tokenizer_checkpoints_record_their_vocabulary(tmp_path):
    """A checkpoint records the tokenizer's size (tokenizer_vocab_size): converters read it
    without tokenizer files.  One saved before that (NullTokenizer --vocab-size N then had
    N ids, eod N - 1) keeps its meaning: N ids for export, eod N - 1 for generation."""
    from megatron.checkpoint_convert import true_vocab_size
    from megatron.text_generation import build_checkpoint_tokenizer

    new = {"tokenizer_type": "NullTokenizer", "vocab_size": 96, "tokenizer_vocab_size": 97}
    old = {"tokenizer_type": "NullTokenizer", "vocab_size": 96}
    assert true_vocab_size({"data": new}) == 97 and true_vocab_size({"data": old}) == 96
    assert build_checkpoint_tokenizer(new, {}).eod == 96
    tok = build_checkpoint_tokenizer(old, {})
    assert (tok.vocab_size, tok.eod) == (96, 95)


def test_training_records_the_null_tokenizer_vocabulary(tmp_path):
    """--vocab-size 100 trains 101 ids (eod 100) and the checkpoint says so."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron.checkpoint_discovery import read_saved_config

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_DEBUG"}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run(
        [sys.executable, str(root / "pretrain_gpt.py"), "--num-layers", "1", "--hidden-size",
         "32", "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
         "16", "--vocab-size", "100", "--mock-data", "--micro-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0",
         "--save", str(tmp_path / "ck")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = read_saved_config(str(tmp_path / "ck"))[1]["data"]
    assert (data["tokenizer_type"], data["vocab_size"], data["tokenizer_vocab_size"]) == (
        "NullTokenizer", 100, 101)

"""QA pass 47: the fast (``tokenizers``) path must give the pure-Python ids on every text.

Two holes in the guard that decides per character whether the Rust backend may encode:

* GPT-2: the ``regex`` module and the Rust pre-tokenizer carry different Unicode
  versions, so a character can be a letter for one and "other" for the other.  The
  guard's id probe did not see it (the byte-level pieces merge the same way there), but
  next to a contraction the split differs: ``"\\u058c'll"`` gave ``' + ll`` instead of
  ``'ll``.
* A lone UTF-16 surrogate made the probe itself raise a ``TypeError`` from the Rust
  binding, where the Python WordPiece encodes it as ``[UNK]`` (as Megatron-LM's BERT
  tokenizer does) and the Python BPE raises ``UnicodeEncodeError`` (as GPT-2's does).
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
regex = pytest.importorskip("regex")

from megatron.tokenizer import BertWordPieceTokenizer, GPT2BPETokenizer  # noqa: E402
from megatron.tokenizer.gpt2_bpe import GPT2_SPLIT_PATTERN  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
GPT2_FILES = (DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
BERT_VOCAB = DATA / "bert" / "vocab.txt"

# Blocks where Unicode 15-17 assigned letters (Armenian, Kannada, Telugu, Latin Ext-D...).
SCAN = list(range(0x0500, 0x0D00)) + list(range(0x2000, 0x2100)) + list(range(0xA700, 0xAB80))


def _need(*paths):
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        pytest.skip(f"shared data not found: {missing}")


def _classes_differ() -> list:
    """Characters the installed regex module and Rust pre-tokenizer split differently."""
    from tokenizers import pre_tokenizers

    rust = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pattern = regex.compile(GPT2_SPLIT_PATTERN)
    found = []
    for cp in SCAN:
        text = f"a{chr(cp)}'s {chr(cp)}9"
        if [m.span() for m in pattern.finditer(text)] != \
                [span for _, span in rust.pre_tokenize_str(text)]:
            found.append(chr(cp))
    return found


@pytest.fixture(scope="module")
def gpt2():
    _need(*GPT2_FILES)
    return GPT2BPETokenizer(*map(str, GPT2_FILES), fast=True)


def test_gpt2_fast_path_follows_python_where_unicode_versions_differ(gpt2):
    chars = _classes_differ()
    if not chars:
        pytest.skip("the installed regex and tokenizers classify every scanned character alike")
    texts = [t for ch in chars[:40] for t in (f"{ch}'ll", f"x {ch}'s {ch}9 don't")]
    want = [gpt2.tokenize_python(t) for t in texts]
    assert [gpt2.tokenize(t) for t in texts] == want
    assert gpt2.tokenize_batch(texts) == want
    assert gpt2.tokenize_batch(["plain ascii"] + texts) == [gpt2.tokenize_python("plain ascii")] + want


@pytest.mark.parametrize("lower", [True, False], ids=["lower", "cased"])
def test_bert_fast_path_encodes_a_lone_surrogate_as_python_does(lower):
    _need(BERT_VOCAB)
    fast = BertWordPieceTokenizer(str(BERT_VOCAB), lower, fast=True)
    text = "ab \ud800 cd"
    want = fast.tokenize_python(text)
    assert fast.unk in want
    assert fast.tokenize(text) == want
    assert fast.tokenize_batch(["ok", text]) == [fast.tokenize_python("ok"), want]


def test_gpt2_fast_path_rejects_a_lone_surrogate_as_python_does(gpt2):
    for call in (lambda: gpt2.tokenize("ab \ud800 cd"),
                 lambda: gpt2.tokenize_batch(["ok", "ab \ud800 cd"])):
        with pytest.raises(UnicodeEncodeError):
            call()
    assert gpt2.tokenize("still works \u00e9") == gpt2.tokenize_python("still works \u00e9")

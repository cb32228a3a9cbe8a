"""BERT WordPiece: basic tokenisation rules, greedy WordPiece, and ids on the real vocab."""
from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from megatron.config import DataConfig
from megatron.tokenizer import BertWordPieceTokenizer, build_tokenizer
from megatron.tokenizer.bert_wordpiece import basic_tokenize, wordpiece

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
BERT_VOCAB = DATA / "bert" / "vocab.txt"
WIKI = DATA / "wikitext" / "wikitext-2-raw" / "wiki.test.raw"


@pytest.fixture(scope="module")
def uncased() -> BertWordPieceTokenizer:
    if not BERT_VOCAB.is_file():
        pytest.skip(f"{BERT_VOCAB} not found")
    return BertWordPieceTokenizer(str(BERT_VOCAB), lower_case=True)


@pytest.fixture(scope="module")
def cased() -> BertWordPieceTokenizer:
    if not BERT_VOCAB.is_file():
        pytest.skip(f"{BERT_VOCAB} not found")
    return BertWordPieceTokenizer(str(BERT_VOCAB), lower_case=False)


def test_basic_tokenize_rules():
    assert basic_tokenize("Hello, world!", True) == ["hello", ",", "world", "!"]
    assert basic_tokenize("Hello, world!", False) == ["Hello", ",", "world", "!"]
    # Accents are stripped only when lower-casing.
    assert basic_tokenize("Héllo naïve Ünïcödé", True) == ["hello", "naive", "unicode"]
    assert basic_tokenize("Héllo", False) == ["Héllo"]
    # CJK ideographs become words of their own; kana and Hangul do not (and accent
    # stripping also removes the kana voicing mark: "で" -> "て").
    assert basic_tokenize("ab東京cd です", True) == ["ab", "東", "京", "cd", "てす"]
    assert basic_tokenize("ab東京cd です", False) == ["ab", "東", "京", "cd", "です"]
    # ASCII symbols split even where Unicode does not call them punctuation.
    assert basic_tokenize("a$b^c`d", True) == ["a", "$", "b", "^", "c", "`", "d"]
    # Control and format characters vanish, tabs/newlines separate, NUL/U+FFFD dropped.
    assert basic_tokenize("so\u00adft\u200bx\ty\nz\x00\ufffdw", True) == ["softx", "y", "zw"]
    assert basic_tokenize("  \u3000 ", True) == []


def test_wordpiece_greedy_longest_match():
    vocab = {t: i for i, t in enumerate(["[UNK]", "un", "##aff", "##able", "##a", "a", "runn", "##ing"])}
    assert wordpiece("unaffable", vocab) == ["un", "##aff", "##able"]
    assert wordpiece("running", vocab) == ["runn", "##ing"]
    # One uncoverable piece makes the whole word [UNK].
    assert wordpiece("unaffablez", vocab) == ["[UNK]"]
    assert wordpiece("a" * 100, vocab) == ["a"] + ["##a"] * 99
    assert wordpiece("a" * 101, vocab) == ["[UNK]"]


# Expected pieces checked by hand against bert-base-uncased's vocab.txt and confirmed
# with HuggingFace `tokenizers` (an independent implementation).
UNCASED_CASES = {
    "Hello, world!": ["hello", ",", "world", "!"],
    "unaffable": ["una", "##ffa", "##ble"],
    "Héllo naïve café Ünïcödé": ["hello", "naive", "cafe", "unicode"],
    "東京は日本の首都です。": ["東", "京", "は", "日", "本", "の", "[UNK]", "都", "て", "##す", "。"],
    "don't $100 a^b": ["don", "'", "t", "$", "100", "a", "^", "b"],
    "ＦＵＬＬ ｗｉｄｔｈ": ["[UNK]", "[UNK]"],
    "straße": ["st", "##raße"],
}


def test_uncased_hand_checked_cases(uncased):
    assert uncased.vocab_size == 30522
    assert (uncased.pad, uncased.unk, uncased.cls, uncased.sep, uncased.mask) == (0, 100, 101, 102, 103)
    assert uncased.eod == uncased.sep
    for text, pieces in UNCASED_CASES.items():
        assert uncased.text_to_tokens(text) == pieces, text
        assert uncased.tokenize(text) == [uncased.vocab[p] for p in pieces]
    assert uncased.tokenize("hello world") == [7592, 2088]
    assert uncased.detokenize(uncased.tokenize("Unaffable Hello, world!")) == "unaffable hello , world !"
    ids = [uncased.cls] + uncased.tokenize("hello") + [uncased.sep, uncased.pad]
    assert uncased.decode_token_ids(ids) == "hello"


def test_cased_keeps_case_and_accents(cased):
    # The shared vocab is uncased, so capitalised words are unknown in cased mode.
    assert cased.text_to_tokens("Hello, world!") == ["[UNK]", ",", "world", "!"]
    assert cased.text_to_tokens("café") == ["[UNK]"]
    assert cased.text_to_tokens("東京です") == ["東", "京", "[UNK]"]  # no "で" in the vocab


def _strip_accents_lower(text: str) -> str:
    decomposed = unicodedata.normalize("NFD", text.lower())
    return "".join(c for c in decomposed if unicodedata.category(c) != "Mn")


def test_wikitext_lines_lose_no_characters(uncased):
    if not WIKI.is_file():
        pytest.skip(f"{WIKI} not found")
    lines = [l for l in WIKI.read_text(encoding="utf-8").split("\n") if l.strip()][:1500]
    checked = 0
    for line in lines:
        ids = uncased.tokenize(line)
        if uncased.unk in ids:
            continue
        # Without [UNK]s, the pieces spell exactly the lower-cased, accent-free text
        # minus its whitespace (and control characters, absent from WikiText).
        glued = uncased.detokenize(ids).replace(" ", "")
        assert glued == "".join(_strip_accents_lower(line).split()), line
        checked += 1
    assert checked > 1000


def test_matches_hf_tokenizers_if_installed(uncased):
    tokenizers = pytest.importorskip("tokenizers")
    if not WIKI.is_file():
        pytest.skip(f"{WIKI} not found")
    hf = tokenizers.BertWordPieceTokenizer(str(BERT_VOCAB), lowercase=True)
    for line in WIKI.read_text(encoding="utf-8").split("\n")[:3000]:
        assert uncased.tokenize(line) == hf.encode(line, add_special_tokens=False).ids


def test_build_bert_and_bad_vocab(tmp_path, uncased):
    cfg = DataConfig(tokenizer_type="BertWordPieceLowerCase", vocab_file=str(BERT_VOCAB))
    tok = build_tokenizer(cfg, tensor_model_parallel_size=1)
    assert tok.lower_case and tok.padded_vocab_size == 30592
    cfg.tokenizer_type = "BertWordPieceCase"
    assert not build_tokenizer(cfg).lower_case
    bad = tmp_path / "vocab.txt"
    bad.write_text("a\nb\n[UNK]\n")
    with pytest.raises(ValueError, match=r"--vocab-file.*vocab.txt.*\[CLS\]"):
        BertWordPieceTokenizer(str(bad))

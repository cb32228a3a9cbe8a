"""BERT's WordPiece tokenizer: basic (whitespace/punctuation) split, then greedy WordPiece.

Follows the original BERT release's rules so that ids match the published checkpoints:
text is cleaned, CJK ideographs become single-character words, lower-casing also strips
accents, punctuation is split off, and each word is split greedily into the longest
vocabulary pieces (continuations spelled ``##piece``); a word that cannot be covered,
or is longer than 100 characters, becomes ``[UNK]``.

Where the references differ: the 100-character limit is transformers' (Google's release
and Megatron-LM's copy of it allow 200, so a word of 101-200 characters is ``[UNK]``
here and pieces there); control characters are Google's and Megatron-LM's ``Cc``/``Cf``
(transformers also drops private-use, unassigned and surrogate code points, which give
``[UNK]`` here); and ``[CLS]`` etc. written in the text are split like any word, as in
Megatron-LM (transformers keeps them whole as special tokens).
"""
from __future__ import annotations

import unicodedata
from typing import Dict, List, Optional, Sequence

from megatron.tokenizer.base import MegatronTokenizer, check_file
from megatron.tokenizer.fast import FastEncoded, build_guarded, wordpiece_backend

UNK, CLS, SEP, PAD, MASK = "[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"
MAX_CHARS_PER_WORD = 100

# CJK Unified Ideographs blocks (not Hangul or kana: those are written with spaces).
_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


def is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def is_control(ch: str) -> bool:
    # Tab/newline/CR count as whitespace, not control, so they still separate words.
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def is_punctuation(ch: str) -> bool:
    # All non-alphanumeric ASCII (e.g. "$", "^", "`") is split off even where Unicode
    # does not call it punctuation.
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def basic_tokenize(text: str, lower_case: bool) -> List[str]:
    """Split ``text`` into words and punctuation the way BERT's BasicTokenizer does."""
    cleaned = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or is_control(ch):
            continue
        if is_whitespace(ch):
            cleaned.append(" ")
        elif is_cjk(cp):
            cleaned.append(f" {ch} ")
        else:
            cleaned.append(ch)
    words: List[str] = []
    for word in "".join(cleaned).split():
        if lower_case:
            word = unicodedata.normalize("NFD", word.lower())
            word = "".join(c for c in word if unicodedata.category(c) != "Mn")
        current: List[str] = []
        for ch in word:
            if is_punctuation(ch):
                if current:
                    words.append("".join(current))
                    current = []
                words.append(ch)
            else:
                current.append(ch)
        if current:
            words.append("".join(current))
    return words


def wordpiece(word: str, vocab: Dict[str, int], unk: str = UNK) -> List[str]:
    """Greedy longest-match-first split of one word into vocabulary pieces."""
    if len(word) > MAX_CHARS_PER_WORD:
        return [unk]
    pieces: List[str] = []
    start = 0
    while start < len(word):
        end = len(word)
        found = None
        while start < end:
            candidate = word[start:end] if start == 0 else "##" + word[start:end]
            if candidate in vocab:
                found = candidate
                break
            end -= 1
        if found is None:
            # One uncoverable suffix makes the whole word unknown, not just its tail.
            return [unk]
        pieces.append(found)
        start = end
    return pieces


def load_vocab(vocab_file: str) -> Dict[str, int]:
    """One token per line; the line number (from 0) is the id (a repeated token keeps its last)."""
    vocab: Dict[str, int] = {}
    with open(vocab_file, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index
    return vocab


class BertWordPieceTokenizer(FastEncoded, MegatronTokenizer):
    """BERT tokenizer over a ``vocab.txt`` (``--vocab-file``), cased or lower-cased.

    ``fast`` (None = when installed) encodes with Hugging Face ``tokenizers``, guarded
    to give exactly the ids of ``tokenize_python`` (see ``megatron.tokenizer.fast``).
    """

    def __init__(self, vocab_file: str, lower_case: bool = True,
                 fast: Optional[bool] = None) -> None:
        name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        super().__init__(name)
        check_file(vocab_file, "--vocab-file", name)
        try:
            self._vocab = load_vocab(vocab_file)
        except UnicodeDecodeError as exc:
            raise ValueError(f"--vocab-file {vocab_file!r}: not UTF-8 text: {exc}") from None
        missing = [t for t in (UNK, CLS, SEP, PAD, MASK) if t not in self._vocab]
        if missing:
            raise ValueError(
                f"--vocab-file {vocab_file!r}: expected a BERT vocab.txt with the special "
                f"tokens {missing} on their own lines"
            )
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self.lower_case = lower_case
        self._size = max(self._vocab.values()) + 1
        self._fast = build_guarded(
            fast, name,
            lambda: wordpiece_backend(self._vocab, lower_case, UNK, MAX_CHARS_PER_WORD),
            self.tokenize_python)

    @property
    def backend(self) -> str:
        """"tokenizers" or "python": which implementation ``tokenize`` runs."""
        return "tokenizers" if self._fast is not None else "python"

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    def text_to_tokens(self, text: str) -> List[str]:
        """Text -> WordPiece token strings."""
        return [p for w in basic_tokenize(text, self.lower_case) for p in wordpiece(w, self._vocab)]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> List[int]:
        return [self._vocab[t] for t in tokens]

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> List[str]:
        return [self._inv_vocab[int(i)] for i in token_ids]

    def tokenize_python(self, text: str) -> List[int]:
        """The pure-Python reference encoder (the definition of the ids)."""
        return self.convert_tokens_to_ids(self.text_to_tokens(text))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Join pieces with spaces and glue ``##`` continuations back onto their word.

        Lossy by nature: case (when lower-casing), accents and the spacing around
        punctuation are not recoverable.
        """
        return " ".join(self.convert_ids_to_tokens(token_ids)).replace(" ##", "")

    def decode_token_ids(self, token_ids: Sequence[int]) -> str:
        """Like ``detokenize`` but drops ``[PAD]``/``[CLS]``/``[SEP]`` (for printing samples)."""
        skip = {self.pad, self.cls, self.sep}
        return self.detokenize([i for i in token_ids if int(i) not in skip])

    @property
    def cls(self) -> int:
        return self._vocab[CLS]

    @property
    def sep(self) -> int:
        return self._vocab[SEP]

    @property
    def pad(self) -> int:
        return self._vocab[PAD]

    @property
    def mask(self) -> int:
        return self._vocab[MASK]

    @property
    def unk(self) -> int:
        return self._vocab[UNK]

    @property
    def eod(self) -> int:
        # BERT has no end-of-document token; [SEP] is what separates segments, and it
        # lets tools/preprocess_data.py --append-eod work for BERT corpora too.
        return self.sep

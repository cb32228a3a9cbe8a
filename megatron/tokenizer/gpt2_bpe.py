"""GPT-2 byte-level BPE, implemented from the published algorithm.

Text is split by GPT-2's pre-tokenisation regex; each piece's UTF-8 bytes are mapped
to printable unicode characters (so every byte sequence has a string form and no
byte is ever unknown), and adjacent symbols are merged by the rank of the merge in
``vocab.bpe`` until no ranked pair is left.  The result must equal OpenAI's ids.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import regex

from megatron.tokenizer.base import MegatronTokenizer, check_file
from megatron.tokenizer.fast import (FastEncoded, build_guarded, gpt2_backend,
                                     same_pretokenization)

# Contractions first, then runs of letters / digits / other symbols each with at most
# one leading space, then whitespace.  ``\s+(?!\S)`` leaves the last space of a run to
# prefix the following word, which is why " the" is a single token.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
EOD_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes stand for themselves; the remaining 68 (control chars,
    space, a few others) are shifted to code points 256, 257, ... in byte order.
    """
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table: Dict[int, str] = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def read_merges(merge_file: str) -> List[Tuple[str, str]]:
    """Parse ``vocab.bpe``: a version header line, then one ``left right`` pair per line."""
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    merges = []
    for lineno, line in enumerate(lines, start=2):
        if not line:
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"--merge-file {merge_file!r} line {lineno}: expected two symbols separated "
                f"by one space, got {line!r}"
            )
        merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer(FastEncoded, MegatronTokenizer):
    """GPT-2 tokenizer from ``encoder.json`` (``--vocab-file``) and ``vocab.bpe`` (``--merge-file``).

    Like the reference encoder, ``tokenize`` treats the text ``<|endoftext|>`` as plain
    characters; documents are separated by appending ``eod`` ids instead.

    ``fast`` (None = when installed) encodes with Hugging Face ``tokenizers``, guarded
    to give exactly the ids of ``tokenize_python`` (see ``megatron.tokenizer.fast``).
    """

    def __init__(self, vocab_file: str, merge_file: str, fast: Optional[bool] = None) -> None:
        super().__init__("GPT2 BPE")
        check_file(vocab_file, "--vocab-file", "GPT2BPETokenizer")
        check_file(merge_file, "--merge-file", "GPT2BPETokenizer")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                encoder = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(
                f"--vocab-file {vocab_file!r}: expected GPT-2 encoder.json (a JSON object "
                f"token -> id): {exc}"
            ) from None
        if not isinstance(encoder, dict) or EOD_TOKEN not in encoder:
            raise ValueError(
                f"--vocab-file {vocab_file!r}: expected a JSON object containing {EOD_TOKEN!r}"
            )
        # vocab_size is len(encoder): an id outside it would index past the embedding.
        bad = next(((t, i) for t, i in encoder.items()
                    if type(i) is not int or not 0 <= i < len(encoder)), None)
        if bad is not None:
            raise ValueError(
                f"--vocab-file {vocab_file!r}: token {bad[0]!r} has id {bad[1]!r}; expected "
                f"integer ids in [0, {len(encoder)}) (one per token, as GPT-2's encoder.json)"
            )
        try:
            merges = read_merges(merge_file)
        except UnicodeDecodeError as exc:
            raise ValueError(f"--merge-file {merge_file!r}: not UTF-8 text: {exc}") from None
        self.encoder: Dict[str, int] = encoder
        self.decoder: Dict[int, str] = {i: t for t, i in encoder.items()}
        self.bpe_ranks: Dict[Tuple[str, str], int] = {p: r for r, p in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_SPLIT_PATTERN)
        # Natural text repeats words constantly, so memoising each piece's BPE result
        # makes tokenisation several times faster.
        self.cache: Dict[str, List[str]] = {}
        self._eod_id = encoder[EOD_TOKEN]
        self._fast = build_guarded(fast, "GPT2BPETokenizer",
                                   lambda: gpt2_backend(encoder, merges), self.tokenize_python,
                                   split_check=same_pretokenization(self.pattern))

    @property
    def backend(self) -> str:
        """"tokenizers" or "python": which implementation ``tokenize`` runs."""
        return "tokenizers" if self._fast is not None else "python"

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def vocab(self) -> Dict[str, int]:
        return self.encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self.decoder

    @property
    def eod(self) -> int:
        return self._eod_id

    def bpe(self, piece: str) -> List[str]:
        """Merge the byte-characters of one pre-tokenised piece into BPE symbols."""
        cached = self.cache.get(piece)
        if cached is not None:
            return cached
        symbols = list(piece)
        ranks = self.bpe_ranks
        while len(symbols) > 1:
            best = min(
                zip(symbols, symbols[1:]), key=lambda p: ranks.get(p, float("inf"))
            )
            if best not in ranks:
                break
            left, right = best
            merged: List[str] = []
            i = 0
            # Left to right, non-overlapping: "a a a" with merge (a, a) gives "aa a".
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        self.cache[piece] = symbols
        return symbols

    def tokenize_python(self, text: str) -> List[int]:
        """The pure-Python reference encoder (the definition of the ids)."""
        ids: List[int] = []
        byte_encoder = self.byte_encoder
        for piece in self.pattern.findall(text):
            mapped = "".join(byte_encoder[b] for b in piece.encode("utf-8"))
            symbols = self.bpe(mapped)
            try:
                ids.extend(self.encoder[s] for s in symbols)
            except KeyError as exc:  # merge and vocabulary files of different tokenizers
                raise ValueError(
                    f"GPT2BPETokenizer: the merges make the token {exc.args[0]!r}, which "
                    f"--vocab-file lacks; expected the vocabulary and merge files of one "
                    f"tokenizer (--vocab-file, --merge-file)") from None
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        chars = "".join(self.decoder[int(i)] for i in token_ids)
        # A slice of ids can end inside a multi-byte character; replace, don't fail.
        return bytes(self.byte_decoder[c] for c in chars).decode("utf-8", errors="replace")

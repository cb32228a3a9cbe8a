"""Optional Hugging Face ``tokenizers`` backend for GPT-2 BPE and BERT WordPiece.

The pure-Python tokenizers in this package define the ids; this backend only makes
them faster.  It is used when the ``tokenizers`` package is installed (``pip install
.[fast]``) unless ``MEGATRON_FAST_TOKENIZER=0`` is set or a tokenizer is built with
``fast=False``.

Equality with the Python path is guarded, not assumed.  The Rust library carries its
own Unicode tables (version, private-use and "other" categories, final-sigma
lower-casing, one CJK block boundary), so for some non-ASCII characters its WordPiece
normalisation differs from Python's ``unicodedata``.  ``GuardedEncoder`` therefore
sends pure-ASCII text straight to the fast backend and, for other text, probes each
distinct non-ASCII character once (both backends encode a few short contexts around
it; the verdict is cached).  Text containing a character the backends disagree on is
encoded by the Python path, so the ids are the Python ids either way.  For GPT-2 the
probe also compares where the two pre-tokenisers split (``split_check``): the ``regex``
module and the Rust library classify characters by different Unicode versions, and a
letter for one that is "other" for the other merges to the same ids in the probe yet
splits a following contraction differently (U+058C before ``'ll``).  A character the backend
cannot take at all (a lone surrogate) is one it disagrees on.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Sequence

ENV_SWITCH = "MEGATRON_FAST_TOKENIZER"


def fast_backend_available() -> bool:
    """True when ``tokenizers`` imports and the user has not switched it off."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def want_fast(fast: Optional[bool], name: str) -> bool:
    """Resolve a tokenizer's ``fast`` argument: None = use it when available."""
    if fast is None:
        return fast_backend_available()
    if fast and not fast_backend_available():
        raise ValueError(f"{name}: fast=True needs the 'tokenizers' package (pip install "
                         f"tokenizers) and {ENV_SWITCH} not set to 0")
    return bool(fast)


def build_guarded(fast: Optional[bool], name: str, build_backend: Callable[[], object],
                  reference: Callable[[str], List[int]],
                  split_check: Optional[Callable[[object, str], bool]] = None,
                  ) -> Optional["GuardedEncoder"]:
    """The guarded fast encoder, or None for the Python path.

    With ``fast=None`` a backend that cannot be built (e.g. a hand-made merges file the
    Rust BPE rejects) quietly leaves the Python path in charge; ``fast=True`` raises.
    ``split_check(backend, probe)`` is an extra per-character test (see GuardedEncoder).
    """
    if not want_fast(fast, name):
        return None
    try:
        backend = build_backend()
    except Exception as exc:  # any failure of the optional library means "not available"
        if fast:
            raise ValueError(f"{name}: the 'tokenizers' backend could not be built from "
                             f"these vocabulary files ({exc})") from None
        return None
    return GuardedEncoder(backend, reference, split_check)


def _probe_texts(ch: str) -> str:
    # Word-internal, word-final (final sigma), doubled, after a digit/accented capital
    # (normalisation), and alone between spaces.
    return f"a{ch}b {ch}{ch} x{ch} {ch}9 \u00c9{ch} {ch}"


class GuardedEncoder:
    """Encode with a ``tokenizers.Tokenizer`` where it provably matches ``reference``."""

    def __init__(self, backend, reference: Callable[[str], List[int]],
                 split_check: Optional[Callable[[object, str], bool]] = None) -> None:
        self._backend = backend
        self._reference = reference
        # Optional extra test of a probe text, e.g. that both pre-tokenisers split it alike.
        self._split_check = split_check
        self._safe: Dict[str, bool] = {}
        # encode_batch_fast (tokenizers >= 0.20) skips offset tracking we never use.
        self._batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def _char_ok(self, ch: str) -> bool:
        ok = self._safe.get(ch)
        if ok is None:
            probe = _probe_texts(ch)
            try:
                ok = self._backend.encode(probe, add_special_tokens=False).ids == \
                    self._reference(probe)
                if ok and self._split_check is not None:
                    ok = bool(self._split_check(self._backend, probe))
            except Exception:  # noqa: BLE001 - e.g. a lone surrogate: the Python path decides
                ok = False
            self._safe[ch] = ok
        return ok

    def text_ok(self, text: str) -> bool:
        """True when the fast backend gives the reference ids for ``text``."""
        if text.isascii():
            return True
        safe = self._safe
        for ch in set(text):
            ok = safe.get(ch)
            if ok is None and ch.isascii():
                continue
            if not (ok if ok is not None else self._char_ok(ch)):
                return False
        return True

    def encode(self, text: str) -> List[int]:
        if self.text_ok(text):
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._reference(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        texts = list(texts)
        fast_idx = [i for i, t in enumerate(texts) if self.text_ok(t)]
        if len(fast_idx) == len(texts):
            return [e.ids for e in self._batch(texts, add_special_tokens=False)]
        out: List[Optional[List[int]]] = [None] * len(texts)
        encoded = self._batch([texts[i] for i in fast_idx], add_special_tokens=False)
        for i, e in zip(fast_idx, encoded):
            out[i] = e.ids
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self._reference(t)
        return out  # type: ignore[return-value]


class FastEncoded:
    """Mixin for tokenizers with a pure-Python reference encoder ``tokenize_python`` and an
    optional ``GuardedEncoder`` in ``self._fast``: the fast one encodes when present."""

    _fast: Optional["GuardedEncoder"] = None

    def tokenize_python(self, text: str) -> List[int]:
        raise NotImplementedError

    def tokenize(self, text: str) -> List[int]:
        if self._fast is not None:
            return self._fast.encode(text)
        return self.tokenize_python(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if self._fast is not None:
            return self._fast.encode_batch(texts)
        return [self.tokenize_python(t) for t in texts]


def gpt2_backend(encoder: Dict[str, int], merges: Sequence[tuple]):
    """Byte-level BPE with GPT-2's pre-tokenisation; <|endoftext|> stays plain text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=dict(encoder), merges=[tuple(m) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def same_pretokenization(pattern) -> Callable[[object, str], bool]:
    """A ``split_check`` for GPT-2: the compiled split ``pattern`` and the backend's
    pre-tokenizer cut ``text`` at the same character offsets."""
    def check(backend, text: str) -> bool:
        ours = [m.span() for m in pattern.finditer(text)]
        return ours == [span for _, span in backend.pre_tokenizer.pre_tokenize_str(text)]
    return check


def wordpiece_backend(vocab: Dict[str, int], lower_case: bool, unk: str,
                      max_chars_per_word: int):
    """BERT's basic tokenizer + greedy WordPiece (accents stripped only when lower-casing)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordPiece(vocab=dict(vocab), unk_token=unk,
                                     max_input_chars_per_word=max_chars_per_word))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=lower_case, lowercase=lower_case)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok

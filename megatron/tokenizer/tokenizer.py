"""Tokenizer factory, vocabulary padding and the small tokenizers (SentencePiece, null, char).

``build_tokenizer(data_config)`` is the one entry point the rest of the code uses; it
picks the class named by ``--tokenizer-type`` and records the padded vocabulary size
the embedding table needs.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron.tokenizer.base import MegatronTokenizer, check_file
from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "NullTokenizer",
    "CharTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
)

# Pieces accepted as a SentencePiece model's end-of-document, in order of preference:
# tools/train_tokenizer.py adds "<eod>"; stock models have "</s>".  A model with neither
# uses its EOS id, whatever the piece is called (Gemma's "<eos>").
SENTENCEPIECE_EOD_PIECES = ("<eod>", "</s>")


class SentencePieceTokenizer(MegatronTokenizer):
    """GPT-style tokenizer over a SentencePiece model (``--tokenizer-model``).

    ``eod_is_eos`` (``--tokenizer-type GPTSentencePieceTokenizer``) takes the model's EOS
    id as the end-of-document, as Megatron-LM's type of that name does; otherwise a
    ``<eod>`` piece comes first (see ``SENTENCEPIECE_EOD_PIECES``).
    """

    def __init__(self, model_file: str, eod_is_eos: bool = False) -> None:
        name = "GPTSentencePieceTokenizer" if eod_is_eos else "SentencePieceTokenizer"
        super().__init__(name)
        import sentencepiece  # optional dependency: only needed for this tokenizer

        check_file(model_file, "--tokenizer-model", name)
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(model_file)
        except (OSError, RuntimeError) as exc:
            raise ValueError(
                f"--tokenizer-model {model_file!r}: not a SentencePiece model: {exc}"
            ) from None
        self._eod_id = self._find_eod(model_file, eod_is_eos)
        self._vocab: Optional[Dict[str, int]] = None
        self._inv_vocab: Optional[Dict[int, str]] = None

    def _find_eod(self, model_file: str, eod_is_eos: bool) -> int:
        eos = self.sp.eos_id()
        has_eos = 0 <= eos < self.sp.GetPieceSize() and not self.sp.IsUnknown(eos)
        if eod_is_eos and has_eos:
            return eos
        for piece in SENTENCEPIECE_EOD_PIECES:
            pid = self.sp.PieceToId(piece)
            # Unknown pieces map to the unk id, so confirm the id really spells the piece.
            if self.sp.IdToPiece(pid) == piece and not self.sp.IsUnknown(pid):
                return pid
        if has_eos:
            return eos
        raise ValueError(
            f"--tokenizer-model {model_file!r}: no end-of-document piece; expected one of "
            f"{list(SENTENCEPIECE_EOD_PIECES)} or an EOS id (train with "
            f"tools/train_tokenizer.py, which adds <eod>)"
        )

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = {self.sp.IdToPiece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: self.sp.IdToPiece(i) for i in range(self.vocab_size)}
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self.sp.EncodeAsIds(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in token_ids])

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def pad(self) -> int:
        pid = self.sp.pad_id()
        return pid if pid >= 0 else self._missing("PAD")


class NullTokenizer(MegatronTokenizer):
    """Text is already ids: ``"3 1 4"`` -> ``[3, 1, 4]``.

    Megatron-LM's convention: ``--vocab-size N`` names the N data ids 0..N-1, and the
    end-of-document id N comes on top, so the vocabulary has N + 1 ids (a dataset that
    Megatron-LM's preprocess_data.py wrote with this tokenizer ends documents with N)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__("NullTokenizer")
        if int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer: --vocab-size must be >= 1, got {vocab_size}")
        self._data_ids = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._data_ids + 1

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(
                f"NullTokenizer: expected space-separated integers, got {text[:80]!r}"
            ) from None
        bad = [i for i in ids if not 0 <= i <= self._data_ids]
        if bad:
            raise ValueError(f"NullTokenizer: ids must lie in [0, {self._data_ids}] "
                             f"(--vocab-size {self._data_ids}: data ids 0 to "
                             f"{self._data_ids - 1}, end of document {self._data_ids}), "
                             f"got {bad[:5]}")
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in token_ids)

    @property
    def eod(self) -> int:
        return self._data_ids


class CharTokenizer(MegatronTokenizer):
    """UTF-8 bytes as ids 0..255 plus eod = 256: no files, exact round trip."""

    def __init__(self) -> None:
        super().__init__("CharTokenizer")

    @property
    def vocab_size(self) -> int:
        return 257

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        # eod ids are dropped; a cut through a multi-byte character becomes U+FFFD.
        data = bytes(int(i) for i in token_ids if int(i) < 256)
        return data.decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return 256


def vocab_size_with_padding(
    orig_vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int
) -> int:
    """Round the vocabulary up to a multiple of ``divisible_by * tp``.

    Every tensor-parallel rank then holds an equal slice of the embedding, and each
    slice keeps a GPU-friendly width (e.g. GPT-2: 50257 -> 50304 with 128, tp 1).
    """
    if orig_vocab_size < 1:
        raise ValueError(f"vocab size must be positive, got {orig_vocab_size}")
    if make_vocab_size_divisible_by < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by must be >= 1, got {make_vocab_size_divisible_by}"
        )
    if tensor_model_parallel_size < 1:
        raise ValueError(
            f"--tensor-model-parallel-size must be >= 1, got {tensor_model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def build_tokenizer(
    cfg, tensor_model_parallel_size: int = 1, vocab_size: Optional[int] = None,
    fast: Optional[bool] = None,
) -> MegatronTokenizer:
    """Create the tokenizer named by ``cfg.tokenizer_type`` (a ``DataConfig``).

    ``vocab_size`` is only used by ``NullTokenizer``; ``fast`` (None = when installed)
    selects the Hugging Face ``tokenizers`` backend of GPT-2 BPE and WordPiece.  The result carries
    ``padded_vocab_size`` computed with ``cfg.make_vocab_size_divisible_by`` and
    ``tensor_model_parallel_size``.
    """
    kind = cfg.tokenizer_type
    if kind is None:
        raise ValueError(f"--tokenizer-type is required; choose one of {list(TOKENIZER_TYPES)}")
    tokenizer: MegatronTokenizer
    if kind == "GPT2BPETokenizer":
        check_file(cfg.vocab_file, "--vocab-file", kind)
        check_file(cfg.merge_file, "--merge-file", kind)
        tokenizer = GPT2BPETokenizer(cfg.vocab_file, cfg.merge_file, fast=fast)
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        check_file(cfg.tokenizer_model, "--tokenizer-model", kind)
        tokenizer = SentencePieceTokenizer(cfg.tokenizer_model,
                                           eod_is_eos=kind == "GPTSentencePieceTokenizer")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        check_file(cfg.vocab_file, "--vocab-file", kind)
        tokenizer = BertWordPieceTokenizer(cfg.vocab_file, lower_case=kind.endswith("LowerCase"),
                                           fast=fast)
    elif kind == "HuggingFaceTokenizer":
        if not cfg.tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                             "(a tokenizer directory or a model name)")
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        tokenizer = HuggingFaceTokenizer(cfg.tokenizer_model)
    elif kind == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--vocab-size is required for tokenizer type NullTokenizer")
        tokenizer = NullTokenizer(vocab_size)
    elif kind == "CharTokenizer":
        tokenizer = CharTokenizer()
    else:
        raise ValueError(
            f"--tokenizer-type {kind!r} is not supported; choose one of {list(TOKENIZER_TYPES)}"
        )
    tokenizer.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size, cfg.make_vocab_size_divisible_by, tensor_model_parallel_size
    )
    return tokenizer

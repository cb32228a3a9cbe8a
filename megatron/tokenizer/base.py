"""The tokenizer interface every Megatron tokenizer implements, and file-check helpers.

Data preprocessing, datasets and the evaluation tasks only talk to this interface:
``tokenize`` / ``detokenize``, the (unpadded) ``vocab_size`` and the special ids.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Sequence


class MegatronTokenizer(ABC):
    """Abstract tokenizer.

    ``vocab_size`` is the number of real ids; the model's embedding table is padded
    beyond it (see ``vocab_size_with_padding``), which ``build_tokenizer`` records in
    ``padded_vocab_size``.
    """

    #: Embedding-table size after padding; set by ``build_tokenizer``.
    padded_vocab_size: Optional[int] = None

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can produce (before padding)."""

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""
        raise NotImplementedError(f"{self.name} has no string vocabulary")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string."""
        raise NotImplementedError(f"{self.name} has no string vocabulary")

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text -> token ids."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Many texts at once; fast backends override this to encode in one call."""
        return [self.tokenize(t) for t in texts]

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id appended after each document."""

    def _missing(self, what: str) -> int:
        raise NotImplementedError(f"{self.name} has no {what} token")

    @property
    def cls(self) -> int:
        return self._missing("CLS")

    @property
    def sep(self) -> int:
        return self._missing("SEP")

    @property
    def pad(self) -> int:
        return self._missing("PAD")

    @property
    def mask(self) -> int:
        return self._missing("MASK")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def check_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    """Return ``path`` if it names a readable file, else raise an error naming ``flag``.

    Done before parsing so that a typo in a launch script gives one clear message
    instead of a traceback from deep inside json/sentencepiece.
    """
    if not path:
        raise ValueError(f"{flag} is required for tokenizer type {tokenizer_type}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: no such file: {path!r} (needed by {tokenizer_type})")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag}: file is not readable: {path!r} (needed by {tokenizer_type})")
    return path

"""``--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH``: any tokenizer
transformers' ``AutoTokenizer`` loads, as Megatron-LM's type of the same name.

``PATH`` is a directory ``save_pretrained`` wrote (``tokenizer.json``, or a slow
tokenizer's vocabulary files with ``tokenizer_config.json``; what
``tools/checkpoint_util.py --to-hf`` exports loads too), or a model name already in the
local Hugging Face cache: nothing is downloaded (every rank would, and a mistyped
directory could silently fetch some hub repository of that name).  Loading never runs the directory's code (``trust_remote_code`` stays
off) and reads no pickle: tokenizer files are JSON, text or SentencePiece protobufs.

Ids are Megatron-LM's: ``tokenize`` is the tokenizer's ``__call__`` with its special
tokens (a BERT tokenizer adds [CLS]/[SEP], GPT-2's adds none), the vocabulary size is
``len(tokenizer)`` (added tokens included) and the end-of-document id is the EOS token.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Sequence

from megatron.errors import UserError
from megatron.tokenizer.base import MegatronTokenizer

FLAG = "--tokenizer-model"


class TokenizerError(UserError, ValueError):
    """The tokenizer lacks a token the run needs (one line, no traceback)."""


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_hub_name(spec: str) -> bool:
    """A --tokenizer-model that can only be a Hugging Face model name ('gpt2',
    'org/model'), not a directory: no such path exists and it has a name's shape."""
    return not os.path.exists(spec) and bool(_HUB_NAME.match(spec))


class HuggingFaceTokenizer(MegatronTokenizer):
    """transformers' AutoTokenizer behind Megatron's tokenizer interface."""

    def __init__(self, spec: str) -> None:
        super().__init__("HuggingFaceTokenizer")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs the transformers "
                             "package: pip install transformers") from None
        if os.path.isfile(spec):
            raise ValueError(f"{FLAG} {spec}: expected the directory holding it (the one "
                             f"save_pretrained wrote), not a file")
        local = os.path.isdir(spec)
        if not local and not is_hub_name(spec):
            raise ValueError(f"{FLAG} {spec} does not exist (needed by --tokenizer-type "
                             f"HuggingFaceTokenizer: a tokenizer directory or a model name)")
        try:
            self.hf = AutoTokenizer.from_pretrained(spec, trust_remote_code=False,
                                                    local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = ("transformers' AutoTokenizer cannot load this directory" if local else
                    "no such directory, and no model of that name in the local Hugging Face "
                    "cache (nothing is downloaded: save_pretrained it to a directory)")
            raise ValueError(f"{FLAG} {spec}: {what} ({type(exc).__name__}: {first})") from None
        # Documents of a pretraining corpus are longer than the model's context; the
        # dataset cuts them into samples, so transformers' "longer than the maximum
        # sequence length" warning would be noise on every long document.
        self.hf.model_max_length = int(1e30)
        self.spec = spec
        self._vocab: Optional[Dict[str, int]] = None
        self._inv: Optional[Dict[int, str]] = None

    @property
    def vocab_size(self) -> int:
        # len() counts the ids; a vocabulary with gaps has ids up to its largest one
        return max(len(self.hf), max(self.vocab.values(), default=-1) + 1)

    @property
    def vocab(self) -> Dict[str, int]:
        if self._vocab is None:
            self._vocab = dict(self.hf.get_vocab())
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if self._inv is None:
            self._inv = {i: t for t, i in self.vocab.items()}
        return self._inv

    def tokenize(self, text: str) -> List[int]:
        return list(self.hf(text)["input_ids"])

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        texts = list(texts)
        if not texts:  # transformers raises IndexError on an empty batch
            return []
        return [list(ids) for ids in self.hf(texts)["input_ids"]]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in token_ids])

    def _special(self, attr: str, what: str) -> int:
        tid = getattr(self.hf, attr, None)
        if tid is None:
            raise TokenizerError(f"{FLAG} {self.spec}: the tokenizer has no {what} token, "
                                 f"which this run needs")
        return int(tid)

    @property
    def eod(self) -> int:
        return self._special("eos_token_id", "end-of-document (EOS)")

    @property
    def cls(self) -> int:
        return self._special("cls_token_id", "CLS")

    @property
    def sep(self) -> int:
        return self._special("sep_token_id", "SEP")

    @property
    def pad(self) -> int:
        return self._special("pad_token_id", "PAD")

    @property
    def mask(self) -> int:
        return self._special("mask_token_id", "MASK")

    def __repr__(self) -> str:
        return f"HuggingFaceTokenizer({self.spec!r}, vocab_size={self.vocab_size})"

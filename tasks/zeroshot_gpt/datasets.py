"""WikiText text -> token windows for perplexity evaluation.

The WikiText test file is Moses-tokenised ("actor . He", "guest @-@ starring"); GPT
models are evaluated on text restored to normal spacing (``wikitext_detokenize``),
while the word count for the adjusted perplexity comes from the original file
(``count_words``, Megatron-LM's count).

Windows: every token except the first is a prediction target.  Window k starts at
``k * stride`` and sees ``seq_length`` input tokens; it scores only the targets no
earlier window scored, so with ``stride < seq_length`` (--overlapping-eval) each target
after the first window gets ``seq_length - stride`` or more tokens of context, and with
``stride == seq_length`` the windows are disjoint.  Every target is scored exactly once.
"""
from __future__ import annotations

import math
import re
from typing import Dict, List, Sequence

import numpy as np
import torch

_RULES = [
    (r" @(.)@ ", r"\1"),            # "1 @,@ 000" -> "1,000", "guest @-@ starring" -> "guest-starring"
    (r" ([.,;:!?%])", r"\1"),        # no space before punctuation
    (r" (['’](?:s|re|ve|ll|d|m|t)\b)", r"\1"),  # "Teddy 's" -> "Teddy's"
    (r" n't\b", "n't"),
    (r"([(\[{]) ", r"\1"),           # "( text" -> "(text"
    (r" ([)\]}])", r"\1"),
    (r"\$ (?=\d)", "$"),
    (r"(?m)^ +| +$", ""),            # spaces at line starts/ends
]
_QUOTE = re.compile(r'" ([^"\n]*?) "')
_HEADING = re.compile(r"(?m)^(=+(?: =)*) (.*?) ((?:= )*=+)$")


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenisation spacing (our rules, close to Megatron's intent)."""
    text = _HEADING.sub(lambda m: f"{m[1].replace(' ', '')} {m[2]} {m[3].replace(' ', '')}", text)
    for pattern, repl in _RULES:
        text = re.sub(pattern, repl, text)
    return _QUOTE.sub(r'"\1"', text)


def count_words(text: str) -> int:
    """Words of the original (tokenised) text for the adjusted perplexity, counted as
    Megatron-LM counts them: ``len(text.strip().split(" "))``.  Every space-separated
    piece counts, so each line end (WikiText's " \\n " between lines) is a word, as in
    WikiText's published token counts: the test file gives 245,566, against 241,211
    whitespace-separated words, which would make the adjusted perplexity ~1.8% larger
    in the exponent and not comparable with Megatron-LM's."""
    stripped = text.strip()
    return len(stripped.split(" ")) if stripped else 0


def num_windows(num_tokens: int, seq_length: int, stride: int) -> int:
    targets = num_tokens - 1
    if targets <= 0:
        return 0
    if targets <= seq_length:
        return 1
    return 1 + math.ceil((targets - seq_length) / stride)


class LMWindowDataset(torch.utils.data.Dataset):
    """Sample k: ``text`` (seq_length + 1 tokens, padded) and ``loss_mask`` over targets."""

    def __init__(self, tokens: Sequence[int], seq_length: int, stride: int, pad_id: int) -> None:
        if not 0 < stride <= seq_length:
            raise ValueError(f"--overlapping-eval {stride} must be in [1, --seq-length "
                             f"{seq_length}]")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.seq_length, self.stride, self.pad_id = seq_length, stride, pad_id
        self.n = num_windows(len(self.tokens), seq_length, stride)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int) -> Dict[str, np.ndarray]:
        start = k * self.stride
        chunk = self.tokens[start:start + self.seq_length + 1]
        text = np.full(self.seq_length + 1, self.pad_id, dtype=np.int64)
        text[:len(chunk)] = chunk
        mask = np.zeros(self.seq_length, dtype=np.int64)
        mask[:len(chunk) - 1] = 1
        if k > 0:
            # Targets up to (previous start + seq_length) were scored by window k - 1.
            already = (k - 1) * self.stride + self.seq_length - start
            mask[:already] = 0
        return {"text": text, "loss_mask": mask}


class PaddingWindows(torch.utils.data.Dataset):
    """``dataset`` extended with all-masked windows up to ``size`` (full last batch)."""

    def __init__(self, dataset: LMWindowDataset, size: int) -> None:
        self.dataset, self.size = dataset, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> Dict[str, np.ndarray]:
        if k < len(self.dataset):
            return self.dataset[k]
        L = self.dataset.seq_length
        return {"text": np.full(L + 1, self.dataset.pad_id, dtype=np.int64),
                "loss_mask": np.zeros(L, dtype=np.int64)}


def read_wikitext(paths: List[str]) -> str:
    """The text of the --valid-data files; an unreadable or binary one is a DataError."""
    from tasks.data_utils import TaskDataError, read_text

    parts = []
    for path in paths:
        try:
            parts.append(read_text(path, "a WikiText text file"))
        except ValueError as exc:
            raise TaskDataError(f"--valid-data {exc}") from None
    return "".join(parts)

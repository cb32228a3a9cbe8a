"""WikiText text -> token windows for perplexity evaluation; LAMBADA passages ->
(context, last word) samples for last-word accuracy.

The WikiText test file is Moses-tokenised ("actor . He", "guest @-@ starring"); GPT
models are evaluated on text restored to normal spacing by Megatron-LM's rules
(``wikitext_detokenize``),
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

# Megatron-LM's wikitext_detokenizer (tasks/zeroshot_gpt/detokenizer.py), rule for rule
# and in its order, quirks included ("word ." at the very end keeps its space; a quoted
# span between two apostrophes loses its inner edge spaces): the adjusted perplexity
# is comparable with Megatron-LM's numbers only on the same detokenized text (on the
# WikiText test file our earlier rules gave 0.7% more GPT-2 tokens, and left every
# " = = Section = = " heading as it was).
_PLAIN = "plain"
_REGEX = "regex"
_MEGATRON_WIKITEXT_RULES = (
    (_PLAIN, "s '", "s'"),
    (_REGEX, r"/' [0-9]/", r"/'[0-9]/"),
    (_PLAIN, " @-@ ", "-"),
    (_PLAIN, " @,@ ", ","),
    (_PLAIN, " @.@ ", "."),
) + tuple((_PLAIN, f" {p} ", f"{p} ") for p in ":;.!?,") + tuple(
    (_REGEX, rf"{re.escape(o)}\s*([^{re.escape(c)}]*?)\s*{re.escape(c)}", rf"{o}\1{c}")
    for o, c in (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'"))
) + (
    (_PLAIN, "= = = =", "===="),
    (_PLAIN, "= = =", "==="),
    (_PLAIN, "= =", "=="),
    (_PLAIN, " \u00b0 ", "\u00b0"),
    (_PLAIN, " \n", "\n"),
    (_PLAIN, "\n ", "\n"),
    (_PLAIN, " N ", " 1 "),
    (_PLAIN, " 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenisation spacing exactly as Megatron-LM's
    ``wikitext_detokenizer`` does (``_MEGATRON_WIKITEXT_RULES``)."""
    for kind, pattern, repl in _MEGATRON_WIKITEXT_RULES:
        text = text.replace(pattern, repl) if kind == _PLAIN else re.sub(pattern, repl, text)
    return text


wikitext_detokenizer = wikitext_detokenize  # Megatron-LM's name


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


def check_words(num_words: int, paths: List[str]) -> None:
    """The adjusted perplexity divides by (words - 1): fewer than two words is an error
    naming the file (Megatron-LM divides by zero; we reported it from '0 words')."""
    from tasks.data_utils import TaskDataError

    if num_words < 2:
        raise TaskDataError(f"--valid-data {' '.join(paths)}: {num_words} word(s); expected "
                            f"a WikiText text file of at least two space-separated words")


# ---------------------------------------------------------------------------- LAMBADA
def lambada_split(text: str, tokenizer, strict: bool):
    """(context tokens, target tokens) of one LAMBADA passage, as Megatron-LM splits it.

    Non-strict: the passage is tokenized whole and its last token is the target (often
    only the end of the last word).  --strict-lambada: the target is the whole last
    (whitespace-separated) word, tokenized on its own as ``" " + word`` (as it follows a
    space), and the context is the text before it, stripped, tokenized separately."""
    if not strict:
        tokens = tokenizer.tokenize(text)
        return tokens[:-1], tokens[-1:]
    word = text.split()[-1]
    start = text.rfind(word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize(" " + word)


class LambadaDataset(torch.utils.data.Dataset):
    """Sample k: ``text`` = context + target, padded to seq_length + 1 with ``pad_id``,
    and ``loss_mask`` over the positions that predict the target's tokens.  A passage
    longer than seq_length + 1 tokens keeps its last seq_length + 1 (the target and the
    context nearest it; Megatron-LM fails on it)."""

    def __init__(self, samples: List[tuple], seq_length: int, pad_id: int) -> None:
        self.samples, self.seq_length, self.pad_id = samples, seq_length, pad_id
        self.truncated = sum(1 for c, t in samples if len(c) + len(t) > seq_length + 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, k: int) -> Dict[str, np.ndarray]:
        context, target = self.samples[k]
        tokens = (list(context) + list(target))[-(self.seq_length + 1):]
        text = np.full(self.seq_length + 1, self.pad_id, dtype=np.int64)
        text[:len(tokens)] = tokens
        mask = np.zeros(self.seq_length, dtype=np.int64)
        # position i predicts text[i + 1]: the target's tokens are the last len(target)
        mask[len(tokens) - 1 - len(target):len(tokens) - 1] = 1
        return {"text": text, "loss_mask": mask}


class PaddingSamples(torch.utils.data.Dataset):
    """``dataset`` (WikiText windows or LAMBADA samples: anything with ``seq_length`` and
    ``pad_id``) extended with all-masked samples up to ``size`` (a full last batch)."""

    def __init__(self, dataset, size: int) -> None:
        self.dataset, self.size = dataset, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, k: int) -> Dict[str, np.ndarray]:
        if k < len(self.dataset):
            return self.dataset[k]
        L = self.dataset.seq_length
        return {"text": np.full(L + 1, self.dataset.pad_id, dtype=np.int64),
                "loss_mask": np.zeros(L, dtype=np.int64)}


def read_lambada(paths: List[str]) -> List[tuple]:
    """(where, passage) of every line of the --valid-data JSON-lines files (one
    ``{"text": ...}`` object a line; blank lines skipped).  A file that cannot be read,
    a line that is not a JSON object with a non-empty string ``text``, or no passage at
    all: one TaskDataError naming --valid-data and the file (and line)."""
    import json

    from tasks.data_utils import TaskDataError, read_text

    passages = []
    for path in paths:
        try:
            content = read_text(path, "a LAMBADA JSON-lines file ({\"text\": ...} a line)")
        except ValueError as exc:
            raise TaskDataError(f"--valid-data {exc}") from None
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            where = f"--valid-data {path}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise TaskDataError(f"{where}: not JSON ({exc}); expected one "
                                    f"{{\"text\": ...}} object a line") from None
            text = row.get("text") if isinstance(row, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise TaskDataError(f"{where}: expected a JSON object with a non-empty "
                                    f"string \"text\" (the passage), got {line.strip()[:80]}")
            passages.append((where, text))
    if not passages:
        raise TaskDataError(f"--valid-data {' '.join(paths)}: no passages; expected a LAMBADA "
                            f"JSON-lines file ({{\"text\": ...}} a line)")
    return passages


def lambada_samples(passages: List[tuple], tokenizer, strict: bool,
                    seq_length: int) -> List[tuple]:
    """(context, target) token lists of ``read_lambada``'s passages; a passage with no
    context before its target, or a target longer than --seq-length, is a TaskDataError
    naming its file and line."""
    from tasks.data_utils import TaskDataError

    samples = []
    for where, text in passages:
        context, target = lambada_split(text, tokenizer, strict)
        if not context or not target:
            raise TaskDataError(f"{where}: the passage has no context before its last "
                                f"{'word' if strict else 'token'}; nothing to predict it from")
        if len(target) > seq_length:
            raise TaskDataError(f"{where}: its last word is {len(target)} tokens, more than "
                                f"--seq-length {seq_length}")
        samples.append((context, target))
    return samples

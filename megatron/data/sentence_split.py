"""A rule-based English sentence splitter (no downloaded models).

Used by ``tools/preprocess_data.py --split-sentences`` to cut documents into the
sentences BERT's sentence-pair samples are built from.  A sentence ends at ``.``, ``!``
or ``?`` (possibly repeated, possibly followed by closing quotes or brackets) when
whitespace follows and the next word looks like a sentence start (capital letter,
digit, or opening quote/bracket before one).  It does NOT end:

* after known abbreviations ("Mr.", "Dr.", "e.g.", "i.e.", "vs.", "U.S." ...), except
  that "etc." may end a sentence when a capitalised word follows;
* after single-letter initials ("J. R. R. Tolkien");
* inside numbers ("3.14", "v1.2") or when no whitespace follows the period.

Blank lines always separate sentences (paragraphs); single newlines inside a
paragraph become spaces unless ``keep_newlines`` is set.
"""
from __future__ import annotations

import re
from typing import Iterator, List

# Abbreviations after which a period never ends a sentence (lower-case, no final dot).
NEVER_FINAL = frozenset("""
mr mrs ms dr prof sr jr st mt ft rev hon gen col lt sgt capt cmdr adm gov sen rep pres
messrs mme mlle esp e.g i.e cf vs viz al approx appt apt dept est fig figs no nos vol
vols pp p ed eds op ch sec inc ltd co corp bros jan feb mar apr jun jul aug sep sept oct
nov dec mon tue tues wed thu thur thurs fri sat sun a.m p.m u.s u.k u.n e.u ph.d
""".split())
# Abbreviations that may also end a sentence (split only before a capitalised word).
MAYBE_FINAL = frozenset("etc".split())

_CLOSERS = "\"')]}\u201d\u2019\u00bb"
_OPENERS = "\"'([{\u201c\u2018\u00ab"
# A terminator run plus any closing quotes/brackets, then the whitespace after it.
_BOUNDARY = re.compile(r"([.!?]+)([" + re.escape(_CLOSERS) + r"]*)(\s+)")
_PARAGRAPH = re.compile(r"\n\s*\n")


def _word_before(text: str, end: int) -> str:
    """The whitespace-delimited word ending at ``end`` (without leading openers)."""
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:end].lstrip(_OPENERS)


def _starts_sentence(text: str, pos: int) -> bool:
    """Does the text at ``pos`` look like the beginning of a sentence?"""
    while pos < len(text) and text[pos] in _OPENERS:
        pos += 1
    if pos >= len(text):
        return False
    ch = text[pos]
    return ch.isupper() or ch.isdigit() or not ch.isalpha() and ch not in ",;:.!?)"


def _is_boundary(text: str, match: re.Match) -> bool:
    terminators = match.group(1)
    nxt = match.end()
    if not _starts_sentence(text, nxt):
        return False
    if terminators != ".":
        return True  # "!", "?", "..." or "?!" before a capital: a real end
    word = _word_before(text, match.start(1)).lower()
    if not word:
        return True
    if word in NEVER_FINAL:
        return False
    if word in MAYBE_FINAL:
        return text[nxt:nxt + 1].isupper() or text[nxt:nxt + 1] in _OPENERS
    # Single-letter initials ("J." in "J. Smith") and dotted acronyms ("U.S" + ".").
    stripped = word.replace(".", "")
    if len(stripped) == 1 and stripped.isalpha():
        return False
    if "." in word and all(len(part) == 1 for part in word.split(".") if part):
        return False
    return True


def _split_paragraph(paragraph: str) -> Iterator[str]:
    start = 0
    for match in _BOUNDARY.finditer(paragraph):
        if _is_boundary(paragraph, match):
            end = match.start(3)
            sentence = paragraph[start:end].strip()
            if sentence:
                yield sentence
            start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        yield tail


def split_sentences(text: str, keep_newlines: bool = False) -> List[str]:
    """Sentences of ``text`` in order, stripped; empty input gives []."""
    sentences: List[str] = []
    for paragraph in _PARAGRAPH.split(text):
        if not keep_newlines:
            paragraph = re.sub(r"\s*\n\s*", " ", paragraph)
        sentences.extend(_split_paragraph(paragraph))
    return sentences

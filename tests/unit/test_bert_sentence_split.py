"""The rule-based sentence splitter used by preprocess_data.py --split-sentences."""
from __future__ import annotations

import pytest

from megatron.data.sentence_split import split_sentences


@pytest.mark.parametrize("text, expected", [
    ("Mr. Smith went to Washington. He arrived on Monday.",
     ["Mr. Smith went to Washington.", "He arrived on Monday."]),
    ("Dr. Who and Mrs. Hudson met Prof. Xavier. They talked.",
     ["Dr. Who and Mrs. Hudson met Prof. Xavier.", "They talked."]),
    ("Use a tool, e.g. a hammer. Then rest, i.e. sleep.",
     ["Use a tool, e.g. a hammer.", "Then rest, i.e. sleep."]),
    ("Pi is about 3.14. It is irrational!", ["Pi is about 3.14.", "It is irrational!"]),
    ("It costs $4.50 today. Tomorrow it costs 5.", ["It costs $4.50 today.", "Tomorrow it costs 5."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("\u201cReally?\u201d she asked. \u201cYes.\u201d", ["\u201cReally?\u201d she asked.", "\u201cYes.\u201d"]),
    ("(This is quoted.) And this.", ["(This is quoted.)", "And this."]),
    ("J. R. R. Tolkien wrote it. The U.S. Army agreed.",
     ["J. R. R. Tolkien wrote it.", "The U.S. Army agreed."]),
    ("Apples, pears, etc. Fruit is good.", ["Apples, pears, etc.", "Fruit is good."]),
    ("Apples, pears, etc. are fruit.", ["Apples, pears, etc. are fruit."]),
    ("Wait... What? Really?! Yes.", ["Wait...", "What?", "Really?!", "Yes."]),
    ("see v1.2 for details. ok then.", ["see v1.2 for details. ok then."]),
    ("It ended in 1999. 2000 was new.", ["It ended in 1999.", "2000 was new."]),
    ("No terminator at the end", ["No terminator at the end"]),
])
def test_cases(text, expected):
    assert split_sentences(text) == expected


def test_paragraphs_and_newlines():
    text = "Line one\ncontinues here. Next one.\n\nNew paragraph without a dot\n\n  \nLast."
    assert split_sentences(text) == ["Line one continues here.", "Next one.",
                                     "New paragraph without a dot", "Last."]
    kept = split_sentences("Line one\ncontinues. Next.", keep_newlines=True)
    assert kept == ["Line one\ncontinues.", "Next."]


def test_empty_and_whitespace():
    assert split_sentences("") == []
    assert split_sentences("  \n\n \t ") == []


def test_no_text_is_lost():
    text = ("The U.S. economy grew 2.5% in Q3. Mr. Lee said, \"Good.\" Others disagreed! "
            "Why? Nobody knows... The end")
    joined = " ".join(split_sentences(text))
    assert joined.split() == text.split()

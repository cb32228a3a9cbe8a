"""RACE answers are one letter: 'AB' or 'BCD' is a malformed question, not label A/B."""
from __future__ import annotations

import json

from tasks.race.data import read_race


def test_multi_letter_answers_are_malformed_not_a_label(tmp_path):
    passage = {"article": "The cat sat on the mat.",
               "questions": ["Who sat?", "Where?", "What?", "Which?", "Why?"],
               "options": [["a", "b", "c", "d"]] * 5,
               "answers": ["AB", "BCD", " C ", "", "ABCD"]}
    path = tmp_path / "1.txt"
    path.write_text(json.dumps(passage), encoding="utf-8")
    examples, report = read_race([str(path)])
    assert [(e.question, e.label) for e in examples] == [("What?", 2)]
    assert len(report.malformed) == 4
    for answer in ("'AB'", "'BCD'", "''", "'ABCD'"):
        assert any(f"answer {answer} is not one of A, B, C, D" in m for m in report.malformed)

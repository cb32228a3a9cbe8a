"""RACE: the original directories of JSON passages and the 4-way multiple-choice task.

Each ``.txt`` file holds one JSON object: ``article`` (str), ``questions`` (list of
str, cloze questions mark the gap with ``_``), ``options`` (one list of 4 strings per
question) and ``answers`` (one of A-D per question).  One sample per question: for
each option, ``[CLS] article [SEP] question-with-option [SEP]``, label = the answer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from tasks.data_utils import (ListDataset, ReadReport, build_pair_sample, clean_text, read_text,
                              special_ids)

NUM_CHOICES = 4
ANSWERS = "ABCD"


@dataclass
class RaceExample:
    uid: str
    article: str
    question: str
    options: List[str]
    label: int


def race_files(paths: Sequence[str]) -> List[str]:
    """The .txt files named by ``paths`` (files, or directories searched recursively)."""
    files: List[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(root, f) for root, _, names in os.walk(path)
                           for f in names if f.endswith(".txt"))
            if not found:
                raise ValueError(f"{path}: no RACE .txt files in this directory")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"RACE data path {path} does not exist")
    return files


def _question_problem(question, options, answer) -> Optional[str]:
    if not isinstance(question, str):
        return "question is not a string"
    if (not isinstance(options, list) or len(options) != NUM_CHOICES
            or not all(isinstance(o, str) for o in options)):
        return f"options must be a list of {NUM_CHOICES} strings"
    # one letter: a substring test ('AB' in 'ABCD') would read 'AB' as A, 'BCD' as B
    if not isinstance(answer, str) or answer.strip() not in tuple(ANSWERS):
        return f"answer {answer!r} is not one of A, B, C, D"
    return None


def read_race_file(path: str, report: ReadReport) -> List[RaceExample]:
    """Examples of one passage file; problems are recorded in ``report``."""
    try:
        obj = json.loads(read_text(path, "a RACE passage (one JSON object)"))
    except json.JSONDecodeError as exc:
        report.bad(path, exc.lineno, f"not valid JSON ({exc.msg})")
        return []
    except ValueError as exc:  # not UTF-8 text, unreadable
        report.bad(path, 1, str(exc).removeprefix(f"{path}: "))
        return []
    except RecursionError:
        report.bad(path, 1, "not valid JSON (nested too deeply)")
        return []
    keys = ("article", "questions", "options", "answers")
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        report.bad(path, 1, f"expected a JSON object with keys {', '.join(keys)}")
        return []
    questions, options, answers = obj["questions"], obj["options"], obj["answers"]
    if not isinstance(obj["article"], str) or not all(isinstance(x, list) for x in
                                                      (questions, options, answers)):
        report.bad(path, 1, "article must be a string and questions/options/answers lists")
        return []
    if not len(questions) == len(options) == len(answers):
        report.bad(path, 1, f"{len(questions)} questions, {len(options)} option lists and "
                            f"{len(answers)} answers: the counts must agree")
        return []
    article = clean_text(obj["article"])
    uid = str(obj.get("id", os.path.basename(path)))
    out = []
    for k, (q, opts, ans) in enumerate(zip(questions, options, answers)):
        problem = _question_problem(q, opts, ans)
        if problem:
            report.bad(path, 1, f"question {k + 1}: {problem}")
            continue
        out.append(RaceExample(f"{uid}#{k}", article, clean_text(q),
                               [clean_text(o) for o in opts], ANSWERS.index(ans.strip())))
    return out


def read_race(paths: Sequence[str]) -> Tuple[List[RaceExample], ReadReport]:
    files = race_files(paths)
    report = ReadReport("RACE", files=list(paths))
    examples: List[RaceExample] = []
    for path in files:
        examples += read_race_file(path, report)
    report.samples = len(examples)
    return examples, report


def question_with_option(question: str, option: str) -> str:
    """Fill every cloze gap ('_') with the option, else append the option to the question
    (as Megatron-LM's RACE reader, so finetuning inputs and scores compare with its)."""
    if "_" in question:
        return question.replace("_", option)
    return f"{question} {option}"


def build_dataset(name: str, examples: Sequence[RaceExample], tokenizer,
                  max_seq_length: int) -> ListDataset:
    """Samples of [4, seq] text/types/padding_mask and the answer label."""
    cls, sep, pad = special_ids(tokenizer)
    samples = []
    article_ids = {}
    for ex in examples:
        if ex.article not in article_ids:  # questions of one passage share its tokens
            article_ids = {ex.article: tokenizer.tokenize(ex.article)}
        art = article_ids[ex.article]
        choices = [build_pair_sample(art, tokenizer.tokenize(question_with_option(ex.question, o)),
                                     max_seq_length, cls, sep, pad) for o in ex.options]
        sample = {k: np.stack([c[k] for c in choices]) for k in choices[0]}
        sample["label"] = ex.label
        sample["weight"] = 1
        samples.append(sample)
    return ListDataset(name, samples)

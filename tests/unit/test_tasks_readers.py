"""MNLI and RACE readers on the real sample files and on malformed input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasks.data_utils import build_pair_sample
from tasks.glue.mnli import LABELS, read_mnli, read_mnli_files
from tasks.race.data import question_with_option, read_race

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MNLI = DATA / "glue" / "MNLI"
RACE = DATA / "race"


def _need(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} not available")


# ---------------------------------------------------------------------------- MNLI
def test_mnli_real_files_all_variants():
    _need(MNLI)
    train, rep = read_mnli(str(MNLI / "train.tsv"))  # 12 columns
    assert len(train) == 6 and rep.samples == 6 and rep.malformed == []
    assert train[0].premise.startswith("Conceptually cream skimming has two basic dimensions")
    assert train[0].hypothesis == "Product and geography are what make cream skimming work."
    assert train[0].label == LABELS["neutral"] and train[0].uid == "31193n"
    dev, rep = read_mnli(str(MNLI / "dev_matched.tsv"))  # 16 columns
    assert len(dev) == 5 and rep.malformed == []
    assert dev[0].premise == "The new rights are nice enough"
    assert dev[0].hypothesis == "Everyone really likes the newest benefits"  # trailing space gone
    assert dev[0].label == LABELS["neutral"]
    sixteen, _ = read_mnli(str(MNLI / "sample_dev_matched_16col.tsv"))
    assert len(sixteen) == 11 and {e.label for e in sixteen} <= {0, 1, 2}
    both, rep = read_mnli_files([str(MNLI / "dev_matched.tsv"), str(MNLI / "dev_mismatched.tsv")])
    assert len(both) == 10 and len(rep.files) == 2


def test_mnli_test_files_have_no_labels():
    _need(MNLI)
    with pytest.raises(ValueError, match="gold_label"):
        read_mnli(str(MNLI / "test_matched.tsv"))
    test, rep = read_mnli(str(MNLI / "test_matched.tsv"), require_labels=False)  # 10 columns
    assert len(test) == 5 and all(e.label == -1 for e in test) and rep.malformed == []


def test_mnli_malformed_rows_are_reported_and_counted(tmp_path):
    header = "index\tpairID\tsentence1\tsentence2\tlabel1\tgold_label"
    rows = ["0\tp0\tA man sleeps.\tA person rests.\tentailment\tentailment",
            "1\tp1\tToo few columns\tneutral",
            "2\tp2\tA dog.\tA cat.\tneutral\tmaybe",
            "",
            "3\tp3\t \tEmpty premise.\tneutral\tneutral",
            "4\tp4\tShe said \"hi.\tShe spoke.\tentailment\tcontradiction",
            "5\tp5\tx\ty\tz\tneutral\textra"]
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join([header] + rows) + "\n")
    examples, rep = read_mnli(str(path))
    assert [e.uid for e in examples] == ["p0", "p4"]
    assert examples[1].premise == 'She said "hi.' and examples[1].label == LABELS["contradiction"]
    assert len(rep.malformed) == 4 and rep.samples == 2
    assert rep.malformed[0].startswith(f"{path}:3: expected 6 tab-separated columns, found 4")
    assert rep.malformed[1].startswith(f"{path}:4: gold_label 'maybe'")
    assert rep.malformed[2].startswith(f"{path}:6: empty sentence1")
    assert rep.malformed[3].startswith(f"{path}:8:")
    assert "2 samples" in rep.summary() and "4 malformed rows skipped" in rep.summary()


def test_mnli_wrong_file_is_an_error(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text("a\tb\n1\t2\n")
    with pytest.raises(ValueError, match=r"x.tsv:1: header has no 'sentence1'"):
        read_mnli(str(path))


# ---------------------------------------------------------------------------- RACE
def test_race_real_directories():
    _need(RACE)
    examples, rep = read_race([str(RACE / "dev" / "middle")])
    assert rep.malformed == [] and len(rep.files) == 1
    files = sorted((RACE / "dev" / "middle").glob("*.txt"))
    expected = sum(len(json.loads(f.read_text())["questions"]) for f in files)
    assert len(examples) == expected == rep.samples
    first = json.loads(sorted(files)[0].read_text())
    ex = [e for e in examples if e.uid.startswith(first["id"] + "#")]
    assert len(ex) == len(first["questions"])
    assert ex[0].label == "ABCD".index(first["answers"][0])
    assert all(len(e.options) == 4 for e in examples)


def test_race_malformed_files_are_reported(tmp_path):
    good = {"article": "Tom has a cat.", "questions": ["Tom has a _ .", "Who is Tom?"],
            "options": [["cat", "dog", "cow", "pig"], ["a boy", "a cat", "a car", "a hat"]],
            "answers": ["A", "A"], "id": "good.txt"}
    (tmp_path / "good.txt").write_text(json.dumps(good))
    (tmp_path / "broken.txt").write_text('{"article": "x",\n "questions": [')
    (tmp_path / "keys.txt").write_text(json.dumps({"article": "x", "questions": []}))
    bad_q = dict(good, options=[["a", "b", "c"], ["a", "b", "c", "d"]], answers=["A", "E"],
                 id="badq.txt")
    (tmp_path / "badq.txt").write_text(json.dumps(bad_q))
    (tmp_path / "notes.md").write_text("ignored: not a .txt file")
    examples, rep = read_race([str(tmp_path)])
    assert [e.uid for e in examples] == ["good.txt#0", "good.txt#1"]
    assert len(rep.malformed) == 4 and rep.samples == 2
    joined = "\n".join(rep.malformed)
    assert f"{tmp_path / 'broken.txt'}:2: not valid JSON" in joined
    assert f"{tmp_path / 'keys.txt'}:1: expected a JSON object with keys" in joined
    assert f"{tmp_path / 'badq.txt'}:1: question 1: options must be a list of 4 strings" in joined
    assert f"{tmp_path / 'badq.txt'}:1: question 2: answer 'E'" in joined
    assert "4 malformed rows skipped" in rep.summary()


def test_race_missing_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_race(["/nonexistent/race/dir"])


# ---------------------------------------------------------------------- sample layout
def test_pair_sample_layout_and_truncation():
    s = build_pair_sample([5, 6, 7, 8, 9], [10, 11], 8, cls=1, sep=2, pad=0)
    assert s["text"].tolist() == [1, 5, 6, 7, 2, 10, 11, 2]
    assert s["types"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    s = build_pair_sample([5, 6], [10], 8, cls=1, sep=2, pad=0)
    assert s["text"].tolist() == [1, 5, 6, 2, 10, 2, 0, 0]
    assert s["padding_mask"].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert question_with_option("Tom has a _ .", "cat") == "Tom has a cat ."
    assert question_with_option("Who is Tom?", "a boy") == "Who is Tom? a boy"
    # every gap, as Megatron-LM's reader (str.replace without a count)
    assert question_with_option("_ likes _ .", "Tom") == "Tom likes Tom ."


def test_datasets_tokenize_with_bert_vocab():
    vocab = DATA / "bert" / "vocab.txt"
    _need(vocab)
    _need(MNLI)
    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
    from tasks.glue.mnli import build_dataset

    tok = BertWordPieceTokenizer(str(vocab))
    examples, _ = read_mnli(str(MNLI / "dev_matched.tsv"))
    ds = build_dataset("dev", examples, tok, 32)
    s = ds[0]
    n = int(s["padding_mask"].sum())
    expected = ([tok.cls] + tok.tokenize("The new rights are nice enough") + [tok.sep]
                + tok.tokenize("Everyone really likes the newest benefits") + [tok.sep])
    assert s["text"][:n].tolist() == expected and s["label"] == LABELS["neutral"]
    assert np.all(s["text"][n:] == tok.pad)

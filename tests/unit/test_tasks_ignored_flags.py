"""Task flags another task does not read (Megatron-LM ignores them without a word):
tasks/main.py names them in one warning line, before any file is read."""
from __future__ import annotations

import argparse

import pytest

from megatron.entry import run_entry_point
from tasks.data_utils import warn_ignored_task_flags
from tests.unit.test_qa30_tasks_cli import BERT, GPT


def test_wikitext_names_the_training_flags_it_ignores(tmp_path, capsys, monkeypatch):
    from tasks.main import main

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):  # the missing file is still the error
        run_entry_point(main, GPT + ["--task", "WIKITEXT103", "--load", str(tmp_path),
                                     "--valid-data", str(tmp_path / "wiki.tokens"),
                                     "--train-data", "a.tsv", "--epochs", "0", "--keep-last"])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("warning: --train-data, --epochs, --keep-last are ignored by --task "
                      "WIKITEXT103 (zero-shot evaluation: nothing is trained)"), err
    assert err[1].startswith("error: ") and "wiki.tokens" in err[1], err


def test_finetuning_names_overlapping_eval(tmp_path, capsys, monkeypatch):
    from tasks.main import main

    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        run_entry_point(main, BERT + ["--task", "MNLI", "--epochs", "1", "--train-data",
                                      str(tmp_path / "nope.tsv"), "--overlapping-eval", "8"])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("warning: --overlapping-eval is ignored by --task MNLI (it is for "
                      "--task WIKITEXT103)"), err


def test_flags_left_at_their_defaults_are_not_named(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # other local ranks print nothing either way
    raw = argparse.Namespace(train_data=["x"], epochs=None, keep_last=False)
    assert warn_ignored_task_flags(raw, "WIKITEXT103",
                                   ("--train-data", "--epochs", "--keep-last")) == ["--train-data"]
    assert capsys.readouterr().err == ""
    raw = argparse.Namespace(train_data=None, epochs=None, keep_last=False)
    assert warn_ignored_task_flags(raw, "WIKITEXT103", ("--train-data", "--epochs")) == []

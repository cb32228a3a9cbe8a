"""QA of finetuning as a user runs the examples' flags (one process, the MNLI sample).

* --exit-interval at an epoch's end (3 here: 6 examples, batch 2) was never acted on:
  the trainer checks it only before its own end, which in finetuning is each epoch's
  end, so the run trained on to the last epoch.  Now it scores the epoch, saves and
  stops there, and a run resuming from that checkpoint trains as the uninterrupted one.
* --epochs 0 (evaluation only) with the examples' --lr-warmup-fraction stopped with
  '--lr-warmup-fraction needs the LR decay length': no step is taken, so no length.
* A --train-data file without one usable example said 'holds 0 examples, fewer than one
  global batch ...; use more data or a smaller batch'; now, like --valid-data, it names
  the file and its first problem.
"""
from __future__ import annotations


import pytest
import torch

from megatron.entry import run_entry_point
from tasks.main import main

from tests.unit.test_qa30_tasks_cli import BERT as QA30_BERT, DATA, MNLI, VOCAB  # noqa: F401

BERT = QA30_BERT + ["--lr-decay-style", "linear", "--lr-warmup-fraction", "0.065"]
TRAIN = ["--task", "MNLI", "--train-data", str(MNLI / "train.tsv"),
         "--valid-data", str(MNLI / "dev_matched.tsv")]

pytestmark = pytest.mark.skipif(not (VOCAB.exists() and MNLI.exists()),
                                reason="../shared/data (BERT vocab, MNLI) absent")


def test_exit_interval_at_an_epoch_end_stops_there_and_the_resumed_run_matches(tmp_path,
                                                                                capsys):
    torch.set_num_threads(1)
    full = main(BERT + TRAIN + ["--epochs", "2"])
    ck = str(tmp_path / "ck")
    first = main(BERT + TRAIN + ["--epochs", "2", "--save", ck, "--load", ck,
                                 "--exit-interval", "3"])
    out = capsys.readouterr().out
    assert first.iteration == 3 and first.training.exited_early
    assert list(first.accuracy) == [1] and first.accuracy[1] == full.accuracy[1]
    assert "exiting at iteration 3 (--exit-interval 3)" in out
    assert (tmp_path / "ck" / "iter_0000003").is_dir()
    rest = main(BERT + TRAIN + ["--epochs", "2", "--save", ck, "--load", ck])
    assert rest.iteration == 6 and list(rest.accuracy) == [2]
    assert rest.accuracy[2] == full.accuracy[2]
    assert sorted(rest.training.losses) == [4, 5, 6]
    for it, losses in rest.training.losses.items():
        assert losses["loss"] == pytest.approx(full.training.losses[it]["loss"], rel=1e-6)


def test_epochs_0_evaluates_with_a_warmup_fraction(capsys):
    torch.set_num_threads(1)
    result = main(BERT + TRAIN + ["--epochs", "0"])
    assert list(result.accuracy) == [0] and result.iteration == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "| validation" in ln]
    assert len(lines) == 1 and "MNLI epoch 0 |" in lines[0]


@pytest.mark.parametrize("task", ["MNLI", "RACE"])
def test_training_files_without_a_usable_example_name_the_file_and_problem(
        tmp_path, capsys, monkeypatch, task):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    if task == "MNLI":
        rows = (MNLI / "train.tsv").read_text(encoding="utf-8").splitlines()
        bad = tmp_path / "train.tsv"
        bad.write_text("\n".join([rows[0]] + [r.rsplit("\t", 1)[0] + "\tmaybe"
                                              for r in rows[1:]]) + "\n", encoding="utf-8")
        problem = "gold_label 'maybe' is not one of"
    else:
        (tmp_path / "race").mkdir()
        bad = tmp_path / "race"
        (bad / "1.txt").write_text('{"article": "x", "questions": [', encoding="utf-8")
        problem = "not valid JSON"
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, BERT + ["--task", task, "--epochs", "1",
                                      "--train-data", str(bad)])
    assert info.value.code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"error: --train-data {bad}: no usable {task} examples "
                                f"(first problem: "), errors
    assert problem in errors[0]


def test_rerunning_a_finished_finetuning_says_nothing_to_train(tmp_path):
    """Resumed at its last iteration, finetuning trained nothing, scored nothing and saved
    that iteration's checkpoint again; pretraining stops with 'nothing to train'."""
    from megatron.errors import UserError

    torch.set_num_threads(1)
    ck = str(tmp_path / "ck")
    main(BERT + TRAIN + ["--epochs", "1", "--save", ck, "--load", ck])
    saved = (tmp_path / "ck" / "iter_0000003").stat().st_mtime_ns
    with pytest.raises(UserError, match=r"^nothing to train: the checkpoint in --load .* is at "
                                        r"iteration 3, the end of --epochs 1 \(3 iterations "
                                        r"each\); raise --epochs to continue, or pass "
                                        r"--epochs 0 to only evaluate$") as info:
        main(BERT + TRAIN + ["--epochs", "1", "--save", ck, "--load", ck])
    assert info.value.every_rank_alike
    assert (tmp_path / "ck" / "iter_0000003").stat().st_mtime_ns == saved


def _without_tokenizer(argv):
    i = argv.index("--tokenizer-type")
    return argv[:i] + argv[i + 2:]


def _one_error(capsys, monkeypatch, argv) -> str:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_a_gpt_tokenizer_for_a_bert_task_is_one_error_line(capsys, monkeypatch):
    """It was a ValueError traceback on every rank."""
    gpt2 = DATA / "gpt2"
    argv = _without_tokenizer(BERT) + TRAIN + ["--epochs", "1", "--tokenizer-type",
                                               "GPT2BPETokenizer", "--vocab-file",
                                               str(gpt2 / "encoder.json"), "--merge-file",
                                               str(gpt2 / "vocab.bpe")]
    line = _one_error(capsys, monkeypatch, argv)
    assert line.startswith("error: --tokenizer-type: finetuning BERT needs a WordPiece "
                           "tokenizer"), line
    assert "got GPT2BPETokenizer" in line


def test_a_bert_task_without_tokenizer_type(capsys, monkeypatch):
    """--vocab-file alone: BertWordPieceLowerCase, as pretrain_bert.py (and Megatron-LM's)
    defaults; nothing at all: the task's own line, not '(e.g. GPT2BPETokenizer ...)'."""
    torch.set_num_threads(1)
    result = main(_without_tokenizer(BERT) + TRAIN + ["--epochs", "1"])
    assert result.iteration == 3 and list(result.accuracy) == [1]
    assert ("note: --tokenizer-type BertWordPieceLowerCase (this entry point's default"
            in capsys.readouterr().err)
    i = BERT.index("--vocab-file")
    bare = _without_tokenizer(BERT[:i] + BERT[i + 2:])
    line = _one_error(capsys, monkeypatch, bare + TRAIN + ["--epochs", "1"])
    assert line == ("error: --task MNLI needs --tokenizer-type BertWordPieceLowerCase (or "
                    "BertWordPieceCase) and --vocab-file"), line

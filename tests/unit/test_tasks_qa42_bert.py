"""QA of BERT pretraining flags and its checkpoints as finetuning starts from them.

* pretrain_bert.py --mask-prob / --short-seq-prob out of range: every rank printed the
  same error line (two lines on 2 ranks); now local rank 0 of each node prints it.
* A BERT pretrained with --bert-no-binary-head has no pooler: MNLI and RACE refused it
  ('has no value for pooler.dense.weight ...; is it a checkpoint of this kind of
  model?'); the pooler is part of their new head, initialised where the checkpoint
  lacks it (and named in 'newly initialised').
"""
from __future__ import annotations


import pytest
import torch

import pretrain_bert
from tasks.main import main

from tests.unit.test_qa30_tasks_cli import DATA, MNLI, VOCAB  # noqa: F401
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32",
         "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(VOCAB),
         "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
         "--seed", "5", "--log-interval", "1000", "--num-workers", "0"]


@pytest.mark.parametrize("flag, value", [("--mask-prob", "1.5"), ("--short-seq-prob", "-1")])
@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_bert_flag_errors_are_one_line_per_node(capsys, monkeypatch, flag, value, local_rank):
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # no wait for local rank 0 here
    with pytest.raises(SystemExit) as info:
        pretrain_bert.masking_from_args([flag, value])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ([f"error: {flag} must be in " + ("(0, 1)" if flag == "--mask-prob"
                                                     else "[0, 1]") + f", got {float(value)}"]
                     if local_rank == "0" else []), lines


@pytest.mark.skipif(not (VOCAB.exists() and MNLI.exists()), reason="../shared/data absent")
@pytest.mark.parametrize("task", ["MNLI", "RACE"])
def test_finetuning_from_a_bert_without_binary_head(tmp_path, capsys, task):
    torch.set_num_threads(1)
    ck = str(tmp_path / "bert")
    pretrain_bert.main(MODEL + ["--mock-data", "--bert-no-binary-head", "--train-iters", "1",
                                "--eval-iters", "1", "--save", ck])
    if task == "MNLI":
        data = ["--train-data", str(MNLI / "train.tsv"), "--valid-data",
                str(MNLI / "dev_matched.tsv")]
    else:
        race = DATA / "race" / "dev" / "middle"
        if not race.exists():
            pytest.skip("../shared/data/race absent")
        (tmp_path / "race").mkdir()
        for f in sorted(race.glob("*.txt"))[:2]:
            (tmp_path / "race" / f.name).write_bytes(f.read_bytes())
        data = ["--train-data", str(tmp_path / "race"), "--valid-data", str(tmp_path / "race")]
    result = main(MODEL + ["--task", task, "--epochs", "1", "--pretrained-checkpoint", ck]
                  + data)
    assert list(result.accuracy) == [1] and result.iteration > 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "newly initialised" in ln]
    assert len(line) == 1 and "'pooler.dense.weight', 'pooler.dense.bias'" in line[0], line

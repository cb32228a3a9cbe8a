"""tasks/main.py as a user runs it: one error line per node, Megatron-LM's word count for
the adjusted WikiText perplexity, and what an evaluation-only finetuning run prints."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron.entry import run_entry_point
from tasks.main import main
from tasks.zeroshot_gpt.datasets import count_words
from tasks.zeroshot_gpt.evaluate import perplexity
from tests.unit.test_tasks_wikitext import TEXT

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
VOCAB = DATA / "bert" / "vocab.txt"
MNLI = DATA / "glue" / "MNLI"
BERT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(VOCAB),
        "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--seed", "5",
        "--log-interval", "1000", "--num-workers", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--tokenizer-type", "CharTokenizer", "--micro-batch-size", "2"]


def _errors(capsys, monkeypatch, local_rank: str, argv) -> list:
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("RANK", local_rank)
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, argv)
    assert info.value.code == 2
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]


@pytest.mark.parametrize("case", ["no task", "missing train file", "missing wikitext file",
                                  "no wikitext checkpoint"])
def test_task_errors_are_one_line_per_node_not_one_per_rank(tmp_path, capsys, monkeypatch,
                                                            case):
    """Every rank reads the same flags and files: torchrun showed each such error once per
    rank; now local rank 0 prints it and the other ranks exit 2 silently."""
    argv = {"no task": BERT,
            "missing train file": BERT + ["--task", "MNLI", "--epochs", "1", "--train-data",
                                          str(tmp_path / "nope.tsv")],
            "missing wikitext file": GPT + ["--task", "WIKITEXT103", "--load", str(tmp_path),
                                            "--valid-data", str(tmp_path / "wiki.tokens")],
            "no wikitext checkpoint": GPT + ["--task", "WIKITEXT103", "--valid-data", "x"],
            }[case]
    assert len(_errors(capsys, monkeypatch, "0", argv)) == 1
    assert _errors(capsys, monkeypatch, "1", argv) == []


def test_adjusted_perplexity_counts_words_as_megatron():
    """Megatron-LM: num_original_tokens = len(text.strip().split(" ")); line ends count."""
    assert count_words(TEXT) == len(TEXT.strip().split(" ")) == 64
    assert count_words(" \n ") == 0
    r = perplexity(total_loss=60.0, num_tokens=31, num_words=count_words(TEXT))
    assert r.adjusted_ppl == pytest.approx(math.exp(60.0 / 63))
    test_file = DATA / "wikitext" / "wikitext-2" / "wiki.test.tokens"
    if test_file.exists():  # WikiText's published test size is 245,569 with line ends
        assert count_words(test_file.read_text(encoding="utf-8")) == 245566


@pytest.mark.skipif(not (VOCAB.exists() and MNLI.exists()), reason="../shared/data absent")
def test_evaluation_only_run_without_train_data_names_the_iteration(tmp_path, capsys):
    """One MNLI epoch at global batch 2 is 3 iterations; evaluating that checkpoint
    without --train-data printed 'epoch 3' (the iteration, as the epoch)."""
    torch.set_num_threads(1)
    ckpt = str(tmp_path / "mnli")
    main(BERT + ["--task", "MNLI", "--epochs", "1", "--train-data", str(MNLI / "train.tsv"),
                 "--valid-data", str(MNLI / "dev_matched.tsv"), "--save", ckpt])
    trained = [ln for ln in capsys.readouterr().out.splitlines() if "| validation" in ln]
    assert len(trained) == 1 and "MNLI epoch 1 |" in trained[0]
    result = main(BERT + ["--task", "MNLI", "--epochs", "0", "--load", ckpt,
                          "--valid-data", str(MNLI / "dev_matched.tsv")])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "| validation" in ln]
    assert len(lines) == 1 and "MNLI iteration 3 |" in lines[0], lines
    assert lines[0].split("| validation")[1] == trained[0].split("| validation")[1]
    assert list(result.accuracy) == [3]

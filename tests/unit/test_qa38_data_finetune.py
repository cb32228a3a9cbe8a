"""QA of the per-split datasets and finetuning's --keep-last, as a Megatron-LM user runs them.

* --keep-last's incomplete batch: its loss (the gradient) and the logged loss/accuracy
  were each microbatch's mean averaged over all microbatches, weight-0 padding included,
  so the batch's logged loss was about half the real one (MNLI, 2 real examples among 4
  places: 0.55 next to 1.10) and its update was scaled down; now they are the means
  over its real examples.
* An error every rank meets alike is printed by local rank 0 only; under torchrun a
  silent rank that exited first got local rank 0 killed (SIGTERM) before it printed:
  no error line at all (2 of 6 runs of a float .idx on 2 ranks).  Silent ranks now wait.
* tasks/main.py with --data-path or --train-data-path said '... and --mock-data are
  mutually exclusive', a flag the user never gave.
* The same prefix as one run's train split and another's valid split: separate caches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tasks.finetune_utils import _loss_fn, _Padded, epoch_order, microbatches

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
VOCAB = DATA / "bert" / "vocab.txt"
MNLI = DATA / "glue" / "MNLI"


def _batch_loss(n: int, gbs: int, mbs: int, dp: int, seed: int = 0):
    """The keep-last batch of an epoch of ``n`` examples as the engine reduces it: each
    microbatch's loss and accuracy averaged over the microbatches of every replica."""
    per_epoch = -(-n // gbs)
    order = epoch_order(n, per_epoch, gbs, mbs, seed)
    last = order[(per_epoch - 1) * gbs:]
    real = last[last < n]
    ds = [{"text": np.array([i]), "label": i % 3, "weight": 1} for i in range(n)]
    padded = _Padded(ds, per_epoch * gbs, real, gbs / len(real))
    logits = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)
    losses, accs = [], []
    for rank in range(dp):
        for mb in microbatches(padded, last, mbs, rank, dp):
            idx = mb["text"][:, 0]
            loss, rep = _loss_fn(mb["label"], mb["weight"], True, logits[idx])
            losses.append(float(loss))
            accs.append(float(rep["accuracy"]))
    ce = F.cross_entropy(logits[real], torch.as_tensor(real % 3), reduction="none")
    right = (logits[real].argmax(-1) == torch.as_tensor(real % 3)).double()
    return np.mean(losses), np.mean(accs), float(ce.mean()), float(right.mean())


@pytest.mark.parametrize("n, gbs, mbs, dp", [(6, 4, 1, 1), (6, 4, 1, 2), (13, 8, 2, 2),
                                             (789, 16, 4, 1), (9, 8, 2, 1)])
def test_keep_last_batch_loss_and_accuracy_are_means_over_its_real_examples(n, gbs, mbs, dp):
    loss, acc, expected_loss, expected_acc = _batch_loss(n, gbs, mbs, dp)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    assert acc == pytest.approx(expected_acc, rel=1e-12)


def test_full_batches_keep_the_mean_and_the_weights_travel_as_floats():
    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    label = torch.tensor([0, 1, 2, 0])
    loss, rep = _loss_fn(label, torch.ones(4, dtype=torch.long), True, logits)
    assert float(loss) == float(F.cross_entropy(logits, label))
    ds = [{"text": np.array([i]), "weight": 1} for i in range(3)]
    mb = next(microbatches(_Padded(ds, 4, [1, 2], 4 / 3), [0, 1, 2, 3], 4, 0, 1))
    assert mb["weight"].dtype == torch.float64   # collate_samples made 4/3 an int 1
    assert mb["weight"].tolist() == [1.0, 4 / 3, 4 / 3, 0.0]


@pytest.mark.skipif(not (VOCAB.exists() and MNLI.exists()), reason="../shared/data absent")
def test_mnli_keep_last_logs_the_real_examples_loss():
    from tasks.main import main
    from tests.unit.test_qa30_tasks_cli import BERT

    torch.set_num_threads(1)
    argv = list(BERT) + ["--task", "MNLI", "--epochs", "1", "--keep-last", "--train-data",
                         str(MNLI / "train.tsv"), "--valid-data", str(MNLI / "dev_matched.tsv")]
    argv[argv.index("--global-batch-size") + 1] = "4"
    result = main(argv)
    losses = {i: v["loss"] for i, v in result.training.losses.items()}
    assert result.iteration == 2 and sorted(losses) == [1, 2]
    # 3 labels, random weights: ~ln 3 = 1.10 each; the padded batch logged ~0.55
    assert losses[2] == pytest.approx(losses[1], rel=0.1)


# ------------------------------------------------------------------ one line per node
def _exit_silently(monkeypatch, local_rank: str, local_world: str = None):
    from megatron import errors
    from megatron.entry import exit_with_user_error

    waits = []
    monkeypatch.setattr(errors.time, "sleep", waits.append)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    err = errors.DataError("--train-data-path x: float data")
    err.every_rank_alike = True
    with pytest.raises(SystemExit) as info:
        exit_with_user_error(err, debug=False)
    assert info.value.code == 2
    return waits


def test_a_silent_rank_lets_local_rank_zero_print_first(monkeypatch, capsys):
    from megatron.errors import SILENT_RANK_WAIT_S

    assert _exit_silently(monkeypatch, "1", "2") == [SILENT_RANK_WAIT_S]
    assert capsys.readouterr().err == ""
    assert _exit_silently(monkeypatch, "0", "2") == []     # the printing rank: at once
    assert capsys.readouterr().err.startswith("error: --train-data-path x")
    assert _exit_silently(monkeypatch, "1") == []          # no torchrun: nothing to wait for


def test_argument_errors_exit_once_per_node_too(monkeypatch, capsys):
    """The parser's and the tasks' one-line errors go through ``exit_once_per_node``: the
    silent rank waits under torchrun, local rank 0 prints its lines in order."""
    from megatron import errors
    from megatron.arguments import parse_and_validate

    waits = []
    monkeypatch.setattr(errors.time, "sleep", waits.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(SystemExit) as info:
            parse_and_validate(["--num-layers", "-1"])
        assert info.value.code == 2
    assert waits == [errors.SILENT_RANK_WAIT_S]
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and err.startswith("error: ")
    with pytest.raises(SystemExit):
        errors.exit_once_per_node("note: first", "error: second", code=3)
    assert capsys.readouterr().err == "note: first\nerror: second\n"


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path", "--test-data-path"])
def test_tasks_refuse_pretraining_corpus_flags_naming_them(tmp_path, capsys, monkeypatch, flag):
    from megatron.entry import run_entry_point
    from tasks.main import main
    from tests.unit.test_qa30_tasks_cli import BERT

    monkeypatch.setenv("LOCAL_RANK", "0")
    argv = list(BERT) + ["--task", "MNLI", "--epochs", "1", "--train-data",
                         str(MNLI / "train.tsv"), flag, str(tmp_path / "corpus")]
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, argv)
    assert info.value.code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and flag in errors[0] and "--mock-data" not in errors[0]


# ------------------------------------------------------------------------ index cache
def test_one_prefix_as_train_in_one_run_and_valid_in_another_has_its_own_cache(tmp_path):
    from megatron.data.gpt_dataset import build_split_path_datasets
    from tests.unit.test_split_data_paths import _corpus, _gpt_tokens

    a, b = _corpus(tmp_path / "a", 4, 40), _corpus(tmp_path / "b", 50, 90)
    cache = str(tmp_path / "cache")
    first = build_split_path_datasets(([a], [b], []), (16, 16, 0), 8, 3, cache, 96)
    second = build_split_path_datasets(([b], [a], []), (16, 16, 0), 8, 3, cache, 96)
    assert not any(d.index_cache_hit for d in first[:2] + second[:2])
    assert len(list(Path(cache).glob("*_doc_idx.npy"))) == 4
    again = build_split_path_datasets(([b], [a], []), (16, 16, 0), 8, 3, cache, 96)
    assert all(d.index_cache_hit for d in again[:2])
    assert np.array_equal(_gpt_tokens(again[0]), _gpt_tokens(second[0]))

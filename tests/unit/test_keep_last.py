"""--keep-last (Megatron-LM's finetuning flag): each epoch's last incomplete global batch
is trained too, its missing examples padded with weight 0 and its real ones dealt over
its microbatches; without the flag the order is what it always was."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.finetune_utils import _Padded, epoch_order, microbatches

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
VOCAB = DATA / "bert" / "vocab.txt"
MNLI = DATA / "glue" / "MNLI"


def test_without_keep_last_the_order_is_the_seeded_permutation_cut():
    order = epoch_order(10, 2, 4, 1, seed=3)
    assert order.tolist() == np.random.RandomState(3).permutation(10)[:8].tolist()


@pytest.mark.parametrize("n, gbs, mbs", [(10, 8, 2), (13, 8, 2), (9, 4, 1), (7, 6, 3)])
def test_every_example_once_and_the_last_batch_dealt_over_its_microbatches(n, gbs, mbs):
    per_epoch = -(-n // gbs)
    order = epoch_order(n, per_epoch, gbs, mbs, seed=0)
    assert len(order) == per_epoch * gbs
    real = order[order < n]
    assert sorted(real.tolist()) == list(range(n))                  # each exactly once
    full = (n // gbs) * gbs
    assert order[:full].tolist() == np.random.RandomState(0).permutation(n)[:full].tolist()
    last = order[full:].reshape(gbs // mbs, mbs)                    # its microbatch slices
    counts = (last < n).sum(axis=1)
    assert counts.max() - counts.min() <= 1 and counts.sum() == n - full


def test_padding_has_weight_zero_and_dp_ranks_cut_the_batch_as_the_trainer():
    ds = [{"text": np.array([i]), "weight": 1} for i in range(5)]
    padded = _Padded(ds, 8)
    order = epoch_order(5, 2, 4, 1, seed=1)
    seen = []
    for rank in range(2):          # two data-parallel ranks, micro-batch 1
        for mb in microbatches(padded, order, 1, rank, 2):
            seen.append((int(mb["text"][0]), int(mb["weight"][0])))
    assert sorted(t for t, w in seen if w == 1) == list(range(5))
    assert sum(w for _, w in seen) == 5 and len(seen) == 8


@pytest.mark.skipif(not (VOCAB.exists() and MNLI.exists()), reason="../shared/data absent")
def test_mnli_epochs_keep_their_last_batch(tmp_path):
    """MNLI's 6-example sample at global batch 4: one iteration per epoch without the
    flag (2 examples dropped), two with it; the compatibility note is gone."""
    from tasks.main import main
    from tests.unit.test_qa30_tasks_cli import BERT

    torch.set_num_threads(1)
    argv = [a for a in BERT] + ["--task", "MNLI", "--epochs", "2", "--train-data",
                                str(MNLI / "train.tsv"), "--valid-data",
                                str(MNLI / "dev_matched.tsv")]
    argv[argv.index("--global-batch-size") + 1] = "4"
    assert main(argv).iteration == 2
    kept = main(argv + ["--keep-last"])
    assert kept.iteration == 4 and sorted(kept.accuracy) == [1, 2]


def test_tasks_main_help_without_a_task_prints_the_flags(capsys):
    """`tasks/main.py --help` printed 'error: --task is required'; now the help of the
    trainer's and the tasks' flags, --keep-last among them."""
    from tasks.main import main

    assert main(["--help"]) is None
    out = capsys.readouterr().out
    assert out.startswith("usage: tasks/main.py") and "--keep-last" in out
    assert "--task {MNLI,RACE,WIKITEXT103,LAMBADA}" in out

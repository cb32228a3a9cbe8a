"""End to end on two gloo ranks: pretrain a tiny BERT (real vocabulary, d = 2), save,
finetune it on the MNLI sample (d = 2, 2BW) and on a few RACE passages (d = 1, w = 2,
so the d = 2 checkpoint is re-split), and evaluate a d = 2 GPT checkpoint's WikiText
perplexity with tensor parallelism (t = 2) against the same checkpoint in one process."""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_bert_harness import DATA, GPT, ROOT, spawn_all

pytestmark = pytest.mark.skipif(
    not ((DATA / "bert" / "vocab.txt").exists() and (DATA / "glue" / "MNLI").exists()
         and (DATA / "race").exists()), reason="../shared/data (BERT vocab, MNLI, RACE) absent")


@pytest.fixture(scope="module")
def last():
    return spawn_all()[-1]


def test_pretraining_saved_a_pipeline_checkpoint(last):
    losses = last["bert_pretrain"]["losses"]
    assert sorted(losses) == [1, 2]
    assert all(math.isfinite(v) for step in losses.values() for v in step.values())
    assert (ROOT / "bert_real" / "iter_0000002" / "mp_rank_00_001").is_dir()


def test_mnli_finetuning_reports_accuracy_per_epoch_and_set(last):
    mnli = last["mnli"]
    dev = [str(DATA / "glue" / "MNLI" / f) for f in ("dev_matched.tsv", "dev_mismatched.tsv")]
    assert sorted(mnli["accuracy"]) == [1, 2]  # epochs
    for epoch in (1, 2):
        assert sorted(mnli["accuracy"][epoch]) == sorted(dev)
        for acc in mnli["accuracy"][epoch].values():
            assert 0.0 <= acc <= 1.0 and abs(acc * 5 - round(acc * 5)) < 1e-9  # k / 5 rows
    assert mnli["samples"]["train"] == 6 and mnli["malformed"]["train"] == 0
    assert mnli["iteration"] == 2 * (6 // 4)
    assert (ROOT / "mnli" / "iter_0000002" / "mp_rank_00_001").is_dir()


def test_race_finetuning_on_a_resplit_checkpoint(last):
    race = last["race"]
    assert sorted(race["accuracy"]) == [1]
    accs = race["accuracy"][1]
    assert len(accs) == 2 and all(0.0 <= a <= 1.0 for a in accs.values())
    n_train = race["samples"]["train"]
    assert n_train >= 4 and race["iteration"] == n_train // 4
    losses = race["train_losses"]
    assert losses and all(math.isfinite(v["loss"]) for v in losses.values())


def test_race_with_sequence_parallelism_trains_as_with_data_parallelism(last):
    """RACE from the same pipeline checkpoint, resplit to t = 2 with sequence
    parallelism, trains to the losses and accuracies of the w = 2 run (float32)."""
    plain, sp = last["race"], last["race_t2_sp"]
    assert sp["samples"] == plain["samples"] and sp["iteration"] == plain["iteration"]
    assert sorted(sp["train_losses"]) == sorted(plain["train_losses"])
    for it, loss in plain["train_losses"].items():
        assert sp["train_losses"][it]["loss"] == pytest.approx(loss["loss"], rel=1e-4), it
    assert sp["accuracy"] == plain["accuracy"]


def test_wikitext_perplexity_same_with_tensor_parallelism_and_without(last):
    from tasks.main import main

    torch.set_num_threads(1)
    t2 = last["wikitext_t2"]["perplexity"]
    t1 = main(GPT + ["--task", "WIKITEXT103", "--valid-data", str(ROOT / "wiki.txt"),
                     "--load", str(ROOT / "gpt"), "--overlapping-eval", "6"])
    assert t2.num_tokens == t1.num_tokens and t2.num_words == t1.num_words
    assert t2.total_loss == pytest.approx(t1.total_loss, rel=1e-10)
    assert t2.adjusted_ppl == pytest.approx(t1.adjusted_ppl, rel=1e-9)
    sp = last["wikitext_t2_sp"]["perplexity"]   # --sequence-parallel at t = 2
    assert sp.num_tokens == t1.num_tokens
    assert sp.total_loss == pytest.approx(t1.total_loss, rel=1e-10)


def test_finetuning_that_ends_on_nan_steps_fails_and_saves_nothing(tmp_path):
    """lr 1e30: the first step sends the weights to ~1e30 and every later step is skipped
    for a non-finite loss; the run ends on those weights, so it fails and saves nothing
    (it used to save them and exit 0)."""
    from megatron.training_exits import NonFiniteError
    from tasks.main import main
    from tests.distributed.test_bert_harness import REAL

    torch.set_num_threads(1)
    mnli = DATA / "glue" / "MNLI"
    with pytest.raises(NonFiniteError, match=r"last 2 optimizer step\(s\) \(iterations 2-3\)"):
        main(REAL + ["--task", "MNLI", "--global-batch-size", "2", "--epochs", "1",
                     "--lr", "1e30", "--train-data", str(mnli / "train.tsv"),
                     "--valid-data", str(mnli / "dev_matched.tsv"),
                     "--save", str(tmp_path / "ck")])
    assert not list((tmp_path / "ck").glob("iter_*"))


def test_finetuning_log_counts_to_the_end_of_the_run(capsys):
    """'iteration i/N' names the run's last iteration, not the current epoch's end."""
    from tasks.main import main
    from tests.distributed.test_bert_harness import REAL

    torch.set_num_threads(1)
    mnli = DATA / "glue" / "MNLI"
    main(REAL + ["--task", "MNLI", "--global-batch-size", "2", "--epochs", "2",
                 "--lr", "1e-5", "--log-interval", "1", "--train-data", str(mnli / "train.tsv"),
                 "--valid-data", str(mnli / "dev_matched.tsv")])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " iteration " in ln]
    ends = {ln.split(" iteration ")[1].split("|")[0].split("/")[1].strip() for ln in lines}
    assert len(lines) >= 4 and ends == {str(len(lines))}, lines


def test_megatron_finetune_script_flags_and_its_time_limit(tmp_path, monkeypatch, capsys):
    """Megatron-LM's finetune_mnli_distributed.sh passes 2020 flag names (--batch-size,
    --model-parallel-size, --warmup, --checkpoint-activations): they finetune here.
    --exit-duration-in-mins, already passed, stops finetuning at the first batch
    boundary with a checkpoint and no epoch score (it was unrecognised, and finetuning
    ignored --exit-signal-handler)."""
    import time

    import megatron.training_exits as training
    from tasks.main import main
    from tests.distributed.test_bert_harness import REAL

    torch.set_num_threads(1)
    monkeypatch.setattr(training, "STARTED", time.monotonic() - 120.0)
    old = ["--batch-size" if a == "--micro-batch-size" else a for a in REAL]
    old += ["--model-parallel-size", "1", "--warmup", "0.1", "--checkpoint-activations"]
    mnli = DATA / "glue" / "MNLI"
    result = main(old + ["--task", "MNLI", "--global-batch-size", "2", "--epochs", "2",
                         "--lr", "1e-5", "--train-data", str(mnli / "train.tsv"),
                         "--valid-data", str(mnli / "dev_matched.tsv"),
                         "--exit-duration-in-mins", "1", "--save", str(tmp_path / "ck")])
    captured = capsys.readouterr()
    assert "--batch-size as --micro-batch-size" in captured.err
    assert "--checkpoint-activations adds --recompute-granularity full" in captured.err
    assert "recompute layers, 1 per chunk" in captured.out
    assert result.training.exited_early and result.iteration == 1 and not result.accuracy
    assert "stopped at iteration 1: " in captured.out
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

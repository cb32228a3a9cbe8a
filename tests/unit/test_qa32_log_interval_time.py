"""The log line after an evaluation or a checkpoint save reports training time only: its
'elapsed time per iteration', samples/s and TFLOP/s leave the evaluation and the save
out, as Megatron-LM stops its 'interval-time' timer around them (one process)."""
from __future__ import annotations

import contextlib
import io
import re
import time

from tests.distributed.gpt_harness import TINY

PAUSE = 1.0
"""Seconds the evaluation and the save at iteration 2 are made to last (an iteration of
TINY takes tens of milliseconds on one thread)."""


def test_evaluation_and_saves_are_not_counted_as_iteration_time(tmp_path, monkeypatch):
    import torch

    import pretrain_gpt
    import megatron.training_loop as training
    from megatron.training import pretrain

    evaluate, save = training.evaluate_and_print, training._save_checked

    def slow_evaluate(engine, iterator, eval_iters, label, iteration, logger, **kw):
        if iteration == 2:
            time.sleep(PAUSE)
        return evaluate(engine, iterator, eval_iters, label, iteration, logger, **kw)

    def slow_save(cfg, groups, engine, optimizer, scheduler, state, monitor=None):
        if state.iteration == 2:
            time.sleep(PAUSE)
        return save(cfg, groups, engine, optimizer, scheduler, state, monitor)

    monkeypatch.setattr(training, "evaluate_and_print", slow_evaluate)
    monkeypatch.setattr(training, "_save_checked", slow_save)
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # iterations of steady length on a machine shared with others
    try:
        with contextlib.redirect_stdout(out):
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                     pretrain_gpt.forward_step,
                     argv=TINY + ["--train-iters", "3", "--log-interval", "1",
                                  "--eval-interval", "2", "--save",
                                  str(tmp_path / "ck"), "--save-interval", "2"])
    finally:
        torch.set_num_threads(threads)
    ms = {int(i): float(t) for i, t in re.findall(
        r"iteration +(\d+)/ +\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)",
        out.getvalue())}
    assert sorted(ms) == [1, 2, 3]
    assert "validation loss at iteration 2" in out.getvalue()
    # iteration 3 follows an evaluation and a save of PAUSE seconds each: counted, they
    # made it 2 x PAUSE longer than the others
    assert ms[3] < max(ms[1], ms[2]) + 1000 * PAUSE, ms


def test_finetuning_leaves_the_scoring_between_epochs_out(tmp_path, monkeypatch):
    """tasks/main.py: the accuracy scored after epoch 1 is not time of the first
    iteration of epoch 2 (one MNLI-sample epoch at global batch 2 is 3 iterations)."""
    import pytest
    import torch

    import tasks.finetune_utils as finetune_utils
    from tasks.main import main
    from tests.unit.test_qa30_tasks_cli import BERT, MNLI, VOCAB

    if not (VOCAB.exists() and MNLI.exists()):
        pytest.skip("../shared/data absent")
    score = finetune_utils.evaluate_accuracy

    def slow_score(engine, dataset, cfg, groups):
        time.sleep(PAUSE)
        return score(engine, dataset, cfg, groups)

    monkeypatch.setattr(finetune_utils, "evaluate_accuracy", slow_score)
    out = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            main(BERT[:BERT.index("--log-interval")] + BERT[BERT.index("--log-interval") + 2:]
                 + ["--log-interval", "1", "--task", "MNLI", "--epochs", "2", "--train-data",
                    str(MNLI / "train.tsv"), "--valid-data", str(MNLI / "dev_matched.tsv")])
    finally:
        torch.set_num_threads(threads)
    ms = {int(i): float(t) for i, t in re.findall(
        r"iteration +(\d+)/ +\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)",
        out.getvalue())}
    assert sorted(ms) == [1, 2, 3, 4, 5, 6], out.getvalue()[-2000:]
    assert out.getvalue().count("| validation") == 2
    # iteration 4 follows epoch 1's scoring of PAUSE seconds: counted, it would be longer
    assert ms[4] < max(ms[2], ms[3], ms[5]) + 1000 * PAUSE, ms

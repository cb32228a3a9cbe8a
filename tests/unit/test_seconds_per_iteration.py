"""TrainingResult.seconds_per_iteration (what the convergence benches time runs with)
leaves the loop's evaluations and interval saves out, as the log line does: a slow
evaluation does not make training look slower."""
from __future__ import annotations

import time

import torch

import megatron.training_loop as training

ARGV = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "4", "--lr", "1e-3", "--eval-interval", "1", "--eval-iters", "1",
        "--num-workers", "0", "--log-interval", "100"]


def test_evaluations_are_not_training_time(monkeypatch):
    import pretrain_gpt

    real = training.evaluate_and_print
    calls = []

    def slow(*args, **kwargs):
        calls.append(args[3])
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "evaluate_and_print", slow)
    torch.manual_seed(0)
    result = pretrain_gpt.main(list(ARGV))
    assert calls.count("validation") >= 4  # one per iteration (plus the end's)
    # before: 4 x 0.5 s of evaluation over 4 iterations put it above 0.5 s
    assert 0 < result.seconds_per_iteration < 0.4, result.seconds_per_iteration

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


def test_a_long_run_keeps_only_the_newest_reports(monkeypatch):
    """TrainingResult keeps STEPS_KEPT iterations (here 3): a run of millions of
    iterations kept every report and loss before, about 0.7 KB each per rank."""
    import pretrain_gpt

    monkeypatch.setattr(training, "STEPS_KEPT", 3)
    torch.manual_seed(0)
    argv = [a if a != "4" or i == 0 or ARGV[i - 1] != "--train-iters" else "9"
            for i, a in enumerate(ARGV)]
    result = pretrain_gpt.main(argv)
    assert result.iteration == 9
    kept = [r.iteration for r in result.reports]
    assert 3 <= len(kept) < 6 and kept == list(range(9 - len(kept), 9)), kept
    assert sorted(result.losses) == [t + 1 for t in kept]

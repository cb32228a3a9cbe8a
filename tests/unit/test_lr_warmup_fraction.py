"""--lr-warmup-fraction is not rounded to whole iterations (or samples): Megatron-LM
keeps fraction x decay as it is, in samples, so 0.001 of 400 iterations is 0.4 of one,
and the first step still runs at --lr-warmup-init."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import build_config, parse_args, validate_args
from megatron.optimizer import OptimizerParamScheduler

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--seq-length", "32",
        "--max-position-embeddings", "32", "--lr", "1.0", "--min-lr", "0.1", "--mock-data",
        "--vocab-size", "100", "--lr-decay-style", "linear"]


@pytest.fixture(autouse=True)
def _rank0(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _scheduler(*extra):
    args = validate_args(parse_args(BASE + list(extra)), 1)
    return OptimizerParamScheduler.from_config(build_config(args).optimizer, args.train_iters,
                                               global_batch_size=8)


def _megatron_lm_rate(samples: float, warmup: float, decay: float, lr=1.0, min_lr=0.1,
                      init=0.0) -> float:
    """Megatron-LM's linear schedule, counted in samples as it counts it."""
    if warmup > 0 and samples <= warmup:
        return init + (lr - init) * samples / warmup
    if samples > decay:
        return min_lr
    return min_lr + (lr - min_lr) * (1.0 - (samples - warmup) / (decay - warmup))


@pytest.mark.parametrize("unit", ["--train-iters", "--train-samples"])
def test_a_fraction_of_one_iteration_still_warms_up(unit):
    count = "400" if unit == "--train-iters" else "3200"
    s = _scheduler(unit, count, "--lr-warmup-fraction", "0.001")
    per = 1 if unit == "--train-iters" else 8  # schedule steps per iteration
    # rounded, this was no warmup: the first step at the full rate
    assert s.get_lr(0) == 0.0
    for it in range(0, 6):
        assert s.get_lr(it * per) == pytest.approx(
            _megatron_lm_rate(it * 8, 0.001 * 3200, 3200)), it


def test_whole_warmups_stay_whole_numbers():
    s = _scheduler("--train-iters", "400", "--lr-warmup-fraction", "0.01")
    assert s.warmup_steps == 4 and isinstance(s.warmup_steps, int)

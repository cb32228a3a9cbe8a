"""Dropout seeds per rank follow Megatron-LM's _set_random_seed: stage p adds 100 p;
data-parallel replica r adds 10 r only under --data-parallel-random-init."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron.arguments import build_config, parse_args, validate_args
from megatron.initialize import set_random_seed
from megatron.tensor_parallel.random import get_rng_tracker


def _draws(pp: int, dp: int, random_init: bool):
    groups = SimpleNamespace(pp_rank=pp, dp_rank=dp, tp_rank=0)
    set_random_seed(1234, groups, torch.device("cpu"), data_parallel_random_init=random_init)
    default = torch.rand(8)
    with get_rng_tracker().fork():
        model_parallel = torch.rand(8)
    return default, model_parallel


def test_replicas_share_dropout_streams_by_default():
    a, b = _draws(0, 0, False), _draws(0, 1, False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Stages still differ, as in Megatron-LM.
    c = _draws(1, 0, False)
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])


def test_data_parallel_random_init_gives_each_replica_its_stream():
    a, b = _draws(0, 0, True), _draws(0, 1, True)
    assert torch.equal(a[0], _draws(0, 0, False)[0])  # replica 0 is unchanged
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    # Replica 1 of stage 0 is seed + 10, not stage 1's seed + 100.
    torch.manual_seed(1234 + 10)
    assert torch.equal(b[0], torch.rand(8))


def test_flag_reaches_the_training_config():
    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--mock-data",
            "--vocab-size", "32", "--lr", "1e-3"]
    assert build_config(validate_args(parse_args(base), 1)).training.data_parallel_random_init is False
    flagged = build_config(validate_args(parse_args(base + ["--data-parallel-random-init"]), 1))
    assert flagged.training.data_parallel_random_init is True

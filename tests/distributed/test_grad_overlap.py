"""Data-parallel gradient all-reduce overlapped with the backward pass (w=2, gloo).

The reducer's hooks must start a bucket's all-reduce during the LAST microbatch's
backward of a batch (not before: earlier microbatches have not added their part yet),
and the averaged gradients must equal the mean of the replicas' gradients exactly.
"""
from __future__ import annotations

import torch
from torch import nn

from tests.dist_utils import run_distributed

M = 3  # microbatches per batch


def _reduce_worker(rank: int, world: int):
    import torch.distributed as dist

    from megatron.pipeline.grad_reduction import GradientReduction

    torch.manual_seed(0)  # same weights on both replicas
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4)).double()
    params = list(model.parameters())
    # ~one Linear per bucket: 16x16 doubles = 2 KiB
    reducer = GradientReduction(params, dist.group.WORLD, world, M, bucket_bytes=2200)
    started = []
    orig = reducer._launch

    def spy(b):
        started.append((b, calls[0]))
        orig(b)

    reducer._launch = spy
    calls = [0]
    torch.manual_seed(100 + rank)  # different data per replica
    xs = [torch.randn(5, 8, dtype=torch.float64) for _ in range(M)]
    local = None
    for mb, x in enumerate(xs):
        calls[0] = mb
        model(x).square().mean().backward()
        if mb == M - 2:
            assert started == [], "a bucket left before the last microbatch's backward"
    local = [p.grad.clone() for p in params]
    in_backward = list(started)
    reducer.launch_remaining()
    reducer.finish()
    return {"local": local, "reduced": [p.grad.clone() for p in params],
            "in_backward": in_backward, "buckets": len(reducer._buckets)}


def test_buckets_start_in_the_last_backward_and_average_exactly():
    out = run_distributed(_reduce_worker, 2, timeout=120)
    for r in out:
        assert r["buckets"] >= 3
        # every bucket was started by the hooks, during the last microbatch's backward,
        # the last layers' bucket first
        assert len(r["in_backward"]) == r["buckets"]
        assert all(mb == M - 1 for _, mb in r["in_backward"])
        assert [b for b, _ in r["in_backward"]] == list(range(r["buckets"]))
    for i, (a, b) in enumerate(zip(out[0]["local"], out[1]["local"])):
        mean = (a + b) / 2
        assert torch.equal(out[0]["reduced"][i], mean) and torch.equal(out[1]["reduced"][i], mean)

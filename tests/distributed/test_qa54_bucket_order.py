"""The overlapped gradient reduction starts its buckets in one order on every replica
(QA pass 54).

Collectives of one process group pair up by the order they are issued in.  The hooks
started a bucket as soon as its gradients were final, so a replica on which a parameter
missed one microbatch (its bucket then starts at REDUCE_GRADS, after the others) issued
the buckets in another order than its peers: with buckets of equal size the reductions
paired the wrong buckets and averaged one layer's gradient with another's, silently.
Buckets must leave in index order (as DDP's do): a final bucket waits for the ones
before it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed

M = 3


def _worker(rank: int, world: int, sharded: bool):
    import torch.distributed as dist

    from megatron.optimizer.sharding import plan_shard
    from megatron.pipeline.grad_reduction import GradientReduction

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4).double() for _ in range(3)]  # 20 parameters each
    params = [p for layer in layers for p in layer.parameters()]
    shard = plan_shard(params, dist.group.WORLD, None, bucket_elements=20) if sharded else None
    reducer = GradientReduction(params, dist.group.WORLD, world, M, bucket_elements=20,
                                shard=shard)
    assert len(reducer._buckets) == 3
    torch.manual_seed(10 + rank)
    for mb in range(M):
        h = layers[1](layers[0](torch.randn(5, 4, dtype=torch.float64)).tanh()).tanh()
        # replica 1 leaves the last layer out of its first microbatch
        y = h if (rank == 1 and mb == 0) else layers[2](h)
        y.square().sum().backward()
    local = [p.grad.clone() for p in params]
    reducer.launch_remaining()
    reducer.finish()
    owned = None if shard is None else [(pc.param, pc.start, pc.stop) for pc in shard.pieces()]
    return {"local": local, "reduced": [p.grad.clone() for p in params], "owned": owned}


@pytest.mark.parametrize("sharded", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_a_parameter_unused_on_one_replica_gets_the_right_average(sharded):
    out = run_distributed(_worker, 2, args=(sharded,), timeout=120)
    mean = [(a + b) / 2 for a, b in zip(out[0]["local"], out[1]["local"])]
    for r in out:
        if r["owned"] is None:
            for i, m in enumerate(mean):
                assert torch.allclose(r["reduced"][i], m, rtol=0, atol=1e-12), i
        else:
            for i, start, stop in r["owned"]:
                got = r["reduced"][i].reshape(-1)[start:stop]
                assert torch.allclose(got, mean[i].reshape(-1)[start:stop], rtol=0,
                                      atol=1e-12), i

"""--overlap-param-gather's bookkeeping without a process group: which buckets a layer's
hook waits for, which are waited for before the forward, and the order the gathers
start in (tests/distributed/test_overlap_param_gather.py trains with it)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.optimizer.sharding import OptimizerShard, WeightGather, plan_buckets
from megatron.pipeline.param_gather import GatherHooks
from megatron.pipeline.weights import WeightBuffers


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class _Stage(nn.Module):
    """An embedding, two layers in a ModuleList, a norm, and a head that reads the
    embedding's weight functionally (as a tied output layer does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(4)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.embedding.weight.t()


class _Done:
    def __init__(self, log, b):
        self.log, self.b = log, b

    def wait(self):
        self.log.append(self.b)


def _hooks(bucket_elements: int):
    torch.manual_seed(0)
    model = _Stage()
    weights = WeightBuffers(model, 1)
    params = weights.params(0)
    numels = [p.numel() for p in params]
    buckets = plan_buckets(numels, [p.dtype for p in params], 2, bucket_elements,
                           [1] * len(params))
    shard = OptimizerShard(rank=0, size=2, buckets=buckets, numels=tuple(numels))
    gather = WeightGather(shard, [[] for _ in buckets])
    gather.overlap = True
    return model, weights, gather, GatherHooks(model, weights, gather)


def _bucket_of(gather, weights, param):
    i = next(i for i, p in enumerate(weights.params(0)) if p is param)
    return next(b for b, bucket in enumerate(gather.shard.buckets) if i in bucket.params)


def test_buckets_outside_the_layers_are_waited_first_then_layer_by_layer():
    model, weights, gather, hooks = _hooks(bucket_elements=20)
    outside = {_bucket_of(gather, weights, p) for p in
               (model.embedding.weight, model.norm.weight, model.norm.bias)}
    assert set(hooks.outside) == outside
    layer_buckets = [{_bucket_of(gather, weights, p) for p in layer.parameters()} - outside
                     for layer in model.layers]
    assert [set(b) for b in hooks.per_layer] == layer_buckets
    # a bucket may hold the end of one layer and the start of the next: both wait for it
    assert all(layer_buckets) and layer_buckets[0] & layer_buckets[1]
    n, first = len(hooks.outside), len(layer_buckets[0])
    assert set(gather.order[:n]) == outside
    assert set(gather.order[n:n + first]) == layer_buckets[0]
    assert set(gather.order[n + first:]) == layer_buckets[1] - layer_buckets[0]
    assert sorted(gather.order) == list(range(len(gather.shard.buckets)))


def test_each_layer_waits_for_its_buckets_when_it_runs():
    model, weights, gather, hooks = _hooks(bucket_elements=20)
    log = []
    for b in gather.order:  # gathers "in flight" that write nothing
        gather._pending[b] = (_Done(log, b), torch.zeros(0), None, [])
    gather.shard = OptimizerShard(  # no destinations: nothing to copy
        rank=0, size=2, numels=gather.shard.numels,
        buckets=tuple(type(bk)(params=(), offsets=(), numel=0, padded=0)
                      for bk in gather.shard.buckets))
    hooks.wait_outside()
    assert log == hooks.outside
    seen = []  # what had been waited for when each layer ran (hooks run in order)
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, a: seen.append(set(log)))
    model(torch.tensor([1, 2]))
    assert seen[0] == set(hooks.outside) | set(hooks.per_layer[0])
    assert seen[1] == seen[0] | set(hooks.per_layer[1]) != seen[0]
    # in the order the forward pass reaches them, each once
    assert log == gather.order
    assert not gather.pending


def test_set_order_must_be_an_order_of_the_buckets():
    _, _, gather, _ = _hooks(bucket_elements=20)
    n = len(gather.shard.buckets)
    with pytest.raises(ValueError, match="not an order"):
        gather.set_order(list(range(n - 1)))
    gather.set_order(list(range(n)))
    assert gather.order == list(range(n))

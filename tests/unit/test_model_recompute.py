"""Activation recomputation and dropout RNG replay."""
from __future__ import annotations

import pytest
import torch

import megatron.model.transformer as transformer_module
from megatron.model import GPTModel
from megatron.tensor_parallel import (TPInfo, get_rng_state, get_rng_tracker,
                                      model_parallel_seed, set_rng_state)
from tests.unit.test_model_gpt import make_batch, make_config

RECOMPUTE = {
    "selective": dict(recompute_granularity="selective"),
    "uniform1": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1),
    "uniform3": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=3),
    "block2": dict(recompute_granularity="full", recompute_method="block",
                   recompute_num_layers=2),
}


def loss_and_grads(dropout: float, tp_stream: bool = False, **recompute):
    """``tp_stream``: attention dropout draws from the tracker's stream, as it does on a
    rank with t > 1 (t = 1 draws from the default stream)."""
    torch.set_num_threads(1)
    cfg = make_config(hidden_dropout=dropout, attention_dropout=dropout, **recompute)
    ids, labels = make_batch(2)
    model = GPTModel(cfg, TPInfo.single(), seed=5)
    for module in model.modules():
        if isinstance(module, transformer_module.CoreAttention):
            module.fork_rng = tp_stream
    model_parallel_seed(21)
    loss = model(ids, None, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, atol=1e-13):
    loss_a, grads_a = a
    loss_b, grads_b = b
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=atol)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("kind", sorted(RECOMPUTE))
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("tp_stream", [False, True])
def test_recompute_gives_same_gradients(kind, dropout, tp_stream):
    assert_same(loss_and_grads(dropout, tp_stream, **RECOMPUTE[kind]),
                loss_and_grads(dropout, tp_stream))


def test_dropout_is_active_and_replay_matters(monkeypatch):
    """Guards the test above: dropout changes the result, and a checkpoint that does not
    replay the tracker's stream gives different gradients."""
    plain, dropped = loss_and_grads(0.0, True), loss_and_grads(0.3, True)
    assert not torch.allclose(plain[0], dropped[0])

    def no_tracker_replay(fn, *args):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)

    monkeypatch.setattr(transformer_module, "checkpoint", no_tracker_replay)
    broken = loss_and_grads(0.3, True, **RECOMPUTE["selective"])
    torch.testing.assert_close(broken[0], dropped[0], rtol=0, atol=1e-13)  # forward same
    qkv = "encoder.layers.0.self_attention.query_key_value.weight"
    assert not torch.allclose(broken[1][qkv], dropped[1][qkv])


def test_bad_recompute_config():
    with pytest.raises(ValueError, match="--recompute-num-layers"):
        GPTModel(make_config(recompute_granularity="full", recompute_method="uniform"),
                 TPInfo.single())
    with pytest.raises(ValueError, match="'uniform' or 'block'"):
        GPTModel(make_config(recompute_granularity="full", recompute_method="layer",
                             recompute_num_layers=1), TPInfo.single())


def test_rng_state_capture_replays_forward():
    cfg = make_config(hidden_dropout=0.3, attention_dropout=0.3)
    ids, labels = make_batch(3)
    model = GPTModel(cfg, TPInfo.single(), seed=5)
    model_parallel_seed(8)
    state = get_rng_state()
    first = model(ids, None, None, labels=labels)
    second = model(ids, None, None, labels=labels)
    assert not torch.equal(first, second)  # the streams advanced
    set_rng_state(state)
    assert torch.equal(model(ids, None, None, labels=labels), first)
    # Eval mode draws nothing.
    model.eval()
    assert torch.equal(model(ids, None, None, labels=labels),
                       model(ids, None, None, labels=labels))


def test_tracker_streams():
    model_parallel_seed(100, tp_rank=0)
    tracker = get_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with tracker.fork():
        a_next = torch.rand(4)
    assert not torch.equal(a, a_next)  # the forked stream advances
    model_parallel_seed(100, tp_rank=1)
    with get_rng_tracker().fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # other TP rank, other stream
    model_parallel_seed(100, tp_rank=0)
    default_a = torch.rand(4)
    model_parallel_seed(100, tp_rank=1)
    assert torch.equal(torch.rand(4), default_a)  # default stream shared by TP ranks
    with pytest.raises(ValueError, match="already exists"):
        get_rng_tracker().add("model-parallel-rng", 1)
    get_rng_tracker().reset()
    with pytest.raises(RuntimeError, match="model_parallel_seed"):
        with get_rng_tracker().fork():
            pass
    model_parallel_seed(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_dropout_replay_and_sdpa():
    """On CUDA the tracker swaps the CUDA generator and attention runs through SDPA."""
    def run(**recompute):
        cfg = make_config(hidden_dropout=0.2, attention_dropout=0.2,
                          params_dtype=torch.float32, **recompute)
        ids, labels = (t.cuda() for t in make_batch(2))
        model = GPTModel(cfg, TPInfo.single(), seed=5).cuda()
        model_parallel_seed(21, 0, "cuda")
        loss = model(ids, None, None, labels=labels).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    base = run()
    for kind in ("selective", "uniform1"):
        assert_same(run(**RECOMPUTE[kind]), base, atol=1e-6)
    model_parallel_seed(3, 0, "cuda")
    state = get_rng_state()
    with get_rng_tracker().fork():
        a = torch.rand(8, device="cuda")
    set_rng_state(state)
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(8, device="cuda"), a)
    cfg = make_config(params_dtype=torch.float32)
    from megatron.model.transformer import CoreAttention
    q, k, v = (torch.randn(12, 2, 4, 4, device="cuda") for _ in range(3))
    torch.testing.assert_close(CoreAttention(cfg, TPInfo.single(), "sdpa")(q, k, v, None),
                               CoreAttention(cfg, TPInfo.single(), "manual")(q, k, v, None),
                               rtol=1e-4, atol=1e-5)
    model_parallel_seed(0)


def test_a_layer_with_dropout_traces_as_one_graph_at_t1():
    """--compile-layers: at t=1 attention dropout draws from the default stream, so dynamo
    traces a whole layer without a break (swapping the tracker's generator states split
    it into five graphs, and made the compiled layers slower than eager on an H100)."""
    import torch._dynamo

    from megatron.model.transformer import ParallelTransformerLayer

    cfg = make_config(hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.float32)
    model_parallel_seed(3)
    layer = ParallelTransformerLayer(cfg, TPInfo.single(), 0, seed=3).train()
    x = torch.randn(cfg.seq_length, 2, cfg.hidden_size)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    # the guard: the tensor-parallel stream (what t > 1 draws from) does break the graph
    for module in layer.modules():
        if isinstance(module, transformer_module.CoreAttention):
            module.fork_rng = True
    torch._dynamo.reset()
    assert torch._dynamo.explain(layer)(x).graph_break_count > 0

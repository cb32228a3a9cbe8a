"""Tensor-parallel building blocks with tp=1, init rule helpers and the FLOPs formula."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.flops import gpt_flops_per_iteration, gpt_forward_flops
from megatron.tensor_parallel import (ColumnParallelLinear, InitKey, RowParallelLinear, TPInfo,
                                      VocabParallelEmbedding, divide,
                                      vocab_parallel_cross_entropy)
from megatron.tensor_parallel.param_init import (full_tensor, init_method_normal,
                                                 partitioned_tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_tp1_matches_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    # Large logits: a naive exp() would overflow; the max subtraction must handle it.
    logits = (torch.randn(5, 3, 37, generator=gen, dtype=dtype) * 50).requires_grad_()
    target = torch.randint(0, 37, (5, 3), generator=gen)
    upstream = torch.rand(5, 3, generator=gen, dtype=dtype)
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == dtype and torch.isfinite(loss).all()
    (loss * upstream).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits.view(-1, 37), target.view(-1), reduction="none").view(5, 3)
    (ref * upstream).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(loss, ref, rtol=0, atol=tol)
    torch.testing.assert_close(grad, logits.grad, rtol=0, atol=tol)


def test_cross_entropy_half_logits_compute_in_fp32():
    logits = torch.randn(4, 10).to(torch.bfloat16).requires_grad_()
    target = torch.arange(4)
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="must agree"):
        vocab_parallel_cross_entropy(logits, torch.arange(5))


def _fused_against_chunked(device: str, dtype: torch.dtype) -> None:
    from megatron.tensor_parallel.cross_entropy import _COMPILED
    gen = torch.Generator().manual_seed(3)
    # large logits (the max subtraction must hold) and a target in every position class
    full = (torch.randn(6, 5, 131, generator=gen) * 30).to(dtype).to(device)
    target = torch.randint(0, 131, (6, 5), generator=gen).to(device)
    target[0, 0], target[0, 1] = 0, 130
    upstream = torch.rand(6, 5, generator=gen).to(device)
    grads, losses = [], []
    for fused in (False, True):
        logits = full.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, chunk_rows=4, fused=fused)
        (loss * upstream).sum().backward()
        losses.append(loss)
        grads.append(logits.grad)
    assert losses[1].dtype == torch.float32 and grads[1].dtype == dtype
    # the same float32 math; only exp() may round differently inside the compiled kernel
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grads[1].float(), grads[0].float(), rtol=0.02, atol=1e-3)
    assert set(_COMPILED) == {"forward", "backward"}  # it did go through torch.compile


def test_fused_cross_entropy_math_matches_the_chunked_reference():
    """The fused functions, run eagerly, against the chunked code: exact in float64."""
    from megatron.tensor_parallel.cross_entropy import _fused_grad, _fused_lse_and_target
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 23, generator=gen, dtype=torch.float64) * 20
    target = torch.randint(0, 23, (9,), generator=gen)
    inside = torch.ones(9, dtype=torch.float64)
    inside[2] = 0.0  # a token whose target lives on another TP rank: no one-hot there
    g = torch.rand(9, generator=gen, dtype=torch.float64)
    lse, tl = _fused_lse_and_target(x, target, torch.float64)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=0, atol=0)
    torch.testing.assert_close(tl, x[torch.arange(9), target], rtol=0, atol=0)
    want = torch.softmax(x, -1)
    want[torch.arange(9), target] -= inside
    torch.testing.assert_close(_fused_grad(x, lse, target, inside, g), want * g[:, None],
                               rtol=0, atol=1e-14)
    # each is one graph without breaks, so torch.compile fuses it whole (the code is not
    # compiled with fullgraph=True, which would fail a run past the recompile limit)
    for fn, args in ((_fused_lse_and_target, (x, target, torch.float64)),
                     (_fused_grad, (x, lse, target, inside, g))):
        ex = torch._dynamo.explain(fn)(*args)
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), fn.__name__


def test_fused_cross_entropy_compiled_on_cpu_matches_the_chunked_path():
    _fused_against_chunked("cpu", torch.bfloat16)


def test_fused_cross_entropy_takes_any_number_of_shapes():
    """More logits shapes than dynamo's recompile limit (8): evaluation or a task with
    other lengths must neither fail the run nor change the loss."""
    gen = torch.Generator().manual_seed(9)
    for n in range(1, 11):
        logits = torch.randn(n, 2, 19, generator=gen).to(torch.bfloat16).requires_grad_()
        target = torch.randint(0, 19, (n, 2), generator=gen)
        loss = vocab_parallel_cross_entropy(logits, target, fused=True)
        loss.sum().backward()
        ref = F.cross_entropy(logits.detach().float().view(-1, 19), target.view(-1),
                              reduction="none").view(n, 2)
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        assert logits.grad.shape == logits.shape and torch.isfinite(logits.grad.float()).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_cross_entropy_compiled_on_cuda_matches_the_chunked_path():
    _fused_against_chunked("cuda", torch.bfloat16)


def test_layers_tp1_are_plain_linear_and_embedding():
    tp = TPInfo.single()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    col = ColumnParallelLinear(8, 6, tp=tp, params_dtype=torch.float64,
                               init_key=InitKey(1, 0, "col"))
    with torch.no_grad():
        col.bias.normal_()
    out, bias = col(x)
    assert bias is None
    torch.testing.assert_close(out, x @ col.weight.T + col.bias)
    row = RowParallelLinear(8, 6, tp=tp, params_dtype=torch.float64, skip_bias_add=True,
                            init_key=InitKey(1, 0, "row"))
    out, bias = row(x)
    assert bias is row.bias
    torch.testing.assert_close(out, x @ row.weight.T)
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0
    assert row.weight.tensor_model_parallel and row.weight.partition_dim == 1
    assert row.bias.tensor_model_parallel is False
    emb = VocabParallelEmbedding(10, 4, tp=tp, init_key=InitKey(1, 0, "emb"))
    ids = torch.tensor([[0, 9, 3]])
    assert torch.equal(emb(ids), emb.weight[ids])


def test_init_partitions_tile_the_full_tensor():
    key = InitKey(seed=3, layer_number=2, name="mlp.dense_h_to_4h.weight")
    init = init_method_normal(0.02)
    full = full_tensor((8, 6), key, init, torch.float64)
    assert torch.equal(full, full_tensor((8, 6), key, init, torch.float64))
    for dim in (0, 1):
        parts = [partitioned_tensor((8, 6), key, init, torch.float64, dim, r, 2) for r in (0, 1)]
        assert torch.equal(torch.cat(parts, dim=dim), full)
    # bf16 weights are the float32 draw, rounded.
    half = full_tensor((8, 6), key, init, torch.bfloat16)
    assert torch.equal(half, full_tensor((8, 6), key, init, torch.float32).to(torch.bfloat16))
    other = full_tensor((8, 6), InitKey(3, 3, key.name), init, torch.float64)
    assert not torch.equal(other, full)
    # Initialising draws nothing from the global stream.
    before = torch.get_rng_state()
    full_tensor((8, 6), key, init, torch.float32)
    assert torch.equal(before, torch.get_rng_state())


def test_divide_and_tpinfo_errors():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="--num-attention-heads = 6 must be divisible by 4"):
        divide(6, 4, "--num-attention-heads")
    with pytest.raises(ValueError, match="needs a process group"):
        TPInfo(size=2, rank=0)
    with pytest.raises(ValueError, match="not a valid"):
        TPInfo(size=1, rank=1)


def test_flops_formula_hand_computed():
    cfg = ModelConfig(num_layers=2, hidden_size=6, num_attention_heads=2, seq_length=12,
                      padded_vocab_size=96)
    # 24 * B s l h^2 = 24 * 3 * 12 * 2 * 36 = 62208; 1 + s/(6h) = 1 + 1/3: 82944 for the
    # layers; the output layer 2 B s h V = 2 * 3 * 12 * 6 * 96 = 41472
    layers, head = 62208 * (1 + 1 / 3), 41472.0
    assert gpt_forward_flops(cfg, 3, 12) == pytest.approx(layers + head)
    assert gpt_flops_per_iteration(cfg, 3, 12) == pytest.approx(3 * (layers + head))
    # recomputation reruns the layers, not the output layer
    assert gpt_flops_per_iteration(cfg, 3, 12, recompute=True) == pytest.approx(
        4 * layers + 3 * head)
    assert gpt_flops_per_iteration(cfg, 3, 12) == pytest.approx(373248.0)

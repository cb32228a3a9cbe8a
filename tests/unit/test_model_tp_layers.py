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
    # 24 * B s l h^2 = 24 * 3 * 12 * 2 * 36 = 62208; 1 + s/(6h) + V/(16 l h) = 1 + 1/3 + 1/2
    forward = 62208 * (1 + 1 / 3 + 1 / 2)
    assert gpt_forward_flops(cfg, 3, 12) == pytest.approx(forward)
    assert gpt_flops_per_iteration(cfg, 3, 12) == pytest.approx(3 * forward)
    assert gpt_flops_per_iteration(cfg, 3, 12, recompute=True) == pytest.approx(4 * forward)
    assert 3 * forward == pytest.approx(342144.0)

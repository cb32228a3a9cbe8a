"""The explicit-softmax attention (--attention-backend unfused/local) scales the scores
inside the matmul, as Megatron-LM's unfused path does (baddbmm with alpha =
1/sqrt(head_dim)): in fp16 the raw q.k^T of a wide head can pass 65504 while the scaled
score is small, and taking the product first turned such a row into inf and the
softmax into NaN where the fused kernel (and float32) gave finite attention."""
from __future__ import annotations

import torch

from megatron.config import ModelConfig
from megatron.model.transformer import CoreAttention
from megatron.tensor_parallel import TPInfo

torch.set_num_threads(1)


def _qkv(dtype):
    s, b, heads, d = 4, 2, 2, 128
    g = torch.Generator().manual_seed(3)
    # q.k = 128 * 24 * 24 = 73728 > 65504 (fp16's largest); / sqrt(128) = 6517
    q = torch.full((s, b, heads, d), 24.0)
    k = torch.full((s, b, heads, d), 24.0) * torch.linspace(0.9, 1.0, s).view(s, 1, 1, 1)
    v = torch.randn(s, b, heads, d, generator=g)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _attention(backend, dtype, q, k, v):
    cfg = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=2, seq_length=4,
                      padded_vocab_size=32, attention_dropout=0.0, params_dtype=dtype)
    return CoreAttention(cfg, TPInfo.single(), backend=backend)(q, k, v, None)


def test_fp16_scores_that_pass_the_fp16_range_before_scaling_stay_finite():
    q, k, v = _qkv(torch.float16)
    out = _attention("manual", torch.float16, q, k, v)
    assert torch.isfinite(out).all()
    rq, rk, rv = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _attention("manual", torch.float32, rq, rk, rv)
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    # and the fused kernel agrees
    torch.testing.assert_close(_attention("sdpa", torch.float16, q, k, v).float(), ref,
                               rtol=2e-3, atol=2e-3)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(grad.half())
    ref.backward(grad)
    for a, b in ((q, rq), (k, rk), (v, rv)):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=5e-2, atol=5e-2)


def test_manual_path_still_matches_the_fused_kernel_in_float64():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6, generator=g) < 0.3
    mask[..., 0] = False
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=6,
                      padded_vocab_size=32, attention_dropout=0.0, params_dtype=torch.float64)
    for m in (None, mask):
        manual = CoreAttention(cfg, TPInfo.single(), backend="manual")(q, k, v, m)
        fused = CoreAttention(cfg, TPInfo.single(), backend="sdpa")(q, k, v, m)
        torch.testing.assert_close(manual, fused, rtol=1e-12, atol=1e-12)

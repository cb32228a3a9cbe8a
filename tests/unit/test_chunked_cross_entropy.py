"""The LM loss runs over chunks of tokens in float32 (float64) without a float32 copy
of the whole microbatch's logits; chunking must not change the result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.pipeline.memory import StashTracker
from megatron.tensor_parallel import vocab_parallel_cross_entropy


def _case(dtype, s=7, b=3, v=37):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(s, b, v, generator=gen, dtype=torch.float64) * 30).to(dtype)
    target = torch.randint(0, v, (s, b), generator=gen)
    upstream = torch.rand(s, b, generator=gen, dtype=torch.float64)
    return logits, target, upstream


def _reference(logits, target, upstream):
    x = logits.detach().to(torch.float64).requires_grad_()
    loss = F.cross_entropy(x.view(-1, x.size(-1)), target.view(-1), reduction="none")
    loss = loss.view(target.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("chunk_rows", [1, 2, 5, None])
@pytest.mark.parametrize("inplace", [False, True])
def test_chunked_loss_and_grad_match_reference_float64(chunk_rows, inplace):
    logits, target, upstream = _case(torch.float64)
    ref_loss, ref_grad = _reference(logits, target, upstream)
    leaf = logits.clone().requires_grad_()
    x = leaf * 1.0  # a non-leaf temporary, as the model's logits are
    loss = vocab_parallel_cross_entropy(x, target, chunk_rows=chunk_rows,
                                        inplace_backward=inplace)
    (loss * upstream).sum().backward()
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=0, atol=1e-12)


def test_bf16_logits_match_float32_math_of_the_same_values():
    logits, target, upstream = _case(torch.bfloat16)
    ref_loss, ref_grad = _reference(logits, target, upstream)
    leaf = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf, target, chunk_rows=4)
    (loss * upstream.float()).sum().backward()
    assert loss.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-5)
    # the gradient is float32 math rounded once to bf16
    torch.testing.assert_close(leaf.grad.double(), ref_grad.to(torch.bfloat16).double(),
                               rtol=0, atol=4e-3)


def test_no_float32_copy_of_the_logits_is_saved():
    s, b, v = 16, 4, 512
    leaf = torch.randn(s, b, v).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (s, b))
    tracker = StashTracker(weight_ptrs=set())
    with tracker.counting(0):
        x = leaf * 1.0
        loss = vocab_parallel_cross_entropy(x, target, chunk_rows=8, inplace_backward=True)
    saved = tracker.in_flight[0]
    logits_bytes = s * b * v * 2
    # the bf16 logits, per-token lse/targets: far below one float32 [s, b, v] copy
    assert saved < logits_bytes + 64 * s * b
    assert saved < s * b * v * 4
    loss.sum().backward()
    assert leaf.grad.dtype == torch.bfloat16


def test_leaf_logits_are_not_overwritten_by_default():
    logits, target, _ = _case(torch.float64)
    leaf = logits.clone().requires_grad_()
    vocab_parallel_cross_entropy(leaf, target, chunk_rows=2).sum().backward()
    assert torch.equal(leaf.detach(), logits)
    with pytest.raises(ValueError, match="chunk_rows"):
        vocab_parallel_cross_entropy(leaf, target, chunk_rows=0)

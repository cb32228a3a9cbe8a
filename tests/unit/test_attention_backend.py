"""--attention-backend: torch's scaled_dot_product_attention (auto, flash, fused) or the
explicit softmax (unfused, local), what each keeps for the backward pass, and the
padding mask made once per stage for the fused kernels."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import ArgumentError, build_config, parse_args, validate_args
from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.bert_model import BertModel
from megatron.model.transformer import (ATTENTION_BACKENDS, CoreAttention, _SoftmaxKeptAs,
                                        attention_kernel)
from megatron.tensor_parallel import TPInfo

TP = TPInfo.single()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=torch.float64)
    base.update(kw)
    return ModelConfig(**base)


def test_backend_names_map_to_the_two_implementations():
    assert {b: attention_kernel(b) for b in ATTENTION_BACKENDS} == {
        "auto": "sdpa", "flash": "sdpa", "fused": "sdpa", "unfused": "manual",
        "local": "manual"}
    for backend in ATTENTION_BACKENDS:
        assert CoreAttention(_config(attention_backend=backend), TP).backend == \
            attention_kernel(backend)
    # an explicit implementation wins over the config (the tests' reference path)
    assert CoreAttention(_config(attention_backend="local"), TP, backend="sdpa").backend == "sdpa"
    with pytest.raises(ValueError, match="--attention-backend 'cudnn': expected one of auto"):
        GPTModel(_config(attention_backend="cudnn"), TP)


def test_softmax_kept_as_has_softmax_gradients():
    x = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _SoftmaxKeptAs.apply(t, torch.float64), (x,))
    x32 = x.detach().float().requires_grad_()
    ref = x32.detach().clone().requires_grad_()
    g = torch.randn(2, 3, 5, 7)
    _SoftmaxKeptAs.apply(x32, torch.float32).backward(g)
    torch.softmax(ref, dim=-1).backward(g)
    assert torch.allclose(x32.grad, ref.grad, atol=1e-6)
    # bf16 probabilities: the gradient of the rounded ones, formed in fp32
    y = _SoftmaxKeptAs.apply(x32, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), torch.softmax(x32, dim=-1), atol=4e-3)


def _saved_scores(attn: CoreAttention, dtype: torch.dtype, s: int, mask=None) -> list:
    """dtypes of the distinct tensors with [b, heads, s, s] values the attention keeps."""
    kept = {}

    def pack(t):
        if t.dim() >= 2 and tuple(t.shape[-2:]) == (s, s) and t.numel() > s * s:
            kept[t.untyped_storage().data_ptr()] = t.dtype
        return t

    q = torch.randn(s, 2, 4, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(s, 2, 4, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(q, k, v, mask).sum().backward()
    return sorted(kept.values(), key=str)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_explicit_softmax_keeps_probabilities_in_the_values_dtype(dropout):
    """bf16 probabilities (2 bytes per score, not fp32's 4) and, with dropout, its mask
    and the dropped probabilities (2 bytes): Korthikanti et al.'s 5 bytes per score with
    CUDA's 1-byte dropout mask, what the planner charges --attention-backend
    unfused/local.  (torch's CPU dropout keeps a scaled noise tensor of the input's
    dtype instead of a bool mask.)  Without dropout the value matmul keeps the
    softmax's own output: 2 bytes."""
    attn = CoreAttention(_config(attention_dropout=dropout, params_dtype=torch.bfloat16), TP,
                         backend="manual").train()
    kept = _saved_scores(attn, torch.bfloat16, 16)
    if not dropout:
        assert kept == [torch.bfloat16]
    else:
        assert kept == [torch.bfloat16] * 3    # probabilities, CPU noise, dropped


def test_sdpa_keeps_no_scores():
    attn = CoreAttention(_config(params_dtype=torch.float32), TP, backend="sdpa").train()
    assert _saved_scores(attn, torch.float32, 16) == []


def _bert_batch(b=3, s=16, vocab=64):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (b, s), generator=g)
    pad = torch.ones(b, s, dtype=torch.long)
    pad[0, 10:] = 0
    pad[1, 5:] = 0
    return ids, pad, torch.zeros(b, s, dtype=torch.long)


def test_bert_padding_mask_is_made_once_per_stage():
    """sdpa keeps its additive mask for the backward: one per stage and microbatch (made
    by the stage), not one per layer."""
    cfg = _config(num_layers=4, num_tokentypes=2, params_dtype=torch.float32)
    model = BertModel(cfg, TP, seed=1).train()
    ids, pad, types = _bert_batch()
    s = ids.size(1)
    masks = set()

    def pack(t):
        if t.dim() == 4 and tuple(t.shape[-2:]) == (s, s) and t.dtype == torch.float32:
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm, binary = model(ids, pad, types)
    assert len(masks) == 1


def test_both_backends_compute_the_same_bert_and_gpt():
    ids, pad, types = _bert_batch()
    real = pad.bool().t()  # [s, b]: padded query rows differ (uniform vs softmax rows)
    outs = {}
    for backend in ("auto", "local"):
        cfg = _config(num_layers=3, num_tokentypes=2, attention_backend=backend)
        model = BertModel(cfg, TP, seed=2, add_binary_head=False)
        hidden = model.encode(ids, pad, types)
        hidden[real].sum().backward()
        outs[backend] = (hidden[real].detach(),
                         {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(outs["auto"][0], outs["local"][0], atol=1e-12)
    assert outs["auto"][1].keys() == outs["local"][1].keys()
    for name, grad in outs["auto"][1].items():
        assert torch.allclose(grad, outs["local"][1][name], atol=1e-10), name

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = {backend: GPTModel(_config(attention_backend=backend), TP, seed=4)(
        tokens, None, None) for backend in ("fused", "unfused")}
    assert torch.allclose(logits["fused"], logits["unfused"], atol=1e-12)


SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
         "--mock-data", "--lr", "1e-3"]


def test_flag_reaches_the_model_config():
    model = build_config(validate_args(parse_args(SMALL + ["--attention-backend", "local"]),
                                       1)).model
    assert model.attention_backend == "local"
    assert build_config(validate_args(parse_args(SMALL), 1)).model.attention_backend == "auto"
    with pytest.raises((ArgumentError, SystemExit)):
        parse_args(SMALL + ["--attention-backend", "cudnn"])


def test_export_ignores_the_backend():
    """How attention was computed is not part of the model: a checkpoint trained with
    the explicit softmax exports like any other."""
    from megatron.hf_export_target import check_known_options
    check_known_options({"attention_backend": "local", "num_layers": 2})

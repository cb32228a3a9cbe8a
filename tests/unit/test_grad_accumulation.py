"""Gradients of bf16 weights accumulated over microbatches in float32
(--accumulate-allreduce-grads-in-fp32, on by default with --bf16, as in Megatron-LM)."""
from __future__ import annotations

import pytest
import torch

from megatron.arguments import parse_and_validate
from megatron.config import GRAD_DTYPE_SUPPORTED, ModelConfig, OptimizerConfig, PrecisionConfig
from megatron.model import GPTModel
from megatron.optimizer.builder import get_megatron_optimizer
from megatron.pipeline.weights import WeightBuffers, grad_dtype_of, zero_grad_like
from megatron.tensor_parallel import TPInfo

pytestmark = pytest.mark.skipif(not GRAD_DTYPE_SUPPORTED,
                                reason="Tensor.grad_dtype needs torch >= 2.10")

VOCAB, SEQ = 64, 16
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3"]


def _model(seed: int = 3) -> GPTModel:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                      padded_vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                      params_dtype=torch.bfloat16)
    return GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                    layer_numbers=range(2), seed=seed)


def _microbatches(n: int):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        text = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
        out.append((text[:, :-1], text[:, 1:]))
    return out


def _backward(model: GPTModel, tokens, labels) -> None:
    model(tokens, None, None, labels=labels).float().mean().backward()


def test_bf16_turns_fp32_accumulation_on_and_fp16_leaves_it_off():
    _, cfg = parse_and_validate(BASE + ["--bf16"], world_size=1)
    assert cfg.precision.accumulate_allreduce_grads_in_fp32
    assert cfg.precision.grad_dtype == torch.float32
    _, cfg = parse_and_validate(BASE + ["--fp16"], world_size=1)
    assert cfg.precision.grad_dtype is None
    _, cfg = parse_and_validate(BASE + ["--fp16", "--accumulate-allreduce-grads-in-fp32"],
                                world_size=1)
    assert cfg.precision.grad_dtype == torch.float32
    # fp32 weights: nothing to widen
    _, cfg = parse_and_validate(BASE + ["--accumulate-allreduce-grads-in-fp32"], world_size=1)
    assert cfg.precision.grad_dtype is None
    assert PrecisionConfig(bf16=True).grad_dtype is None  # the config default is off


def test_flag_on_a_torch_without_grad_dtype_is_one_clear_error(monkeypatch, capsys):
    import megatron.argument_checks.optimizer as arguments

    monkeypatch.setattr(arguments, "GRAD_DTYPE_SUPPORTED", False)
    with pytest.raises(SystemExit) as exc:
        parse_and_validate(BASE + ["--bf16", "--accumulate-allreduce-grads-in-fp32"],
                           world_size=1)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--accumulate-allreduce-grads-in-fp32 needs torch >= 2.10" in err
    # plain --bf16 warns and accumulates in bf16
    _, cfg = parse_and_validate(BASE + ["--bf16"], world_size=1)
    assert cfg.precision.grad_dtype is None
    assert "gradients accumulate in bf16" in capsys.readouterr().err


def test_fp32_accumulation_matches_the_exact_sum_and_bf16_accumulation_does_not():
    m = 16
    batches = _microbatches(m)
    # the exact sum (float64) of the per-microbatch bf16 gradients
    ref_model = _model()
    exact = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in ref_model.named_parameters()}
    for tokens, labels in batches:
        ref_model.zero_grad(set_to_none=True)
        _backward(ref_model, tokens, labels)
        for n, p in ref_model.named_parameters():
            exact[n] += p.grad.double()

    errors = {}
    for widen in (False, True):
        model = _model()
        buffers = WeightBuffers(model, 1)
        if widen:
            buffers.set_grad_dtype(torch.float32)
        for tokens, labels in batches:
            _backward(model, tokens, labels)
        num = den = 0.0
        for n, p in model.named_parameters():
            assert p.grad.dtype == (torch.float32 if widen else torch.bfloat16), n
            if n == "embedding.word_embeddings.weight":
                # tied to the output layer: its two contributions per microbatch are
                # added in float32 too, so the bf16-added reference is not its exact sum
                continue
            num += (p.grad.double() - exact[n]).square().sum().item()
            den += exact[n].square().sum().item()
        errors[widen] = (num / den) ** 0.5
    assert errors[True] < 1e-6, errors      # float32 rounding only
    assert errors[False] > 1e-3, errors     # bf16 keeps 8 bits of each partial sum
    assert errors[False] > 1000 * errors[True]


def test_second_weight_buffer_and_present_gradients_are_widened():
    model = _model()
    tokens, labels = _microbatches(1)[0]
    _backward(model, tokens, labels)  # a bf16 gradient already present
    before = {id(p): p.grad.clone() for p in model.parameters()}
    buffers = WeightBuffers(model, 2)
    buffers.set_grad_dtype(torch.float32)
    for j in range(2):
        for p in buffers.params(j):
            assert grad_dtype_of(p) == torch.float32
            assert zero_grad_like(p).dtype == torch.float32
    for p in buffers.params(0):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, before[id(p)].float())
    buffers.install(1)
    _backward(model, tokens, labels)
    assert all(p.grad.dtype == torch.float32 for p in buffers.params(1))


def test_optimizer_uses_fp32_gradients_in_place_and_matches_cast_copies():
    """With masters, float32 gradients are used as they are (no copy); the update equals
    the one from bf16 gradients holding the same values."""
    opt_cfg = OptimizerConfig(lr=1e-2, clip_grad=0.5, weight_decay=0.01)
    prec = PrecisionConfig(bf16=True, fp32_master_weights=True)
    results = []
    for widen in (False, True):
        model = _model()
        params = list(model.parameters())
        opt = get_megatron_optimizer(opt_cfg, prec, params)
        gen = torch.Generator().manual_seed(5)
        grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in params]
        if widen:
            WeightBuffers(model, 1).set_grad_dtype(torch.float32)
        for p, g in zip(params, grads):
            p.grad = g.float() if widen else g
        pending = opt.begin_step(params)
        if widen:
            assert all(g is p.grad for g, p in zip(pending.grads, params))
        info = opt.finish_step(pending, params, params, lr=1e-2)
        assert not info.skipped and info.grad_norm > 0.5  # clipping was active
        results.append([p.detach().clone() for p in params] + [m.detach().clone()
                                                             for m in opt.main_params])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_optimizer_without_masters_casts_wide_gradients_to_the_weights_dtype():
    opt_cfg = OptimizerConfig(lr=1e-2, clip_grad=0.0, weight_decay=0.0)
    prec = PrecisionConfig(bf16=True, fp32_master_weights=False)
    model = _model()
    params = list(model.parameters())
    WeightBuffers(model, 1).set_grad_dtype(torch.float32)
    opt = get_megatron_optimizer(opt_cfg, prec, params)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full(p.shape, 1e-2, dtype=torch.float32)
    info = opt.finish_step(opt.begin_step(params), params, params, lr=1e-2)
    assert not info.skipped
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert any(not torch.equal(a, p) for a, p in zip(before, params))

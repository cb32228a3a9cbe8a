"""Selective recomputation (--recompute-granularity selective) in the planner: each
layer's core attention is checkpointed, so the layer keeps neither its s x s tensors
(the explicit softmax of --attention-backend local/unfused) nor the fused kernels'
log-sum-exp, and the attention matmuls run again in the backward pass."""
from __future__ import annotations

import dataclasses
import shlex

import pytest

from megatron.config import ModelConfig
from megatron.pipeline.planner import (Config, CostModel, ModelSpec, best_plan, command_line,
                                       get_hardware, get_model)
from tests.unit.test_planner_llama import PLAIN, _layer_stash, _plan

S, B, A, F = 16, 2, 4, 40


def _stash(backend: str, selective: bool) -> int:
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=A, seq_length=S,
                         ffn_hidden_size=F, padded_vocab_size=64, hidden_dropout=0.0,
                         attention_dropout=0.0, attention_backend=backend,
                         recompute_granularity="selective" if selective else None)
    return _layer_stash(config, B)


def test_selective_drops_what_the_formula_says_the_kernel_keeps():
    """The executor's count of a trainer layer, with and without selective recompute:
    the fused kernel's fp32 log-sum-exp is exactly ``score_bytes``; the explicit
    softmax drops its probabilities (fp32 here, 4 bytes: the formula's 2 fp16 bytes,
    and no dropout mask or output without dropout) and the shared causal mask.  q, k
    and v stay counted (the recomputation needs them)."""
    spec = ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=A, seq_length=S,
                     ffn_hidden_size=F, vocab_size=64)
    assert _stash("auto", False) - _stash("auto", True) == spec.score_bytes(B) == 4 * A * S * B
    local = dataclasses.replace(spec, attention_backend="local")
    assert local.score_bytes(B) == 5 * A * S * S * B
    assert _stash("local", False) - _stash("local", True) == 4 * A * S * S * B + S * S


def test_cost_model_charges_memory_and_recomputed_flops():
    model = dataclasses.replace(get_model("gpt-355m"), attention_backend="local")
    cm = CostModel(model, PLAIN)
    base = Config(w=1, d=2, t=2, b=4, m=8, schedule="flush")
    sel = dataclasses.replace(base, selective_recompute=True)
    for p, s in zip(cm.stage_costs(base), cm.stage_costs(sel)):
        assert p.activation_per_microbatch_bytes - s.activation_per_microbatch_bytes == \
            pytest.approx(p.num_layers * model.score_bytes(4) / 2)
        rate = PLAIN.flops_rate(4 * model.seq_length)
        assert s.backward_s - p.backward_s == pytest.approx(
            p.num_layers * model.core_attention_flops(4) / 2 / rate)
        assert s.forward_s == p.forward_s
    assert "+selective recompute" in sel.describe()
    with pytest.raises(ValueError, match="selective"):
        Config(w=1, d=2, recompute=True, selective_recompute=True)
    with pytest.raises(ValueError, match="selective"):
        Config(w=1, d=2, recompute_method="uniform", recompute_num_layers=1,
               selective_recompute=True)


def test_selective_lets_the_explicit_softmax_fit_at_long_context():
    """GPT-1.3B at 16k tokens with the paper's explicit softmax on 8 H100s: without
    recomputation only one microbatch per stage of a d = 8 pipeline fits (no
    pipelining); selective recomputation drops the 5 a s^2 b bytes of every layer, fits
    as w = 8 data parallelism, and beats whole-stage recomputation (it redoes the
    attention matmuls only); its command passes the flag the trainer parses."""
    from megatron.arguments import parse_args

    model = dataclasses.replace(get_model("gpt-1.3b"), seq_length=16384,
                                attention_backend="local")
    hw = get_hardware("h100-sxm")
    plain = best_plan(model, hw, 8, 64, recompute=(False,))
    stage = best_plan(model, hw, 8, 64, recompute=(True,))
    plan = best_plan(model, hw, 8, 64, recompute=(False, True, "uniform", "selective"))
    assert plan.config.selective_recompute and plan.fits and plan.config.w > plain.config.w
    assert plan.predicted_samples_per_s > stage.predicted_samples_per_s \
        > plain.predicted_samples_per_s
    # the fused kernel keeps no s x s tensors: nothing for selective recomputation to save
    fused = dataclasses.replace(model, attention_backend="auto")
    assert not best_plan(fused, hw, 8, 64, recompute=(False, "selective")
                         ).config.selective_recompute
    cmd = command_line(plan, model)
    assert "--recompute-granularity selective" in cmd and "--recompute-activations" not in cmd
    words = shlex.split(cmd)
    args = parse_args(words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:])
    assert args.recompute_granularity == "selective" and args.recompute_method is None


def test_plan_cli_takes_selective():
    res = _plan("--model", "gpt-1.3b", "--seq-length", "16384", "--attention-backend", "local",
                "--num-gpus", "8", "--max-batch-size", "64", "--cluster", "h100-sxm",
                "--recompute", "selective")
    assert res.returncode == 0, res.stderr
    assert "--recompute-granularity selective" in res.stdout
    assert " sel " in res.stdout  # the table's recompute column

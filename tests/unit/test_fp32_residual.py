"""--fp32-residual-connection: with bf16 weights the residual stream is float32.

The model (GPT and BERT, recomputation, stage splits), the flag's plumbing (arguments,
checkpoints) and the planner's byte counts, which the executor's saved-tensor counter
checks to the byte.  The 2-rank pipeline is tests/distributed/test_fp32_residual_pipeline.py.
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model import BertModel, GPTModel
from megatron.model.transformer import (Float32LayerNorm, Float32RMSNorm,
                                        ParallelTransformerLayer)
from megatron.model.utils import get_attention_mask
from megatron.pipeline.memory import StashTracker
from megatron.pipeline.planner import Config, CostModel, ModelSpec, command_line
from megatron.tensor_parallel import TPInfo

S, B, H, A, V = 16, 2, 32, 4, 64
TP = TPInfo.single()


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=A, seq_length=S,
                padded_vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=torch.bfloat16, fp32_residual_connection=True)
    return ModelConfig(**{**base, **kw})


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _layer_outputs(model: nn.Module) -> list:
    """The dtype of every transformer layer's output in the next forward."""
    seen = []
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


# ------------------------------------------------------------------ the model
@pytest.mark.parametrize("options", [
    {}, {"apply_residual_connection_post_layernorm": True},
    {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
     "num_query_groups": 2, "qk_layernorm": True, "attention_backend": "unfused"}])
def test_the_stream_is_float32_with_the_flag_and_bf16_without(options):
    """Every layer's output and the tensor a stage sends (and gets its gradient back
    in) are float32 with the flag, bf16 without; the logits are bf16 either way.  RoPE's
    tables and the attention mask stay bf16 (attention computes in bf16)."""
    for flag, stream in ((True, torch.float32), (False, torch.bfloat16)):
        cfg = _config(fp32_residual_connection=flag, **options)
        assert cfg.residual_dtype == stream
        first = GPTModel(cfg, TP, pre_process=True, post_process=False,
                         layer_numbers=range(1), seed=1)
        seen = _layer_outputs(first)
        hidden = first(_ids(), None, None)
        assert hidden.dtype == stream and seen == [stream]
        last = GPTModel(cfg, TP, pre_process=False, post_process=True,
                        layer_numbers=range(1, 2), seed=1)
        last.set_input_tensor(hidden.detach().requires_grad_())
        logits = last(None, None, None)
        assert logits.dtype == torch.bfloat16          # the output layer reads bf16
        logits.float().sum().backward()
        assert last.input_tensor.grad.dtype == stream  # what the stage sends back


def _reference_logits(model: GPTModel, ids: torch.Tensor,
                      mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The flag's forward written out: the residual stream in float32, each norm in
    float32 with its weights cast up, attention and MLP (the model's own modules) on the
    norms' outputs cast to bf16 -- with RoPE's tables and the attention mask in bf16 --
    and bf16 logits of the final norm's bf16 output."""
    cfg = model.config
    post = cfg.apply_residual_connection_post_layernorm

    def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32
        if cfg.normalization == "RMSNorm":
            return F.rms_norm(x, (H,), module.weight.float(), cfg.layernorm_epsilon)
        return F.layer_norm(x, (H,), module.weight.float(), module.bias.float(),
                            cfg.layernorm_epsilon)

    emb = model.embedding
    x = emb.word_embeddings.weight[ids]
    if emb.position_embeddings is not None:
        x = x + emb.position_embeddings.weight[:S]
    x = x.transpose(0, 1).float()                                 # bf16 sum, then float32
    bf16 = torch.bfloat16
    rotary = (model.encoder.rotary(S, x.device, bf16)
              if model.encoder.rotary is not None else None)
    attention = model.encoder.layers[0].self_attention
    mask = attention.core_attention.prepare_mask(mask, bf16, S, x.device)
    for layer in model.encoder.layers:
        normed = norm(layer.input_layernorm, x)
        x = (normed if post else x) + layer.self_attention(normed.to(bf16), mask, rotary)
        normed = norm(layer.post_attention_layernorm, x)
        x = (normed if post else x) + layer.mlp(normed.to(bf16))
    hidden = norm(model.encoder.final_layernorm, x).to(bf16)
    return F.linear(hidden, emb.word_embeddings.weight).transpose(0, 1)


@pytest.mark.parametrize("options", [
    {}, {"apply_residual_connection_post_layernorm": True},
    {"normalization": "RMSNorm", "position_embedding_type": "rope", "mask": True},
    {"apply_residual_connection_post_layernorm": True, "mask": True,
     "attention_backend": "unfused"}])
def test_the_forward_is_the_hand_written_float32_stream(options):
    options = dict(options)
    mask = get_attention_mask("causal", S) if options.pop("mask", False) else None
    cfg = _config(**options)
    model = GPTModel(cfg, TP, seed=3)
    with torch.no_grad():
        got = model(_ids(), None, mask)
        want = _reference_logits(model, _ids(), mask)
        plain = GPTModel(dataclasses.replace(cfg, fp32_residual_connection=False), TP,
                         seed=3)(_ids(), None, mask)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, plain)                 # the flag does change the numbers


def test_the_float32_stream_is_closer_to_float64():
    """The same bf16 weights in float64: a float32 stream lands about twice as close to
    it as a bf16 one (each layer's sums are not rounded to bf16)."""
    def error(flag: bool) -> float:
        cfg = _config(num_layers=3, fp32_residual_connection=flag)
        model = GPTModel(cfg, TP, pre_process=True, post_process=False,
                         layer_numbers=range(2), seed=5)
        exact = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), TP,
                         pre_process=True, post_process=False, layer_numbers=range(2), seed=5)
        exact.load_state_dict(model.state_dict())
        with torch.no_grad():
            got, ref = model(_ids(5), None, None).double(), exact(_ids(5), None, None)
        return ((got - ref).norm() / ref.norm()).item()

    assert error(True) < 0.75 * error(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_training_is_bit_identical(dtype):
    """In fp32 (and fp64) the flag changes nothing: the same modules, the same bits over
    a few SGD steps."""
    runs = []
    for flag in (False, True):
        cfg = _config(params_dtype=dtype, fp32_residual_connection=flag)
        assert cfg.residual_dtype == dtype
        model = GPTModel(cfg, TP, seed=2)
        assert not any(isinstance(m, (Float32LayerNorm, Float32RMSNorm))
                       for m in model.modules())
        losses = []
        for step in range(3):
            loss = model(_ids(step), None, None, labels=_ids(step + 10)).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            losses.append(loss.detach())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def test_bert_stages_send_float32_and_heads_read_bf16():
    """A BERT cut into two stages gives the whole model's outputs and gradients; the
    stage sends float32, the pooler and the LM head read bf16."""
    cfg = _config(num_tokentypes=2)
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, 12:] = 0
    labels = _ids(7)
    whole = BertModel(cfg, TP, seed=4)
    heads_read = []
    for head in (whole.pooler.dense, whole.lm_head.dense):
        head.register_forward_hook(lambda _m, inp, _o: heads_read.append(inp[0].dtype))
    loss, binary = whole(_ids(), pad, None, labels)
    (loss.float().sum() + binary.float().sum()).backward()
    assert heads_read == [torch.bfloat16] * 2 and loss.dtype == torch.float32

    first = BertModel(cfg, TP, pre_process=True, post_process=False, layer_numbers=range(1),
                      seed=4)
    last = BertModel(cfg, TP, pre_process=False, post_process=True,
                     layer_numbers=range(1, 2), seed=4)
    hidden = first(_ids(), pad, None)
    assert hidden.dtype == torch.float32
    sent = hidden.detach().requires_grad_()
    last.set_input_tensor(sent)
    loss2, binary2 = last(None, pad, None, labels)
    (loss2.float().sum() + binary2.float().sum()).backward()
    hidden.backward(sent.grad)
    assert sent.grad.dtype == torch.float32
    assert torch.equal(loss, loss2) and torch.equal(binary, binary2)
    # each stage's layers (numbered locally) have the whole model's gradients
    for stage, layer in ((first, 0), (last, 1)):
        for (name, p), ref in zip(stage.encoder.layers[0].named_parameters(),
                                  whole.encoder.layers[layer].parameters()):
            assert torch.equal(p.grad, ref.grad), (layer, name)
    assert torch.equal(last.encoder.final_layernorm.weight.grad,
                       whole.encoder.final_layernorm.weight.grad)
    assert torch.equal(first.embedding.position_embeddings.weight.grad,
                       whole.embedding.position_embeddings.weight.grad)


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective")])
def test_recomputation_gives_the_same_bits(recompute):
    """Layer-level and selective recomputation rebuild the float32 stream exactly."""
    results = []
    for kw in ({}, recompute):
        model = GPTModel(_config(num_layers=3, **kw), TP, seed=6)
        loss = model(_ids(), None, None, labels=_ids(1)).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


# ------------------------------------------------------------------ flags, checkpoints
def test_the_flag_is_parsed_and_noted_without_half_precision():
    from megatron.arguments import build_config, parse_args, validate_args
    from tests.unit.test_megatron_lm_flags import SMALL

    args = validate_args(parse_args(SMALL + ["--bf16", "--fp32-residual-connection"]), 1)
    model = build_config(args).model
    assert model.fp32_residual_connection and model.residual_dtype == torch.float32
    assert not any("fp32-residual" in n for n in args.megatron_lm_notes)
    args = validate_args(parse_args(SMALL + ["--fp32-residual-connection"]), 1)
    assert build_config(args).model.residual_dtype == torch.float32
    assert any("--fp32-residual-connection changes nothing" in n
               for n in args.megatron_lm_notes)
    assert build_config(validate_args(parse_args(SMALL + ["--bf16"]), 1)) \
        .model.residual_dtype == torch.bfloat16


def test_a_checkpoint_loads_with_either_value():
    """Numerics, not shape: a checkpoint saved with the flag loads without it and back."""
    from megatron.checkpoint_shape import check_model_shape
    from tests.unit.test_model_options import _saved

    on, off = _config(), _config(fp32_residual_connection=False)
    check_model_shape("ckpt", _saved(on), off)
    check_model_shape("ckpt", _saved(off), on)
    check_model_shape("ckpt", _saved(off, drop=("fp32_residual_connection",)), on)
    state = GPTModel(on, TP, seed=1).state_dict()
    loaded = GPTModel(off, TP, seed=1).load_state_dict(state)
    assert not loaded.missing_keys and not loaded.unexpected_keys


# ------------------------------------------------------------------ the planner
SPEC = ModelSpec(num_layers=4, hidden_size=H, num_attention_heads=A, seq_length=S,
                 vocab_size=V)
FLAG = dataclasses.replace(SPEC, fp32_residual_connection=True)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True)])
def test_planner_bytes_by_hand(t, sp):
    off = dataclasses.replace(SPEC, sequence_parallel=sp)
    on = dataclasses.replace(FLAG, sequence_parallel=sp)
    split = t if sp else 1
    sbh = S * B * H
    assert on.residual_bytes == 4 and off.residual_bytes == 2
    assert on.layer_activation_bytes(B, t) - off.layer_activation_bytes(B, t) == 4 * sbh / split
    assert on.input_activation_bytes(B, t) == 2 * off.input_activation_bytes(B, t) \
        == 4 * sbh / split
    assert on.head_activation_bytes(B, t) - off.head_activation_bytes(B, t) == 2 * sbh / split
    bert_off, bert_on = (dataclasses.replace(x, kind="bert") for x in (off, on))
    assert bert_on.head_activation_bytes(B, t) - bert_off.head_activation_bytes(B, t) == \
        2 * sbh / split
    assert on.tensor_parallel_bytes(B) == off.tensor_parallel_bytes(B) == 2 * sbh
    assert on.layer_elementwise_bytes(B, t) == 36 * sbh / split
    assert "fp32 residual stream" in on.describe()


def test_cost_model_sends_and_keeps_float32_but_tensor_traffic_is_unchanged():
    cfg = Config(w=1, d=2, t=2, b=B, m=4, schedule="flush")
    off = CostModel(SPEC, _hardware()).stage_costs(cfg)
    on = CostModel(FLAG, _hardware()).stage_costs(cfg)
    sbh = S * B * H
    for a, b, last in zip(off, on, (False, True)):
        assert b.p2p_s == pytest.approx(2 * a.p2p_s) and a.p2p_s > 0
        assert b.input_bytes == 2 * a.input_bytes == 4 * sbh
        assert b.forward_s == a.forward_s and b.backward_s == a.backward_s  # tensor traffic
        extra = 2 * 4 * sbh + (2 * sbh if last else 0)     # 2 layers (+ the final norm)
        assert b.activation_per_microbatch_bytes - a.activation_per_microbatch_bytes == extra
    # layer-level recomputation keeps one float32 hidden state per chunk
    rc = dataclasses.replace(cfg, recompute_method="uniform", recompute_num_layers=1)
    a, b = (CostModel(x, _hardware()).stage_costs(rc)[0] for x in (SPEC, FLAG))
    assert b.activation_per_microbatch_bytes - a.activation_per_microbatch_bytes == 2 * 2 * sbh


def _hardware():
    from tests.unit.test_planner_llama import PLAIN
    return PLAIN


def _counted(module: nn.Module, run) -> int:
    tracker = StashTracker({p.untyped_storage().data_ptr() for p in module.parameters()})
    with tracker.counting(0):
        out = run()
    out.float().sum().backward()
    return tracker.in_flight[0]


def _norm_extras(flag: bool, norms: int) -> int:
    """What the executor counts of ``norms`` LayerNorms beyond their inputs, which the
    formula leaves out: a mean and a 1/std per token (in the dtype torch keeps them for
    this input on this device, measured) and, with the flag, each norm's float32 copy of
    its weight and bias."""
    dtype = torch.float32 if flag else torch.bfloat16
    x = torch.randn(S, B, H, dtype=dtype)
    w = torch.ones(H, dtype=dtype)
    _, mean, rstd = torch.native_layer_norm(x, (H,), w, w, 1e-5)
    stats = mean.numel() * mean.element_size() + rstd.numel() * rstd.element_size()
    return norms * (stats + (2 * H * 4 if flag else 0))


@pytest.mark.parametrize("flag", [False, True])
def test_the_layer_formula_is_the_executors_count_in_bf16(flag):
    """A bf16 layer (dropout off: no masks) keeps exactly ``layer_activation_bytes`` less
    the two dropout masks, plus the norms' per-token statistics and, with the flag,
    their float32 weight copies."""
    cfg = _config(fp32_residual_connection=flag)
    spec = dataclasses.replace(SPEC, fp32_residual_connection=flag)
    layer = ParallelTransformerLayer(cfg, TP, 0, seed=1).train()
    x = torch.randn(S, B, H, dtype=cfg.residual_dtype, requires_grad=True)
    counted = _counted(layer, lambda: layer(x, None, None))
    masks = 2 * S * B * H
    assert counted == spec.layer_activation_bytes(B) - masks + _norm_extras(flag, 2)


def test_the_head_and_the_recomputed_chunks_are_the_executors_count():
    """The last stage's final norm keeps a float32 input with the flag (the head
    formula's 2 s b h more), and uniform recomputation keeps one float32 hidden state
    per chunk (``input_activation_bytes``)."""
    counts = {}
    for flag in (False, True):
        cfg = _config(fp32_residual_connection=flag)
        layer_only = ParallelTransformerLayer(cfg, TP, 1, seed=1).train()
        x = torch.randn(S, B, H, dtype=cfg.residual_dtype, requires_grad=True)
        layer = _counted(layer_only, lambda: layer_only(x, None, None))
        last = GPTModel(cfg, TP, pre_process=False, post_process=True,
                        layer_numbers=range(1, 2), seed=1)
        last.set_input_tensor(x)
        counts[flag] = _counted(last, lambda: last(None, None, None, labels=_ids())) \
            - layer - _norm_extras(flag, 1)
        spec = dataclasses.replace(SPEC, fp32_residual_connection=flag)
        rc = _config(num_layers=4, fp32_residual_connection=flag,
                     recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
        middle = GPTModel(rc, TP, pre_process=False, post_process=False,
                          layer_numbers=range(1, 3), seed=1)
        middle.set_input_tensor(x)
        assert _counted(middle, lambda: middle(None, None, None)) == \
            2 * spec.input_activation_bytes(B)
    assert counts[True] - counts[False] == \
        FLAG.head_activation_bytes(B) - SPEC.head_activation_bytes(B)


def test_plans_pass_the_flag_to_the_trainer():
    from megatron.arguments import parse_args
    from tests.unit.test_planner_llama import _plan

    cmd = command_line(Config(w=1, d=2, b=1, m=4, schedule="flush"), FLAG, precision="bf16")
    words = shlex.split(cmd)
    args = parse_args(words[next(i for i, w in enumerate(words) if w.endswith(".py")) + 1:])
    assert args.fp32_residual_connection and args.bf16
    assert "--fp32-residual-connection" not in command_line(
        Config(w=1, d=2, b=1, m=4, schedule="flush"), SPEC)
    res = _plan("--model", "gpt-1.3b", "--fp32-residual-connection", "--num-gpus", "8",
                "--max-batch-size", "64")
    assert res.returncode == 0, res.stderr
    assert "--fp32-residual-connection" in res.stdout and "fp32 residual stream" in res.stdout


def test_a_half_precision_profile_without_the_flag_is_refused():
    from megatron.pipeline.planner.profile import Profile
    from tests.unit.test_planner_llama import GPT_MODEL, _profile_dict

    spec = dataclasses.replace(Profile(_profile_dict(dict(GPT_MODEL))).model_spec(),
                               fp32_residual_connection=True)
    CostModel(spec, _hardware(), profile=Profile(_profile_dict(dict(GPT_MODEL))))  # no dtype
    for dtype in ("bf16", "fp16"):
        prof = Profile(_profile_dict(dict(GPT_MODEL, dtype=dtype)))
        with pytest.raises(ValueError, match="without --fp32-residual-connection"):
            CostModel(spec, _hardware(), profile=prof)
    CostModel(spec, _hardware(), profile=Profile(_profile_dict(dict(GPT_MODEL, dtype="fp32"))))

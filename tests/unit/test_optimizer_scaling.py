"""Loss scalers, overflow skipping, global-norm clipping and the counting rule."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megatron.config import OptimizerConfig, PrecisionConfig
from megatron.optimizer import ConstantGradScaler, DynamicGradScaler, get_megatron_optimizer
from megatron.optimizer.clip_grads import clip_coefficient, local_grad_stats, norm_mask

torch.set_num_threads(1)


def params_of(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(5, 3), (5,), (2, 5)]]


def grads_of(params, seed=10, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-64, 65, p.shape, generator=g).double() / 32.0 * scale for p in params]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype, copy=True)


def sgd(clip=0.0, **kw):
    return OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                           clip_grad=clip, **kw)


# -- scalers ---------------------------------------------------------------------------
def test_dynamic_scaler_hysteresis_backoff_growth_and_floor():
    s = DynamicGradScaler(initial_scale=64.0, min_scale=8.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 64.0, "first overflow is absorbed by hysteresis"
    s.update(True)
    assert s.scale == 32.0
    s.update(True)
    assert s.scale == 16.0, "hysteresis stays spent until the scale grows again"
    s.update(False)
    s.update(False)
    assert s.scale == 16.0
    s.update(True)  # resets the clean-step counter
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 8.0, "never below min_scale"
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0, "grows after growth_interval clean steps"
    s.update(True)
    assert s.scale == 16.0, "growth refilled the hysteresis"
    sd = s.state_dict()
    t = DynamicGradScaler(initial_scale=2.0 ** 20, min_scale=1.0, growth_interval=3, hysteresis=2)
    t.load_state_dict(sd)
    for found in (True, False, False, False, True, True):
        s.update(found)
        t.update(found)
        assert s.scale == t.scale


@pytest.mark.parametrize("field,value", [("scale", float("nan")), ("scale", 0.0),
                                         ("scale", -4.0), ("growth_tracker", -1)])
def test_scaler_state_out_of_range_is_refused(field, value):
    s = DynamicGradScaler(initial_scale=2.0 ** 8, min_scale=1.0)
    sd = {**s.state_dict(), field: value}
    with pytest.raises(ValueError, match="grad scaler state: .*expected a finite scale > 0"):
        DynamicGradScaler(initial_scale=2.0 ** 8, min_scale=1.0).load_state_dict(sd)


def test_scaler_input_validation_and_constant_scaler():
    with pytest.raises(ValueError, match="--min-loss-scale"):
        DynamicGradScaler(initial_scale=4.0, min_scale=8.0)
    with pytest.raises(ValueError, match="--hysteresis"):
        DynamicGradScaler(initial_scale=4.0, min_scale=1.0, hysteresis=0)
    c = ConstantGradScaler(512.0)
    c.update(True)
    assert c.scale == 512.0 and c.inv_scale == 1.0 / 512.0


# -- overflow handling -----------------------------------------------------------------
@pytest.mark.parametrize("two_buffers", [False, True])
def test_fp16_inf_gradient_skips_and_backs_off(two_buffers):
    pcfg = PrecisionConfig(fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    x, y = params_of(torch.float16, 0), params_of(torch.float16, 1)
    base = y if two_buffers else x
    base_before = [p.detach().clone() for p in base]
    opt = get_megatron_optimizer(sgd(), pcfg, base)
    masters_before = [m.detach().clone() for m in opt.main_params]
    grads = grads_of(x, scale=opt.loss_scale)
    grads[1][2] = float("inf")
    set_grads(x, grads)
    info = opt.step(grads_from=x, write_to=x, base=base, lr=1.0)
    assert info.skipped and info.num_nonfinite == 1 and math.isinf(info.grad_norm)
    assert info.loss_scale == 512.0 and opt.loss_scale == 512.0
    for px, pb, b in zip(x, base, base_before):
        assert torch.equal(px.detach(), b), "write_to must hold a copy of base"
        assert torch.equal(pb.detach(), b)
        assert px.grad is None
    for m, mb in zip(opt.main_params, masters_before):
        assert torch.equal(m.detach(), mb)
    # The next clean step proceeds with the backed-off scale.
    set_grads(x, grads_of(x, scale=opt.loss_scale))
    assert not opt.step(grads_from=x, write_to=x, base=base, lr=1.0).skipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nonfinite_gradient_skips_without_loss_scaling(dtype):
    params = params_of(dtype)
    before = [p.detach().clone() for p in params]
    opt = get_megatron_optimizer(sgd(), PrecisionConfig(bf16=dtype == torch.bfloat16), params)
    grads = grads_of(params)
    grads[0][0, 0] = float("nan")
    set_grads(params, grads)
    info = opt.step(params, params, params, lr=1.0)
    assert info.skipped and info.num_nonfinite == 1 and info.loss_scale == 1.0
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


@pytest.mark.parametrize("fp16", [True, False])
def test_loss_scale_flag_is_a_constant_scale_under_fp16_and_bf16(fp16):
    """Megatron-LM: --loss-scale under --bf16 is a constant scale too (it was ignored)."""
    params = params_of(torch.float16 if fp16 else torch.bfloat16)
    opt = get_megatron_optimizer(sgd(), PrecisionConfig(fp16=fp16, bf16=not fp16,
                                                        loss_scale=1024.0), params)
    assert isinstance(opt.scaler, ConstantGradScaler) and opt.loss_scale == 1024.0
    set_grads(params, grads_of(params, scale=1024.0))
    info = opt.step(params, params, params, lr=1.0)
    assert not info.skipped and info.loss_scale == 1024.0
    unscaled = math.sqrt(sum(float((g ** 2).sum()) for g in grads_of(params)))
    assert info.grad_norm == pytest.approx(unscaled, rel=1e-2)  # divided by the scale


def test_extra_found_inf_skips_without_touching_the_scaler():
    pcfg = PrecisionConfig(fp16=True, initial_loss_scale=64.0, hysteresis=1)
    params = params_of(torch.float16)
    before = [p.detach().clone() for p in params]
    opt = get_megatron_optimizer(sgd(), pcfg, params)
    set_grads(params, grads_of(params, scale=64.0))
    info = opt.step(params, params, params, lr=1.0, extra_found_inf=True)
    assert info.skipped and info.num_nonfinite == 0 and opt.loss_scale == 64.0
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


@pytest.mark.parametrize("fp16", [False, True])
def test_late_tied_embedding_gradient_gives_the_same_step(fp16):
    """The last stage's copy of the tied embedding (``shared``) may be taken after the
    agreement started (``begin_step(late=...)`` then ``take_late_grads``): the same
    statistics (it counts in none) and the same update, masters and loss scale
    included.  It may not be left out of a step, and nothing else may be late."""
    dtype = torch.float16 if fp16 else torch.float32
    pcfg = PrecisionConfig(fp16=fp16, initial_loss_scale=64.0)
    cfg = sgd(clip=0.1)

    def run(late):
        params = params_of(dtype)
        params[2].shared = True
        opt = get_megatron_optimizer(cfg, pcfg, params)
        grads = grads_of(params, scale=opt.loss_scale)
        set_grads(params, grads)
        final = params[2].grad.clone()
        if late:  # the summed gradient arrives only after the agreement started
            params[2].grad.fill_(float("nan"))
        pending = opt.begin_step(params, late=(2,) if late else ())
        stats = pending.stats.clone()
        if late:
            params[2].grad.copy_(final)
            opt.take_late_grads(pending)
        info = opt.finish_step(pending, params, params, lr=1.0)
        return stats, info, [p.detach().clone() for p in params]

    (s0, i0, w0), (s1, i1, w1) = run(False), run(True)
    assert torch.equal(s0, s1) and i0 == i1 and not i1.skipped
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))

    params = params_of(dtype)
    params[2].shared = True
    opt = get_megatron_optimizer(cfg, pcfg, params)
    set_grads(params, grads_of(params))
    with pytest.raises(ValueError, match="late gradients"):
        opt.begin_step(params, late=(0,))
    pending = opt.begin_step(params, late=(2,))
    with pytest.raises(RuntimeError, match="never taken"):
        opt.finish_step(pending, params, params, lr=1.0)


# -- clipping --------------------------------------------------------------------------
@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_clipping_matches_torch_clip_grad_norm(clip):
    params, ref = params_of(torch.float64), params_of(torch.float64)
    opt = get_megatron_optimizer(sgd(clip=clip), PrecisionConfig(), params)
    grads = grads_of(params)
    set_grads(params, grads)
    set_grads(ref, grads)
    total = torch.nn.utils.clip_grad_norm_(ref, clip).item()
    info = opt.step(params, params, params, lr=1.0)
    assert info.grad_norm == pytest.approx(total, rel=1e-12)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach() - r.grad, rtol=1e-12, atol=1e-12)
    if clip > total:  # no clipping: the update is exact
        for p, r, g in zip(params, ref, grads):
            assert torch.equal(p.detach(), r.detach() - g)


def test_clip_coefficient_edge_cases():
    assert clip_coefficient(10.0, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25)
    assert clip_coefficient(float("inf"), 1.0) == 1.0


# -- counting each logical parameter once ----------------------------------------------
def test_counting_rule_for_shared_and_tensor_parallel_attributes():
    ps = [nn.Parameter(torch.zeros(2)) for _ in range(4)]
    ps[0].shared = True                      # last stage's copy of the tied embedding
    ps[1].tensor_model_parallel = True       # a shard: every TP rank counts its own
    ps[2].tensor_model_parallel = False      # replicated (LayerNorm): TP rank 0 only
    # ps[3] has no attribute: treated as replicated, as in Megatron-LM.
    assert norm_mask(ps, tp_rank=0) == [False, True, True, True]
    assert norm_mask(ps, tp_rank=1) == [False, True, False, False]

    grads = [torch.full((2,), v) for v in (1.0, 2.0, 3.0, float("inf"))]
    stats = local_grad_stats(grads, norm_mask(ps, tp_rank=1), torch.device("cpu"), True)
    assert stats[0].item() == pytest.approx(8.0, rel=1e-6)
    assert stats[1:].tolist() == [1.0, 0.0], "inf in an uncounted copy still flags overflow"
    stats = local_grad_stats([None, torch.zeros(3), None, None], [True] * 4,
                             torch.device("cpu"), True)
    assert stats.tolist() == [0.0, 0.0, 3.0]


def test_optimizer_norm_uses_the_counting_rule():
    params = params_of(torch.float64)
    params[0].shared = True
    params[2].tensor_model_parallel = True
    grads = grads_of(params)
    expected_tp1 = torch.cat([grads[2].flatten()]).norm().item()
    expected_tp0 = torch.cat([grads[1].flatten(), grads[2].flatten()]).norm().item()
    for tp_rank, expected in ((0, expected_tp0), (1, expected_tp1)):
        ps = [nn.Parameter(p.detach().clone()) for p in params]
        for p, src in zip(ps, params):
            p.__dict__.update({k: v for k, v in src.__dict__.items()
                               if k in ("shared", "tensor_model_parallel")})
        opt = get_megatron_optimizer(sgd(), PrecisionConfig(), ps, tp_rank=tp_rank,
                                     log_num_zeros=True)
        set_grads(ps, grads)
        info = opt.step(ps, ps, ps, lr=1.0)
        assert info.grad_norm == pytest.approx(expected, rel=1e-12)
        counted = [g for g, m in zip(grads, opt._mask) if m]
        assert info.num_zeros == sum(int((g == 0).sum()) for g in counted)

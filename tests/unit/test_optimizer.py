"""MegatronOptimizer against plain torch optimizers: equivalence, 2BW buffers, masters,
checkpoints."""
from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from torch import nn

from megatron.config import OptimizerConfig, PrecisionConfig
from megatron.optimizer import get_megatron_optimizer

torch.set_num_threads(1)


def make_params(dtype: torch.dtype, seed: int = 0) -> List[nn.Parameter]:
    """Matrices (decayed) and vectors (not decayed), like linear + LayerNorm layers."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (6,), (6,), (6,), (3, 6), (3,)]
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def make_grads(params, step: int, scale: float = 1.0) -> List[torch.Tensor]:
    """Gradients exactly representable in fp16/bf16 (multiples of 1/64, |g| <= 2)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randint(-128, 129, p.shape, generator=g).double() / 64.0 * scale)
            for p in params]


def set_grads(params, grads, dtype=None) -> None:
    for p, gr in zip(params, grads):
        p.grad = gr.to(dtype or p.dtype, copy=True)


def reference_optimizer(name: str, params, cfg: OptimizerConfig,
                        fused: bool = True) -> torch.optim.Optimizer:
    """torch's own optimizer on plain parameters.  ``fused``: the kernel our Adam uses
    (bit-identical comparisons); False: torch's default per-tensor loop."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    if name == "adam":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, **({"fused": True} if fused else {}))
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)


def opt_cfg(name: str, **kw) -> OptimizerConfig:
    base = dict(optimizer=name, lr=0.1, weight_decay=0.1, clip_grad=0.0, sgd_momentum=0.9)
    base.update(kw)
    return OptimizerConfig(**base)


LRS = [0.1, 0.05, 0.2, 0.01, 0.07]


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_single_buffer_equals_plain_torch_loop(name, dtype):
    cfg = opt_cfg(name)
    ours, ref = make_params(dtype), make_params(dtype)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), ours)
    ref_opt = reference_optimizer(name, ref, cfg)
    assert not opt.use_masters
    for step, lr in enumerate(LRS):
        grads = make_grads(ours, step)
        set_grads(ours, grads)
        set_grads(ref, grads)
        info = opt.step(ours, ours, ours, lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        ref_opt.zero_grad()
        assert not info.skipped and info.loss_scale == 1.0
        expected_norm = torch.cat([g.flatten() for g in grads]).norm().item()
        assert info.grad_norm == pytest.approx(expected_norm, rel=1e-6)
        for p, r in zip(ours, ref):
            assert p.dtype == dtype
            assert torch.equal(p, r), f"step {step}: weights differ"
            assert p.grad is None
    # The moments live once, keyed by the stable main parameters.
    key = "exp_avg_sq" if name == "adam" else "momentum_buffer"
    for m, r in zip(opt.main_params, ref):
        assert torch.equal(opt.optimizer.state[m][key], ref_opt.state[r][key])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adam_agrees_with_torch_default_loop(dtype):
    """Our Adam runs torch's fused kernel on the CPU too (one call for all tensors); it
    must give what torch's default per-tensor loop gives, to rounding."""
    cfg = opt_cfg("adam")
    ours, ref = make_params(dtype), make_params(dtype)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), ours)
    assert opt.optimizer.defaults.get("fused")
    ref_opt = reference_optimizer("adam", ref, cfg, fused=False)
    assert not ref_opt.defaults.get("fused")
    for step, lr in enumerate(LRS):
        grads = make_grads(ours, step)
        set_grads(ours, grads)
        set_grads(ref, grads)
        opt.step(ours, ours, ours, lr)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        ref_opt.zero_grad()
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-14, atol=1e-16)
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), **tol)
    for m, r in zip(opt.main_params, ref):
        torch.testing.assert_close(opt.optimizer.state[m]["exp_avg_sq"],
                                   ref_opt.state[r]["exp_avg_sq"], **tol)


def test_weight_decay_only_on_matrices():
    cfg = opt_cfg("sgd", sgd_momentum=0.0, weight_decay=0.5)
    params = make_params(torch.float64)
    before = [p.detach().clone() for p in params]
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), params)
    set_grads(params, [torch.zeros_like(p) for p in params])
    opt.step(params, params, params, lr=0.5)
    for p, b in zip(params, before):
        # SGD's decay is coupled: w - lr * wd * w = 0.75 w for matrices.
        expected = b * 0.75 if b.ndim >= 2 else b
        assert torch.equal(p.detach(), expected)


def two_buffers(dtype, seed_x=0, seed_y=1):
    return make_params(dtype, seed_x), make_params(dtype, seed_y)


def test_2bw_sgd_writes_latest_minus_stale_gradient_into_x():
    cfg = opt_cfg("sgd", sgd_momentum=0.0, weight_decay=0.0)
    x, y = two_buffers(torch.float64)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), x)
    y_before = [p.detach().clone() for p in y]
    grads = make_grads(x, 0)
    set_grads(x, grads)
    info = opt.step(grads_from=x, write_to=x, base=y, lr=0.25)
    assert not info.skipped
    for px, py, yb, g in zip(x, y, y_before, grads):
        assert torch.equal(px.detach(), yb - 0.25 * g)
        assert torch.equal(py.detach(), yb), "the in-flight buffer Y must not be touched"
        assert px.grad is None


def _force_foreach(monkeypatch, foreach: bool) -> list:
    """Make every buffer copy and master-gradient read of the optimizer take the loop
    (False) or the accelerators' multi-tensor path (True), wherever ``use_foreach`` is
    looked up; the list returned records each decision taken."""
    import megatron.optimizer.main_grads as main_grads
    import megatron.optimizer.sharding as sharding

    calls: list = []

    def decide(_tensors):
        calls.append(foreach)
        return foreach
    for module in (main_grads, sharding):
        monkeypatch.setattr(module, "use_foreach", decide)
    return calls


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "multi-tensor"])
def test_2bw_adam_alternating_buffers_match_reference_sequence(foreach, monkeypatch):
    """Alternate X/Y like 2BW: weights and moments equal a plain loop fed the same grads
    (with the buffer copy as a loop, the CPU's, and as the accelerators' multi-tensor copy)."""
    calls = _force_foreach(monkeypatch, foreach)
    cfg = opt_cfg("adam")
    bufs = list(two_buffers(torch.float64))
    for a, b in zip(*bufs):  # both versions start at W(0)
        b.data.copy_(a.data)
    ref = make_params(torch.float64, 0)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), bufs[0])
    ref_opt = reference_optimizer("adam", ref, cfg)
    for t in range(6):
        x, y = bufs[t % 2], bufs[(t + 1) % 2]
        y_before = [p.detach().clone() for p in y]
        grads = make_grads(x, t)
        set_grads(x, grads)
        opt.step(grads_from=x, write_to=x, base=y, lr=1e-2)
        set_grads(ref, grads)
        for group in ref_opt.param_groups:
            group["lr"] = 1e-2
        ref_opt.step()
        for px, py, yb, r in zip(x, y, y_before, ref):
            assert torch.equal(px.detach(), r.detach()), f"step {t}: new version differs"
            assert torch.equal(py.detach(), yb)
    for m, r in zip(opt.main_params, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.optimizer.state[m][key], ref_opt.state[r][key])
    assert calls, "the buffer copy never asked which path to take"


@pytest.mark.parametrize("dtype,prec", [
    (torch.float16, dict(fp16=True, loss_scale=None, initial_loss_scale=2.0 ** 12)),
    (torch.float16, dict(fp16=True, loss_scale=256.0)),
    (torch.bfloat16, dict(bf16=True)),
])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "multi-tensor"])
def test_mixed_precision_masters_are_fp32_and_written_weights_are_their_cast(
        dtype, prec, foreach, monkeypatch):
    # foreach: the multi-tensor cast an accelerator uses, forced onto the CPU
    calls = _force_foreach(monkeypatch, foreach)
    cfg = opt_cfg("adam", lr=1e-2)
    pcfg = PrecisionConfig(**prec)
    x, y = two_buffers(dtype)
    y_before = [p.detach().clone() for p in y]
    ref = [nn.Parameter(p.detach().float()) for p in y]  # masters start from the latest weights
    opt = get_megatron_optimizer(cfg, pcfg, y)
    ref_opt = reference_optimizer("adam", ref, cfg)
    assert opt.use_masters
    scale = opt.loss_scale
    assert scale == (pcfg.loss_scale or pcfg.initial_loss_scale if pcfg.fp16 else 1.0)
    grads = make_grads(x, 0)
    set_grads(x, [g * scale for g in grads])  # what backward of scale_loss(loss) gives
    info = opt.step(grads_from=x, write_to=x, base=y, lr=1e-2)
    set_grads(ref, grads, torch.float32)
    ref_opt.step()
    assert not info.skipped
    for m, r, px, py, yb in zip(opt.main_params, ref, x, y, y_before):
        assert m.dtype == torch.float32
        assert torch.equal(m.detach(), r.detach())
        assert px.dtype == dtype and torch.equal(px.detach(), m.detach().to(dtype))
        assert torch.equal(py.detach(), yb)
    assert calls, "neither the gradient read nor the weight cast asked which path to take"


def test_scale_loss_multiplies_by_the_loss_scale():
    pcfg = PrecisionConfig(fp16=True, loss_scale=128.0)
    opt = get_megatron_optimizer(opt_cfg("adam"), pcfg, make_params(torch.float16))
    assert opt.scale_loss(torch.tensor(1.5)).item() == 192.0
    opt32 = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(), make_params(torch.float32))
    loss = torch.tensor(1.5)
    assert opt32.scale_loss(loss) is loss


def run_steps(opt, params, steps, start=0):
    for t in range(start, start + steps):
        set_grads(params, [g * opt.loss_scale for g in make_grads(params, t)])
        opt.step(params, params, params, lr=0.01 * (t + 1))
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("dtype,prec", [(torch.float32, {}),
                                        (torch.bfloat16, dict(bf16=True)),
                                        (torch.float16, dict(fp16=True, initial_loss_scale=2.0 ** 8,
                                                             loss_scale_window=2))])
def test_state_dict_round_trip_continues_identically(dtype, prec):
    cfg, pcfg = opt_cfg("adam"), PrecisionConfig(**prec)
    params = make_params(dtype)
    opt = get_megatron_optimizer(cfg, pcfg, params)
    run_steps(opt, params, 3)
    saved_sd = copy.deepcopy(opt.state_dict())
    saved_w = [p.detach().clone() for p in params]
    expected = run_steps(opt, params, 3, start=3)

    params2 = make_params(dtype, seed=7)
    opt2 = get_megatron_optimizer(cfg, pcfg, params2)
    with torch.no_grad():
        for p, w in zip(params2, saved_w):
            p.copy_(w)
    opt2.load_state_dict(saved_sd)
    if not opt2.use_masters:
        opt2.reload_model_params(params2)
    assert opt2.loss_scale == saved_sd["grad_scaler"]["scale"]
    got = run_steps(opt2, params2, 3, start=3)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_a_different_layout_or_optimizer():
    params = make_params(torch.float32)
    sd = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(), params).state_dict()
    other = [nn.Parameter(torch.zeros(5, 4))] + make_params(torch.float32)[1:]
    with pytest.raises(ValueError, match="parameter 0: saved"):
        get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(), other).load_state_dict(sd)
    with pytest.raises(ValueError, match="--optimizer adam"):
        get_megatron_optimizer(opt_cfg("sgd"), PrecisionConfig(), params).load_state_dict(sd)
    bf = make_params(torch.bfloat16)
    with pytest.raises(ValueError, match="no fp32 master weights"):
        get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(bf16=True), bf).load_state_dict(sd)


def test_reload_model_params_refreshes_masters():
    params = make_params(torch.bfloat16)
    opt = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(bf16=True), params)
    with torch.no_grad():
        for p in params:
            p.fill_(0.5)
    opt.reload_model_params(params)
    assert all(torch.equal(m.detach(), torch.full_like(m, 0.5)) for m in opt.main_params)


def test_bad_input_errors_are_clear():
    params = make_params(torch.float32)
    with pytest.raises(ValueError, match="--optimizer must be one of"):
        get_megatron_optimizer(opt_cfg("lamb"), PrecisionConfig(), params)
    opt = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(), params)
    with pytest.raises(ValueError, match="write_to has 5 parameters"):
        opt.step(params, params[:5], params, lr=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused AdamW needs CUDA")
def test_cuda_fused_adam_matches_cpu_reference():
    cfg = opt_cfg("adam")
    ours = [nn.Parameter(p.detach().cuda()) for p in make_params(torch.float32)]
    ref = make_params(torch.float32)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), ours)
    assert opt.optimizer.defaults.get("fused")
    ref_opt = reference_optimizer("adam", ref, cfg)
    for step in range(3):
        grads = make_grads(ref, step)
        set_grads(ours, [g.cuda() for g in grads])
        set_grads(ref, grads)
        opt.step(ours, ours, ours, lr=0.1)
        ref_opt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)


def test_buckets_split_evenly_into_segments():
    """The distributed optimizer's split: buckets in reverse parameter order, each padded
    to a multiple of w and cut into w equal segments; the pieces of all ranks tile every
    parameter once, and each rank holds within the padding of an even share, however
    large one parameter is."""
    from megatron.optimizer.sharding import pieces_of, plan_buckets

    numels = [48, 6, 20, 4, 9, 2, 1000, 1]
    keys = ["f32"] * 6 + ["f32", "bf16"]
    world = 3
    buckets = plan_buckets(numels, keys, world, bucket_bytes=4 * 60,
                           alone=[False] * 6 + [True, False])
    assert buckets == plan_buckets(list(numels), keys, world, 4 * 60,
                                   alone=[False] * 6 + [True, False])
    # reverse order; a dtype change, the lone parameter and a full bucket each close one
    assert [b.params for b in buckets] == [(7,), (6,), (5, 4, 3, 2, 1), (0,)]
    assert buckets[2].offsets == (0, 2, 11, 15, 35) and buckets[2].numel == 41
    assert all(b.padded % world == 0 and 0 <= b.padded - b.numel < world for b in buckets)
    seen = [[0] * n for n in numels]
    held = []
    for r in range(world):
        pieces = pieces_of(buckets, numels, world, r)
        held.append(sum(pc.numel for pc in pieces))
        for pc in pieces:
            bucket = buckets[pc.bucket]
            off = bucket.offsets[bucket.params.index(pc.param)]
            assert pc.at == off + pc.start - r * (bucket.padded // world)
            for e in range(pc.start, pc.stop):
                seen[pc.param][e] += 1
    assert all(c == 1 for counts in seen for c in counts)  # each element owned once
    padding = sum(b.padded - b.numel for b in buckets)
    assert all(abs(h - sum(numels) / world) <= padding for h in held), held
    assert pieces_of(buckets, numels, 1, 0)[0].param == 7
    with pytest.raises(ValueError, match="world must be >= 1"):
        plan_buckets(numels, keys, 0)


def test_distributed_optimizer_over_one_replica_is_the_plain_one():
    """--use-distributed-optimizer without data-parallel replicas splits nothing: one
    main parameter per model parameter, shaped like it, and the unsharded state."""
    params = [nn.Parameter(torch.randn(4, 3, dtype=torch.float64)),
              nn.Parameter(torch.randn(3, dtype=torch.float64))]
    opt = get_megatron_optimizer(opt_cfg("adam", use_distributed_optimizer=True),
                                 PrecisionConfig(), params)
    assert opt.shard is None
    assert [m.shape for m in opt.main_params] == [p.shape for p in params]


@pytest.mark.parametrize("dtype,prec", [(torch.float32, {}), (torch.bfloat16, dict(bf16=True))])
@pytest.mark.parametrize("damage,match", [
    (lambda sd: sd["optimizer"]["state"][0].update(exp_avg=torch.zeros(1)),
     r"parameter 0's exp_avg is \(1,\), expected a tensor of its shape \(6, 4\)"),
    (lambda sd: sd["optimizer"]["state"][4].update(exp_avg_sq=torch.zeros(6, 3)),
     r"exp_avg_sq is \(6, 3\)"),
    (lambda sd: sd["optimizer"]["state"][1].update(exp_avg="x"), r"exp_avg is str"),
    (lambda sd: sd["optimizer"]["state"][2].update(step=torch.tensor(-1.0)), "step is"),
    (lambda sd: sd["optimizer"]["state"][2].update(step=torch.tensor(float("nan"))), "step is"),
    # saved ids list the decayed matrices first: saved id 3 is parameter 2
    (lambda sd: sd["optimizer"]["state"].update({3: [1, 2]}), "state of parameter 2 is list"),
])
def test_load_state_dict_rejects_tensors_of_another_shape(dtype, prec, damage, match):
    """torch's load_state_dict takes moments of any shape: the fused Adam kernel then
    read and wrote past a smaller tensor's end (a bf16 run aborted with heap corruption)."""
    params = make_params(dtype)
    opt = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(**prec), params)
    run_steps(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    damage(sd)
    fresh = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(**prec), make_params(dtype))
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(sd)


def test_load_state_dict_rejects_fp32_masters_of_another_shape():
    """``copy_`` would broadcast a saved scalar over the whole master weight."""
    params = make_params(torch.bfloat16)
    opt = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(bf16=True), params)
    run_steps(opt, params, 1)
    for bad, match in ((torch.tensor(3.0), r"fp32 master weight 0 is \(\)"),
                       (None, "fp32 master weight 0 is NoneType")):
        sd = copy.deepcopy(opt.state_dict())
        sd["fp32_masters"][0] = bad
        fresh = get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(bf16=True),
                                       make_params(torch.bfloat16))
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(sd)
    sd = copy.deepcopy(opt.state_dict())
    sd["fp32_masters"] = sd["fp32_masters"][:-1]
    with pytest.raises(ValueError, match="holds 5 fp32 master weights, this stage has 6"):
        get_megatron_optimizer(opt_cfg("adam"), PrecisionConfig(bf16=True),
                               make_params(torch.bfloat16)).load_state_dict(sd)


def test_sgd_without_momentum_state_round_trips():
    params = make_params(torch.float32)
    cfg = opt_cfg("sgd", sgd_momentum=0.0)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), params)
    run_steps(opt, params, 2)
    get_megatron_optimizer(cfg, PrecisionConfig(), make_params(torch.float32)).load_state_dict(
        copy.deepcopy(opt.state_dict()))

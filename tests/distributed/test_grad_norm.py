"""Two gloo ranks acting as two pipeline stages of one model: the optimizer's decisions
(global gradient norm, clipping coefficient, overflow skip) are agreed by both."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.config import OptimizerConfig, PrecisionConfig
from megatron.optimizer import get_megatron_optimizer
from tests.dist_utils import run_distributed

# Logical model: embedding E (first stage, tied with a copy on the last stage),
# A (first stage), B (last stage).
SHAPES = {"E": (7, 4), "A": (4, 4), "B": (3, 4)}


def _grad(name: str, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randint(-64, 65, SHAPES[name], generator=g).double() / 16.0 * scale


def _stage_params(rank: int, dtype: torch.dtype):
    names = ["E", "A"] if rank == 0 else ["B", "E"]
    params = [nn.Parameter(torch.ones(SHAPES[n], dtype=dtype)) for n in names]
    if rank == 1:
        params[1].shared = True  # the last stage's copy of the tied embedding
    return names, params


def _finish(opt) -> None:
    """What the engine's ``finish_sums`` does at the end of training: wait for the
    agreement's last sends (left in flight so a stage never waits for them on the
    critical path).  Without it a rank could exit, closing the connection, before its
    message went out: the other rank's receive then failed with "Connection closed by
    peer" (about 1 run in 5)."""
    exchange = opt.agreement_exchange()
    if exchange is not None:
        exchange.drain()


def _norm_and_clip(rank: int, group):
    names, params = _stage_params(rank, torch.float64)
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                          clip_grad=1.0)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), params, model_groups=group)
    for n, p in zip(names, params):
        p.grad = _grad(n)  # the trainer has already summed E's grad on both stages
    info = opt.step(params, params, params, lr=1.0)
    _finish(opt)
    return info.grad_norm, info.skipped, {n: p.detach().clone() for n, p in zip(names, params)}


def _inf_on_one_rank(rank: int, group):
    names, params = _stage_params(rank, torch.float16)
    pcfg = PrecisionConfig(fp16=True, initial_loss_scale=256.0, hysteresis=1)
    cfg = OptimizerConfig(optimizer="adam", lr=0.1, clip_grad=1.0)
    opt = get_megatron_optimizer(cfg, pcfg, params, model_groups=group)
    for n, p in zip(names, params):
        p.grad = _grad(n, opt.loss_scale).half()
    if rank == 1:
        params[0].grad[0, 0] = float("inf")
    info = opt.step(params, params, params, lr=0.1)
    _finish(opt)
    unchanged = all(bool((p == 1).all()) for p in params)
    return info.skipped, info.loss_scale, info.num_nonfinite, unchanged


def _params_norm(rank: int, group):
    """--log-params-norm: the norm rides in the same agreement, of the weights the
    gradients were computed with (before this step's update)."""
    names, params = _stage_params(rank, torch.float64)
    with torch.no_grad():
        for n, p in zip(names, params):
            p.copy_(_grad(n, 0.5) + 1.0)
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                          clip_grad=0.0)
    opt = get_megatron_optimizer(cfg, PrecisionConfig(), params, model_groups=group,
                                 log_params_norm=True)
    norms = []
    for _ in range(2):
        for n, p in zip(names, params):
            p.grad = _grad(n)
        norms.append(opt.step(params, params, params, lr=1.0).params_norm)
    _finish(opt)
    return norms


def _both_scenarios(rank: int, world_size: int):
    torch.set_num_threads(1)
    group = dist.new_group(ranks=[0, 1])  # the model group: both pipeline stages
    return {"clip": _norm_and_clip(rank, group), "inf": _inf_on_one_rank(rank, group),
            "params": _params_norm(rank, group)}


@pytest.fixture(scope="module")
def results():
    # One spawn for both scenarios: starting gloo ranks dominates the test time.
    return run_distributed(_both_scenarios, world_size=2, timeout=60)


def test_global_norm_counts_shared_embedding_once_and_clips_alike(results):
    results = [r["clip"] for r in results]
    expected = math.sqrt(sum(float(_grad(n).square().sum()) for n in SHAPES))
    coeff = 1.0 / (expected + 1e-6)
    for norm, skipped, weights in results:
        assert not skipped
        assert abs(norm - expected) <= 1e-12 * expected
        for n, w in weights.items():
            torch.testing.assert_close(w, 1.0 - coeff * _grad(n), rtol=1e-12, atol=1e-12)
    # Both copies of the tied embedding received the same update.
    assert torch.equal(results[0][2]["E"], results[1][2]["E"])


def test_params_norm_counts_shared_embedding_once_before_the_update(results):
    w0 = {n: _grad(n, 0.5) + 1.0 for n in SHAPES}
    w1 = {n: w - _grad(n) for n, w in w0.items()}  # SGD, lr 1, no clipping
    expected = [math.sqrt(sum(float(w[n].square().sum()) for n in SHAPES)) for w in (w0, w1)]
    for r in results:
        assert r["params"] == pytest.approx(expected, rel=1e-12)


def test_inf_on_one_rank_makes_both_ranks_skip(results):
    for skipped, scale, nonfinite, unchanged in (r["inf"] for r in results):
        assert skipped and unchanged
        assert scale == 128.0
        assert nonfinite == 1

"""The 2BW staleness mitigations (--2bw-mitigation), proven like 2BW itself: in float64
each equals an independent single-process implementation of its update rule at
d = 1, 2, 4 and w = 1, 2; resume across a checkpoint is bit-identical; the executor's
counters see at most two weight versions.

Rules (W(t): weights after t updates; g_t: batch t's clipped gradient):
* predict: g_t is taken at P_t(W(t-1)), P_t = one AdamW step with a zero gradient from
  the optimizer state after step t-2 (identity before the first step); W(t+1) = W(t) -
  lr * AdamW(g_t);
* dc: g_t taken at W(t-1), then g_t + lambda * g_t^2 * (W(t) - W(t-1)) is applied to W(t);
* warmup N: batches t < N run on W(t) (Flush), later ones on W(max(t-1, N)).  N is odd
  here: the last warm-up step must update buffer 0 in place, not from buffer N % 2.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs
from tests.distributed.test_pipeline_semantics import _close, _losses, reference_setup

STEPS, WARMUP, LAMBDA = 5, 3, 100.0


def _argv(d: int, mitigation: str) -> List[str]:
    return TINY + ["--pipeline-model-parallel-size", str(d), "--pipeline-schedule", "2bw",
                   "--train-iters", str(STEPS), "--2bw-mitigation", mitigation,
                   "--2bw-flush-warmup-iters", str(WARMUP), "--2bw-dc-lambda", str(LAMBDA)]


def reference_losses(kind: str) -> List[float]:
    """Plain single-process PyTorch loop; ``kind`` in 2bw, predict, dc, warmup."""
    model, data, params = reference_setup(STEPS)

    def adamw(ps):
        decay = [p for p in ps if p.ndim >= 2]
        no_decay = [p for p in ps if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=1e-3, betas=(0.9, 0.999), eps=1e-8)

    opt = adamw(params)
    states = [copy.deepcopy(opt.state_dict())]  # states[k]: optimizer state after k steps
    history = [[p.detach().clone() for p in params]]  # history[k] = W(k)
    losses = []
    for t in range(STEPS):
        current = history[t]
        previous = history[max(t - 1, 0)]
        if kind == "warmup":
            at = current if t <= WARMUP else previous
        elif kind == "predict":
            at = _zero_grad_step(previous, states[max(t - 1, 0)], adamw)
        else:
            at = previous
        with torch.no_grad():
            for p, w in zip(params, at):
                p.copy_(w)
        opt.zero_grad(set_to_none=True)
        text = torch.stack([torch.as_tensor(data[i]["text"])
                            for i in range(8 * t, 8 * t + 8)]).long()
        tokens, labels = text[:, :-1], text[:, 1:]
        pos = torch.arange(16).unsqueeze(0).expand_as(tokens)
        loss = model(tokens, pos, None, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        with torch.no_grad():
            if kind == "dc":
                for p, w_new, w_old in zip(params, current, previous):
                    p.grad.add_(LAMBDA * p.grad * p.grad * (w_new - w_old))
            for p, w in zip(params, current):
                p.copy_(w)
        opt.step()
        states.append(copy.deepcopy(opt.state_dict()))
        history.append([p.detach().clone() for p in params])
    return losses


def _zero_grad_step(weights, state, make_opt) -> List[torch.Tensor]:
    """torch.optim.AdamW's step with zero gradients from ``state`` (identity if empty)."""
    if not state["state"]:
        return weights
    ps = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = make_opt(ps)
    opt.load_state_dict(copy.deepcopy(state))
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    return [p.detach() for p in ps]


KINDS = ("predict", "dc", "warmup")


@pytest.fixture(scope="module")
def runs() -> Dict[str, Dict]:
    out: Dict[str, Dict] = {}
    out.update(run_distributed(train_configs, 1, timeout=300,
                               args=([(k, _argv(1, k), None) for k in KINDS],))[-1])
    two = [(f"{k}_d2", _argv(2, k), None) for k in KINDS]
    two += [(f"{k}_w2", _argv(1, k), None) for k in ("predict", "warmup")]
    out.update(run_distributed(train_configs, 2, args=(two,), timeout=300)[-1])
    four = [(f"{k}_d4", _argv(4, k), None) for k in KINDS]
    four += [("predict_d2w2", _argv(2, "predict"), None)]
    out.update(run_distributed(train_configs, 4, args=(four,), timeout=600)[-1])
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_mitigation_equals_single_process_reference(runs, kind):
    ref = reference_losses(kind)
    assert not _close(ref, reference_losses("2bw")), "the rule must differ from plain 2BW"
    for name in [kind, f"{kind}_d2", f"{kind}_d4", f"{kind}_w2", f"{kind}_d2w2"]:
        if name in runs:
            assert _close(_losses(runs[name]), ref), (name, _losses(runs[name]), ref)


def test_warmup_versions_switch_from_flush_to_2bw(runs):
    expected = [0, 1, 2, 3, 3]  # batches 0-2 under Flush; 2BW restarts from W(3)
    assert runs["warmup_d2"]["versions"] == expected
    assert runs["predict_d2"]["versions"] == [max(t - 1, 0) for t in range(STEPS)]


@pytest.mark.parametrize("name", ["predict_d4", "dc_d4", "warmup_d4"])
def test_at_most_two_weight_versions(runs, name):
    stages = runs[name]["memory"]["per_rank"]
    assert len(stages) == 4
    assert all(r["peak_weight_versions"] == 2 for r in stages), stages


def _resume_argv(mitigation: str, *extra: str) -> List[str]:
    """float32 with dropout, d=2; the warm-up ends exactly at the checkpoint (iteration 3,
    an odd one: the first 2BW batch runs on the buffer the warm-up never used)."""
    base = [a for a in TINY if a != "--fp64"]
    for flag, value in (("--hidden-dropout", "0.1"), ("--attention-dropout", "0.1"),
                        ("--train-iters", "6")):
        base[base.index(flag) + 1] = value
    return base + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                   "--2bw-mitigation", mitigation, "--2bw-flush-warmup-iters", "3", *extra]


def test_resume_is_bit_identical(tmp_path):
    configs = []
    for kind in ("predict", "warmup"):
        ckpt = str(tmp_path / kind)
        configs += [(f"{kind}_full", _resume_argv(kind), None),
                    (f"{kind}_first", _resume_argv(kind, "--save", ckpt, "--exit-interval", "3"),
                     None),
                    (f"{kind}_second", _resume_argv(kind, "--save", ckpt, "--load", ckpt), None)]
    res = run_distributed(train_configs, 2, args=(configs,), timeout=300)[-1]
    for kind in ("predict", "warmup"):
        full, first = res[f"{kind}_full"]["losses"], res[f"{kind}_first"]["losses"]
        second = res[f"{kind}_second"]["losses"]
        assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6], kind
        for t in (1, 2, 3):
            assert first[t] == full[t], (kind, t)
        for t in (4, 5, 6):
            assert second[t] == full[t], (kind, t, second[t], full[t])
    assert res["warmup_second"]["versions"] == [3, 3, 4]

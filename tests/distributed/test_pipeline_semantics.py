"""Weight-update semantics of every schedule, in float64 on CPU gloo ranks.

* none, gpipe and flush equal single-process training step for step;
* 2bw equals an independent single-process implementation of the delayed update
  W(t+1) = W(t) - lr * grad f(W(t-1)) (with AdamW's moments fed the stale gradient);
* losses are invariant to the pipeline depth d and width w at a fixed global batch;
* the tied embedding of first and last stage stays identical;
* an overflow injected on one stage under fp16 makes every stage skip that batch.
"""
from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

STEPS = 4


def _args(*extra: str) -> List[str]:
    # --log-params-norm: the norm joins the optimizer's agreement, nothing else changes
    return TINY + ["--log-params-norm"] + list(extra)


def _pp(d: int, schedule: str, *extra: str) -> List[str]:
    return _args("--pipeline-model-parallel-size", str(d), "--pipeline-schedule", schedule, *extra)


# ---------------------------------------------------------------- independent references
def reference_losses(delayed: bool, optimizer: str = "adam") -> List[float]:
    """Plain single-process PyTorch loop over the same data, model and hyper-parameters."""
    model, data, params = reference_setup(STEPS)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if optimizer == "adam":
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    else:
        opt = torch.optim.SGD(groups, lr=1e-3, momentum=0.9)
    previous = [p.detach().clone() for p in params]  # W(t-1); W(-1) := W(0)
    losses = []
    for t in range(STEPS):
        text = torch.stack([torch.as_tensor(data[i]["text"]) for i in range(8 * t, 8 * t + 8)]).long()
        tokens, labels = text[:, :-1], text[:, 1:]
        pos = torch.arange(16).unsqueeze(0).expand_as(tokens)
        current = [p.detach().clone() for p in params]
        if delayed:  # gradient at W(t-1)
            with torch.no_grad():
                for p, w in zip(params, previous):
                    p.copy_(w)
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, pos, None, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
        if delayed:  # ...applied to W(t)
            with torch.no_grad():
                for p, w in zip(params, current):
                    p.copy_(w)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        previous = current
    return losses


def reference_setup(steps: int):
    """(model, data, params) of the single-process float64 references: TINY's GPT with
    the same initial weights and mock data as the pipelined runs, ``steps`` batches of 8."""
    from megatron.config import ModelConfig
    from megatron.data.gpt_dataset import MockGPTDataset
    from megatron.model import GPTModel
    from megatron.tensor_parallel.utils import TPInfo

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, padded_vocab_size=128, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.float64)
    model = GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                     layer_numbers=range(cfg.num_layers), seed=7)
    data = MockGPTDataset(steps * 8, 16, 97, 7)  # --vocab-size 96: 97 ids
    return model, data, list(model.parameters())


def _losses(summary: Dict) -> List[float]:
    return [summary["losses"][t] for t in sorted(summary["losses"])]


def _close(a: List[float], b: List[float], tol: float = 1e-10) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b))


# ------------------------------------------------------------------------ the runs
@pytest.fixture(scope="module")
def single():
    configs = [("flush", _args(), None), ("2bw", _pp(1, "2bw"), None),
               ("sgd", _args("--optimizer", "sgd"), None)]
    return run_distributed(train_configs, 1, args=(configs,), timeout=300)[0]


@pytest.fixture(scope="module")
def two_ranks():
    configs = [(f"{s}_d2", _pp(2, s), None) for s in ("none", "gpipe", "flush", "2bw")]
    configs += [("flush_w2", _pp(1, "flush"), None), ("2bw_w2", _pp(1, "2bw"), None),
                ("sgd_flush_d2", _pp(2, "flush", "--optimizer", "sgd"), None),
                ("fp16_flush_d2", _fp16(_pp(2, "flush")), "inject_overflow_stage0_iter2"),
                ("fp16_2bw_d2", _fp16(_pp(2, "2bw")), "inject_overflow_stage0_iter2")]
    # uneven stages: 1 layer + embedding on stage 0, 3 layers + head on stage 1
    configs += [(f"{s}_d2_first1", _pp(2, s, "--decoder-first-pipeline-num-layers", "1"), None)
                for s in ("flush", "2bw")]
    return run_distributed(train_configs, 2, args=(configs,), timeout=600)


@pytest.fixture(scope="module")
def four_ranks():
    configs = [(f"{s}_d4", _pp(4, s), None) for s in ("none", "gpipe", "flush", "2bw")]
    configs += [("flush_d2w2", _pp(2, "flush"), None), ("2bw_d2w2", _pp(2, "2bw"), None),
                ("flush_t2w2", _args("--tensor-model-parallel-size", "2"), None),
                # a model replica of 4 ranks: the optimizer's agreement among 4 members,
                # the tied embedding summed by each tensor-parallel rank's own pair
                ("flush_d2t2", _pp(2, "flush", "--tensor-model-parallel-size", "2"), None),
                ("2bw_d2t2", _pp(2, "2bw", "--tensor-model-parallel-size", "2"), None)]
    return run_distributed(train_configs, 4, args=(configs,), timeout=600)


def _fp16(argv: List[str]) -> List[str]:
    out = [a for a in argv if a != "--fp64"]
    return out + ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", "--train-iters", "6"]


# ------------------------------------------------------------------------ the tests
def test_single_process_trainer_matches_plain_pytorch_loop(single):
    assert _close(_losses(single["flush"]), reference_losses(delayed=False))
    assert _close(_losses(single["sgd"]), reference_losses(delayed=False, optimizer="sgd"))


def test_2bw_single_stage_matches_delayed_update_reference(single):
    ref = reference_losses(delayed=True)
    assert _close(_losses(single["2bw"]), ref)
    # and it is really different from vanilla semantics after the first steps
    assert not _close(ref, reference_losses(delayed=False))


@pytest.mark.parametrize("schedule", ["none", "gpipe", "flush"])
def test_flushing_schedules_equal_single_process_d2(single, two_ranks, schedule):
    assert _close(_losses(two_ranks[-1][f"{schedule}_d2"]), _losses(single["flush"]))


@pytest.mark.parametrize("schedule", ["none", "gpipe", "flush"])
def test_flushing_schedules_equal_single_process_d4(single, four_ranks, schedule):
    assert _close(_losses(four_ranks[-1][f"{schedule}_d4"]), _losses(single["flush"]))


def test_2bw_invariant_to_depth_and_width(single, two_ranks, four_ranks):
    ref = _losses(single["2bw"])
    for res, name in ((two_ranks, "2bw_d2"), (four_ranks, "2bw_d4"), (two_ranks, "2bw_w2"),
                      (four_ranks, "2bw_d2w2")):
        assert _close(_losses(res[-1][name]), ref), name
    # tensor parallelism splits the matmuls: another order of the additions
    assert _close(_losses(four_ranks[-1]["2bw_d2t2"]), ref, tol=1e-9)


def test_width_and_tensor_parallel_invariance(single, two_ranks, four_ranks):
    ref = _losses(single["flush"])
    assert _close(_losses(two_ranks[-1]["flush_w2"]), ref)
    assert _close(_losses(four_ranks[-1]["flush_d2w2"]), ref)
    assert _close(_losses(four_ranks[-1]["flush_t2w2"]), ref, tol=1e-9)
    assert _close(_losses(four_ranks[-1]["flush_d2t2"]), ref, tol=1e-9)


def test_sgd_flush_pipeline_equals_single(single, two_ranks):
    assert _close(_losses(two_ranks[-1]["sgd_flush_d2"]), _losses(single["sgd"]))


def test_params_norm_is_of_the_weights_each_gradient_used(single, two_ranks, four_ranks):
    """--log-params-norm, summed in the optimizer's agreement: every stage and tensor-
    parallel rank counts its own weights once (the tied embedding on the first stage
    only), so each layout reports the single-process norm; flush reports W(t), 2BW the
    W(t-1) its gradient was computed with, so its first two steps both report W(0)."""
    _, _, params = reference_setup(STEPS)
    w0 = math.sqrt(sum(float(p.detach().square().sum()) for p in params))
    for name in ("flush", "2bw"):
        assert single[name]["params_norms"][0] == pytest.approx(w0, rel=1e-12)
    assert single["2bw"]["params_norms"][1] == single["2bw"]["params_norms"][0]
    assert single["flush"]["params_norms"][1] != single["flush"]["params_norms"][0]
    for res, name, ref in ((two_ranks, "flush_d2", "flush"), (two_ranks, "2bw_d2", "2bw"),
                           (four_ranks, "2bw_d4", "2bw"), (four_ranks, "2bw_d2t2", "2bw"),
                           (four_ranks, "flush_d2w2", "flush")):
        for rank_result in res:
            assert _close(rank_result[name]["params_norms"], single[ref]["params_norms"],
                          tol=1e-9), name


def test_2bw_version_numbers_in_reports(two_ranks):
    for rank_result in two_ranks:
        assert rank_result["2bw_d2"]["versions"] == [max(t - 1, 0) for t in range(STEPS)]
        assert rank_result["flush_d2"]["versions"] == list(range(STEPS))


@pytest.mark.parametrize("name", ["flush_d2", "2bw_d2", "gpipe_d2", "none_d2"])
def test_tied_embeddings_identical_on_first_and_last_stage(two_ranks, name):
    first, last = two_ranks[0][name]["shared_embedding"], two_ranks[1][name]["shared_embedding"]
    assert first is not None and last is not None
    assert torch.equal(first, last)


def test_tied_embeddings_identical_d4_w2(four_ranks):
    # d=2, w=2: ranks (stage 0: 0, 1) and (stage 1: 2, 3)
    embs = [r["2bw_d2w2"]["shared_embedding"] for r in four_ranks]
    assert all(torch.equal(embs[0], e) for e in embs)


@pytest.mark.parametrize("name", ["fp16_flush_d2", "fp16_2bw_d2"])
def test_injected_overflow_skips_same_step_on_every_stage(two_ranks, name):
    skipped = [r[name]["skipped"] for r in two_ranks]
    assert skipped[0] == skipped[1]
    assert skipped[0][2] is True
    # every other step that did not overflow naturally was applied on both stages alike
    assert [r[name]["loss_scales"] for r in two_ranks][0] == two_ranks[1][name]["loss_scales"]
    assert all(math.isfinite(v) for v in two_ranks[-1][name]["losses"].values())


@pytest.mark.parametrize("name,lag", [("fp16_flush_d2", 1), ("fp16_2bw_d2", 2)])
def test_loss_scale_change_reaches_whole_batches_only(two_ranks, name, lag):
    """The overflow at batch 2 halves the scale (hysteresis 1).  Every stage unscales a
    batch by the scale its backward passes used: under 2BW batch 3 has started its
    backward before STEP(2), so the halved scale applies from batch 2 + lag on."""
    used = [r[name]["grad_scales"] for r in two_ranks]
    assert used[0] == used[1]
    assert used[0][:2 + lag] == [1024.0] * (2 + lag)
    assert all(s == 512.0 for s in used[0][2 + lag:])
    assert two_ranks[0][name]["loss_scales"][2] == 512.0


def test_uneven_stage_split_keeps_the_update_rule(single, two_ranks):
    """--decoder-first-pipeline-num-layers moves layers between stages, not semantics
    (``single`` is checked against the independent references above)."""
    assert _close(_losses(two_ranks[-1]["flush_d2_first1"]), _losses(single["flush"]))
    assert _close(_losses(two_ranks[-1]["2bw_d2_first1"]), _losses(single["2bw"]))


"""The executor builds each segment shape's schedule once (``StagePlans``) and runs this
stage's list of it; the lists and counts are those of ``build_schedule``."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megatron.pipeline.actions import Op
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.stage_plan import StagePlan, StagePlans


@pytest.mark.parametrize("name,d,m,batches,forward_only", [
    ("2bw", 4, 4, 3, False), ("2bw", 3, 5, 7, False), ("flush", 4, 6, 2, False),
    ("gpipe", 2, 3, 2, False), ("none", 3, 2, 2, False), ("flush", 3, 4, 2, True),
    ("2bw", 1, 2, 3, False)])
def test_plan_is_this_stages_list_with_its_counts(name, d, m, batches, forward_only):
    full = build_schedule(name, d, m, batches, forward_only=forward_only)
    for stage in range(d):
        plan = StagePlans(stage).get(name, d, m, batches, forward_only)
        assert list(plan.actions) == full[stage]
        ops = [a.op for a in full[stage]]
        assert (plan.forwards, plan.reduces, plan.steps, plan.act_receives,
                plan.grad_receives) == (ops.count(Op.FORWARD), ops.count(Op.REDUCE_GRADS),
                                        ops.count(Op.STEP), ops.count(Op.RECV_ACT),
                                        ops.count(Op.RECV_GRAD))
        assert plan.full_schedule() == full


def test_each_shape_is_built_once_and_the_oldest_shape_goes_first():
    plans = StagePlans(stage=1, size=2)
    a = plans.get("2bw", 2, 4, 10)
    assert plans.get("2bw", 2, 4, 10) is a and plans.builds == 1
    b = plans.get("2bw", 2, 4, 3)
    assert plans.get("2bw", 2, 4, 10) is a and plans.builds == 2  # a is now the newest
    plans.get("2bw", 2, 4, 10, forward_only=True)  # a third shape: b goes
    assert plans.builds == 3
    assert plans.get("2bw", 2, 4, 10) is a and plans.builds == 3
    assert plans.get("2bw", 2, 4, 3) is not b and plans.builds == 4
    with pytest.raises(ValueError, match="size"):
        StagePlans(stage=0, size=0)


def test_plans_are_immutable():
    plan = StagePlans(0).get("flush", 2, 2, 1)
    assert isinstance(plan, StagePlan) and isinstance(plan.actions, tuple)
    with pytest.raises(AttributeError):
        plan.forwards = 0  # type: ignore[misc]


def test_a_run_builds_each_segment_shape_once(monkeypatch):
    """25 flush iterations drain at 10 and 20 (evaluation, and where ten skipped steps
    could stop the run) and evaluate three times: six segments of three shapes.  Before
    the plans, every segment built its schedule."""
    import pretrain_gpt
    from megatron import training
    from tests.distributed.gpt_harness import TINY

    made = {}
    setup = training.setup_model_and_optimizer

    def capture(*args, **kw):
        model, opt, scheduler, engine = setup(*args, **kw)
        made["engine"] = engine
        return model, opt, scheduler, engine

    monkeypatch.setattr(training, "setup_model_and_optimizer", capture)
    built = []
    import megatron.pipeline.stage_plan as stage_plan
    real = stage_plan.build_schedule
    monkeypatch.setattr(stage_plan, "build_schedule",
                        lambda *a, **k: built.append((a, k)) or real(*a, **k))
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):
        result = training.pretrain(
            pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
            pretrain_gpt.forward_step,
            argv=TINY + ["--train-iters", "25", "--eval-interval", "10", "--eval-iters", "1"])
    assert result.iteration == 25 and len(result.eval_losses) == 3
    assert len(built) == 3 == made["engine"].plans.builds, built

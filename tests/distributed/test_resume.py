"""Resuming after --exit-interval gives bit-identical losses to the uninterrupted run
(float32 with dropout on, so model, optimizer, scaler, LR schedule, RNG, data position
and -- under 2BW -- the shadow weight version must all be restored)."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs


def _argv(schedule: str, *extra: str):
    base = [a for a in TINY if a != "--fp64"]
    i = base.index("--hidden-dropout")
    base[i + 1] = "0.1"
    i = base.index("--attention-dropout")
    base[i + 1] = "0.1"
    i = base.index("--train-iters")
    base[i + 1] = "6"
    return base + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
                   *extra]


@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_resume_is_bit_identical(tmp_path, schedule):
    ckpt = str(tmp_path / "ckpt")
    configs = [("full", _argv(schedule), None),
               ("first", _argv(schedule, "--save", ckpt, "--exit-interval", "3"), None),
               ("second", _argv(schedule, "--save", ckpt, "--load", ckpt), None)]
    res = run_distributed(train_configs, 2, args=(configs,), timeout=300)[-1]
    assert res["first"]["exited_early"] and res["first"]["iteration"] == 3
    full, first, second = res["full"]["losses"], res["first"]["losses"], res["second"]["losses"]
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    for t in (1, 2, 3):
        assert first[t] == full[t]
    for t in (4, 5, 6):
        assert second[t] == full[t], (t, second[t], full[t])

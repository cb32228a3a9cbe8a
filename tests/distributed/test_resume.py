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


def _one_process(argv):
    import contextlib
    import io

    import pretrain_gpt
    from megatron.training import pretrain

    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=list(argv))
    return result, out.getvalue()


def test_train_samples_counts_samples_across_a_batch_size_change(tmp_path):
    """--train-samples 64: 4 batches of 8, then resume at --global-batch-size 16.  The
    run goes on for the 32 samples left (2 batches, not 64 // 16 - 4 = 0: "nothing to
    train"), and the linear LR decay over 64 samples continues from sample 32."""
    ckpt = str(tmp_path / "ckpt")
    base = [a for a in TINY]
    del base[base.index("--train-iters"):base.index("--train-iters") + 2]
    base += ["--train-samples", "64", "--lr-decay-style", "linear", "--min-lr", "0",
             "--distributed-backend", "gloo", "--save", ckpt]
    first, _ = _one_process(base + ["--exit-interval", "4"])
    assert first.iteration == 4 and [r.lr for r in first.reports] == pytest.approx(
        [1e-3 * (1 - s / 64) for s in (0, 8, 16, 24)], rel=1e-12)
    gbs = base.index("--global-batch-size") + 1
    base[gbs] = "16"
    second, log = _one_process(base + ["--load", ckpt, "--log-interval", "1"])
    assert second.iteration == 6, log[-2000:]
    assert [r.lr for r in second.reports] == pytest.approx([1e-3 * (1 - s / 64)
                                                            for s in (32, 48)], rel=1e-12)
    assert "iteration        6/       6" in log
    # nothing left: one error line naming --train-samples, not --train-iters
    from megatron.errors import UserError

    with pytest.raises(UserError, match="--train-samples is 64"):
        _one_process(base + ["--load", ckpt])


def test_flush_checkpoint_resumed_under_2bw_is_a_flush_warmup(tmp_path):
    """A Flush checkpoint holds one weight version: 2BW restarts from it as after
    --2bw-mitigation warmup's Flush batches (batches t and t+1 on W(t)), in losses and
    in the versions it reports (they said t-1 for batch t)."""
    ckpt = str(tmp_path / "ckpt")
    six = ["--train-iters", "6"]
    configs = [("warmup", _argv("2bw", *six, "--2bw-mitigation", "warmup",
                                "--2bw-flush-warmup-iters", "3"), None),
               ("flush", _argv("flush", *six, "--save", ckpt, "--exit-interval", "3"), None),
               ("2bw", _argv("2bw", *six, "--save", ckpt, "--load", ckpt), None)]
    res = run_distributed(train_configs, 2, args=(configs,), timeout=300)[-1]
    warm, resumed = res["warmup"], res["2bw"]
    assert resumed["versions"] == warm["versions"][3:] == [3, 3, 4]
    for t in (4, 5, 6):
        assert resumed["losses"][t] == warm["losses"][t], (t, resumed["losses"], warm["losses"])

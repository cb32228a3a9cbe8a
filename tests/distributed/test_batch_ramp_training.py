"""A global batch that grows during training (--rampup-batch-size,
--step-batch-size-schedule) on spawned gloo ranks: the pipeline changes m between
segments and gives the same losses as another layout of the same math, the LR schedule
counts each batch's own samples, and a run stopped mid-ramp resumes bit-identically."""
from __future__ import annotations

import math

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

# micro batch 2: k = 3 increments of 4, one per 12 samples: 8 from sample 12 on, 12 from
# sample 24, 16 from sample 36 (batches start after 0, 4, 8, 12, 20, 28, 40, ... samples)
RAMP = ["--rampup-batch-size", "4", "4", "36", "--global-batch-size", "16"]
SAMPLES = 120
SIZES = [4, 4, 4, 8, 8, 12, 16, 16, 16, 16, 16]
ITERS = len(SIZES)


def _argv(schedule: str, depth: int, *extra: str):
    base = list(TINY)
    i = base.index("--train-iters")
    del base[i:i + 2]
    i = base.index("--global-batch-size")
    del base[i:i + 2]
    i = base.index("--lr-decay-style")
    base[i + 1] = "linear"
    return base + RAMP + ["--train-samples", str(SAMPLES), "--min-lr", "0",
                          "--pipeline-model-parallel-size", str(depth),
                          "--pipeline-schedule", schedule, *extra]


def _close(a, b, tol=1e-11):
    return sorted(a) == sorted(b) and all(abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k]))
                                          for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = {s: str(tmp_path_factory.mktemp(f"ckpt_{s}")) for s in ("flush", "2bw")}
    configs = []
    for s in ("flush", "2bw"):
        configs += [(f"{s}_d2", _argv(s, 2), None),
                    # the same ramp on 2 parallel pipelines of one stage: another layout
                    (f"{s}_w2", _argv(s, 1), None),
                    (f"{s}_first", _argv(s, 2, "--save", ckpt[s], "--exit-interval", "4"), None),
                    (f"{s}_second", _argv(s, 2, "--save", ckpt[s], "--load", ckpt[s]), None)]
    # the ramp's first three batches are batches of 4: as a constant --global-batch-size 4
    constant = _argv("flush", 2)
    i = constant.index("--rampup-batch-size")
    del constant[i:i + 4]
    i = constant.index("--global-batch-size")
    constant[i + 1] = "4"
    i = constant.index("--train-samples")
    constant[i + 1] = "12"
    configs.append(("constant4", constant + ["--lr-decay-samples", str(SAMPLES)], None))
    return run_distributed(train_configs, 2, args=(configs,), timeout=600)


def test_argument_layer_counts_the_ramp():
    from megatron.arguments import parse_and_validate

    _, cfg = parse_and_validate(_argv("2bw", 2), world_size=2)
    tr = cfg.training
    assert tr.train_iters == ITERS
    assert tr.batch_sizes().sizes(ITERS) == SIZES
    assert sum(SIZES) <= SAMPLES < sum(SIZES) + 16


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_growing_batch_trains_every_iteration_with_its_own_size(runs, schedule):
    last = runs[-1][f"{schedule}_d2"]
    assert last["iteration"] == ITERS
    assert sorted(last["losses"]) == list(range(1, ITERS + 1))
    assert all(math.isfinite(v) for v in last["losses"].values())
    assert not any(last["skipped"])


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_depth_two_equals_two_parallel_pipelines(runs, schedule):
    """m changes 2 -> 4 -> 6 -> 8 at d=2, and 1 -> 2 -> 3 -> 4 on each of w=2 one-stage
    pipelines: the same batches, the same updates."""
    assert _close(runs[-1][f"{schedule}_d2"]["losses"], runs[-1][f"{schedule}_w2"]["losses"])


def test_first_batches_equal_a_constant_batch_of_the_start_size(runs):
    """Same samples in the same order, the same LR: the ramp's batches of 4 are batches
    of 4 (under flush the first three updates are identical)."""
    ramp, constant = runs[-1]["flush_d2"]["losses"], runs[-1]["constant4"]["losses"]
    assert sorted(constant) == [1, 2, 3]
    assert _close({t: ramp[t] for t in (1, 2, 3)}, constant)


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_resume_mid_ramp_is_bit_identical(runs, schedule):
    res = runs[-1]
    first, second = res[f"{schedule}_first"], res[f"{schedule}_second"]
    full = res[f"{schedule}_d2"]["losses"]
    assert first["exited_early"] and first["iteration"] == 4
    assert sorted(second["losses"]) == list(range(5, ITERS + 1))
    for t in range(1, ITERS + 1):
        got = first["losses"][t] if t <= 4 else second["losses"][t]
        assert got == full[t], (t, got, full[t])


def _one_process(argv):
    import contextlib
    import io

    import pretrain_gpt
    from megatron.training import pretrain

    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=list(argv))
    return result, out.getvalue()


def test_lr_follows_samples_and_log_lines_name_the_batch():
    """One process: the LR decays over samples (each step moves it by its own batch),
    and every log line carries the batch size, as Megatron-LM's do."""
    argv = _argv("flush", 1, "--distributed-backend", "gloo", "--log-interval", "1")
    result, log = _one_process(argv)
    consumed = [sum(SIZES[:i]) for i in range(ITERS)]
    assert [r.lr for r in result.reports] == pytest.approx(
        [1e-3 * (1 - c / SAMPLES) for c in consumed], rel=1e-12)
    sizes = [int(line.split("global batch size:")[1].split("|")[0])
             for line in log.splitlines() if "global batch size:" in line]
    assert sizes == SIZES
    assert f"consumed samples: {sum(SIZES):12d}" in log
    assert "batch sizes 4 from sample 0, 8 from sample 12" in log


def test_step_schedule_in_tokens():
    """--step-batch-size-schedule: thresholds in tokens (seq 16), the last batch is the
    global batch size; 4, then 8 from 192 tokens (12 samples) on."""
    argv = _argv("flush", 1, "--distributed-backend", "gloo")
    i = argv.index("--rampup-batch-size")
    del argv[i:i + 6]
    argv += ["--step-batch-size-schedule", "0:4 192:8"]
    i = argv.index("--train-samples")
    argv[i + 1] = "44"
    result, log = _one_process(argv)
    assert result.iteration == 7  # 4, 4, 4, then 8, 8, 8, 8 (44 samples)
    assert "microbatches per batch m=2..4 |" in log and "global batch 8 (batch sizes" in log


def test_train_iters_with_a_ramp_counts_iterations():
    """--train-iters (Megatron-LM's GPT-3 script): that many iterations, each of its ramp
    size; the LR decays per iteration over --lr-decay-iters."""
    argv = _argv("flush", 1, "--distributed-backend", "gloo")
    i = argv.index("--train-samples")
    del argv[i:i + 2]
    argv += ["--train-iters", "7", "--lr-decay-iters", "10"]
    result, _ = _one_process(argv)
    assert result.iteration == 7
    assert [r.lr for r in result.reports] == pytest.approx(
        [1e-3 * (1 - t / 10) for t in range(7)], rel=1e-12)

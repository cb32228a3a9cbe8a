"""megatron.batch_schedule: batch sizes as functions of consumed samples (pure logic),
and the argument checks of --rampup-batch-size / --step-batch-size-schedule."""
from __future__ import annotations

import random

import pytest

from megatron.batch_schedule import BatchSchedule, BatchScheduleError


def _megatron_ramp(start, increment, samples, gbs):
    """Megatron-LM's ramp written out as its documentation states it (float division),
    the reference the integer thresholds must reproduce."""
    k = (gbs - start) // increment

    def size(consumed):
        if consumed > samples:
            return gbs
        return start + int(consumed / (samples / k)) * increment
    return size


def _brute_iterations(size_at, train_samples, consumed=0):
    n = 0
    while consumed + size_at(consumed) <= train_samples:
        consumed += size_at(consumed)
        n += 1
    return n


def test_gpt3_ramp_matches_the_float_formula_everywhere():
    """GPT-3 175B's --rampup-batch-size 16 16 5859375 --global-batch-size 1536."""
    sched = BatchSchedule.from_rampup((16, 16, 5859375), 1536)
    ref = _megatron_ramp(16, 16, 5859375, 1536)
    rng = random.Random(0)
    points = list(range(0, 300_000, 13)) + [rng.randrange(0, 7_000_000) for _ in range(20_000)]
    points += [t + d for t, _ in sched.points for d in (-1, 0, 1) if t + d >= 0]
    points += [5859375, 5859376]
    assert all(sched.batch_size_at(c) == ref(c) for c in points)
    assert len(sched.points) == 96 and sched.final_batch_size == 1536


def test_gpt3_ramp_iteration_count():
    """300B tokens / 2048 = 146,484,375 samples; batches counted one by one agree."""
    sched = BatchSchedule.from_rampup((16, 16, 5859375), 1536)
    samples = 300 * 10 ** 9 // 2048
    ramp_end = sched.samples_after(sched.iterations(5859375 + 1536))
    # the ramp part one batch at a time, the rest in whole global batches
    n_ramp = _brute_iterations(sched.batch_size_at, ramp_end)
    assert sched.iterations(samples) == n_ramp + (samples - ramp_end) // 1536


@pytest.mark.parametrize("seed", range(20))
def test_queries_agree_with_stepping_batch_by_batch(seed):
    rng = random.Random(seed)
    unit = rng.choice([1, 2, 4])
    sizes = [unit * rng.randint(1, 8) for _ in range(rng.randint(1, 5))]
    thresholds = [0] + sorted(rng.sample(range(1, 200), len(sizes) - 1))
    sched = BatchSchedule(tuple(zip(thresholds, sizes)), "test")
    for consumed in (0, rng.randrange(0, 100)):
        seq = sched.sizes(60, consumed)
        # samples_after / iterations against the batch-by-batch walk
        total = consumed
        for n, size in enumerate(seq):
            assert sched.samples_after(n, consumed) == total
            total += size
        for train in (consumed, consumed + rng.randrange(1, 300)):
            assert sched.iterations(train, consumed) == _brute_iterations(
                sched.batch_size_at, train, consumed)
        # batches_at_this_size: the run of equal sizes at the head of seq
        same = sched.batches_at_this_size(consumed)
        if same is None:
            assert len(set(seq)) == 1 and seq[0] == sizes[-1]
        else:
            assert seq[:same] == [seq[0]] * same and seq[same] != seq[0]


def test_ramp_with_zero_ramp_samples_starts_at_the_global_batch():
    assert BatchSchedule.from_rampup((4, 4, 0), 16).sizes(3) == [16, 16, 16]
    assert BatchSchedule.from_rampup((16, 4, 100), 16).sizes(3) == [16, 16, 16]


@pytest.mark.parametrize("values, gbs, message", [
    ((0, 4, 10), 16, "must be positive"),
    ((4, 0, 10), 16, "must be positive"),
    ((4, 4, -1), 16, "samples >= 0"),
    ((32, 4, 10), 16, "larger than --global-batch-size"),
    ((4, 5, 10), 16, "multiple of the increment"),
    ((4, 4), 16, "takes 3 integers"),
])
def test_ramp_errors(values, gbs, message):
    with pytest.raises(BatchScheduleError, match=message):
        BatchSchedule.from_rampup(values, gbs)


def test_step_schedule_parses_suffixes_and_tokens():
    sched = BatchSchedule.parse("0:768 250B:1536 500B:3072, 750B:6K", 4096)
    assert sched.points == ((0, 768), (250 * 10 ** 9 // 4096, 1536),
                            (500 * 10 ** 9 // 4096, 3072), (750 * 10 ** 9 // 4096, 6000))
    assert BatchSchedule.parse("100:8 0:4", None).points == ((0, 4), (100, 8))  # sorted
    assert BatchSchedule.parse("0:4 1.5k:8", None).points == ((0, 4), (1500, 8))


@pytest.mark.parametrize("text, seq, message", [
    ("10:4 20:8", None, "first threshold must be 0"),
    ("0:4 0:8", None, "thresholds must increase"),
    ("0:4 10:8", 16, r"0 and 10 tokens are both sample 0"),
    ("0:4 10", None, "not THRESHOLD:BATCH_SIZE"),
    ("0:4 x:8", None, "'x' is not a number"),
    ("0:0", None, "batch sizes must be positive"),
    ("0:4 10:-8", None, "non-negative whole number"),
    ("0:4 10:2.5", None, "non-negative whole number"),
    ("", None, "expected THRESHOLD:BATCH_SIZE entries"),
])
def test_step_schedule_errors(text, seq, message):
    with pytest.raises(BatchScheduleError, match=message):
        BatchSchedule.parse(text, seq)


def test_check_names_the_batch_that_does_not_fit():
    sched = BatchSchedule.parse("0:4 100:6", None)
    sched.check(2, 1)
    with pytest.raises(BatchScheduleError, match=r"batch of 6 \(from sample 100\).* = 4"):
        sched.check(2, 2)
    with pytest.raises(BatchScheduleError, match="2 microbatches, fewer than the 4 PipeDream-2BW"):
        sched.check(2, 1, min_microbatches=4)


# -- the flags ------------------------------------------------------------------------------
BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--micro-batch-size", "2", "--lr", "1e-3"]


def _parse(*extra, world_size=1):
    from megatron.arguments import parse_and_validate

    return parse_and_validate(BASE + list(extra), world_size=world_size)


def _error(capsys, *extra, world_size=1):
    with pytest.raises(SystemExit) as exc:
        _parse(*extra, world_size=world_size)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_flags_fill_the_training_config(capsys):
    _, cfg = _parse("--global-batch-size", "16", "--rampup-batch-size", "4", "4", "36",
                    "--train-samples", "120")
    tr = cfg.training
    assert tr.train_iters == 11 and tr.global_batch_size == 16
    assert tr.batch_sizes().sizes(4) == [4, 4, 4, 8] and tr.batch_size_at(200) == 16
    assert cfg.optimizer.lr_schedule_unit == "samples"
    _, cfg = _parse("--step-batch-size-schedule", "0:4 192:8", "--global-batch-size", "32",
                    "--train-samples", "44")
    assert cfg.training.global_batch_size == 8 and cfg.training.train_iters == 7
    assert ("note: --global-batch-size 32 is replaced by the last batch of "
            "--step-batch-size-schedule, 8") in capsys.readouterr().err


def test_gpt3_script_counts_iterations():
    """Megatron-LM's GPT-3 175B script gives --rampup-batch-size with --train-iters and
    --lr-decay-iters (which Megatron-LM's own argument checks refuse): here that many
    iterations, each of its ramp size, with the LR schedule in iterations."""
    _, cfg = _parse("--global-batch-size", "16", "--rampup-batch-size", "4", "4", "36",
                    "--train-iters", "50", "--lr-decay-iters", "40",
                    "--lr-warmup-fraction", ".1", "--lr-decay-style", "cosine")
    tr, oc = cfg.training, cfg.optimizer
    assert tr.train_iters == 50 and tr.samples_after(50, 0) == 12 + 16 + 12 + 44 * 16
    assert oc.lr_schedule_unit == "iterations"
    assert (oc.lr_decay_iters, oc.lr_warmup_iters) == (40, 4)


@pytest.mark.parametrize("extra, world, message", [
    (["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "36",
      "--train-iters", "10", "--lr-decay-samples", "100"], 1,
     "--lr-decay-samples counts samples, and --train-iters with --rampup-batch-size counts "
     "the LR schedule in iterations; give --lr-decay-iters"),
    (["--rampup-batch-size", "4", "4", "36", "--train-samples", "100"], 1,
     "--rampup-batch-size needs --global-batch-size"),
    (["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "36",
      "--step-batch-size-schedule", "0:16", "--train-samples", "100"], 1, "mutually exclusive"),
    (["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "36",
      "--train-samples", "100", "--lr-decay-iters", "5"], 1,
     "--lr-decay-iters counts iterations, whose size changes under --rampup-batch-size, and "
     "--train-samples counts samples; give --lr-decay-samples"),
    (["--global-batch-size", "16", "--rampup-batch-size", "2", "2", "36",
      "--train-samples", "100", "--pipeline-model-parallel-size", "2",
      "--pipeline-schedule", "2bw"], 2, "fewer than the 2 PipeDream-2BW needs"),
    (["--global-batch-size", "16", "--rampup-batch-size", "2", "2", "36",
      "--train-samples", "100", "--tensor-model-parallel-size", "1"], 2, "= 4"),
    (["--step-batch-size-schedule", "0:64 100:8", "--train-samples", "10"], 1,
     "--train-samples (10) must be >= the first batch of --step-batch-size-schedule"),
])
def test_flag_errors_are_one_line(capsys, extra, world, message):
    assert message in _error(capsys, *extra, world_size=world)


def test_finetuning_refuses_a_batch_schedule(capsys):
    from tasks.finetune_utils import FinetuneTask, _setup

    task = FinetuneTask(name="MNLI", read=None, build=None, model_provider=None,
                        head_prefixes=())  # refused before anything of the task is used
    with pytest.raises(SystemExit) as exc:
        _setup(task, BASE + ["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "36",
                             "--epochs", "1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --rampup-batch-size is for pretraining: finetuning trains whole epochs of "
        "--global-batch-size batches")


def test_check_skips_the_sizes_a_resumed_run_has_passed(capsys):
    """Resuming on more ranks (Megatron-LM allows it): the GPT-3 ramp's batch of 16 does not
    split over 32 data-parallel ranks, but a checkpoint past the ramp never trains it.  The
    arguments check only the last size when there is a --load; the rest is checked once
    the checkpoint says where the run stands."""
    from types import SimpleNamespace

    from megatron.errors import UserError
    from megatron.checkpointing import TrainState
    from megatron.training_setup import check_batch_schedule

    sched = BatchSchedule.from_rampup((16, 16, 5859375), 1536)
    sched.check(1, 32, consumed_samples=6_000_000)
    with pytest.raises(BatchScheduleError, match="batch of 16 .* = 32"):
        sched.check(1, 32, consumed_samples=0)
    ramp = ["--micro-batch-size", "1", "--global-batch-size", "1536",
            "--rampup-batch-size", "16", "16", "5859375", "--train-samples", "10000000"]
    from megatron.arguments import parse_and_validate

    i = BASE.index("--micro-batch-size")
    argv = BASE[:i] + BASE[i + 2:] + ramp
    with pytest.raises(SystemExit):
        parse_and_validate(argv, world_size=32)  # a fresh run trains the batch of 16
    assert "the batch of 16 (from sample 0) is not a multiple" in capsys.readouterr().err
    _, cfg = parse_and_validate(argv + ["--load", "/nonexistent/ckpt"], world_size=32)
    groups = SimpleNamespace(pp_size=1, dp_size=32)
    check_batch_schedule(cfg, groups, TrainState(iteration=4000,
                                                 consumed_train_samples=6_000_000))
    with pytest.raises(UserError, match="resumes at sample 1,000 of --load /nonexistent"):
        check_batch_schedule(cfg, groups, TrainState(iteration=60, consumed_train_samples=1000))


def test_lr_state_converts_units_through_the_batch_sizes():
    """A checkpoint whose LR schedule counts iterations, resumed by a --train-samples run:
    20 iterations of the ramp are the samples those batches hold, not 20 x the average
    batch so far."""
    from megatron.optimizer.lr_scheduler import OptimizerParamScheduler

    sched = BatchSchedule.from_rampup((4, 4, 36), 16)
    saved = OptimizerParamScheduler(1e-3, 0.0, 2, 20, "linear").state_dict()
    saved["num_steps"] = 4
    ours = OptimizerParamScheduler(1e-3, 0.0, sched.samples_after(2), sched.samples_after(20),
                                   "linear", unit="samples")
    ours.load_state_dict(saved, convert=lambda n, unit: sched.samples_after(n)
                         if unit == "samples" else sched.iterations(n))
    assert ours.num_steps == sched.samples_after(4) == 20
    assert ours.decay_steps == 4 * 3 + 8 * 2 + 12 + 14 * 16

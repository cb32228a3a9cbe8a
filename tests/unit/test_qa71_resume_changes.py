"""Resuming a run with changed flags (QA pass 71), one process, the tiny float64 GPT.

* --2bw-mitigation predict keeps the prediction P(W) in its newest weight buffer.  Its
  checkpoints held that buffer as the model's weights, so a run that loaded them under
  other flags (another mitigation or schedule, --no-load-optim, --finetune, evaluation
  only) and every export started from P(W), about one optimizer step away from the
  trained weights.  The checkpoint now holds the true weights, and the prediction
  beside them for a resume under predict, which stays bit-identical.
* What a resume under other flags took from the checkpoint was not in the log: which LR
  schedule values --override/--use-checkpoint-opt_param-scheduler kept, what
  --no-load-optim/--no-load-rng left out, where another --2bw-mitigation starts, that
  the checkpoint's Adam betas and eps replace this run's, and that another --seed
  changes the order of the training samples.  The LR schedule's error named internal
  fields only, and only the first that differed.
"""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from tests.distributed.gpt_harness import TINY

PREDICT = ["--pipeline-schedule", "2bw", "--2bw-mitigation", "predict"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pretrain(*extra: str, iters: int = 3):
    import pretrain_gpt
    from megatron.training import pretrain

    argv = list(TINY)
    argv[argv.index("--train-iters") + 1] = str(iters)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=argv + list(extra))
    return result, out.getvalue()


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """A predict run's checkpoint of iteration 3 and the loss its own end-of-run
    evaluation gives (evaluation takes the true weights out of the prediction)."""
    torch.set_num_threads(1)
    ck = str(tmp_path_factory.mktemp("predict") / "ck")
    trained, _ = _pretrain(*PREDICT, "--save", ck)
    return ck, trained.eval_losses[3]["lm loss"]


# Each way of starting from the checkpoint's weights under other flags; with --lr 0 no
# step moves them, so the end-of-run evaluation (on the same validation batches: the
# checkpoint's run had not evaluated before its end) sees the weights that were loaded.
STARTS = {"evaluation only": ["--skip-train"],
          "evaluation only under 2bw": ["--pipeline-schedule", "2bw", "--skip-train"],
          "evaluation only under predict": PREDICT + ["--skip-train"],
          "resumed under flush": ["--lr", "0", "--override-opt_param-scheduler"],
          "resumed under 2bw without predict": ["--pipeline-schedule", "2bw", "--lr", "0",
                                                "--override-opt_param-scheduler"],
          "predict with --no-load-optim": PREDICT + ["--no-load-optim", "--lr", "0",
                                                     "--override-opt_param-scheduler"],
          "finetuning": ["--finetune", "--lr", "0"]}


@pytest.mark.parametrize("start", sorted(STARTS))
def test_a_predict_checkpoint_gives_the_trained_weights(predicted, start):
    ck, want = predicted
    iters = 1 if start == "finetuning" else 4
    got, log = _pretrain(*STARTS[start], "--load", ck, iters=iters)
    (loss,) = got.eval_losses.values()
    # (under predict, evaluation inverts the prediction: equal to rounding)
    assert loss["lm loss"] == pytest.approx(want, rel=1e-13, abs=0), start
    assert "warning" not in log


def test_the_checkpoint_holds_both_and_predict_resumes_bit_identically(tmp_path, predicted):
    from megatron.checkpoint_files import iteration_dir, load_payload

    payload = load_payload(os.path.join(iteration_dir(predicted[0], 3), "mp_rank_00",
                                        "model_optim_rng"))
    assert payload["model_is_true_weights"] is True
    gap = max((payload["model"][k] - payload["model_predicted"][k]).abs().max().item()
              for k in payload["model"])
    assert 1e-5 < gap < 1e-2  # about one optimizer step of lr 1e-3 apart
    ck = str(tmp_path / "ck")
    whole, _ = _pretrain(*PREDICT, iters=5)
    _pretrain(*PREDICT, "--save", ck, "--exit-interval", "3", iters=5)
    resumed, log = _pretrain(*PREDICT, "--load", ck, iters=5)
    assert sorted(resumed.losses) == [4, 5] and "warning" not in log
    for it in (4, 5):
        assert resumed.losses[it] == whole.losses[it]
    # a converted checkpoint carries no predicted copy: the resume predicts again from
    # the true weights (equal to rounding: W -> P(W) is not the saving run's round trip)
    from tools.checkpoint_util import convert
    convert(ck, str(tmp_path / "converted"), tp=1, pp=1, dp=1)
    again, _ = _pretrain(*PREDICT, "--load", str(tmp_path / "converted"), iters=5)
    for it in (4, 5):
        assert again.losses[it] == pytest.approx(whole.losses[it], rel=1e-13, abs=0)


# -- the log says what a resume took from the checkpoint ---------------------------------------
@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory):
    torch.set_num_threads(1)
    ck = str(tmp_path_factory.mktemp("two") / "ck")
    _pretrain("--save", ck, iters=2)
    return ck


def test_another_lr_names_the_flag_and_the_log_says_which_value_is_kept(two_iterations):
    from megatron.errors import CheckpointError

    ck = two_iterations
    with pytest.raises(CheckpointError, match=r"lr scheduler \(--lr\): checkpoint has "
                                              r"max_lr=0\.001 but this run has max_lr=0\.005"):
        _pretrain("--load", ck, "--lr", "5e-3", iters=4)
    # every field that differs, each with its flag
    with pytest.raises(CheckpointError, match=r"lr scheduler \(--lr-decay-iters, by default "
                                              r"--train-iters\): checkpoint has decay_steps=2 "
                                              r"but this run has decay_steps=4 \(iterations\), "
                                              r"and \(--lr-decay-style\): checkpoint has "
                                              r"decay_style='constant' but this run has "
                                              r"decay_style='linear'; pass --override"):
        _pretrain("--load", ck, "--lr-decay-style", "linear", iters=4)
    from megatron.optimizer.lr_scheduler import OptimizerParamScheduler
    with pytest.raises(ValueError, match=r"lr scheduler \(--lr-decay-iters, by default "
                                         r"--train-iters\): checkpoint has decay_steps=4 but "
                                         r"this run has decay_steps=8 \(iterations\); pass"):
        OptimizerParamScheduler(1.0, 0.0, 0, 8, "linear").load_state_dict(
            OptimizerParamScheduler(1.0, 0.0, 0, 4, "linear").state_dict())
    kept, log = _pretrain("--load", ck, "--lr", "5e-3", "--override-opt_param-scheduler",
                          iters=4)
    assert [r.lr for r in kept.reports] == [5e-3, 5e-3]
    assert ("note: --override-opt_param-scheduler: the LR and weight-decay schedule keeps "
            "this run's values where the two differ: max_lr 0.005 (--lr; the checkpoint has "
            "0.001)") in log
    taken, log = _pretrain("--load", ck, "--lr", "5e-3", "--use-checkpoint-opt_param-scheduler",
                           iters=4)
    assert [r.lr for r in taken.reports] == [1e-3, 1e-3]
    assert "keeps the checkpoint's values where the two differ: max_lr 0.001 (--lr; this run " \
           "has 0.005)" in log
    _, log = _pretrain("--load", ck, "--override-opt_param-scheduler", iters=4)
    assert "note: --override" not in log  # nothing differs: nothing to say


def test_the_resume_line_says_what_was_taken_and_what_was_not(two_iterations):
    _, log = _pretrain("--load", two_iterations, iters=3)
    assert (f"resumed from {two_iterations} at iteration 2: took its weights, data position "
            f"(16 samples), optimizer state, LR schedule, RNG state\n") in log
    _, log = _pretrain("--load", two_iterations, "--no-load-optim", "--no-load-rng", iters=3)
    assert ("took its weights, data position (16 samples), LR schedule; not loaded: "
            "optimizer state (--no-load-optim), RNG state (--no-load-rng)\n") in log


def test_another_mitigation_says_where_it_starts(tmp_path):
    """--2bw-mitigation warmup counts its Flush batches from iteration 0, also when it is
    first given on resume: a 2BW checkpoint of iteration 2 resumed with a warm-up of 4
    runs batches 3 and 4 under Flush (on W(2) and W(3)), then 2BW."""
    ck = str(tmp_path / "ck")
    _pretrain("--pipeline-schedule", "2bw", "--save", ck, iters=2)
    warm = ["--pipeline-schedule", "2bw", "--2bw-mitigation", "warmup",
            "--2bw-flush-warmup-iters", "4"]
    resumed, log = _pretrain(*warm, "--load", ck, iters=6)
    assert [r.weight_version for r in resumed.reports] == [2, 3, 4, 4]
    assert ("note: the checkpoint was trained with --2bw-mitigation none, this run uses "
            "warmup: iterations 2 to 3 run under Flush, since the warm-up counts from "
            "iteration 0 (--2bw-flush-warmup-iters 4), then 2BW") in log
    _, log = _pretrain("--pipeline-schedule", "2bw", "--2bw-mitigation", "predict", "--load",
                       ck, iters=3)
    assert "this run uses predict: the batch after the resume runs on the checkpoint's" in log


def test_an_older_predict_checkpoint_is_named_where_its_prediction_is_loaded_as_weights(
        tmp_path, predicted):
    """A predict checkpoint saved before the fix holds P(W) as ``model`` and nothing
    beside it: a predict resume takes it as before (silently); any other start warns."""
    import shutil

    from megatron.checkpoint_files import iteration_dir, load_payload, write_manifest
    from megatron.checkpoint_payload import save_payload

    ck = str(tmp_path / "old")
    shutil.copytree(predicted[0], ck)
    base = iteration_dir(ck, 3)
    stem = os.path.join(base, "mp_rank_00", "model_optim_rng")
    payload = load_payload(stem)
    payload["model"] = payload.pop("model_predicted")
    del payload["model_is_true_weights"]
    save_payload(payload, stem)
    write_manifest(base, 3, {"tensor": 1, "pipeline": 1, "data": 1})
    _, log = _pretrain(*PREDICT, "--load", ck, iters=4)
    assert "warning" not in log
    got, log = _pretrain("--load", ck, "--skip-train")
    assert ("saved by a --2bw-mitigation predict run before 2026-12-08: its weights are the "
            "predicted ones") in log
    assert got.eval_losses[3]["lm loss"] != pytest.approx(predicted[1], rel=1e-9)


def test_other_adam_flags_on_resume_are_named_as_the_checkpoints_are_kept(two_iterations):
    """torch's load_state_dict takes the saved groups' betas and eps (Megatron-LM's resume
    does the same): the run continues as the checkpoint's run would, and says so."""
    same, _ = _pretrain("--load", two_iterations, iters=4)
    other, log = _pretrain("--load", two_iterations, "--adam-beta2", "0.9", "--adam-eps",
                           "1e-5", iters=4)
    assert sorted(other.losses) == [3, 4] and other.losses == same.losses
    assert (f"note: the optimizer state of --load {two_iterations} keeps its own --adam-beta2 "
            f"0.999 (this run gives 0.9), --adam-eps 1e-08 (this run gives 1e-05), as "
            f"Megatron-LM does; --no-load-optim starts the optimizer afresh with this run's"
            ) in log
    _, log = _pretrain("--load", two_iterations, "--adam-beta2", "0.9", "--no-load-optim",
                       iters=3)
    assert "keeps its own" not in log


def test_another_seed_warns_that_the_data_order_changes(two_iterations):
    """The RNG streams come from the checkpoint, but the samples' order follows --seed:
    another seed reads other samples from the same position, silently until now."""
    same, _ = _pretrain("--load", two_iterations, iters=3)
    other, log = _pretrain("--load", two_iterations, "--seed", "8", iters=3)
    assert other.losses[3] != same.losses[3]  # W(2) on another batch
    assert ("warning: the checkpoint was trained with --seed 7, this run uses 8: the order of "
            "the training samples follows --seed, so its data position (16 consumed samples) "
            "does not continue where the checkpoint's run stopped") in log

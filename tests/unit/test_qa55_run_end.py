"""How a run ends, and what it leaves behind (one process).

* The end-of-run save comes before the end-of-run evaluation, as in Megatron-LM's
  ``pretrain`` (save, then 'on validation set' / 'on test set').  Old code evaluated
  first, so the checkpoint's ``consumed_valid_samples`` counted that evaluation when the
  last iteration was not a --save-interval multiple, and a run resumed from it (a longer
  --train-iters) evaluated other validation batches than an uninterrupted run; it also
  lost the whole end-of-run checkpoint when the job was stopped during that evaluation.
* With --exit-signal-handler a SIGTERM is noted until the run returns, end-of-run
  evaluation and save included (Megatron-LM's handler covers the whole run).  Old code
  restored the default action after the training loop: a SIGTERM during the final
  evaluation killed the process (143) before it saved anything.
* A training data iterator that runs out mid-run stops with one ``error:`` line
  (DataError, exit 2) and keeps the last checkpoint; old code printed a traceback.
* A validation (or test) split too small for one micro-batch is an error before
  training; old code spun forever at the first evaluation (a silent hang).
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron.errors import DataError

REPO = Path(__file__).resolve().parents[2]

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-decay-style", "constant", "--seed", "7", "--log-interval", "1000",
        "--num-workers", "0"]


def _pretrain(argv, datasets_provider=None):
    import pretrain_gpt
    from megatron.training import pretrain

    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = pretrain(datasets_provider or pretrain_gpt.datasets_provider,
                          pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                          argv=list(argv))
    return result, out.getvalue()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MEGATRON_DEBUG", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_a_finished_run_resumed_evaluates_what_an_uninterrupted_run_evaluates(tmp_path):
    ckpt = str(tmp_path / "ck")
    ev = ["--eval-interval", "2", "--eval-iters", "1"]
    full, _ = _pretrain(TINY + ev + ["--train-iters", "8"])
    # ends at 4, not a --save-interval multiple: the end-of-run save writes iteration 4
    first, log = _pretrain(TINY + ev + ["--train-iters", "4", "--save", ckpt,
                                        "--save-interval", "3"])
    assert log.index("saved checkpoint of iteration 4") < log.index(
        "validation loss at iteration 4 on validation set"), log[-2000:]
    second, _ = _pretrain(TINY + ev + ["--train-iters", "8", "--save", ckpt, "--load", ckpt])
    for t in (6, 8):
        assert second.eval_losses[t] == full.eval_losses[t], (t, second.eval_losses,
                                                              full.eval_losses)


_SIGTERM_IN_FINAL_EVAL = """
import os, signal, sys
import pretrain_gpt
from megatron.training import pretrain, run_entry_point

def forward_step(data_iterator, model):
    if not model.training and not forward_step.sent:  # the end-of-run evaluation
        forward_step.sent = True
        print("final evaluation starts", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    return pretrain_gpt.forward_step(data_iterator, model)
forward_step.sent = False

run_entry_point(lambda: pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                 forward_step) and None)
"""


def test_sigterm_during_the_final_evaluation_keeps_the_end_of_run_checkpoint(tmp_path):
    ckpt = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", _SIGTERM_IN_FINAL_EVAL, *TINY,
                          "--train-iters", "3", "--eval-interval", "1000", "--eval-iters", "1",
                          "--exit-signal-handler", "--save", str(ckpt)],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert "final evaluation starts" in out.stdout, out.stderr[-3000:]
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert "on test set" in out.stdout  # the run finished its end as planned


_SHORT_TRAIN_DATA = """
import pretrain_gpt
from megatron.training import pretrain, run_entry_point

def datasets_provider(cfg, tokenizer, num_samples):
    # a provider that ignores how many samples training needs: 5 batches of 8
    return pretrain_gpt.datasets_provider(cfg, tokenizer, (40,) + tuple(num_samples[1:]))

run_entry_point(lambda: pretrain(datasets_provider, pretrain_gpt.model_provider,
                                 pretrain_gpt.forward_step) and None)
"""


def test_training_data_running_out_is_one_error_line_and_keeps_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ck"
    out = subprocess.run([sys.executable, "-c", _SHORT_TRAIN_DATA, *TINY, "--train-iters", "8",
                          "--eval-iters", "0", "--save", str(ckpt), "--save-interval", "2"],
                         capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and out.stderr.strip() == errors[0], out.stderr[-3000:]
    # 40 samples: batches 1-5 train, the sixth finds no data
    assert errors[0].startswith("error: the training data ran out at iteration 6 of 8: the "
                                "training dataset holds 40 samples"), errors[0]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004",
                                        "latest_checkpointed_iteration.txt"]


def _tiny_validation(cfg, tokenizer, num_samples):
    import pretrain_gpt

    # one validation sample: no micro-batch of 2 can be cut from it
    return pretrain_gpt.datasets_provider(cfg, tokenizer, (num_samples[0], 1, 1))


def test_validation_split_smaller_than_a_micro_batch_is_an_error_not_a_hang():
    # (old code: an endless loop at the first evaluation; guarded by an alarm here)
    def hung(signum, frame):
        raise TimeoutError("the run hung at its first evaluation")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    start = time.time()
    try:
        with pytest.raises(DataError, match=r"the validation split holds 1 sample, fewer than "
                                            r"one micro-batch"):
            _pretrain(TINY + ["--train-iters", "2", "--eval-interval", "1",
                              "--eval-iters", "1"], _tiny_validation)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.time() - start < 30

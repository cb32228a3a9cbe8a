"""What a resumed run takes from its checkpoint besides the weights (one process): the
validation position, so it evaluates the batches an uninterrupted run would, and the
optimizer state, whose absence is an error rather than a silent restart."""
from __future__ import annotations

import contextlib
import io

import pytest

from tests.distributed.gpt_harness import TINY

VALID = ["--train-iters", "8", "--eval-interval", "4", "--eval-iters", "2"]


def _pretrain(*extra: str):
    import pretrain_gpt
    from megatron.training import pretrain
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                        pretrain_gpt.forward_step, argv=TINY + list(extra))


def test_a_resumed_run_evaluates_the_batches_an_uninterrupted_one_would(tmp_path):
    ck = str(tmp_path / "ck")
    whole = _pretrain(*VALID)
    first = _pretrain(*VALID, "--save", ck, "--save-interval", "4", "--exit-interval", "4")
    second = _pretrain(*VALID, "--save", ck, "--load", ck)
    assert first.exited_early and sorted(first.eval_losses) == [4]
    assert first.eval_losses[4] == whole.eval_losses[4]
    # iteration 8: the end-of-training evaluation, which reads on after the one at 8;
    # restarting validation at its first batch after the resume gave other values
    assert sorted(second.eval_losses) == [8]
    assert second.eval_losses[8] == whole.eval_losses[8]
    assert whole.losses == {**first.losses, **second.losses}


def test_a_checkpoint_without_optimizer_state_needs_no_load_optim(tmp_path):
    from megatron.errors import CheckpointError
    ck = str(tmp_path / "ck")
    _pretrain("--save", ck, "--no-save-optim", "--exit-interval", "2")
    with pytest.raises(CheckpointError, match=r"holds no optimizer state .*--no-load-optim"):
        _pretrain("--load", ck)
    resumed = _pretrain("--load", ck, "--no-load-optim")
    assert sorted(resumed.losses) == [3, 4]

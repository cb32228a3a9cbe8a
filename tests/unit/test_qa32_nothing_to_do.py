"""Command lines that used to end badly without saying why (one process): an
evaluation-only run (--skip-train) with nothing to evaluate exited 0 having done nothing,
and a --seed outside numpy's range failed with a traceback while building the datasets
(now one error each); --sequence-parallel at t = 1 was dropped without a word (now a
note, as Megatron-LM warns)."""
from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from megatron.errors import DataError, UserError
from tests.distributed.gpt_harness import TINY


def _pretrain(argv):
    import pretrain_gpt
    from megatron.training import pretrain
    with contextlib.redirect_stdout(io.StringIO()):
        return pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                        pretrain_gpt.forward_step, argv=argv)


def _corpus(prefix: str) -> str:
    from megatron.data.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for d in range(40):
        b.add_item(np.arange(d % 7, d % 7 + 20) % 96)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


def test_skip_train_with_eval_iters_0_is_an_error():
    with pytest.raises(UserError, match=r"^nothing to do: --skip-train only evaluates, and "
                                        r"--eval-iters 0 evaluates nothing"):
        _pretrain(TINY + ["--skip-train", "--eval-iters", "0"])


def test_skip_train_with_an_empty_validation_split_is_an_error(tmp_path):
    data = [a for a in TINY if a != "--mock-data"] + ["--data-path", _corpus(str(tmp_path / "c"))]
    with pytest.raises(DataError, match=r"^nothing to evaluate: --skip-train only evaluates, "
                                        r"and the validation split is empty \(--split '100,0,0'"):
        _pretrain(data + ["--skip-train", "--split", "100,0,0"])
    # with a validation share it evaluates, as before
    assert _pretrain(data + ["--skip-train", "--split", "50,50,0"]).eval_losses[0]["lm loss"] > 0


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])
def test_seed_outside_numpys_range_is_one_error_line(seed, capsys):
    from megatron.arguments import parse_and_validate

    with pytest.raises(SystemExit) as info:
        parse_and_validate(TINY + ["--seed", seed], world_size=1)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2
    assert err == f"error: --seed must be between 0 and 2^32 - 1 = 4294967295, got {seed}"


def test_sequence_parallel_at_t_1_is_dropped_with_a_note(capsys):
    from megatron.arguments import parse_and_validate

    _, cfg = parse_and_validate(TINY + ["--sequence-parallel"], world_size=1)
    assert not cfg.model.sequence_parallel
    assert ("note: --sequence-parallel changes nothing with --tensor-model-parallel-size 1"
            in capsys.readouterr().err)
    parse_and_validate(TINY, world_size=1)
    assert "--sequence-parallel" not in capsys.readouterr().err


def test_an_evaluation_only_run_does_not_say_end_of_training(capsys):
    """--skip-train evaluates the validation and test splits once, labelled without
    '(end of training)': nothing was trained (helper-38's note).  Both runs label the
    final evaluations as Megatron-LM does, 'iteration N on validation set' and
    'iteration N on test set' (helper-49)."""
    import pretrain_gpt
    from megatron.training import pretrain

    result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                      pretrain_gpt.forward_step, argv=TINY + ["--skip-train"])
    out = capsys.readouterr().out
    assert " validation loss at iteration 0 on validation set |" in out
    assert " validation loss at iteration 0 on test set |" in out
    assert "end of training" not in out
    assert list(result.eval_losses) == [0] and list(result.test_losses) == [0]
    pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
             pretrain_gpt.forward_step, argv=TINY + ["--train-iters", "1"])
    out = capsys.readouterr().out
    assert " validation loss at iteration 1 on validation set |" in out
    assert " validation loss at iteration 1 on test set |" in out

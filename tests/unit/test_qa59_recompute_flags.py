"""Recomputation flags against Megatron-LM's meaning (QA pass 59).

Here ``--recompute-activations`` is the paper's whole-stage recomputation (Megatron-LM:
selective), ``--recompute-granularity full`` without a method is the same stage-level
scheme (Megatron-LM: an error), and ``--recompute-granularity full --recompute-method
uniform|block --recompute-num-layers N`` is Megatron-LM's layer checkpointing.  Stage-
and layer-level are alternatives (docs/pipeline.md).  Every inconsistent combination
must stop with one line before any rank waits; none may run something other than what
the command line and its notes say.

The last two tests are defects fixed after the pass: --recompute-activations with a
recompute method, and Megatron-LM's --recompute-modules.
"""
from __future__ import annotations

import pytest

from megatron.argument_checks.errors import ArgumentError
from megatron.arguments import build_config, parse_args, validate_args
from tests.unit.test_megatron_lm_flags import SMALL

FULL = ["--recompute-granularity", "full"]


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def _model(*extra: str, world: int = 1):
    args = validate_args(parse_args(SMALL + list(extra)), world)
    return args, build_config(args).model


@pytest.mark.parametrize("extra, message", [
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "needs --recompute-granularity full"),
    (FULL + ["--recompute-method", "block"], "needs --recompute-num-layers"),
    (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "0"],
     r"--recompute-num-layers \(0\) must be between 1"),
    (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "-1"],
     r"--recompute-num-layers \(-1\) must be between 1"),
    (FULL + ["--recompute-method", "block", "--recompute-num-layers", "3"],
     r"largest pipeline stage \(2\)"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"], "selective cannot be combined with --recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers needs --recompute-method"),
    (FULL + ["--recompute-num-layers", "1"], "--recompute-num-layers needs --recompute-method"),
    (["--recompute-activations", "--recompute-granularity", "selective"],
     "conflicts with --recompute-granularity selective"),
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     "--checkpoint-activations .* selective"),
])
def test_inconsistent_recompute_flags_stop_with_one_line(extra, message):
    with pytest.raises(ArgumentError, match=message):
        _model(*extra)


def test_the_layer_count_is_bounded_by_the_largest_stage():
    """4 layers split 1 + 3: N = 3 is valid (the 1-layer stage checkpoints its one layer,
    as Megatron-LM does with N above a stage's layers), N = 4 is not."""
    split = ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
             "--decoder-first-pipeline-num-layers", "1"]
    _, model = _model(*split, *FULL, "--recompute-method", "block",
                      "--recompute-num-layers", "3", world=2)
    assert (model.recompute_method, model.recompute_num_layers) == ("block", 3)
    with pytest.raises(ArgumentError, match=r"largest pipeline stage \(3\)"):
        _model(*split, *FULL, "--recompute-method", "block", "--recompute-num-layers", "4",
               world=2)


@pytest.mark.parametrize("extra, expected", [
    (["--recompute-activations"], ("full", None, None, True)),
    (FULL, ("full", None, None, True)),
    (["--recompute-granularity", "selective"], ("selective", None, None, False)),
    (["--checkpoint-activations"], ("full", "uniform", 1, False)),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2"], ("full", "uniform", 2, False)),
    (["--activations-checkpoint-method", "block"], ("full", "block", 1, False)),
    (["--checkpoint-num-layers", "2"], (None, None, None, False)),
])
def test_what_each_flag_runs(extra, expected):
    _, model = _model(*extra)
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers,
            model.stage_recompute) == expected


def test_distribute_saved_activations_is_a_note():
    args, _ = _model(*FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1",
                     "--distribute-saved-activations")
    assert any("--distribute-saved-activations" in n for n in args.megatron_lm_notes)


@pytest.mark.parametrize("extra", [
    ["--recompute-activations", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ["--recompute-activations", "--checkpoint-activations"],
])
def test_stage_level_and_layer_level_together_stop(extra):
    """``--recompute-activations`` (whole-stage recomputation, says its note) with a
    recompute method ran layer-level recomputation only, with the note still claiming
    the whole stage.  In Megatron-LM the pair is refused as well (--recompute-activations
    is selective there, which takes no method)."""
    with pytest.raises(ArgumentError, match="--recompute-activations"):
        _model(*extra)


def test_recompute_modules_core_attn_is_this_trainers_selective():
    """Megatron-LM's --recompute-modules (default core_attn) picks what
    --recompute-granularity selective recomputes.  core_attn is what selective
    recomputation does here; the flag was an unknown flag ("did you mean
    --recompute-method"), so a Megatron-LM script passing it could not start."""
    args, model = _model("--recompute-granularity", "selective", "--recompute-modules",
                         "core_attn")
    assert model.recompute_granularity == "selective"
    assert any("--recompute-modules" in n for n in args.megatron_lm_notes)
    with pytest.raises(ArgumentError, match="--recompute-modules"):
        _model("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp")

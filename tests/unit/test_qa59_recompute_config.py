"""Recomputation settings a model accepts (QA pass 59), against Megatron-LM's meaning.

Megatron-LM checkpoints layers (``--recompute-method uniform|block``, N layers) only
under ``--recompute-granularity full``; with no granularity it recomputes nothing and
selective recomputation takes no layer count.  The command line here refuses those
combinations (megatron/argument_checks/), but a ``ModelConfig`` built directly (tests,
tools, a notebook) reached the model unchecked: a method without granularity 'full'
checkpointed every chunk anyway, and a layer count without a method (stage-level or
selective recomputation) was dropped without a word.  The model now refuses both.
"""
from __future__ import annotations

import pytest

from megatron.model import GPTModel
from megatron.tensor_parallel import TPInfo
from tests.unit.test_model_gpt import make_config


@pytest.mark.parametrize("granularity", [None, "selective"])
def test_a_method_needs_granularity_full(granularity):
    with pytest.raises(ValueError, match="needs --recompute-granularity full"):
        GPTModel(make_config(recompute_granularity=granularity, recompute_method="uniform",
                             recompute_num_layers=1), TPInfo.single())


@pytest.mark.parametrize("granularity", [None, "full", "selective"])
def test_a_layer_count_needs_a_method(granularity):
    with pytest.raises(ValueError, match="--recompute-num-layers needs"):
        GPTModel(make_config(recompute_granularity=granularity, recompute_num_layers=2),
                 TPInfo.single())


def test_an_unknown_granularity_is_refused():
    with pytest.raises(ValueError, match="'full' or 'selective'"):
        GPTModel(make_config(recompute_granularity="layer"), TPInfo.single())


@pytest.mark.parametrize("recompute", [
    {}, dict(recompute_granularity="selective"), dict(recompute_granularity="full"),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9)])
def test_megatron_lm_combinations_still_build(recompute):
    """N above the stage's layers is Megatron-LM's behaviour (one chunk / every layer);
    the command line bounds it by the largest stage."""
    GPTModel(make_config(**recompute), TPInfo.single())

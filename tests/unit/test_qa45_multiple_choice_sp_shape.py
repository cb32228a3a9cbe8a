"""A non-first pipeline stage of the RACE model (``MultipleChoice``) receives this
tensor rank's [s/t, b * C, h] under --sequence-parallel, as every other stage does: the
executor sizes its receive buffers from ``stage_input_shape``, and a full-length
shape made the receive of the previous stage's [s/t, ...] activations disagree."""
from __future__ import annotations

import pytest

from megatron.config import ModelConfig
from megatron.model import BertModel
from megatron.model.classification import Classification
from megatron.model.multiple_choice import MultipleChoice
from megatron.tensor_parallel import TPInfo


def _config(sp: bool) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                       padded_vocab_size=32, sequence_parallel=sp, num_tokentypes=2)


@pytest.mark.parametrize("sp", [False, True])
def test_multiple_choice_stage_input_is_split_like_the_other_stages(sp):
    tp = TPInfo(group=object(), size=2, rank=1)  # built only: no collective runs
    cfg = _config(sp)
    kw = dict(pre_process=False, post_process=True, layer_numbers=range(1, 2))
    mc = MultipleChoice(cfg, tp, num_choices=4, **kw)
    seq = 4 if sp else 8
    assert mc.stage_input_shape(2) == (seq, 2 * 4, 16)
    # the same rule as BERT's own stages, with b * C sequences per microbatch
    assert mc.stage_input_shape(3) == BertModel(cfg, tp, **kw).stage_input_shape(3 * 4)
    assert Classification(cfg, tp, num_classes=3, **kw).stage_input_shape(2) == (seq, 2, 16)


def test_multiple_choice_without_tensor_parallelism_keeps_the_whole_sequence():
    mc = MultipleChoice(_config(True), TPInfo.single(), num_choices=2, pre_process=False,
                        post_process=True, layer_numbers=range(1, 2))
    assert mc.stage_input_shape(5) == (8, 10, 16)

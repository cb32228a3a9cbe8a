"""A --pretrained-checkpoint/--load of another model is found alike by every rank (each
reads the whole checkpoint and compares it with the same flags): one error line per
node, not one per rank; what one stage lacks differs between stages and prints on each."""
from __future__ import annotations

import pytest

from megatron.errors import CheckpointError
from megatron.model.gpt_model import GPTModel
from tests.unit.test_hf_interop import TP, _cfg, _save
from tools.checkpoint_util import load_into_stage


def test_checkpoint_of_another_model_is_one_line_per_node(tmp_path):
    root = _save(str(tmp_path / "ckpt"), GPTModel(_cfg(), TP, seed=5), _cfg())
    wider = GPTModel(_cfg(hidden_size=64), TP, seed=5)
    with pytest.raises(CheckpointError, match="another model shape") as info:
        load_into_stage(wider, root, layer_offset=0, tp_rank=0, tp_size=1,
                        flag="--pretrained-checkpoint")
    assert info.value.every_rank_alike
    with pytest.raises(CheckpointError, match="found nothing") as info:
        load_into_stage(wider, str(tmp_path / "none"), layer_offset=0, tp_rank=0, tp_size=1,
                        flag="--pretrained-checkpoint")
    assert info.value.every_rank_alike

"""QA pass 58: a model built directly for t tensor ranks refuses widths that do not
split, with one error naming the flag -- BERT as GPT does (building a model performs no
communication, so a stand-in process group serves)."""
from __future__ import annotations

import pytest

from megatron.config import ModelConfig
from megatron.model import BertModel, GPTModel
from megatron.tensor_parallel import TPInfo

_TP2 = TPInfo(group=object(), size=2, rank=0)   # never used: no collective at build time


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=8,
                padded_vocab_size=32, num_tokentypes=2)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("cls", [GPTModel, BertModel])
@pytest.mark.parametrize("kw, flag", [
    (dict(ffn_hidden_size=33), "--ffn-hidden-size"),
    (dict(num_attention_heads=3, hidden_size=18), "--num-attention-heads"),
    (dict(sequence_parallel=True, seq_length=7), "--seq-length 7"),
])
def test_indivisible_width_names_the_flag(cls, kw, flag):
    with pytest.raises(ValueError) as info:
        cls(_config(**kw), _TP2)
    assert flag in str(info.value), str(info.value)
    assert "\n" not in str(info.value)

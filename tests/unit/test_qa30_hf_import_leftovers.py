"""--from-hf refuses weights its config.json does not account for: a config of 1 layer
over a file of 2 layers used to import a 1-layer model silently (the README says a
config that disagrees with its weights is refused).  Buffers that are not parameters
(GPT-2's causal masks, Llama's rotary inv_freq, a tied model's lm_head copy) still
import."""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from megatron.errors import CheckpointError  # noqa: E402
from megatron.hf_import import hf_gpt2_to_ours, hf_llama_to_ours  # noqa: E402
from tests.unit.test_hf_llama import _edit_config, _hf_llama  # noqa: E402


def _add(path, tensors):
    st = os.path.join(path, "model.safetensors")
    weights = safetensors_torch.load_file(st)
    weights.update(tensors(weights))
    safetensors_torch.save_file(weights, st)


def test_gpt2_config_with_fewer_layers_than_its_weights_is_refused(tmp_path):
    torch.manual_seed(0)
    path = str(tmp_path / "gpt2")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=100, n_positions=16, n_embd=16, n_layer=2, n_head=2)).save_pretrained(path)
    # what older GPT-2 files also hold: causal-mask buffers and the tied lm_head's copy
    _add(path, lambda w: {**{f"transformer.h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 16, 16))
                             for i in range(2)},
                          **{f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4)
                             for i in range(2)},
                          "lm_head.weight": w["transformer.wte.weight"].clone()})
    assert hf_gpt2_to_ours(path, 8, 1)[1]["num_layers"] == 2  # as saved: imports
    _edit_config(path, n_layer=1)
    with pytest.raises(CheckpointError) as info:
        hf_gpt2_to_ours(path, 8, 1)
    msg = str(info.value)
    assert "(n_layer 1," in msg and "h.1.attn.c_attn.bias" in msg and "\n" not in msg
    assert "12 weight(s)" in msg and "different models" in msg  # no buffer among them


def test_llama_config_with_fewer_layers_than_its_weights_is_refused(tmp_path):
    _, path = _hf_llama(tmp_path, tie_word_embeddings=True)
    _add(path, lambda w: {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4)
                          for i in range(2)})
    assert hf_llama_to_ours(path, 8, 1)[1]["num_layers"] == 2
    _edit_config(path, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r": 9 weight\(s\) that .*\(num_hidden_layers 1, "
                                              r".*layers\.1\.input_layernorm\.weight"):
        hf_llama_to_ours(path, 8, 1)

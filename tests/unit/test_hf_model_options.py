"""The new block options through transformers (megatron/hf_interop.py): --squared-relu is
GPT-2's activation_function "relu2" both ways; --rotary-interleaved exports to Llama by
reordering each q/k head's dimensions; --rotary-seq-len-interpolation-factor is
rope_type "linear" both ways; xavier init changes nothing exported; the post-norm
residual, a BERT with --squared-relu and llama3 scaling with linear interpolation are
refused with one line.  Each mapping is checked by transformers computing our logits.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.model.bert_model import BertModel  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from tests.unit.test_hf_llama import (QWEN3, TP, VOCAB, _cfg, _edit_config, _hf_llama,  # noqa: E402
                                      _ids, _load_hf, _model, _one_line, _ours_from, _record,
                                      _save)
from tools.checkpoint_util import main  # noqa: E402

GPT2 = dict(normalization="LayerNorm", position_embedding_type="learned_absolute",
            swiglu=False)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _export(tmp_path, cfg, model=None):
    model = model or _model(cfg)
    out = str(tmp_path / "hf")
    main(["--load", _save(str(tmp_path / "ckpt"), model, cfg), "--to-hf", out])
    return model, out, json.load(open(os.path.join(out, "config.json")))


def test_squared_relu_gpt_exports_as_relu2_and_imports_back(tmp_path, capsys):
    cfg = _cfg(squared_relu=True, init_method_xavier_uniform=True, **GPT2)
    model, out, hf_cfg = _export(tmp_path, cfg)
    assert hf_cfg["activation_function"] == "relu2"  # transformers' "relu" would not square
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert (model(_ids(), None, None)[..., :VOCAB] - hf(_ids()).logits).abs().max() < 1e-4
    capsys.readouterr()
    back = str(tmp_path / "back")
    main(["--from-hf", out, "--save", back, "--make-vocab-size-divisible-by", "64"])
    assert "--squared-relu" in capsys.readouterr().err
    ours = _ours_from(back)
    assert ours.config.squared_relu
    with torch.no_grad():
        assert (ours(_ids(), None, None)[..., :VOCAB] - hf(_ids()).logits).abs().max() < 1e-4


@pytest.mark.parametrize("kw,cls", [
    (dict(rotary_interleaved=True, num_query_groups=2, add_bias_linear=True),
     transformers.LlamaForCausalLM),
    (dict(rotary_interleaved=True, num_query_groups=2, **QWEN3), transformers.Qwen3ForCausalLM),
    (dict(rotary_seq_len_interpolation_factor=4.0, add_bias_linear=False),
     transformers.LlamaForCausalLM),
    (dict(rotary_interleaved=True, rotary_seq_len_interpolation_factor=2.5,
          add_bias_linear=False, add_qkv_bias=True), transformers.Qwen2ForCausalLM),
], ids=["llama-interleaved-bias", "qwen3-interleaved", "llama-linear", "qwen2-both"])
def test_rope_options_export_with_our_logits(tmp_path, kw, cls):
    cfg = _cfg(rotary_base=100, untie_embeddings_and_output_weights=True, **kw)
    model, out, hf_cfg = _export(tmp_path, cfg)
    factor = cfg.rotary_seq_len_interpolation_factor
    if factor is None:
        assert hf_cfg["rope_parameters"]["rope_type"] == "default"
    else:
        assert hf_cfg["rope_scaling"] == {"rope_type": "linear", "factor": factor}
        assert hf_cfg["rope_parameters"] == {"rope_type": "linear", "factor": factor,
                                             "rope_theta": 100.0}
    hf = _load_hf(out, cls)
    with torch.no_grad():
        logits = model(_ids(), None, None)[..., :VOCAB]
        assert (logits - hf(_ids()).logits).abs().max().item() < 1e-4
        # the option matters: the model without it computes something else
        plain = GPTModel(dataclasses.replace(cfg, rotary_interleaved=False,
                                             rotary_seq_len_interpolation_factor=None),
                         TP, seed=1).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(_ids(), None, None)[..., :VOCAB] - logits).abs().max().item() > 1e-3


def test_linear_rope_scaling_imports_as_interpolation(tmp_path, capsys):
    hf, path = _hf_llama(tmp_path, rope_theta=100.0,
                         rope_parameters={"rope_type": "linear", "factor": 4.0,
                                          "rope_theta": 100.0})
    _edit_config(path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    out = str(tmp_path / "ours")
    capsys.readouterr()
    main(["--from-hf", path, "--save", out, "--make-vocab-size-divisible-by", "64"])
    assert "--rotary-seq-len-interpolation-factor 4" in capsys.readouterr().err
    ours = _ours_from(out)
    assert ours.config.rotary_seq_len_interpolation_factor == 4.0
    ids = _ids(vocab=100)
    with torch.no_grad():
        assert (ours(ids, None, None)[..., :100] - hf(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("kw,expected", [
    (dict(apply_residual_connection_post_layernorm=True, **GPT2),
     "takes its residuals after the LayerNorm (--apply-residual-connection-post-layernorm)"),
    (dict(apply_residual_connection_post_layernorm=True, add_bias_linear=False),
     "takes its residuals after the LayerNorm (--apply-residual-connection-post-layernorm)"),
    (dict(rope_scaling=True, rotary_seq_len_interpolation_factor=2.0, add_bias_linear=False),
     "combines --use-rope-scaling with --rotary-seq-len-interpolation-factor 2; "
     "transformers' LlamaForCausalLM takes one rope_type"),
    (dict(squared_relu=True, swiglu=False),
     "GPT-2 has no equivalent of this GPT's --normalization RMSNorm --position-embedding-type "
     "rope, and transformers' LlamaForCausalLM would also need --swiglu"),
])
def test_export_refusals(tmp_path, capsys, kw, expected):
    cfg = _cfg(**kw)
    src = _save(str(tmp_path / "ckpt"), GPTModel(cfg, TP, seed=1), cfg)
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert expected in err, err
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("kw,expected", [
    (dict(squared_relu=True), "this BERT was built with --squared-relu"),
    (dict(apply_residual_connection_post_layernorm=True),
     "--apply-residual-connection-post-layernorm"),
])
def test_bert_export_refusals(tmp_path, capsys, kw, expected):
    cfg = _cfg(num_tokentypes=2, **GPT2, **kw)
    src = _save(str(tmp_path / "bert"), BertModel(cfg, TP, seed=1), cfg)
    err = _one_line(capsys, ["--load", src, "--to-hf", str(tmp_path / "hf")])
    assert expected in err, err


def test_every_new_field_is_read_or_ignored_by_the_export():
    """A ModelConfig field neither mapped nor ignored would make every export with it
    fail with the generic 'does not know' error: each new one is placed on purpose."""
    from megatron.hf_export_target import EXPORT_IGNORES, EXPORT_READS

    assert "init_method_xavier_uniform" in EXPORT_IGNORES
    for name in ("squared_relu", "rotary_interleaved", "rotary_seq_len_interpolation_factor",
                 "apply_residual_connection_post_layernorm"):
        assert name in EXPORT_READS, name
    record = _record(_cfg())
    assert set(record) <= EXPORT_READS | EXPORT_IGNORES, set(record) - (EXPORT_READS
                                                                           | EXPORT_IGNORES)

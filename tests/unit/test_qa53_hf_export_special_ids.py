"""QA pass 53 (Hugging Face interop): what the export writes besides the weights.

* config.json's bos/eos ids of a GPT trained with GPT2BPETokenizer are the end-of-text id
  of the vocabulary the checkpoint records (the trainer's eod), not GPT-2's 50256 (a
  vocab.json of another order or size has <|endoftext|> elsewhere: 50256 is another
  token, or outside the exported vocabulary).
* A PipeDream-2BW checkpoint holds two weight versions; the export writes ``model`` (the
  newest), never the shadow.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.checkpointing import save_payload  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.tensor_parallel import TPInfo  # noqa: E402
from megatron.tokenizer import GPT2BPETokenizer  # noqa: E402
from tools.checkpoint_util import main  # noqa: E402

TP = TPInfo.single()
GPT2_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gpt2")
EOT = "<|endoftext|>"


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16,
                padded_vocab_size=50304, hidden_dropout=0.0, attention_dropout=0.0,
                init_method_std=0.2)
    base.update(kw)
    return ModelConfig(**base)


def _save(root, model_state, cfg, data, shadow=None):
    record = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in cfg.__dict__.items()}
    base = os.path.join(root, "iter_0000004", "mp_rank_00")
    os.makedirs(base)
    save_payload({"iteration": 4, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                  "model": model_state, "model_shadow": shadow,
                  "config": {"model": record, "data": data}},
                 os.path.join(base, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    return root


def _gpt2_files():
    vocab = os.path.join(GPT2_DIR, "encoder.json")
    if not os.path.isfile(vocab):
        pytest.skip("shared GPT-2 vocabulary not available")
    return vocab, os.path.join(GPT2_DIR, "vocab.bpe")


def test_gpt2_bpe_export_takes_eos_from_the_recorded_vocabulary(tmp_path):
    """A vocab.json with <|endoftext|> at id 0 (swapped with '!'): the ids the trainer
    ended documents with are 0, and so are the exported bos/eos."""
    vocab_file, merge_file = _gpt2_files()
    with open(vocab_file, encoding="utf-8") as fh:
        encoder = json.load(fh)
    first = next(t for t, i in encoder.items() if i == 0)
    encoder[first], encoder[EOT] = encoder[EOT], 0
    custom = tmp_path / "vocab.json"
    custom.write_text(json.dumps(encoder), encoding="utf-8")
    ours = GPT2BPETokenizer(str(custom), merge_file, fast=False)
    assert ours.eod == 0
    cfg = _cfg()
    model = GPTModel(cfg, TP, seed=3).eval()
    data = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(custom),
            "merge_file": merge_file, "make_vocab_size_divisible_by": 128}
    src = _save(str(tmp_path / "ckpt"), model.state_dict(), cfg, data)
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    with open(os.path.join(out, "config.json")) as fh:
        written = json.load(fh)
    assert (written["bos_token_id"], written["eos_token_id"]) == (0, 0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == tok.bos_token_id == ours.eod
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.eos_token_id == ours.eod


def test_gpt2_bpe_export_of_gpt2s_vocabulary_keeps_50256(tmp_path):
    vocab_file, merge_file = _gpt2_files()
    cfg = _cfg()
    model = GPTModel(cfg, TP, seed=3).eval()
    data = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab_file,
            "merge_file": merge_file, "make_vocab_size_divisible_by": 128}
    src = _save(str(tmp_path / "ckpt"), model.state_dict(), cfg, data)
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    with open(os.path.join(out, "config.json")) as fh:
        written = json.load(fh)
    assert (written["vocab_size"], written["bos_token_id"], written["eos_token_id"]) == \
        (50257, 50256, 50256)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 50256
    assert tok("Hello world, it's me.")["input_ids"] == \
        GPT2BPETokenizer(vocab_file, merge_file, fast=False).tokenize("Hello world, it's me.")


def test_2bw_export_writes_the_newest_weights_not_the_shadow(tmp_path):
    from safetensors.torch import load_file

    cfg = _cfg(padded_vocab_size=128)
    newest = GPTModel(cfg, TP, seed=3).state_dict()
    shadow = GPTModel(cfg, TP, seed=4).state_dict()
    data = {"tokenizer_type": "NullTokenizer", "vocab_size": 99, "tokenizer_vocab_size": 100,
            "make_vocab_size_divisible_by": 128}
    src = _save(str(tmp_path / "ckpt"), newest, cfg, data, shadow=shadow)
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    written = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(written["transformer.wte.weight"],
                       newest["embedding.word_embeddings.weight"][:100])
    assert torch.equal(written["transformer.h.0.mlp.c_fc.weight"],
                       newest["encoder.layers.0.mlp.dense_h_to_4h.weight"].t())

"""tools/checkpoint_util.py --true-vocab-size is checked against the checkpoint: a size
its embedding cannot hold, or one its readable tokenizer contradicts, is one error line
before anything is written (it used to drop real rows, invent rows, or write a
config.json with vocab_size -5)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("safetensors")

from megatron.checkpointing import save_payload  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.tensor_parallel import TPInfo  # noqa: E402
from tools.checkpoint_util import main  # noqa: E402

VOCAB = 96  # NullTokenizer --vocab-size; padded to 128 rows


def _ckpt(root: str, data: dict) -> str:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      padded_vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, TPInfo.single(), seed=5)
    record = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in cfg.__dict__.items()}
    base = os.path.join(root, "iter_0000004", "mp_rank_00")
    os.makedirs(base)
    save_payload({"iteration": 4, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                  "model": model.state_dict(),
                  "config": {"model": record,
                             "data": dict(data, make_vocab_size_divisible_by=64)}},
                 os.path.join(base, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    return root


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --true-vocab-size"), err
    return err[0]


@pytest.mark.parametrize("value", ["0", "-5", "129"])
@pytest.mark.parametrize("workflow", ["export", "reshard"])
def test_a_size_the_embedding_cannot_hold_is_refused(tmp_path, capsys, value, workflow):
    src = _ckpt(str(tmp_path / "ck"), {"tokenizer_type": "GPT2BPETokenizer",
                                       "vocab_file": "/elsewhere/vocab.json",
                                       "merge_file": "/elsewhere/merges.txt"})
    out = ["--to-hf", str(tmp_path / "hf")] if workflow == "export" else \
        ["--save", str(tmp_path / "out"), "--target-tensor-parallel-size", "2"]
    line = _error(capsys, ["--load", src, *out, f"--true-vocab-size={value}"])
    assert "expected 1 to 128" in line
    assert not os.path.exists(out[1])


@pytest.mark.parametrize("workflow", ["export", "reshard"])
def test_a_size_the_recorded_tokenizer_contradicts_is_refused(tmp_path, capsys, workflow):
    src = _ckpt(str(tmp_path / "ck"), {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB})
    out = ["--to-hf", str(tmp_path / "hf")] if workflow == "export" else \
        ["--save", str(tmp_path / "out"), "--target-tensor-parallel-size", "2"]
    line = _error(capsys, ["--load", src, *out, "--true-vocab-size", "90"])
    assert f"has {VOCAB} tokens" in line
    assert not os.path.exists(out[1])
    main(["--load", src, *out, "--true-vocab-size", str(VOCAB)])  # agreeing: fine
    assert os.path.isdir(out[1])


def test_a_size_for_tokenizer_files_elsewhere_is_used(tmp_path, capsys):
    src = _ckpt(str(tmp_path / "ck"), {"tokenizer_type": "GPT2BPETokenizer",
                                       "vocab_file": "/elsewhere/vocab.json",
                                       "merge_file": "/elsewhere/merges.txt"})
    main(["--load", src, "--to-hf", str(tmp_path / "hf"), "--true-vocab-size", "100"])
    import json
    with open(tmp_path / "hf" / "config.json") as fh:
        assert json.load(fh)["vocab_size"] == 100

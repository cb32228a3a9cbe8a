"""QA pass 53 (Hugging Face interop): the vocabulary an import records.

* Without tokenizer files the import records NullTokenizer.  This trainer's NullTokenizer
  has ``--vocab-size N`` data ids plus its end-of-document id N, so N + 1 ids: the
  printed ``--vocab-size`` (and the recorded one, which ``--use-checkpoint-args`` takes)
  must be the model's vocab_size - 1, or a vocabulary that is a multiple of the padding
  unit (Llama 3's 128256, Qwen2's 151936 at the default 128) pads to more rows than the
  import wrote and the training run cannot load it.
* GPT-2 tokenizer files whose vocabulary is not the model's vocab_size (a model padded to
  50304 or 50400 rows) are not the model's tokenizer: recording them made the printed
  flags build another padded size and the export drop real rows.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.tokenizer import build_tokenizer, vocab_size_with_padding  # noqa: E402
from tools.checkpoint_util import main, read_checkpoint  # noqa: E402

GPT2_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gpt2")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _hf_gpt2(tmp_path, vocab, name="hf"):
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, activation_function="gelu",
                                     initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    path = str(tmp_path / name)
    hf.save_pretrained(path)
    return path


def _printed_argv(err: str):
    line = [l for l in err.splitlines() if "train with:" in l][0]
    return line.split("train with: ", 1)[1].replace(" [--finetune]", "").split()


def _run_rows(argv) -> int:
    """The padded vocabulary rows a training run with ``argv`` builds (training.py's
    setup: the tokenizer's size padded to the divisor x t)."""
    from megatron.arguments import build_config, parse_args, validate_args

    argv = argv + ["--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length",
                   "16", "--train-iters", "1", "--lr", "1e-4", "--mock-data"]
    args = validate_args(parse_args(argv), 1)
    cfg = build_config(args)
    tok = build_tokenizer(cfg.data, cfg.parallel.tensor_model_parallel_size,
                          vocab_size=getattr(args, "vocab_size", None))
    return vocab_size_with_padding(tok.vocab_size, cfg.data.make_vocab_size_divisible_by,
                                   cfg.parallel.tensor_model_parallel_size)


def _round_trip_tensors(path, back):
    from safetensors.torch import load_file

    a = load_file(os.path.join(path, "model.safetensors"))
    b = load_file(os.path.join(back, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("vocab", [128, 100])
def test_null_tokenizer_flags_build_the_imported_rows(tmp_path, capsys, vocab):
    """128 is a multiple of the padding unit 64: NullTokenizer --vocab-size 128 has 129
    ids and pads to 192 rows, not the imported 128."""
    path = _hf_gpt2(tmp_path, vocab)
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out, "--make-vocab-size-divisible-by", "64"])
    argv = _printed_argv(capsys.readouterr().err)
    assert "NullTokenizer" in argv
    rows = read_checkpoint(out).config["model"]["padded_vocab_size"]
    assert _run_rows(argv) == rows == vocab_size_with_padding(vocab, 64, 1)
    # what --use-checkpoint-args takes builds the same vocabulary: vocab ids, eod the last
    data = read_checkpoint(out).config["data"]
    from megatron.config import DataConfig
    fields = {k: data[k] for k in ("tokenizer_type", "vocab_size",
                                   "make_vocab_size_divisible_by")}
    tok = build_tokenizer(DataConfig(**fields), 1, vocab_size=data["vocab_size"])
    assert tok.vocab_size == vocab and tok.eod == vocab - 1
    # and the export gives the model back, every real row and no padding row
    main(["--load", out, "--to-hf", str(tmp_path / "back")])
    _round_trip_tensors(path, str(tmp_path / "back"))


@pytest.mark.parametrize("vocab", [50304, 50400])
def test_gpt2_files_of_another_vocabulary_are_not_the_models_tokenizer(tmp_path, capsys,
                                                                        vocab):
    if not os.path.isfile(os.path.join(GPT2_DIR, "encoder.json")):
        pytest.skip("shared GPT-2 vocabulary not available")
    path = _hf_gpt2(tmp_path, vocab)
    shutil.copyfile(os.path.join(GPT2_DIR, "encoder.json"), os.path.join(path, "vocab.json"))
    shutil.copyfile(os.path.join(GPT2_DIR, "vocab.bpe"), os.path.join(path, "merges.txt"))
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out])
    err = capsys.readouterr().err
    assert "50257 tokens" in err and f"vocab_size is {vocab}" in err
    argv = _printed_argv(err)
    assert "GPT2BPETokenizer" not in argv
    assert _run_rows(argv) == read_checkpoint(out).config["model"]["padded_vocab_size"]
    main(["--load", out, "--to-hf", str(tmp_path / "back")])
    _round_trip_tensors(path, str(tmp_path / "back"))


def test_gpt2_files_of_the_models_vocabulary_are_recorded(tmp_path, capsys):
    if not os.path.isfile(os.path.join(GPT2_DIR, "encoder.json")):
        pytest.skip("shared GPT-2 vocabulary not available")
    path = _hf_gpt2(tmp_path, 50257)
    shutil.copyfile(os.path.join(GPT2_DIR, "encoder.json"), os.path.join(path, "vocab.json"))
    shutil.copyfile(os.path.join(GPT2_DIR, "vocab.bpe"), os.path.join(path, "merges.txt"))
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out])
    argv = _printed_argv(capsys.readouterr().err)
    assert "GPT2BPETokenizer" in argv
    assert _run_rows(argv) == read_checkpoint(out).config["model"]["padded_vocab_size"]
    main(["--load", out, "--to-hf", str(tmp_path / "back")])
    _round_trip_tensors(path, str(tmp_path / "back"))

"""tools/generate_samples_gpt.py: what a user met sampling from real checkpoints.

A SentencePiece continuation lost the space before its first word; an output file in a
directory not made yet failed after all the sampling; a bad prompt on a late line of
--sample-input-file failed after the samples before it (named as --prompt), and a BOM
became part of the first prompt; a model the export refuses was named as --to-hf; a
tokenizer file flag the checkpoint's tokenizer does not read was ignored; a tokenizer
larger than the model's vocabulary was used.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.errors import UserError  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.text_generation import Generator, SamplingParams  # noqa: E402
from tests.unit.test_text_generation import NULL_DATA, TP, _cfg, _save  # noqa: E402
from tools.generate_samples_gpt import main  # noqa: E402


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _null_checkpoint(tmp_path, name="ckpt", data=None, **cfg_kw):
    cfg = _cfg(**cfg_kw)
    return _save(str(tmp_path / name), GPTModel(cfg, TP, seed=21).eval(), cfg, data=data)


def test_sentencepiece_continuation_keeps_its_leading_space(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"The module is used {i} times" for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=40, minloglevel=2, hard_vocab_limit=False)
    data = dict(tokenizer_type="SentencePieceTokenizer",
                tokenizer_model=str(tmp_path / "sp.model"), make_vocab_size_divisible_by=64)
    gen = Generator(_null_checkpoint(tmp_path, data=data), device="cpu")
    tok = gen.tokenizer
    whole = tok.tokenize("The module is used")
    head = len(tok.tokenize("The module"))
    gen.generate_ids = lambda ids, params: whole[head:] + [tok.eod]
    sample = gen.generate("The module", SamplingParams(greedy=True))
    assert sample["finished"] and sample["text"] == " is used"
    assert sample["prompt"] + sample["text"] == "The module is used"
    gen.generate_ids = lambda ids, params: whole[head:]  # unconditional: no prompt text
    assert gen.generate("", SamplingParams(greedy=True))["text"] == "is used"


def test_output_file_in_a_new_directory_and_an_unwritable_one(tmp_path, monkeypatch):
    src = _null_checkpoint(tmp_path)
    out = tmp_path / "new" / "dir" / "samples.jsonl"
    argv = ["--load", src, "--prompt", "1 2", "--tokens-to-generate", "3", "--greedy",
            "--device", "cpu"]
    assert main(argv + ["--sample-output-file", str(out)]) == 0
    assert [json.loads(line)["prompt"] for line in open(out)] == ["1 2"]
    # a directory this user cannot write to: refused before the checkpoint is loaded
    import megatron.text_generation as tg

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: (os.path.abspath(p) != str(tmp_path)
                                                       and real_access(p, mode)))
    monkeypatch.setattr(tg, "Generator", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(UserError, match=f"--sample-output-file .*: {tmp_path} is not "
                                        f"writable"):
        main(argv + ["--sample-output-file", str(tmp_path / "other" / "s.jsonl")])


def test_every_prompt_is_checked_before_sampling_and_named_by_its_line(tmp_path,
                                                                       monkeypatch):
    src = _null_checkpoint(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("\ufeff1 2\n\n3 4\nnot ids\n".encode("utf-8"))
    calls = []
    real = Generator.generate_ids
    monkeypatch.setattr(Generator, "generate_ids",
                        lambda self, ids, params: calls.append(ids) or real(self, ids, params))
    argv = ["--load", src, "--sample-input-file", str(prompts), "--tokens-to-generate", "3",
            "--device", "cpu"]
    with pytest.raises(UserError, match=f"--sample-input-file {prompts} line 4 'not ids': "
                                        f"NullTokenizer: expected space-separated"):
        main(argv)
    assert calls == []
    prompts.write_bytes("\ufeff1 2\n".encode("utf-8"))  # a BOM is not part of the prompt
    assert main(argv) == 0 and calls == [[1, 2]]


def test_a_model_the_export_refuses_is_named_as_load(tmp_path):
    src = _null_checkpoint(tmp_path, apply_residual_connection_post_layernorm=True)
    with pytest.raises(UserError) as info:
        Generator(src, device="cpu")
    message = str(info.value)
    assert message.startswith(f"--load {src}: ") and "--to-hf" not in message
    assert "residuals after the LayerNorm" in message


def test_tokenizer_files_the_tokenizer_does_not_read_or_too_many_tokens(tmp_path):
    src = _null_checkpoint(tmp_path)
    with pytest.raises(UserError, match="--tokenizer-model /x/tok.model: the checkpoint's "
                                        "tokenizer is NullTokenizer, which reads no "
                                        "tokenizer file; leave --tokenizer-model out"):
        Generator(src, device="cpu", tokenizer_files={"tokenizer_model": "/x/tok.model"})
    # 200 tokens, but the model has 128 rows of vocabulary (96 + padding)
    big = _null_checkpoint(tmp_path, "big", data=dict(NULL_DATA, vocab_size=200))
    with pytest.raises(UserError, match="NullTokenizer has 200 tokens, more than the 128 "
                                        "rows of the checkpoint's word embedding"):
        Generator(big, device="cpu")


def test_vocabulary_and_merges_of_two_tokenizers(tmp_path):
    vocab = {"<|endoftext|>": 0, **{c: i for i, c in enumerate("abcdefghijklmnop", 1)}}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")  # makes "ab": not a token
    data = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                merge_file=str(tmp_path / "merges.txt"), make_vocab_size_divisible_by=64)
    gen = Generator(_null_checkpoint(tmp_path, data=data), device="cpu")
    assert gen.encode("dc") == [4, 3]
    with pytest.raises(UserError, match="--prompt 'cab': GPT2BPETokenizer: the merges make "
                                        "the token 'ab', which --vocab-file lacks"):
        gen.encode("cab")


def test_stdout_closed_early_still_writes_the_file(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    src = _null_checkpoint(tmp_path)
    out = tmp_path / "s.jsonl"
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("MEGATRON_DEBUG", None)
    proc = subprocess.Popen([sys.executable, str(root / "tools" / "generate_samples_gpt.py"),
                             "--load", src, "--prompt", "1 2", "--num-samples", "3",
                             "--tokens-to-generate", "2", "--device", "cpu",
                             "--sample-output-file", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `| head -0` does
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "wrote 3 samples" in err
    assert len(open(out).readlines()) == 3

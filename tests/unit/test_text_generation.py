"""tools/generate_samples_gpt.py (megatron/text_generation.py): samples from a checkpoint.

The hot path is transformers' ``generate`` on the exported model; the reference here is
a hand-written greedy loop over our own GPTModel (no KV cache, the whole sequence each
step).  Greedy samples must be the same tokens for the GPT-2 block and the Llama block,
for a checkpoint of any (t, d) layout, with vocabulary padding never drawn.  Bad flags
and inputs are one ``error:`` line.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.checkpointing import save_payload  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.errors import UserError  # noqa: E402
from megatron.model.bert_model import BertModel  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.tensor_parallel import TPInfo  # noqa: E402
from megatron.text_generation import (Generator, SamplingParams,  # noqa: E402
                                      check_sampling, generate_samples)
from tools.checkpoint_util import convert  # noqa: E402
from tools.generate_samples_gpt import main  # noqa: E402

TP = TPInfo.single()
VOCAB = 96  # NullTokenizer: ids as text, eod = 95; padded to 128
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True,
             ffn_hidden_size=48, num_query_groups=2)
NULL_DATA = {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB,
             "make_vocab_size_divisible_by": 64}


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                max_position_embeddings=32, padded_vocab_size=128, hidden_dropout=0.0,
                attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.5)
    base.update(kw)
    return ModelConfig(**base)


def _save(root, model, cfg, data=None):
    record = {k: (str(v) if isinstance(v, torch.dtype) else v)
              for k, v in dataclasses.asdict(cfg).items()}
    base = os.path.join(root, "iter_0000004", "mp_rank_00")
    os.makedirs(base)
    save_payload({"iteration": 4, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                  "model": model.state_dict(),
                  "config": {"model": record, "data": data or NULL_DATA}},
                 os.path.join(base, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    return root


def _reference_greedy(model, ids, new_tokens, eod=VOCAB - 1):
    """Our model, argmax over the real vocabulary, whole sequence every step."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([seq]), None, None)[0, -1, :VOCAB]
            seq.append(int(logits.argmax()))
            if seq[-1] == eod:
                break
    return seq[len(ids):]


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_greedy_samples_are_our_models_argmax(tmp_path, block):
    cfg = _cfg(**(LLAMA if block == "llama" else {}))
    model = GPTModel(cfg, TP, seed=11).eval()
    src = _save(str(tmp_path / "ckpt"), model, cfg)
    gen = Generator(src, device="cpu")
    assert gen.vocab == VOCAB  # the export drops the padding rows
    params = SamplingParams(tokens_to_generate=20, greedy=True)
    for prompt in ("3 1 4 1 5", "90 2"):
        ids = [int(x) for x in prompt.split()]
        assert gen.generate_ids(ids, params) == _reference_greedy(model, ids, 20)
    # the unconditional sample starts from the end-of-document token
    assert gen.generate_ids([VOCAB - 1], params) == _reference_greedy(model, [VOCAB - 1], 20)
    if block == "gpt2":  # any layout samples the same tokens
        convert(src, str(tmp_path / "t2d2"), tp=2, pp=2)
        again = Generator(str(tmp_path / "t2d2"), device="cpu")
        assert again.generate_ids([3, 1, 4], params) == gen.generate_ids([3, 1, 4], params)


def test_padding_rows_are_never_drawn(tmp_path):
    cfg = _cfg()
    model = GPTModel(cfg, TP, seed=12).eval()
    src = _save(str(tmp_path / "ckpt"), model, cfg)
    gen = Generator(src, device="cpu")
    # pretend the export kept padded rows the tokenizer does not have: make them likely
    gen.vocab = 128
    with torch.no_grad():
        head = gen.model.get_output_embeddings()
        wide = torch.nn.Linear(head.in_features, 128, bias=False)
        wide.weight[:VOCAB] = head.weight
        wide.weight[VOCAB:] = 10 * head.weight[:128 - VOCAB]
    gen.model.set_output_embeddings(wide)
    gen.model.config.vocab_size = 128
    torch.manual_seed(0)
    ids = gen.generate_ids([1, 2, 3], SamplingParams(tokens_to_generate=30))
    assert ids and max(ids) < VOCAB


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path):
    cfg = _cfg()
    model = GPTModel(cfg, TP, seed=13).eval()
    gen = Generator(_save(str(tmp_path / "ckpt"), model, cfg), device="cpu")
    sampled = SamplingParams(tokens_to_generate=16, temperature=1.5, seed=7)
    a = generate_samples(gen, ["1 2 3", ""], 2, sampled)
    b = generate_samples(gen, ["1 2 3", ""], 2, sampled)
    assert a == b and len(a) == 4
    assert a[0]["prompt"] == "1 2 3" and a[2]["prompt"] == ""
    assert len({s["text"] for s in a}) > 1  # not every draw the same continuation
    top1 = generate_samples(gen, ["1 2 3"], 1, SamplingParams(tokens_to_generate=16, top_k=1))
    greedy = generate_samples(gen, ["1 2 3"], 1,
                              SamplingParams(tokens_to_generate=16, greedy=True))
    assert top1 == greedy
    # an end-of-document token ends the sample and is not in its text
    for s in a:
        assert s["finished"] == (len(s["text"].split()) < s["tokens"])


def test_command_line_writes_jsonl_and_refuses_to_replace_it(tmp_path, capsys):
    cfg = _cfg()
    src = _save(str(tmp_path / "ckpt"), GPTModel(cfg, TP, seed=14).eval(), cfg)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 6 7\n\n8 9\n")
    out = str(tmp_path / "samples.jsonl")
    argv = ["--load", src, "--sample-input-file", str(prompts), "--sample-output-file", out,
            "--tokens-to-generate", "8", "--greedy", "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in open(out)]
    assert [r["prompt"] for r in rows] == ["5 6 7", "8 9"]  # blank lines are skipped
    assert all(r["text"] in printed for r in rows)
    with pytest.raises(UserError, match="--sample-output-file .*exists; expected a new file"):
        main(argv)
    assert [json.loads(line) for line in open(out)] == rows


def test_one_line_errors(tmp_path):
    for bad, match in ((dict(tokens_to_generate=0), "--tokens-to-generate 0"),
                       (dict(temperature=0.0), "--temperature 0"),
                       (dict(top_k=-1), "--top-k -1"),
                       (dict(top_p=1.5), "--top-p 1.5"),
                       (dict(top_k=5, top_p=0.9), "--top-k 5 and --top-p 0.9")):
        with pytest.raises(UserError, match=match):
            check_sampling(SamplingParams(**bad))
    cfg = _cfg()
    src = _save(str(tmp_path / "ckpt"), GPTModel(cfg, TP, seed=15).eval(), cfg)
    gen = Generator(src, device="cpu")
    with pytest.raises(UserError, match="--prompt .*: 40 tokens; the model takes 32 "
                                        "positions, so a prompt may have at most 31"):
        gen.encode(" ".join(["1"] * 40))
    with pytest.raises(UserError, match="--prompt 'one two'.*space-separated integers"):
        gen.encode("one two")
    # a tokenizer file the checkpoint recorded that is not here names the flag to give
    spm = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model="/nowhere/tok.model")
    other = _save(str(tmp_path / "spm"), GPTModel(cfg, TP, seed=15).eval(), cfg, data=spm)
    with pytest.raises(UserError, match="recorded --tokenizer-model '/nowhere/tok.model'; "
                                        "give the file again"):
        Generator(other, device="cpu")
    bert_cfg = _cfg(num_tokentypes=2)
    bert = _save(str(tmp_path / "bert"), BertModel(bert_cfg, TP, seed=6).eval(), bert_cfg)
    with pytest.raises(UserError, match="a BERT checkpoint"):
        Generator(bert, device="cpu")
    with pytest.raises(UserError, match="--sample-input-file .*cannot read it"):
        main(["--load", src, "--sample-input-file", str(tmp_path / "none.txt")])
    with pytest.raises(UserError, match="--num-samples 0"):
        main(["--load", src, "--num-samples", "0"])


def test_the_script_prints_one_error_line_and_exits_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("MEGATRON_DEBUG", None)
    proc = subprocess.run([sys.executable, str(root / "tools" / "generate_samples_gpt.py"),
                           "--load", str(tmp_path / "missing"), "--prompt", "1 2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --load ") and "missing" in lines[0]

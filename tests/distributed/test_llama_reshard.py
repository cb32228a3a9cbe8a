"""A Llama-style GPT (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, untied
output layer) across tools/checkpoint_util.py, on spawned gloo ranks in float64:

* trained at t=2, resharded to t=1 d=2 and back to t=2: SwiGLU's [gate; up] weight, its
  Adam moments and its master copy are merged and re-cut with stride 2 (rank r holds
  [gate_r; up_r]); each resumed run's losses equal an uninterrupted run at its layout;
* a transformers LlamaForCausalLM imported with --from-hf trains with the flags the
  import prints, at t=2 and at t=1 d=2 alike (the same first loss);
* so does a Qwen3ForCausalLM with heads wider than hidden / heads and Llama 3.1's RoPE
  scaling (--qk-layernorm --kv-channels --use-rope-scaling), over three steps.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs
from tools.checkpoint_util import convert, main, read_checkpoint

LLAMA = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--position-embedding-type", "rope", "--rotary-base", "500000", "--swiglu",
         "--ffn-hidden-size", "40", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def _argv(t: int, d: int, *extra: str, iters: int = 6):
    base = list(TINY) + LLAMA
    base[base.index("--train-iters") + 1] = str(iters)
    base[base.index("--lr-decay-style") + 1] = "cosine"  # a restarted schedule would show
    return base + ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
                   str(d), "--pipeline-schedule", "flush", "--min-lr", "1e-4", *extra]


def _import_llama(tmp_path, capsys, tp: int, pp: int, name: str, family: str = "llama"):
    """A random transformers Llama (or ``family`` "qwen3": a Qwen3 with heads of 16 and
    Llama 3.1's RoPE scaling) shaped like TINY + LLAMA, imported for (tp, pp); returns
    the model flags the import printed."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"hf-{family}"
    if not path.exists():
        shape = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)
        torch.manual_seed(0)
        if family == "qwen3":
            rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                    "rope_theta": 10000.0}
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                head_dim=16, rope_parameters=rope, **shape))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                rope_theta=500000.0, **shape))
        model.save_pretrained(str(path))
    capsys.readouterr()
    main(["--from-hf", str(path), "--save", str(tmp_path / name),
          "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp),
          "--make-vocab-size-divisible-by", "64"])
    line = [x for x in capsys.readouterr().err.splitlines() if "train with:" in x][0]
    return line.split("train with: ", 1)[1].replace("[--finetune]", "--finetune").split()


def test_llama_reshard_resume_and_import(tmp_path, capsys):
    src = str(tmp_path / "src")
    run_distributed(train_configs, 2, args=([("first", _argv(2, 1, "--save", src,
                                                            "--exit-interval", "3"), None)],),
                    timeout=300)
    convert(src, str(tmp_path / "t1d2"), tp=1, pp=2, dp=1)
    convert(str(tmp_path / "t1d2"), str(tmp_path / "t2"), tp=2, pp=1, dp=1)
    ckpt = read_checkpoint(str(tmp_path / "t2"))
    assert (ckpt.tensor, ckpt.pipeline) == (2, 1)
    assert ckpt.payloads[(0, 0)]["optimizer"] is not None
    hf_t2 = _import_llama(tmp_path, capsys, 2, 1, "hf-t2")
    hf_d2 = _import_llama(tmp_path, capsys, 1, 2, "hf-d2")
    assert "--swiglu" in hf_t2 and "--disable-bias-linear" in hf_t2
    hf_common = list(TINY) + ["--pipeline-schedule", "flush", "--lr", "0", "--min-lr", "0",
                              "--train-iters", "1"]
    second = [("full-t1d2", _argv(1, 2), None),
              ("resumed-t1d2", _argv(1, 2, "--load", str(tmp_path / "t1d2")), None),
              ("full-t2", _argv(2, 1), None),
              ("resumed-t2", _argv(2, 1, "--load", str(tmp_path / "t2")), None),
              ("hf-t2", hf_common + hf_t2, None),
              ("hf-d2", hf_common + hf_d2, None)]
    res = run_distributed(train_configs, 2, args=(second,), timeout=600)[-1]
    for layout in ("t1d2", "t2"):
        full, resumed = res[f"full-{layout}"]["losses"], res[f"resumed-{layout}"]["losses"]
        assert sorted(resumed) == [4, 5, 6], (layout, sorted(resumed))
        for it in (4, 5, 6):
            assert abs(resumed[it] - full[it]) < 1e-10, (layout, it, resumed[it], full[it])
    a, b = res["hf-t2"]["losses"], res["hf-d2"]["losses"]
    assert sorted(a) == sorted(b) == [1]
    assert math.isfinite(a[1]) and abs(a[1] - b[1]) < 1e-10, (a, b)
    assert abs(a[1] - math.log(96)) < 0.5  # a random Llama: about uniform over 96 tokens
    assert os.path.isdir(tmp_path / "hf-t2" / "iter_0000000")


def test_qwen3_import_trains_at_any_layout(tmp_path, capsys):
    """The Qwen3 import's flags (query/key norms, whose replicated weights get gradients
    summed over the tensor ranks; --kv-channels 16 in a hidden size of 32; RoPE scaling)
    train it at t=2 and at t=1 d=2 to the same losses, step after step."""
    t2 = _import_llama(tmp_path, capsys, 2, 1, "q-t2", family="qwen3")
    d2 = _import_llama(tmp_path, capsys, 1, 2, "q-d2", family="qwen3")
    for flag in ("--qk-layernorm", "--kv-channels", "--use-rope-scaling"):
        assert flag in t2, t2
    common = list(TINY) + ["--pipeline-schedule", "flush", "--lr", "1e-3",
                           "--train-iters", "3"]
    runs = [("q-t2", common + t2, None), ("q-d2", common + d2, None)]
    res = run_distributed(train_configs, 2, args=(runs,), timeout=600)[-1]
    a, b = res["q-t2"]["losses"], res["q-d2"]["losses"]
    assert sorted(a) == sorted(b) == [1, 2, 3], (a, b)
    for it in (1, 2, 3):
        assert math.isfinite(a[it]) and abs(a[it] - b[it]) < 1e-10, (it, a, b)
    assert abs(a[1] - math.log(96)) < 0.5  # a random model: about uniform over 96 tokens

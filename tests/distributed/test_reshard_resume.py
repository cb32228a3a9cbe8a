"""Train at one (t, d, w) layout, save, reshard with tools/checkpoint_util.py, resume at
another: the resumed losses equal an uninterrupted run at the new layout (float64, no
dropout; the model's initial weights do not depend on the layout, so both start from the
same state).  This holds only if the optimizer moments, the LR schedule, the consumed
samples, the engine's iteration and -- under 2BW -- the shadow weight version all cross
the layout change."""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs
from tools.checkpoint_util import convert, main, read_checkpoint

# (schedule, source (t, d, w), target (t, d, w), target's first-stage layers); sources
# run on 2 ranks, targets on 4.
CASES = [("flush", (1, 2, 1), (2, 1, 2), None),  # pp 2 -> 1 with a tp change and a dp change
         ("2bw", (1, 1, 2), (2, 2, 1), 3)]       # pp 1 -> 2, uneven (3 + 1), tp change


def _split(first):
    return [] if first is None else ["--decoder-first-pipeline-num-layers", str(first)]


def _argv(schedule, layout, *extra):
    t, d, _ = layout
    base = list(TINY)
    base[base.index("--train-iters") + 1] = "6"
    # a decaying LR: a scheduler that restarted would change the resumed losses
    base[base.index("--lr-decay-style") + 1] = "cosine"
    return base + ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
                   str(d), "--pipeline-schedule", schedule, "--min-lr", "1e-4", *extra]


def _import_hf_gpt2(tmp_path) -> "torch.Tensor":
    """A random transformers GPT-2 shaped like TINY, imported for (t2, d2)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=4,
                                     n_head=4, activation_function="gelu", bos_token_id=95,
                                     eos_token_id=95)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config)
    hf.save_pretrained(str(tmp_path / "hf"))
    main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "hf-ours"),
          "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
          "--make-vocab-size-divisible-by", "64"])
    return hf.transformer.wte.weight.detach().clone()


def test_reshard_then_resume_matches_uninterrupted_run(tmp_path):
    first = [(f"{s}-first", _argv(s, src, "--save", str(tmp_path / f"{s}-src"),
                                  "--exit-interval", "3"), None)
             for s, src, _, _ in CASES]
    run_distributed(train_configs, 2, args=(first,), timeout=300)
    for s, _, (t, d, w), first in CASES:
        out = convert(str(tmp_path / f"{s}-src"), str(tmp_path / f"{s}-dst"), tp=t, pp=d, dp=w,
                      first=first)
        assert os.path.basename(out) == "iter_0000003"
        ckpt = read_checkpoint(str(tmp_path / f"{s}-dst"))
        assert (ckpt.tensor, ckpt.pipeline) == (t, d)
        assert ckpt.stage_offsets == ([0] if d == 1 else [0, first])
        payload = ckpt.payloads[(0, 0)]
        assert payload["consumed_train_samples"] == 24 and payload["optimizer"] is not None
        assert (payload["model_shadow"] is not None) == (s == "2bw")
    hf_wte = _import_hf_gpt2(tmp_path)
    second = []
    for s, _, dst, first in CASES:
        second.append((f"{s}-full", _argv(s, dst, *_split(first)), None))
        second.append((f"{s}-resumed", _argv(s, dst, *_split(first), "--load",
                                             str(tmp_path / f"{s}-dst")), None))
    # an imported Hugging Face GPT-2 (iteration 0, t2 d2) works as --load and --finetune
    hf_layout = (2, 2, 1)
    second.append(("hf-finetune", _argv("flush", hf_layout, "--load", str(tmp_path / "hf-ours"),
                                        "--finetune", "--lr", "0", "--min-lr", "0",
                                        "--train-iters", "2"), None))
    second.append(("hf-load", _argv("2bw", hf_layout, "--load", str(tmp_path / "hf-ours"),
                                    "--train-iters", "2"), None))
    res = run_distributed(train_configs, 4, args=(second,), timeout=300)[-1]
    # the last rank holds tensor rank 1's half of the tied embedding: rows 64..127
    got = res["hf-finetune"]["shared_embedding"]
    assert got.shape == (64, 32)
    mean = hf_wte.double().mean(0).to(hf_wte.dtype).to(got.dtype)  # padding: the mean row
    assert torch.equal(got[:32], hf_wte[64:96].to(got.dtype))
    assert torch.equal(got[32:], mean.expand(32, -1))
    assert res["hf-load"]["iteration"] == 2 and sorted(res["hf-load"]["losses"]) == [1, 2]
    for s, _, _, _ in CASES:
        full, resumed = res[f"{s}-full"]["losses"], res[f"{s}-resumed"]["losses"]
        assert sorted(resumed) == [4, 5, 6], (s, sorted(resumed))
        for it in (4, 5, 6):
            assert abs(resumed[it] - full[it]) < 1e-10, (s, it, resumed[it], full[it])

"""Evaluation under 2BW runs every validation batch on the newest weights W(i).

Regression: the forward pass picked the weight buffer by the batch's index, as training
does, so under 2BW the validation batches alternated W(i) and W(i-1), and right after a
flush warm-up the odd batches ran on the second buffer, still W(0) (an H100 run showed
a validation loss of 7.0 against 3.6 at the switch).  One process, float64, mock data.
"""
from __future__ import annotations

import contextlib
import io
from typing import Dict, List

import pytest

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--log-interval", "1000",
        "--eval-interval", "4", "--eval-iters", "3", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "3", "--fp64",
        "--distributed-backend", "gloo"]


def _run(*extra: str, iters: int = 8) -> Dict[int, float]:
    import pretrain_gpt
    from bench.convergence import fixed_valid_datasets_provider
    from megatron.training import pretrain

    argv: List[str] = BASE + ["--train-iters", str(iters), *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        res = pretrain(fixed_valid_datasets_provider, pretrain_gpt.model_provider,
                       pretrain_gpt.forward_step, argv=argv)
    return {it: v["lm loss"] for it, v in res.eval_losses.items()}


def test_flush_warmup_evaluates_like_flush_until_the_switch():
    flush = _run("--pipeline-schedule", "flush")
    warm = _run("--pipeline-schedule", "2bw", "--2bw-mitigation", "warmup",
                "--2bw-flush-warmup-iters", "4")
    # batches 0-3 ran under flush in both: same weights, same validation loss
    assert warm[4] == pytest.approx(flush[4], rel=1e-12)
    assert warm[8] != pytest.approx(flush[8], rel=1e-9)  # 2BW after the switch


def test_2bw_evaluates_the_weights_it_saves(tmp_path):
    """The validation loss at iteration 4 of a 2BW run equals that of the weights the run
    saves at iteration 4, loaded and evaluated alone (--skip-train)."""
    ckpt = tmp_path / "ck"
    tbw = _run("--pipeline-schedule", "2bw", "--save", str(ckpt), "--save-interval", "4",
               iters=4)
    alone = _run("--pipeline-schedule", "flush", "--load", str(ckpt), "--skip-train", iters=4)
    assert list(alone) == [4]
    assert alone[4] == pytest.approx(tbw[4], rel=1e-12)


def test_evaluation_holds_no_tensor_per_microbatch(monkeypatch):
    """Regression: evaluation kept every microbatch's loss (seg.outputs on the last stage)
    and a new float64 sum per batch until the segment ended.  Each small tensor pinned
    the heap above that forward's freed activations, so a process grew by about one
    activation per microbatch: 862 MB against 377 MB at --eval-iters 400 (t=2, CPU),
    and an OOM kill (11 GB) in a WikiText-103 evaluation.  What a segment holds during
    evaluation must not grow with the number of batches."""
    import torch

    from megatron.pipeline.engine import PipelineEngine

    held: List[int] = []
    original = PipelineEngine._forward

    def counting(self, action, seg):
        original(self, action, seg)
        if not seg.train:
            held.append(sum(torch.is_tensor(v) for v in seg.outputs.values())
                        + sum(len(s) for s in seg.loss_sums.values()))

    monkeypatch.setattr(PipelineEngine, "_forward", counting)
    _run("--pipeline-schedule", "2bw", "--eval-iters", "12", iters=4)
    # three evaluations (validation at iteration 4 and at the end, then the test split)
    # x 12 batches x m=2
    assert len(held) == 3 * 12 * 2
    assert max(held) == 1  # one running sum of "lm loss"

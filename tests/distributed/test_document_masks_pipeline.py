"""--reset-position-ids --reset-attention-mask --eod-mask-loss and
--calculate-per-token-loss through the trainer, in float64 on gloo ranks.

Every pipeline stage builds the document mask from its own copy of the batch, so a
two-stage pipeline, two data-parallel replicas and two sequence-parallel tensor ranks
give the losses of a plain single-process loop whose masks come from a hand-written
reference.  With per-token losses the same loop takes the mean over all loss tokens of
each global batch; with --eod-mask-loss the microbatches hold different numbers of them,
so this differs from the mean of microbatch means, and a token count taken twice (by
both tensor ranks of the last stage, or not added over replicas) changes the losses."""
from __future__ import annotations

import math
from typing import List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, summarize, train_configs

STEPS = 4
# --vocab-size 8 makes id 8 (NullTokenizer's eod, the ninth id) one token in nine: about
# two documents per sample of 16 tokens.
SMALL_VOCAB = [a if a != "96" else "8" for a in TINY]
FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]


def _pp(d: int, *extra: str) -> List[str]:
    return SMALL_VOCAB + ["--pipeline-model-parallel-size", str(d),
                          "--pipeline-schedule", "flush", *extra]


def train_per_token(rank: int, world: int, configs):
    """``train_configs`` through pretrain_gpt.py's entry (which allows per-token losses)."""
    import pretrain_gpt

    out = {}
    for name, argv in configs:
        torch.manual_seed(0)
        out[name] = summarize(pretrain_gpt.main(list(argv)), rank)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    configs = [("docs_d2", _pp(2, *FLAGS), None), ("docs_w2", _pp(1, *FLAGS), None),
               # sequence parallelism: the mask spans the gathered sequence
               ("docs_t2sp", _pp(1, *FLAGS, "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel", "--make-vocab-size-divisible-by",
                                 "32"), None),
               ("plain_d2", _pp(2), None)]
    return run_distributed(train_configs, 2, args=(configs,), timeout=600)


@pytest.fixture(scope="module")
def per_token():
    tok = ["--eod-mask-loss", "--calculate-per-token-loss"]
    configs = [("tok_d2", _pp(2, *tok)), ("tok_w2", _pp(1, *tok)),
               # the vocabulary padded to 64 at t = 2 too (a multiple of 32 x t)
               ("tok_t2", _pp(1, *tok, "--tensor-model-parallel-size", "2",
                              "--make-vocab-size-divisible-by", "32")),
               ("mean_d2", _pp(2, "--eod-mask-loss"))]
    return run_distributed(train_per_token, 2, args=(configs,), timeout=600)


def _reference_losses(per_token: bool = False) -> List[float]:
    from megatron.config import ModelConfig
    from megatron.data.gpt_dataset import MockGPTDataset
    from megatron.model import GPTModel
    from megatron.tensor_parallel.utils import TPInfo

    from tests.unit.test_document_masks import _reference

    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, padded_vocab_size=64, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.float64)
    model = GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                     layer_numbers=range(4), seed=7)
    data = MockGPTDataset(STEPS * 8, 16, 9, 7)  # --vocab-size 8: 9 ids, eod 8
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for t in range(STEPS):
        opt.zero_grad(set_to_none=True)
        text = torch.stack([torch.as_tensor(data[i]["text"]) for i in range(8 * t, 8 * t + 8)])
        tokens, labels = text[:, :-1].long(), text[:, 1:].long()
        if per_token:      # --eod-mask-loss only; the mean over the batch's loss tokens
            mask, loss_mask, pos = _reference(tokens, 8, False, False, True)
            token_losses = model(tokens, pos, None, labels=labels)
            loss = (token_losses * loss_mask).sum() / loss_mask.sum()
        else:              # the trainer's mean over 4 microbatches of 2 samples
            mask, loss_mask, pos = _reference(tokens, 8, True, True, True)
            token_losses = model(tokens, pos, mask, labels=labels)
            per_mb = (token_losses * loss_mask).view(4, -1).sum(1) / loss_mask.view(4, -1).sum(1)
            loss = per_mb.mean()
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return losses


def _losses(results, name: str) -> List[float]:
    last = next(r[name] for r in results if r[name]["losses"])
    return [last["losses"][t] for t in sorted(last["losses"])]


def test_pipeline_and_replicas_equal_the_reference_loop(two_ranks):
    ref = _reference_losses()
    for name in ("docs_d2", "docs_w2", "docs_t2sp"):
        got = _losses(two_ranks, name)
        assert len(got) == STEPS and all(math.isclose(a, b, rel_tol=1e-10, abs_tol=1e-12)
                                         for a, b in zip(got, ref)), (name, got, ref)
    plain = _losses(two_ranks, "plain_d2")
    assert all(abs(a - b) > 1e-6 for a, b in zip(plain, ref))   # the flags change training


def test_per_token_loss_is_the_mean_over_the_global_batchs_tokens(per_token):
    ref = _reference_losses(per_token=True)
    for name in ("tok_d2", "tok_w2", "tok_t2"):
        got = _losses(per_token, name)
        assert len(got) == STEPS and all(math.isclose(a, b, rel_tol=1e-10, abs_tol=1e-12)
                                         for a, b in zip(got, ref)), (name, got, ref)
    mean = _losses(per_token, "mean_d2")     # the default: the mean of microbatch means
    assert all(abs(a - b) > 1e-6 for a, b in zip(mean, ref))

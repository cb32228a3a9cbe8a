"""QA pass 60: differences from Megatron-LM found in files outside megatron/model
(flag tables, the BERT entry point).  Each test fails on the current code and is
fixed after the pass (the GeLU-fusion wording, --apply-layernorm-1p's refusal); BERT's
token types without the binary head stay different, as docs/data.md says.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron import megatron_lm_flags
from megatron.arguments import parse_and_validate

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--train-iters", "1", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--lr", "1e-4"]


def _flag(name):
    return next(f for f in megatron_lm_flags.FLAGS if f.name == name)


def test_megatrons_fused_bias_gelu_is_the_tanh_approximation():
    """Megatron-LM's ParallelMLP (legacy and Core) uses its fused bias-GeLU whenever the
    activation is GeLU with biases and --bias-gelu-fusion is on, its default; that
    kernel computes x/2 (1 + tanh(0.79788456 x (1 + 0.044715 x^2))), not erf's GeLU."""
    x = torch.linspace(-6, 6, 10001, dtype=torch.float64)
    fused = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
    torch.testing.assert_close(fused, F.gelu(x, approximate="tanh"), rtol=0, atol=1e-8)
    assert (fused - F.gelu(x)).abs().max() > 4e-4


def test_the_bias_gelu_flags_do_not_claim_the_same_arithmetic():
    for name in ("--bias-gelu-fusion", "--no-bias-gelu-fusion"):
        assert "arithmetic is the same" not in _flag(name).why, name


def test_bert_without_binary_head_keeps_two_token_types_as_documented():
    """Megatron-LM's pretrain_bert builds no token-type embeddings with
    --bert-no-binary-head (num_tokentypes = 2 if args.bert_binary_head else 0); this
    trainer keeps two, a difference docs/data.md lists (its samples keep two segments)."""
    from pretrain_bert import add_bert_args

    _, cfg = parse_and_validate(BASE + ["--bert-no-binary-head"], add_bert_args,
                                world_size=1)
    assert cfg.model.num_tokentypes == 2


def test_apply_layernorm_1p_is_refused_by_name():
    assert any(f.name == "--apply-layernorm-1p" and f.kind == "refused"
               for f in megatron_lm_flags.FLAGS)

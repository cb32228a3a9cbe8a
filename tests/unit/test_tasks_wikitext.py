"""WIKITEXT103 perplexity: window bookkeeping, formulas, and the task vs a direct loss."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tasks.zeroshot_gpt.datasets import (LMWindowDataset, count_words, num_windows,
                                         wikitext_detokenize)
from tasks.zeroshot_gpt.evaluate import perplexity

TEXT = (" \n = Robert Boulter = \n \n Robert Boulter is an English film , television and "
        "theatre actor . He had a guest @-@ starring role on the television series The Bill "
        "in 2000 . In 2004 Boulter landed a role as \" Craig \" in the episode \" Teddy 's "
        "Story \" ; he starred alongside 1 @,@ 000 actors ( roughly ) . \n")


@pytest.mark.parametrize("num_tokens, seq, stride", [(2, 4, 4), (5, 4, 4), (40, 8, 8),
                                                     (41, 8, 3), (9, 8, 1), (100, 16, 5)])
def test_every_target_is_scored_exactly_once(num_tokens, seq, stride):
    ds = LMWindowDataset(list(range(num_tokens)), seq, stride, pad_id=-1)
    assert len(ds) == num_windows(num_tokens, seq, stride)
    seen = []
    for k in range(len(ds)):
        s = ds[k]
        assert s["text"].shape == (seq + 1,) and s["loss_mask"].shape == (seq,)
        for i in np.flatnonzero(s["loss_mask"]):
            target = s["text"][i + 1]
            assert target != -1
            seen.append(int(target))
            if k > 0:  # at least seq - stride tokens of context
                assert i >= seq - stride
    assert sorted(seen) == list(range(1, num_tokens))


def test_bad_stride():
    with pytest.raises(ValueError, match="--overlapping-eval"):
        LMWindowDataset(list(range(10)), 4, 5, pad_id=0)


def test_perplexity_formulas():
    r = perplexity(total_loss=30.0, num_tokens=11, num_words=6)
    assert r.avg_loss == pytest.approx(3.0) and r.ppl == pytest.approx(math.exp(3.0))
    assert r.token_ratio == pytest.approx(10 / 5)
    assert r.adjusted_ppl == pytest.approx(math.exp(30.0 / 5))


def test_detokenizer():
    out = wikitext_detokenize(TEXT)
    assert "= Robert Boulter =" in out
    assert "guest-starring" in out and "film, television" in out and "actor. He" in out
    assert '"Craig"' in out and "Teddy's Story" in out and "1,000 actors (roughly)." in out
    assert count_words(TEXT) == len(TEXT.split()) + 2  # Megatron-LM's: the line ends count


# ------------------------------------------------------------------ the two computations
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--tokenizer-type", "CharTokenizer",
         "--make-vocab-size-divisible-by", "64", "--seed", "3", "--num-workers", "0", "--fp64",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


def _direct_total_loss(ckpt: str, tokens, seq: int, stride: int) -> float:
    """Target-centred reference: target j is predicted from the window that first covers
    it, i.e. start k * stride with k = 0 if j <= seq else ceil((j - seq) / stride)."""
    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      padded_vocab_size=320, hidden_dropout=0.0, attention_dropout=0.0,
                      params_dtype=torch.float64)
    model = GPTModel(cfg, TPInfo.single(), seed=0)
    from megatron.checkpoint_files import load_payload

    payload = load_payload(os.path.join(ckpt, "iter_0000001", "mp_rank_00", "model_optim_rng"))
    model.load_state_dict(payload["model"])
    model.eval()
    tokens = torch.tensor(tokens)
    logits_of = {}
    total = 0.0
    with torch.no_grad():
        for j in range(1, len(tokens)):
            k = 0 if j <= seq else math.ceil((j - seq) / stride)
            if k not in logits_of:
                window = tokens[k * stride: k * stride + seq].unsqueeze(0)
                pos = torch.arange(window.shape[1]).unsqueeze(0)
                logits_of[k] = model(window, pos, None)[0]
            logit = logits_of[k][j - 1 - k * stride]
            total += F.cross_entropy(logit.unsqueeze(0), tokens[j].unsqueeze(0)).item()
    return total


def test_task_perplexity_equals_direct_loss(tmp_path):
    torch.set_num_threads(1)
    import pretrain_gpt
    from megatron.tokenizer.tokenizer import CharTokenizer
    from tasks.main import main

    ckpt = str(tmp_path / "gpt")
    pretrain_gpt.main(MODEL + ["--mock-data", "--micro-batch-size", "2",
                               "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-2",
                               "--eval-iters", "0", "--save", ckpt, "--log-interval", "100"])
    path = tmp_path / "wiki.test.tokens"
    path.write_text(TEXT)
    tokens = CharTokenizer().tokenize(wikitext_detokenize(TEXT))
    for stride in (None, 5):
        extra = ["--overlapping-eval", str(stride)] if stride else []
        result = main(MODEL + ["--task", "WIKITEXT103", "--valid-data", str(path), "--load", ckpt,
                               "--micro-batch-size", "3"] + extra)
        direct = _direct_total_loss(ckpt, tokens, 16, stride or 16)
        assert result.num_tokens == len(tokens) and result.num_words == len(TEXT.strip().split(" "))
        assert result.total_loss == pytest.approx(direct, rel=1e-10)
        assert result.ppl == pytest.approx(math.exp(direct / (len(tokens) - 1)), rel=1e-10)
        assert result.adjusted_ppl == pytest.approx(
            math.exp(direct / (len(TEXT.strip().split(" ")) - 1)), rel=1e-9)


@pytest.mark.parametrize("stride", ["0", "-2", "17"])
def test_overlapping_eval_out_of_range_is_one_line_before_the_model(tmp_path, capsys,
                                                                   monkeypatch, stride):
    """The stride must be in [1, --seq-length]: checked with the flags, before any process
    group, model or checkpoint (0 used to fall back to --seq-length silently, 17 to fail
    with a traceback after loading the model)."""
    import megatron.training
    from tasks.main import main

    def too_late(*args, **kwargs):
        raise AssertionError("--overlapping-eval was not checked before the model setup")

    monkeypatch.setattr(megatron.training, "initialize_megatron", too_late)
    path = tmp_path / "wiki.test.tokens"
    path.write_text(TEXT)
    with pytest.raises(SystemExit) as info:
        main(MODEL + ["--task", "WIKITEXT103", "--valid-data", str(path), "--load",
                      str(tmp_path / "ckpt"), "--micro-batch-size", "2",
                      "--overlapping-eval", stride])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --overlapping-eval {stride}:"), err
    assert "[1, --seq-length 16]" in err[0], err


def test_overlapping_eval_bounds():
    from tasks.zeroshot_gpt.evaluate import overlapping_eval_error

    assert overlapping_eval_error(None, 16) is None
    assert overlapping_eval_error(1, 16) is None and overlapping_eval_error(16, 16) is None
    assert "--overlapping-eval 0" in overlapping_eval_error(0, 16)
    assert "--seq-length 16" in overlapping_eval_error(17, 16)

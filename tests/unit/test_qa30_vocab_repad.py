"""Loading a checkpoint into a model with more vocabulary padding rows (another t or
--make-vocab-size-divisible-by: finetuning, WikiText evaluation) re-pads as
tools/checkpoint_util.py does: new rows copy the last padding row.  Zero rows gave those
logits 0, a likely value, and shifted the loss ~5x more than the resharding tool."""
from __future__ import annotations

import warnings

import torch

from megatron.model.gpt_model import GPTModel
from tests.unit.test_hf_interop import TP, VOCAB, _cfg, _save
from tools.checkpoint_util import load_into_stage


def _load(tmp_path, vocab_size):
    torch.manual_seed(0)
    cfg = _cfg()  # 128 padded rows for VOCAB = 96 (recorded divisor 64)
    src = GPTModel(cfg, TP, seed=5).eval()
    with torch.no_grad():  # padding rows as training leaves them: far below the real ones
        src.embedding.word_embeddings.weight[VOCAB:] = -3.0
    root = _save(str(tmp_path / "ckpt"), src, cfg)
    dst = GPTModel(_cfg(padded_vocab_size=192), TP, seed=9).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 'different vocabulary padding' warning
        load_into_stage(dst, root, layer_offset=0, tp_rank=0, tp_size=1,
                        vocab_size=vocab_size, flag="--load")
    return src.embedding.word_embeddings.weight, dst.embedding.word_embeddings.weight


def test_new_padding_rows_copy_the_last_padding_row(tmp_path):
    old, new = _load(tmp_path / "a", VOCAB)
    assert torch.equal(new[:128], old)
    assert torch.equal(new[128:], old[-1:].expand(64, -1))
    old, new = _load(tmp_path / "b", None)  # unknown vocabulary: the last row may be a token
    assert torch.equal(new[:128], old) and not new[128:].any()

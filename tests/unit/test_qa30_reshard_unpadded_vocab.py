"""Resharding a checkpoint whose vocabulary has no padding rows (vocab 128, divisor 128)
to t=2 adds 128 rows.  They were zero rows: logit 0, which outweighs every real token of
a model whose logits are negative (a trained GPT-2's are).  They are now the mean row,
whose logit is the mean logit, so the loss can move by at most log(2) here and
log(1 + new / vocab) in general."""
from __future__ import annotations

import os

import torch

from tests.unit.test_tasks_checkpoint_util import _trained_full_state_checkpoint
from tools.checkpoint_util import convert, merge_checkpoint, read_checkpoint


def test_new_rows_of_an_unpadded_vocabulary_are_the_mean_row(tmp_path):
    src, model, _ = _trained_full_state_checkpoint(str(tmp_path / "src"), divisible_by=128,
                                                   vocab=128)
    convert(src, str(tmp_path / "t2"), tp=2, pp=1, dp=1)
    table = merge_checkpoint(read_checkpoint(str(tmp_path / "t2")))[
        "embedding.word_embeddings.weight"]
    old = model.embedding.word_embeddings.weight.detach()
    assert table.shape[0] == 256 and torch.equal(table[:128], old)
    mean = old.double().mean(0).to(old.dtype)
    assert torch.equal(table[128:], mean.expand(128, -1))
    assert os.path.isdir(tmp_path / "t2" / "iter_0000007")

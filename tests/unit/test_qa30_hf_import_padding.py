"""--from-hf pads the vocabulary with rows that cannot take the softmax over.

Our loss (as Megatron-LM's) runs the softmax over the padding rows too.  They were zero
rows, logit 0, while a trained GPT-2's logits are far below 0 (its embeddings share one
direction that its final hidden states point against): the imported model's loss was
then wrong by nats.  Built here in small: a GPT-2 whose logits are about -12 scored
4.85 in transformers and 15.5 after import.  The mean row's logit is the mean logit, so
the loss can move by at most log(1 + padding / vocab)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from megatron.hf_import import hf_gpt2_to_ours  # noqa: E402


def test_imported_padding_rows_leave_the_loss_of_a_negative_logit_gpt2(tmp_path):
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=100, n_positions=16, n_embd=16, n_layer=1, n_head=2)).eval()
    with torch.no_grad():  # GPT-2's geometry: a shared embedding direction u, h against it
        u = torch.nn.functional.normalize(torch.randn(16), dim=0)
        hf.transformer.wte.weight.mul_(10).add_(4 * u)
        hf.transformer.ln_f.weight.fill_(0.3)
        hf.transformer.ln_f.bias.copy_(-4 * u)
    hf.save_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(ids).logits
        hidden = hf.transformer(ids).last_hidden_state
    assert logits.max() < -5  # every real logit far below 0
    theirs = F.cross_entropy(logits[:, :-1].reshape(-1, 100), ids[:, 1:].reshape(-1))
    full, _, vocab = hf_gpt2_to_ours(str(tmp_path / "hf"), 128, 1)
    table = full["embedding.word_embeddings.weight"]
    assert vocab == 100 and table.shape[0] == 128 and torch.equal(table[:100],
                                                                  hf.transformer.wte.weight)
    ours = F.cross_entropy((hidden @ table.t())[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    assert 0 <= (ours - theirs).item() <= math.log(1 + 28 / 100) + 1e-6

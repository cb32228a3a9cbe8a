"""Document boundaries inside a GPT sample: Megatron-LM's left-to-right masks.

A GPT sample is ``seq_length + 1`` tokens cut from the concatenated corpus, so it often
spans several documents separated by the end-of-document id (``--append-eod`` in
``tools/preprocess_data.py``).  By default attention runs across those boundaries and
positions count from the start of the sample, as in Megatron-LM.  Its three flags change
that, each on its own:

* ``--eod-mask-loss``: no loss on the end-of-document tokens (the prediction of the token
  after an eod, the next document's first token, is not trained);
* ``--reset-position-ids``: positions restart at 0 after every eod;
* ``--reset-attention-mask``: a token attends only to earlier tokens of its own document.

The eod token belongs to the document it ends.  Everything is computed with tensor
operations on the device, without a host round trip: a cumulative sum numbers the
documents of each row and a cumulative max finds each token's document start.  Megatron-LM
loops over the eod positions in Python; ``tests/unit/test_document_masks.py`` keeps such
a loop as the reference.

RoPE needs no reset: with ``--reset-attention-mask`` a query meets only keys of its own
document, and a rotary score depends on the two positions' difference only, which the
reset does not change.  Learned absolute positions do change (``--reset-position-ids``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: which document of its row each token is in (0, 1, ...); the token
    after an eod starts the next one."""
    starts = torch.zeros_like(tokens, dtype=torch.int64)
    starts[:, 1:] = (tokens[:, :-1] == eod).to(torch.int64)
    return starts.cumsum(dim=1)


def ltor_masks_and_position_ids(
        tokens: torch.Tensor, eod: Optional[int], *, reset_position_ids: bool = False,
        reset_attention_mask: bool = False, eod_mask_loss: bool = False,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(attention_mask, loss_mask, position_ids) for the input ``tokens`` [b, s].

    ``attention_mask``: None (plain causal, which keeps the fused causal kernels) unless
    ``reset_attention_mask``; then bool [b, 1, s, s], True = masked: later positions and
    other documents.  ``loss_mask``: float32 [b, s], 0 on eod tokens with
    ``eod_mask_loss``.  ``position_ids``: int64 [b, s], restarting after each eod with
    ``reset_position_ids``.  ``eod`` may be None only when all three flags are off.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if eod is None and (reset_position_ids or reset_attention_mask or eod_mask_loss):
        raise ValueError("--eod-mask-loss, --reset-position-ids and --reset-attention-mask "
                         "need the tokenizer's end-of-document id; got none")
    b, s = tokens.shape
    device = tokens.device
    loss_mask = torch.ones((b, s), dtype=torch.float32, device=device)
    if eod_mask_loss:
        loss_mask.masked_fill_(tokens == eod, 0.0)
    index = torch.arange(s, device=device)
    position_ids = index.unsqueeze(0).expand(b, s)
    attention_mask = None
    if reset_position_ids or reset_attention_mask:
        docs = document_ids(tokens, eod)
        if reset_position_ids:
            # a token's document starts at the last index (up to its own) where a new
            # document began; 0 for the first document of the row
            begins = torch.where(docs[:, 1:] != docs[:, :-1], index[1:], 0)
            start = torch.cat([torch.zeros((b, 1), dtype=torch.int64, device=device),
                               begins], dim=1).cummax(dim=1).values
            position_ids = index - start
        if reset_attention_mask:
            later = torch.ones((s, s), dtype=torch.bool, device=device).triu(1)
            attention_mask = (later | (docs.unsqueeze(2) != docs.unsqueeze(1))).unsqueeze(1)
    return attention_mask, loss_mask, position_ids

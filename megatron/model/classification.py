"""Sequence classification on BERT (MNLI): pooled [CLS] -> dropout -> linear."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel, head_init_key, replicated_linear
from megatron.model.transformer import weight_init_method
from megatron.tensor_parallel import TPInfo, mark_replicated_parameters


class Classification(BertModel):
    """BERT without the pretraining heads plus a ``num_classes``-way classifier.

    Parameter names match ``BertModel``'s, so a pretraining checkpoint loads into it
    (its ``lm_head``/``binary_head`` are simply not used).  On the last stage
    ``forward`` returns logits [b, num_classes]; other stages return hidden states.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, *, num_classes: int,
                 pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Optional[range] = None, seed: int = 1234) -> None:
        if num_classes < 2:
            raise ValueError(f"Classification needs at least 2 classes, got {num_classes}")
        super().__init__(config, tp, pre_process=pre_process, post_process=post_process,
                         layer_numbers=layer_numbers, seed=seed, add_binary_head=False,
                         add_lm_head=False, add_pooler=True)
        self.num_classes = num_classes
        self.classification_dropout = config.hidden_dropout
        self.classification_head = replicated_linear(
            config.hidden_size, num_classes, head_init_key(seed).child("classification_head"),
            weight_init_method(config), config.params_dtype) if post_process else None
        mark_replicated_parameters(self)

    def forward(self, input_ids: Optional[torch.Tensor], padding_mask: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None,
                lm_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.encode(input_ids, padding_mask, tokentype_ids)
        if not self.post_process:
            return hidden.contiguous()
        pooled = self.pooler(hidden)
        # Replicated across TP ranks, so the default RNG stream (same on all) is right.
        pooled = F.dropout(pooled, p=self.classification_dropout, training=self.training)
        return self.classification_head(pooled)

"""Multiple choice on BERT (RACE): one score per (question, option) pair, softmax over options.

A microbatch of b questions with C options each runs through the transformer as b * C
sequences; only the last stage folds the scores back to [b, C].
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel, head_init_key, replicated_linear
from megatron.model.transformer import weight_init_method
from megatron.tensor_parallel import TPInfo, mark_replicated_parameters


def _flatten_choices(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1, t.shape[-1])


class MultipleChoice(BertModel):
    """BERT without the pretraining heads plus a scalar score per option.

    Inputs are [b, C, s]; the last stage returns logits [b, C], other stages hidden
    states [s, b * C, h].
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, *, num_choices: int = 4,
                 pre_process: bool = True, post_process: bool = True,
                 layer_numbers: Optional[range] = None, seed: int = 1234) -> None:
        if num_choices < 2:
            raise ValueError(f"MultipleChoice needs at least 2 choices, got {num_choices}")
        super().__init__(config, tp, pre_process=pre_process, post_process=post_process,
                         layer_numbers=layer_numbers, seed=seed, add_binary_head=False,
                         add_lm_head=False, add_pooler=True)
        self.num_choices = num_choices
        self.multichoice_dropout = config.hidden_dropout
        self.multichoice_head = replicated_linear(
            config.hidden_size, 1, head_init_key(seed).child("multichoice_head"),
            weight_init_method(config), config.params_dtype) if post_process else None
        mark_replicated_parameters(self)

    def stage_input_shape(self, micro_batch_size: int) -> Tuple[int, int, int]:
        # b * C sequences per microbatch; under sequence parallelism this tensor rank's
        # s/t positions of each, as for every other stage (``PipelineStage``)
        return super().stage_input_shape(micro_batch_size * self.num_choices)

    def forward(self, input_ids: Optional[torch.Tensor], padding_mask: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None,
                lm_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if padding_mask.dim() != 3 or padding_mask.shape[1] != self.num_choices:
            raise ValueError(f"MultipleChoice expects [batch, {self.num_choices}, seq] inputs, "
                             f"got padding_mask of shape {tuple(padding_mask.shape)}")
        b = padding_mask.shape[0]
        hidden = self.encode(_flatten_choices(input_ids), _flatten_choices(padding_mask),
                             _flatten_choices(tokentype_ids))
        if not self.post_process:
            return hidden.contiguous()
        pooled = F.dropout(self.pooler(hidden), p=self.multichoice_dropout,
                           training=self.training)
        return self.multichoice_head(pooled).view(b, self.num_choices)

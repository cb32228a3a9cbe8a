"""Input embeddings and the tied output projection shared by GPT and BERT."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.tensor_parallel import (InitKey, InitMethod, TPInfo, VocabParallelEmbedding,
                                      copy_to_tp_region, get_rng_tracker,
                                      linear_with_sequence_gather,
                                      reduce_scatter_to_sequence_parallel_region,
                                      scatter_to_sequence_parallel_region)
from megatron.tensor_parallel.param_init import EMBEDDING_LAYER, full_tensor
from megatron.model.transformer import sequence_parallel, weight_init_method
from megatron.model.utils import position_ids_for


def embedding_init_key(seed: int) -> InitKey:
    """Init key of everything in the embedding layer (also the last stage's tied copy)."""
    return InitKey(seed, EMBEDDING_LAYER)


def _replicated_table(rows: int, cols: int, key: InitKey, init_method: InitMethod,
                      dtype: torch.dtype) -> nn.Embedding:
    table = nn.Embedding(rows, cols, dtype=dtype)
    with torch.no_grad():
        table.weight.copy_(full_tensor((rows, cols), key.child("weight"), init_method,
                                       dtype))
    return table


class Embedding(nn.Module):
    """Word (vocab-parallel) + learned position (+ token-type) embeddings, then dropout.

    Returns [seq, batch, hidden].  Dropout draws from the default stream, identical on all
    TP ranks, because the embedding output is replicated across them.  With RoPE
    (``position_embedding_type='rope'``) there is no position table: positions enter as
    rotations of queries and keys in every attention layer.

    With sequence parallelism each tensor rank returns its s/t positions, [s/t, b, h],
    and its dropout draws from the tensor-parallel stream (the ranks hold different
    positions).  Word embeddings alone (RoPE, no token types) are reduce-scattered
    straight to that slice; with position or token-type tables the sum is all-reduced,
    the tables added to the whole sequence and this rank's slice kept, so that every
    rank holds the tables' whole gradient (Megatron-LM's choice too).

    With a float32 residual stream (--fp32-residual-connection under fp16/bf16) the sum
    of the tables is cast to float32 before the sequence is scattered and dropped out,
    as in Megatron-LM; the reduce-scattered word embeddings are cast after the
    reduce-scatter, which is exact either way (each position's vector comes from one
    rank, the others add zeros) and moves half the bytes.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, *, seed: int,
                 num_tokentypes: int = 0) -> None:
        super().__init__()
        if config.padded_vocab_size <= 0:
            raise ValueError("ModelConfig.padded_vocab_size must be set (> 0) before building "
                             "the embedding; it comes from the tokenizer's padded vocab size")
        key = embedding_init_key(seed)
        init = weight_init_method(config)
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, h, tp=tp, init_method=init,
            params_dtype=config.params_dtype, init_key=key.child("word_embeddings"))
        self.position_embeddings = _replicated_table(
            config.max_position_embeddings, h, key.child("position_embeddings"), init,
            config.params_dtype) if config.uses_position_table else None
        self.tokentype_embeddings = _replicated_table(
            num_tokentypes, h, key.child("tokentype_embeddings"), init,
            config.params_dtype) if num_tokentypes > 0 else None
        self.dropout = config.hidden_dropout
        self.tp = tp
        self.sequence_parallel = sequence_parallel(config, tp)
        self.residual_dtype = config.residual_dtype

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        tables = self.position_embeddings is not None or self.tokentype_embeddings is not None
        if self.sequence_parallel and not tables:
            x = self.word_embeddings.partial(input_ids).transpose(0, 1)  # [s, b, h]
            x = reduce_scatter_to_sequence_parallel_region(x, self.tp)
            return self._dropout(x.to(self.residual_dtype))
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = position_ids_for(input_ids)
            x = x + self.position_embeddings(position_ids)
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise ValueError("this model has token-type embeddings: pass tokentype_ids")
            x = x + self.tokentype_embeddings(tokentype_ids)
        x = x.transpose(0, 1).contiguous().to(self.residual_dtype)  # [b, s, h] -> [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp)
        return self._dropout(x)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        if self.sequence_parallel:  # each rank holds other positions: its own mask
            with get_rng_tracker().fork():
                return F.dropout(x, p=self.dropout, training=True)
        return F.dropout(x, p=self.dropout, training=True)


def parallel_lm_logits(hidden: torch.Tensor, word_weight: torch.Tensor,
                       tp: TPInfo, sequence_parallel: bool = False) -> torch.Tensor:
    """Logits of this rank's vocabulary slice: [s, b, h] x [V/t, h]^T -> [s, b, V/t].
    ``sequence_parallel``: hidden is this rank's [s/t, b, h], gathered for the matmul
    (and kept at s/t for the backward); the logits cover the whole sequence."""
    if sequence_parallel:
        return linear_with_sequence_gather(hidden, word_weight, None, tp)
    return F.linear(copy_to_tp_region(hidden, tp), word_weight)

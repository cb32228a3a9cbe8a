"""GPT: embeddings -> transformer layers -> final LN -> logits against the word embedding.

One class serves every pipeline stage: ``pre_process`` (first stage) adds the
embeddings, ``post_process`` (last stage) the final LayerNorm, output projection and
loss, and ``layer_numbers`` picks the stage's global layers.  A stage that does not
embed receives its input through ``set_input_tensor`` (Megatron's seam, called by the
pipeline executor before ``forward``).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.config import ModelConfig
from megatron.model.language_model import Embedding, embedding_init_key, parallel_lm_logits
from megatron.model.stage import PipelineStage
from megatron.model.transformer import (ParallelTransformer, check_architecture,
                                        sequence_parallel, weight_init_method)
from megatron.tensor_parallel import (ColumnParallelLinear, TPInfo, VocabParallelEmbedding,
                                      divide, mark_replicated_parameters,
                                      vocab_parallel_cross_entropy)


def _check_config(config: ModelConfig, tp: TPInfo, layer_numbers: range,
                  pre_process: bool, post_process: bool) -> None:
    if config.kv_channels is None:  # the head size comes from hidden / heads
        divide(config.hidden_size, config.num_attention_heads, "--hidden-size")
    divide(config.num_attention_heads, tp.size, "--num-attention-heads")
    divide(config.ffn_hidden_size, tp.size, "--ffn-hidden-size")
    divide(config.padded_vocab_size, tp.size, "padded vocab size")
    check_architecture(config, tp)
    if pre_process != (layer_numbers.start == 0):
        raise ValueError(f"pre_process={pre_process} but layer_numbers {layer_numbers} "
                         f"{'does' if layer_numbers.start == 0 else 'does not'} start at layer 0")
    if post_process != (layer_numbers.stop == config.num_layers):
        raise ValueError(f"post_process={post_process} but layer_numbers {layer_numbers} "
                         f"{'does' if layer_numbers.stop == config.num_layers else 'does not'} "
                         f"end at the last layer ({config.num_layers})")


class GPTModel(PipelineStage):
    """One pipeline stage (or the whole model) of a GPT language model.

    ``seed`` fixes the initial weights (see megatron/tensor_parallel/param_init.py);
    models built with the same seed agree on every parameter whatever their TP size
    and stage split.  ``share_embeddings_and_output_weights`` (None: not
    ``config.untie_embeddings_and_output_weights``) ties the output layer to the word
    embedding.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, *, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: Optional[range] = None,
                 share_embeddings_and_output_weights: Optional[bool] = None,
                 seed: int = 1234) -> None:
        super().__init__()
        if layer_numbers is None:
            layer_numbers = range(config.num_layers)
        if share_embeddings_and_output_weights is None:
            share_embeddings_and_output_weights = not config.untie_embeddings_and_output_weights
        _check_config(config, tp, layer_numbers, pre_process, post_process)
        self.config = config
        self.tp = tp
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_numbers = layer_numbers
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.input_tensor: Optional[torch.Tensor] = None

        self.embedding = Embedding(config, tp, seed=seed) if pre_process else None
        self.encoder = ParallelTransformer(config, tp, layer_numbers, seed=seed,
                                           post_layer_norm=post_process)
        self.output_word_embeddings = None
        self.output_layer = None
        if post_process and share_embeddings_and_output_weights and not pre_process:
            # The last stage's copy of the tied weight, drawn by the same rule (same key)
            # as the first stage's word embedding so the copies start identical; the
            # trainer keeps them identical by all-reducing their gradients.
            self.output_word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size, tp=tp,
                init_method=weight_init_method(config),
                params_dtype=config.params_dtype,
                init_key=embedding_init_key(seed).child("word_embeddings"))
            self.output_word_embeddings.weight.shared = True
            self.output_word_embeddings.weight.shared_embedding = True
        elif post_process and not share_embeddings_and_output_weights:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, tp=tp, bias=False,
                init_method=weight_init_method(config),
                params_dtype=config.params_dtype,
                init_key=embedding_init_key(seed).child("output_layer"),
                sequence_parallel=config.sequence_parallel)
        if pre_process and share_embeddings_and_output_weights:
            self.embedding.word_embeddings.weight.shared_embedding = True
        # the input and output layers (--decoupled-lr), marked as Megatron-LM marks them
        for layer in (self.embedding, self.output_word_embeddings, self.output_layer):
            if layer is not None:
                weight = layer.word_embeddings.weight if layer is self.embedding else layer.weight
                weight.is_embedding_or_output_parameter = True
        mark_replicated_parameters(self)

    def _output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.output_layer is not None:
            logits, _ = self.output_layer(hidden)
            return logits
        return parallel_lm_logits(hidden, self.shared_embedding_weight(), self.tp,
                                  sequence_parallel(self.config, self.tp))

    # -- forward ------------------------------------------------------------------------
    def forward(self, input_ids: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor],
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-token loss [b, s] (last stage, labels given), logits [b, s, V/t] (last
        stage, no labels) or the hidden states [s, b, h] sent to the next stage
        ([s/t, b, h], this rank's positions, with sequence parallelism).

        ``attention_mask``: bool, True = masked, broadcastable to [b, heads, s, s]; None
        means causal (and lets CUDA use the fused causal kernel).
        """
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask must be a bool tensor (True = masked), "
                             f"got {attention_mask.dtype}")
        if self.pre_process:
            hidden = self.embedding(input_ids, position_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("GPTModel stage without pre_process: call "
                                   "set_input_tensor(previous stage output) before forward")
            hidden = self.input_tensor
        hidden = self.encoder(hidden, attention_mask)
        if not self.post_process:
            return hidden.contiguous()
        logits = self._output_logits(hidden)  # [s, b, V/t]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        # the logits are a temporary: the loss may write their gradient in place
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.tp,
                                            inplace_backward=True,
                                            fused=self.config.cross_entropy_loss_fusion)
        return loss.transpose(0, 1).contiguous()

"""BERT: embeddings (+ token types) -> bidirectional transformer -> MLM and SOP/NSP heads.

Like ``GPTModel``, one class serves every pipeline stage.  ``pre_process`` (first stage)
adds the word/position/token-type embeddings, ``post_process`` (last stage) the final
LayerNorm, the pooler over the [CLS] position, the masked-LM head (tied to the word
embedding) and the binary sentence-order head.  Non-first stages receive the previous
stage's [s, b, h] output through ``set_input_tensor``.

The padding mask is data, not activation: ``forward_step`` hands every stage the whole
microbatch, so each stage rebuilds the [b, 1, s, s] attention mask from the [b, s]
padding mask itself and only the hidden states travel between stages.

Finetuning models (``megatron.model.classification``, ``megatron.model.multiple_choice``)
subclass this one without the pretraining heads, so a pretraining checkpoint loads into
them by parameter name.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.language_model import Embedding, embedding_init_key, parallel_lm_logits
from megatron.model.stage import PipelineStage
from megatron.model.transformer import (ParallelTransformer, layer_norm, non_gpt2_options,
                                        sequence_parallel, weight_init_method)
from megatron.model.utils import padding_attention_mask
from megatron.tensor_parallel import (InitKey, InitMethod, TPInfo, VocabParallelEmbedding,
                                      divide, gather_from_sequence_parallel_region,
                                      mark_replicated_parameters,
                                      vocab_parallel_cross_entropy)
from megatron.tensor_parallel.param_init import full_tensor, set_tensor_model_parallel_attributes

BertOutput = Union[torch.Tensor, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


def head_init_key(seed: int) -> InitKey:
    """Init key of the parameters after the last transformer layer (pooler and heads)."""
    return embedding_init_key(seed).child("bert_heads")


def replicated_linear(in_features: int, out_features: int, key: InitKey,
                      init_method: InitMethod, dtype: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` (same on every TP rank) drawn by the layout-independent rule,
    with ``init_method`` (the model's: ``weight_init_method``)."""
    layer = nn.Linear(in_features, out_features, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(full_tensor((out_features, in_features), key.child("weight"),
                                       init_method, dtype))
        layer.bias.zero_()
    return layer


def bert_attention_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool mask (True = masked) from a [b, s] mask of 1 = real token."""
    return padding_attention_mask(padding_mask)


class Pooler(nn.Module):
    """tanh(W h[CLS] + b): the sentence representation the binary and task heads use."""

    def __init__(self, config: ModelConfig, key: InitKey) -> None:
        super().__init__()
        self.dense = replicated_linear(config.hidden_size, config.hidden_size,
                                       key.child("dense"), weight_init_method(config),
                                       config.params_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> [b, h] from sequence position 0."""
        return torch.tanh(self.dense(hidden[0]))


class BertLMHead(nn.Module):
    """dense -> gelu -> LayerNorm, then logits against the (tied) word embedding + bias.

    The output bias is split across tensor-parallel ranks like the vocabulary.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, key: InitKey) -> None:
        super().__init__()
        self.tp = tp
        self.gelu_approximate = config.gelu_approximate
        self.dense = replicated_linear(config.hidden_size, config.hidden_size,
                                       key.child("dense"), weight_init_method(config),
                                       config.params_dtype)
        self.layernorm = layer_norm(config)
        per_rank = divide(config.padded_vocab_size, tp.size, "padded vocab size")
        self.bias = nn.Parameter(torch.zeros(per_rank, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def forward(self, hidden: torch.Tensor, word_weight: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, V/t] logits of this rank's vocabulary slice."""
        hidden = self.layernorm(F.gelu(self.dense(hidden), approximate=self.gelu_approximate))
        return parallel_lm_logits(hidden, word_weight, self.tp) + self.bias


def _check_stage(config: ModelConfig, tp: TPInfo, layer_numbers: range, pre_process: bool,
                 post_process: bool) -> None:
    if config.kv_channels is None:  # the head size comes from hidden / heads
        divide(config.hidden_size, config.num_attention_heads, "--hidden-size")
    divide(config.num_attention_heads, tp.size, "--num-attention-heads")
    # the MLP's column split: named here, as GPT's check does, not as a layer's width
    divide(config.ffn_hidden_size, tp.size, "--ffn-hidden-size")
    divide(config.padded_vocab_size, tp.size, "padded vocab size")
    if pre_process != (layer_numbers.start == 0):
        raise ValueError(f"BertModel: pre_process={pre_process} but layer_numbers "
                         f"{layer_numbers} {'starts' if layer_numbers.start == 0 else 'does not start'}"
                         f" at layer 0")
    if post_process != (layer_numbers.stop == config.num_layers):
        raise ValueError(f"BertModel: post_process={post_process} but layer_numbers "
                         f"{layer_numbers} and --num-layers {config.num_layers} disagree")
    llama = non_gpt2_options(config)
    if llama:
        raise ValueError(f"BertModel is built with BERT's block (LayerNorm, learned "
                         f"positions, GeLU, biases, tied output): {', '.join(llama)} "
                         f"apply to GPT models only")
    if pre_process and config.num_tokentypes < 1:
        raise ValueError("BertModel needs token-type embeddings: ModelConfig.num_tokentypes "
                         "must be >= 1 (2 for sentence pairs)")


class BertModel(PipelineStage):
    """One pipeline stage (or all) of BERT.

    On the last stage ``forward`` returns ``(lm_output, binary_logits)``: the per-token
    MLM loss [b, s] when ``lm_labels`` is given (else logits [b, s, V/t]) and the
    sentence-order logits [b, 2] (None without the binary head).  Other stages return
    the hidden states [s, b, h] for the next stage.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, *, pre_process: bool = True,
                 post_process: bool = True, layer_numbers: Optional[range] = None,
                 seed: int = 1234, add_binary_head: bool = True, add_lm_head: bool = True,
                 add_pooler: Optional[bool] = None) -> None:
        super().__init__()
        if layer_numbers is None:
            layer_numbers = range(config.num_layers)
        _check_stage(config, tp, layer_numbers, pre_process, post_process)
        self.config = config
        self.tp = tp
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_numbers = layer_numbers
        self.add_lm_head = add_lm_head
        self.add_binary_head = add_binary_head
        self.input_tensor: Optional[torch.Tensor] = None
        heads = head_init_key(seed)

        self.embedding = Embedding(config, tp, seed=seed,
                                   num_tokentypes=config.num_tokentypes) if pre_process else None
        self.encoder = ParallelTransformer(config, tp, layer_numbers, seed=seed,
                                           post_layer_norm=post_process)
        if add_pooler is None:
            add_pooler = add_binary_head
        self.pooler = Pooler(config, heads.child("pooler")) \
            if post_process and (add_pooler or add_binary_head) else None
        self.lm_head = BertLMHead(config, tp, heads.child("lm_head")) \
            if post_process and add_lm_head else None
        self.binary_head = replicated_linear(config.hidden_size, 2, heads.child("binary_head"),
                                             weight_init_method(config),
                                             config.params_dtype) \
            if post_process and add_binary_head else None
        # The last stage keeps a copy of the word embedding whenever the model is cut
        # (even without an LM head, e.g. when finetuning) because the trainer sums the
        # tied-embedding gradient between the first and last stage of every pipeline.
        self.output_word_embeddings = None
        if post_process and not pre_process:
            self.output_word_embeddings = VocabParallelEmbedding(
                config.padded_vocab_size, config.hidden_size, tp=tp,
                init_method=weight_init_method(config),
                params_dtype=config.params_dtype,
                init_key=embedding_init_key(seed).child("word_embeddings"))
            self.output_word_embeddings.weight.shared = True
            self.output_word_embeddings.weight.shared_embedding = True
        if pre_process:
            self.embedding.word_embeddings.weight.shared_embedding = True
        # the input and output layers (--decoupled-lr), as Megatron-LM marks them; the
        # last stage's copy of the tied embedding too, so both copies move alike
        if pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.output_word_embeddings is not None:
            self.output_word_embeddings.weight.is_embedding_or_output_parameter = True
        mark_replicated_parameters(self)

    # -- forward ------------------------------------------------------------------------
    def encode(self, input_ids: Optional[torch.Tensor], padding_mask: torch.Tensor,
               tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run this stage's embeddings (first stage) and transformer layers: [s, b, h]
        ([s/t, b, h] before the last stage with sequence parallelism)."""
        if padding_mask.dim() != 2:
            raise ValueError(f"padding_mask must be [batch, seq] (1 = token, 0 = padding), got "
                             f"shape {tuple(padding_mask.shape)}")
        mask = bert_attention_mask(padding_mask)
        if self.pre_process:
            if tokentype_ids is None:
                tokentype_ids = torch.zeros_like(input_ids)
            hidden = self.embedding(input_ids, None, tokentype_ids)
        else:
            if self.input_tensor is None:
                raise RuntimeError("BertModel stage without pre_process: call "
                                   "set_input_tensor(previous stage output) before forward")
            hidden = self.input_tensor
        hidden = self.encoder(hidden, mask)
        if self.post_process and sequence_parallel(self.config, self.tp):
            # the heads (pooler at position 0, LM head) run on the whole sequence,
            # replicated on the tensor ranks as without sequence parallelism: each rank's
            # gradient is already whole, so the backward keeps this rank's positions
            hidden = gather_from_sequence_parallel_region(hidden, self.tp,
                                                          tensor_parallel_output_grad=False)
        return hidden

    def forward(self, input_ids: Optional[torch.Tensor], padding_mask: torch.Tensor,
                tokentype_ids: Optional[torch.Tensor] = None,
                lm_labels: Optional[torch.Tensor] = None) -> BertOutput:
        hidden = self.encode(input_ids, padding_mask, tokentype_ids)
        if not self.post_process:
            return hidden.contiguous()
        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(self.pooler(hidden))
        lm_output = None
        if self.lm_head is not None:
            logits = self.lm_head(hidden, self.shared_embedding_weight())  # [s, b, V/t]
            if lm_labels is None:
                lm_output = logits.transpose(0, 1).contiguous()
            else:
                loss = vocab_parallel_cross_entropy(
                    logits, lm_labels.transpose(0, 1), self.tp, inplace_backward=True,
                    fused=self.config.cross_entropy_loss_fusion)
                lm_output = loss.transpose(0, 1).contiguous()
        return lm_output, binary_logits

"""Hugging Face ``transformers`` model directories <-> our checkpoints.

Export (``tools/checkpoint_util.py --load CKPT --to-hf DIR``; DIR new or empty, written
as ``DIR.tmp.PID`` and renamed to DIR at the end, so a failed export leaves no DIR):

* GPT -> ``GPT2LMHeadModel``.  Same architecture: learned positions, pre-LayerNorm
  blocks, GELU (exact: ``activation_function: "gelu"``; with ``--openai-gelu`` the tanh
  approximation, ``"gelu_new"``, as OpenAI's GPT-2; with ``--squared-relu``
  ``"relu2"``, transformers' relu(x)^2 -- not ``"relu"``, which does not square),
  final LayerNorm, output tied to the word embedding (or an untied ``lm_head``).  Weight layout differences:
  transformers' GPT-2 uses ``Conv1D`` ([in, out], the transpose of our Linear weights),
  and its fused ``c_attn`` output is [q of all heads | k | v] while ours is ordered
  [head, (q, k, v), head_dim] so that a tensor-parallel split hands out whole heads.
* Llama-style GPT (``--normalization RMSNorm --position-embedding-type rope --swiglu``,
  any ``--num-query-groups``, biases on all four linear layers or on none, tied or
  untied output) -> ``LlamaForCausalLM``; with ``--disable-bias-linear --add-qkv-bias``
  (biases on q, k, v only) -> ``Qwen2ForCausalLM``; with ``--qk-layernorm`` and no
  biases -> ``Qwen3ForCausalLM`` (its ``q_norm``/``k_norm`` are our per-head query and
  key RMSNorms, applied before RoPE in both).  Our fused QKV rows [group, (the group's
  q heads, k, v), head_dim] become ``q_proj``/``k_proj``/``v_proj``; the SwiGLU weight
  [gate; up] becomes ``gate_proj`` and ``up_proj``; ``--kv-channels`` is ``head_dim``.
  RoPE is the same "rotate half" rotation of whole heads; a ``--rotary-percent`` below
  1 is refused (transformers' Llama does not apply ``partial_rotary_factor``).
  ``--rotary-interleaved`` (pairs (2i, 2i+1)) exports by reordering each query and key
  head's dimensions (and their biases and --qk-layernorm weights) to [even ones, odd
  ones], which turns the interleaved rotation into transformers' rotate-half and leaves
  every q.k product unchanged.  ``--rotary-seq-len-interpolation-factor N`` is
  transformers' ``rope_type: "linear"`` with ``factor`` N (its frequencies divided by N,
  the same angles as our positions divided by N); together with ``--use-rope-scaling``
  it is refused (transformers takes one ``rope_type``).
  ``--use-rope-scaling`` is transformers' ``rope_type: "llama3"`` with Llama 3.1's
  constants (all three models compute their frequencies through the same
  ``rope_type`` table); config.json keeps our ``max_position_embeddings`` even where it
  is not above the original 8192, which transformers warns about and which changes
  nothing it computes (the llama3 frequencies do not depend on it), rather than
  claiming a context the model was not built for.
* Any other combination of the Llama-style options has no transformers model and is
  refused with one line naming the flags; so is a BERT built with any of them (or with
  ``--squared-relu``: MegatronBert's ``hidden_act`` also drives its LM head, which ours
  keeps GeLU), so is any model built with ``--apply-residual-connection-post-layernorm``
  (every target takes its residuals before the norm), and so
  is a checkpoint whose recorded model config holds an option this module does not
  know with a value other than its default (``_check_known_options``): an export never
  drops what it does not understand.
* BERT -> ``MegatronBertForPreTraining`` (or ``MegatronBertForMaskedLM`` without the
  sentence-order head): our BERT is Megatron's pre-LayerNorm BERT, which transformers
  implements under that name; the original post-LayerNorm ``BertForPreTraining`` is a
  different network, so it is not a target.
* The padding rows of the vocabulary (Megatron pads it to a multiple of
  ``make_vocab_size_divisible_by * t``) are dropped: the exported vocabulary has the
  tokenizer's real size.
* Tokenizer files: GPT-2 BPE -> ``vocab.json`` + ``merges.txt``; BERT WordPiece ->
  ``vocab.txt``; a HuggingFaceTokenizer -> its ``save_pretrained`` files; any other
  tokenizer (NullTokenizer, SentencePiece) writes none and says so.  A GPT's config.json
  bos/eos ids are its tokenizer's (``_special_token_ids``: the recorded vocab.json's
  <|endoftext|>, a HuggingFaceTokenizer's own), else null.
* PipeDream-2BW checkpoints: ``model`` (the newest weights) is exported, not the shadow.

Import (``--from-hf DIR --save OUT``): ``megatron.hf_import``, which reads the
weight layouts this module writes.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, check_not_a_file, check_outside,
                                         check_true_vocab, read_full_state,
                                         refuse_unknown_model_options, true_vocab_size)
from megatron.errors import CheckpointError, UserError
from megatron.model.transformer import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                        LLAMA3_ORIGINAL_CONTEXT, flag_number,
                                        non_gpt2_options)

_ATTN = "self_attention.query_key_value"
_GELU_EXACT = ("gelu",)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_RELU_SQUARED = "relu2"
"""transformers' relu(x)^2 (``ReLUSquaredActivation``): our --squared-relu."""


def say(line: str) -> None:
    print(f"checkpoint_util.py: {line}", file=sys.stderr)


# ------------------------------------------------------------------- q/k/v layouts
def qkv_ours_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head, (q, k, v), head_dim] -> [(q, k, v), head, head_dim] (weight or bias)."""
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(heads, 3, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest)


def qkv_hf_to_ours(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(3, heads, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest)


def qkv_ours_to_groups(w: torch.Tensor, heads: int, groups: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [group, (the group's heads/groups q heads, k, v), head_dim] -> (q, k, v)
    with rows [head, head_dim] / [group, head_dim] each: Llama's q/k/v_proj (weight or
    bias).  Query head j belongs to group j // (heads / groups), in both layouts."""
    rest = w.shape[1:]
    per = heads // groups
    hd = w.shape[0] // (heads + 2 * groups)
    grouped = w.reshape(groups, per + 2, hd, *rest)
    q = grouped[:, :per].reshape(heads * hd, *rest)
    k = grouped[:, per].reshape(groups * hd, *rest)
    v = grouped[:, per + 1].reshape(groups * hd, *rest)
    return q, k, v


def qkv_groups_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       groups: int) -> torch.Tensor:
    """The inverse of ``qkv_ours_to_groups``: Llama's q/k/v_proj -> our fused rows."""
    rest = q.shape[1:]
    hd = k.shape[0] // groups
    per = q.shape[0] // (groups * hd)
    return torch.cat([q.reshape(groups, per, hd, *rest), k.reshape(groups, 1, hd, *rest),
                      v.reshape(groups, 1, hd, *rest)], dim=1).reshape(-1, *rest)


class _ReadNames(dict):
    """A state dict that records the names read from it, so that the export can tell
    whether any tensor was left behind."""

    def __init__(self, full: Dict[str, torch.Tensor]) -> None:
        super().__init__(full)
        self.names: set = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.names.add(name)
        return super().__getitem__(name)


def _layers(full: Dict[str, torch.Tensor], num_layers: int):
    for i in range(num_layers):
        yield i, (lambda n, i=i: full[f"encoder.layers.{i}.{n}"])


# --------------------------------------------------------------------------- export
def _gpt2_activation(model_cfg: Dict[str, Any]) -> str:
    """GPT-2's ``activation_function`` for our MLP: transformers' "relu2" is relu(x)^2
    (--squared-relu; its "relu" would not square), "gelu_new" the tanh GELU."""
    if model_cfg.get("squared_relu") is True:
        return "relu2"
    return "gelu_new" if model_cfg.get("openai_gelu") else "gelu"


def gpt_to_hf(full: Dict[str, torch.Tensor], model_cfg: Dict[str, Any], vocab: int
              ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our full GPT state dict -> (GPT2LMHeadModel state dict, config.json dict)."""
    heads = int(model_cfg["num_attention_heads"])
    layers = int(model_cfg["num_layers"])
    tied = "output_layer.weight" not in full
    out = {"transformer.wte.weight": full["embedding.word_embeddings.weight"][:vocab],
           "transformer.wpe.weight": full["embedding.position_embeddings.weight"]}
    for i, get in _layers(full, layers):
        h = f"transformer.h.{i}."
        out[h + "ln_1.weight"] = get("input_layernorm.weight")
        out[h + "ln_1.bias"] = get("input_layernorm.bias")
        out[h + "attn.c_attn.weight"] = qkv_ours_to_hf(get(f"{_ATTN}.weight"), heads).t()
        out[h + "attn.c_attn.bias"] = qkv_ours_to_hf(get(f"{_ATTN}.bias"), heads)
        out[h + "attn.c_proj.weight"] = get("self_attention.dense.weight").t()
        out[h + "attn.c_proj.bias"] = get("self_attention.dense.bias")
        out[h + "ln_2.weight"] = get("post_attention_layernorm.weight")
        out[h + "ln_2.bias"] = get("post_attention_layernorm.bias")
        out[h + "mlp.c_fc.weight"] = get("mlp.dense_h_to_4h.weight").t()
        out[h + "mlp.c_fc.bias"] = get("mlp.dense_h_to_4h.bias")
        out[h + "mlp.c_proj.weight"] = get("mlp.dense_4h_to_h.weight").t()
        out[h + "mlp.c_proj.bias"] = get("mlp.dense_4h_to_h.bias")
    out["transformer.ln_f.weight"] = full["encoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = full["encoder.final_layernorm.bias"]
    if not tied:
        out["lm_head.weight"] = full["output_layer.weight"][:vocab]
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab, "n_positions": int(model_cfg["max_position_embeddings"]),
        "n_embd": int(model_cfg["hidden_size"]), "n_layer": layers, "n_head": heads,
        "n_inner": int(model_cfg["ffn_hidden_size"]),
        "activation_function": _gpt2_activation(model_cfg),
        "layer_norm_epsilon": float(model_cfg.get("layernorm_epsilon", 1e-5)),
        "resid_pdrop": float(model_cfg.get("hidden_dropout", 0.1)),
        "embd_pdrop": float(model_cfg.get("hidden_dropout", 0.1)),
        "attn_pdrop": float(model_cfg.get("attention_dropout", 0.1)),
        "initializer_range": float(model_cfg.get("init_method_std", 0.02)),
        "scale_attn_weights": True, "tie_word_embeddings": tied, "use_cache": True,
    }
    return out, config


_LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
"""transformers' models of the Llama-style block: Llama (biases on the four linear
layers of a block, or none), Qwen2 (biases on q, k, v only: --disable-bias-linear
--add-qkv-bias) and Qwen3 (no biases, per-head query/key RMSNorms: --qk-layernorm)."""


def llama_family(arch: Dict[str, Any]) -> str:
    """The ``_LLAMA_FAMILY`` key of a Llama-style block (``block_options``) that
    ``_export_target`` has accepted."""
    if arch["qk_layernorm"]:
        return "qwen3"
    return "qwen2" if not arch["add_bias_linear"] and arch["add_qkv_bias"] else "llama"


def rope_config(theta: float, scaling_factor: Optional[float],
                interpolation_factor: Optional[float] = None) -> Dict[str, Any]:
    """config.json's RoPE keys.  transformers >= 5 reads ``rope_parameters`` (theta
    inside); older versions the top-level ``rope_theta`` and, for Llama 3.1's scaling
    or linear interpolation, ``rope_scaling`` (the same keys without theta: they warn
    about any other key).  transformers 5 prefers ``rope_scaling`` where both are
    present, so the two always say the same.  ``_export_target`` has refused both
    factors at once."""
    out: Dict[str, Any] = {"rope_parameters": {"rope_type": "default", "rope_theta": theta},
                           "rope_theta": theta}
    if interpolation_factor is not None:  # positions / N == frequencies / N
        scaling = {"rope_type": "linear", "factor": float(interpolation_factor)}
        out.update(rope_parameters={**scaling, "rope_theta": theta}, rope_scaling=scaling)
    if scaling_factor is not None:
        scaling = {"rope_type": "llama3", "factor": float(scaling_factor),
                   "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                   "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                   "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
        out.update(rope_parameters={**scaling, "rope_theta": theta}, rope_scaling=scaling)
    return out


def gpt_to_llama(full: Dict[str, torch.Tensor], model_cfg: Dict[str, Any], vocab: int
                 ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our full Llama-style GPT state dict -> (LlamaForCausalLM, Qwen2ForCausalLM or
    Qwen3ForCausalLM state dict, config.json dict).  ``_export_target`` has checked
    that the config is one of them."""
    arch = block_options(model_cfg)
    heads, groups = arch["num_attention_heads"], arch["num_query_groups"]
    layers = int(model_cfg["num_layers"])
    hidden = int(model_cfg["hidden_size"])
    head_dim = arch["kv_channels"]
    bias = arch["add_bias_linear"]
    qkv_bias = bias or arch["add_qkv_bias"]
    family = llama_family(arch)
    tied = "output_layer.weight" not in full
    # --rotary-interleaved: each q/k head's dimensions reordered to rotate-half's layout
    order = rotate_half_order(head_dim) if arch["rotary_interleaved"] else None
    out = {"model.embed_tokens.weight": full[WORD_EMBEDDING][:vocab]}
    for i, get in _layers(full, layers):
        h = f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = get("input_layernorm.weight")
        out[h + "post_attention_layernorm.weight"] = get("post_attention_layernorm.weight")
        for part in ("weight", "bias") if qkv_bias else ("weight",):
            q, k, v = qkv_ours_to_groups(get(f"{_ATTN}.{part}"), heads, groups)
            if order is not None:
                q, k = _reorder_heads(q, order), _reorder_heads(k, order)
            out[h + f"self_attn.q_proj.{part}"] = q
            out[h + f"self_attn.k_proj.{part}"] = k
            out[h + f"self_attn.v_proj.{part}"] = v
        if arch["qk_layernorm"]:  # one head_dim weight each, shared by all heads
            for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
                weight = get(f"self_attention.{ours}.weight")
                if tuple(weight.shape) != (head_dim,):
                    raise ValueError(f"layer {i}'s self_attention.{ours}.weight is "
                                     f"{tuple(weight.shape)}, expected ({head_dim},)")
                out[h + f"self_attn.{theirs}.weight"] = (weight if order is None
                                                         else weight[order])
        for part in ("weight", "bias") if bias else ("weight",):
            out[h + f"self_attn.o_proj.{part}"] = get(f"self_attention.dense.{part}")
            gate, up = get(f"mlp.dense_h_to_4h.{part}").chunk(2, dim=0)
            out[h + f"mlp.gate_proj.{part}"] = gate
            out[h + f"mlp.up_proj.{part}"] = up
            out[h + f"mlp.down_proj.{part}"] = get(f"mlp.dense_4h_to_h.{part}")
    out["model.norm.weight"] = full["encoder.final_layernorm.weight"]
    if not tied:
        out["lm_head.weight"] = full["output_layer.weight"][:vocab]
    theta = float(model_cfg.get("rotary_base", 10000))
    config: Dict[str, Any] = {
        "architectures": [_LLAMA_FAMILY[family]], "model_type": family,
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": int(model_cfg["ffn_hidden_size"]),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": groups, "hidden_act": "silu",
        "max_position_embeddings": int(model_cfg["max_position_embeddings"]),
        "rms_norm_eps": float(model_cfg.get("layernorm_epsilon", 1e-5)),
        **rope_config(theta, arch["rope_scaling_factor"] if arch["rope_scaling"] else None,
                      arch["rotary_seq_len_interpolation_factor"]),
        "attention_dropout": float(model_cfg.get("attention_dropout", 0.0)),
        "initializer_range": float(model_cfg.get("init_method_std", 0.02)),
        "tie_word_embeddings": tied, "use_cache": True,
        # Llama's defaults (1, 2) are SentencePiece Llama's ids: wrong for any other
        # vocabulary; export_hf fills them in where the tokenizer says
        "bos_token_id": None, "eos_token_id": None,
    }
    if family == "llama":
        config.update(head_dim=head_dim, attention_bias=bias, mlp_bias=bias,
                      pretraining_tp=1)
    elif family == "qwen2":  # every layer full attention (the sliding window is off by default)
        config.update(use_sliding_window=False)
        if head_dim * heads != hidden:  # read where present (transformers' Qwen2Attention)
            config.update(head_dim=head_dim)
    else:  # Qwen3's head_dim defaults to 128 whatever the width: always written
        config.update(head_dim=head_dim, attention_bias=False, use_sliding_window=False)
    return out, config


def rotate_half_order(head_dim: int) -> torch.Tensor:
    """The dimension order [0, 2, 4, ..., 1, 3, 5, ...] of one head: interleaved RoPE's
    pair (2i, 2i+1) lands on rotate-half's pair (i, i + head_dim/2), which turns with the
    same frequency base^(-2i/head_dim).  Queries and keys reordered alike keep every
    q.k product, so the exported model computes the same attention."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _reorder_heads(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows [head, head_dim] (a q/k projection's weight or bias) with each head's
    dimensions taken in ``order``."""
    d = order.numel()
    return rows.unflatten(0, (rows.shape[0] // d, d))[:, order].flatten(0, 1)


def bert_to_hf(full: Dict[str, torch.Tensor], model_cfg: Dict[str, Any], vocab: int
               ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our full BERT state dict -> (MegatronBert* state dict, config.json dict)."""
    heads = int(model_cfg["num_attention_heads"])
    layers = int(model_cfg["num_layers"])
    if "lm_head.bias" not in full:
        raise UserError("--to-hf: this BERT checkpoint has no masked-LM head (a finetuned "
                        "model?); only pretraining checkpoints export")
    binary = "binary_head.weight" in full
    out = {"bert.embeddings.word_embeddings.weight":
           full["embedding.word_embeddings.weight"][:vocab],
           "bert.embeddings.position_embeddings.weight":
           full["embedding.position_embeddings.weight"],
           "bert.embeddings.token_type_embeddings.weight":
           full["embedding.tokentype_embeddings.weight"]}
    for i, get in _layers(full, layers):
        h = f"bert.encoder.layer.{i}."
        out[h + "attention.ln.weight"] = get("input_layernorm.weight")
        out[h + "attention.ln.bias"] = get("input_layernorm.bias")
        for part, name in (("weight", "weight"), ("bias", "bias")):
            q, k, v = qkv_ours_to_hf(get(f"{_ATTN}.{part}"), heads).chunk(3, dim=0)
            out[h + f"attention.self.query.{name}"] = q
            out[h + f"attention.self.key.{name}"] = k
            out[h + f"attention.self.value.{name}"] = v
        out[h + "attention.output.dense.weight"] = get("self_attention.dense.weight")
        out[h + "attention.output.dense.bias"] = get("self_attention.dense.bias")
        out[h + "ln.weight"] = get("post_attention_layernorm.weight")
        out[h + "ln.bias"] = get("post_attention_layernorm.bias")
        out[h + "intermediate.dense.weight"] = get("mlp.dense_h_to_4h.weight")
        out[h + "intermediate.dense.bias"] = get("mlp.dense_h_to_4h.bias")
        out[h + "output.dense.weight"] = get("mlp.dense_4h_to_h.weight")
        out[h + "output.dense.bias"] = get("mlp.dense_4h_to_h.bias")
    out["bert.encoder.ln.weight"] = full["encoder.final_layernorm.weight"]
    out["bert.encoder.ln.bias"] = full["encoder.final_layernorm.bias"]
    if "pooler.dense.weight" in full:
        out["bert.pooler.dense.weight"] = full["pooler.dense.weight"]
        out["bert.pooler.dense.bias"] = full["pooler.dense.bias"]
    p = "cls.predictions."
    out[p + "transform.dense.weight"] = full["lm_head.dense.weight"]
    out[p + "transform.dense.bias"] = full["lm_head.dense.bias"]
    out[p + "transform.LayerNorm.weight"] = full["lm_head.layernorm.weight"]
    out[p + "transform.LayerNorm.bias"] = full["lm_head.layernorm.bias"]
    out[p + "bias"] = full["lm_head.bias"][:vocab]
    if binary:
        out["cls.seq_relationship.weight"] = full["binary_head.weight"]
        out["cls.seq_relationship.bias"] = full["binary_head.bias"]
    config = {
        "architectures": ["MegatronBertForPreTraining" if binary else "MegatronBertForMaskedLM"],
        "model_type": "megatron-bert", "vocab_size": vocab,
        "hidden_size": int(model_cfg["hidden_size"]), "num_hidden_layers": layers,
        "num_attention_heads": heads, "intermediate_size": int(model_cfg["ffn_hidden_size"]),
        "hidden_act": "gelu_new" if model_cfg.get("openai_gelu") else "gelu",
        "max_position_embeddings": int(model_cfg["max_position_embeddings"]),
        "type_vocab_size": int(full["embedding.tokentype_embeddings.weight"].shape[0]),
        "layer_norm_eps": float(model_cfg.get("layernorm_epsilon", 1e-5)),
        "hidden_dropout_prob": float(model_cfg.get("hidden_dropout", 0.1)),
        "attention_probs_dropout_prob": float(model_cfg.get("attention_dropout", 0.1)),
        "initializer_range": float(model_cfg.get("init_method_std", 0.02)),
        "position_embedding_type": "absolute", "tie_word_embeddings": True,
    }
    return out, config


_GPT2_EOT, _GPT2_EOT_ID = "<|endoftext|>", 50256


def _special_token_ids(data_cfg: Dict[str, Any], vocab: int) -> Dict[str, Optional[int]]:
    """bos/eos ids for a GPT's config.json from the tokenizer the checkpoint records:
    GPT2BPETokenizer's <|endoftext|> id in its vocab.json (the trainer's end of document;
    GPT-2's 50256 only when that file is not on this machine), a HuggingFaceTokenizer's
    own special tokens; {} (null ids) otherwise.  An id outside the exported ``vocab``
    rows is null too (transformers warns about it and generation could never emit it)."""
    kind = data_cfg.get("tokenizer_type")
    ids: Dict[str, Optional[int]] = {}
    if kind == "GPT2BPETokenizer":
        try:
            with open(str(data_cfg.get("vocab_file")), encoding="utf-8") as fh:
                eot = json.load(fh).get(_GPT2_EOT)
        except (OSError, ValueError, AttributeError):  # not here, or not a vocab.json
            eot = _GPT2_EOT_ID
        ids = {"bos_token_id": eot, "eos_token_id": eot}
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        try:
            hf = HuggingFaceTokenizer(data_cfg.get("tokenizer_model")).hf
        except (ValueError, TypeError):  # not on this machine: _tokenizer_files says so
            return {}
        ids = {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}
    return {k: (v if type(v) is int and 0 <= v < vocab else None) for k, v in ids.items()}


def _tokenizer_files(data_cfg: Dict[str, Any], out_dir: str, n_positions: int) -> str:
    """Copy the tokenizer's vocabulary files; returns a one-line note of what was done."""
    kind = data_cfg.get("tokenizer_type")
    files: List[Tuple[Optional[str], str]] = []
    tok_cfg: Dict[str, Any] = {"model_max_length": n_positions}
    if kind == "GPT2BPETokenizer":
        files = [(data_cfg.get("vocab_file"), "vocab.json"),
                 (data_cfg.get("merge_file"), "merges.txt")]
        tok_cfg.update(tokenizer_class="GPT2Tokenizer", bos_token="<|endoftext|>",
                       eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        files = [(data_cfg.get("vocab_file"), "vocab.txt")]
        tok_cfg.update(tokenizer_class="BertTokenizer",
                       do_lower_case=kind == "BertWordPieceLowerCase")
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        spec = data_cfg.get("tokenizer_model")
        try:
            tokenizer = HuggingFaceTokenizer(spec)
        except ValueError as exc:
            return f"no tokenizer files written: {exc}"
        tokenizer.hf.model_max_length = n_positions
        written = tokenizer.hf.save_pretrained(out_dir)
        return (f"tokenizer files ({kind} {spec}): "
                f"{', '.join(sorted(os.path.basename(str(w)) for w in written))}")
    else:
        return (f"no tokenizer files written: the model was trained with {kind}, which has "
                f"no transformers tokenizer equivalent")
    missing = [src for src, _ in files if not src or not os.path.isfile(src)]
    if missing:
        return (f"no tokenizer files written: {kind} files {missing} recorded in the "
                f"checkpoint are not on this machine")
    for src, name in files:
        shutil.copyfile(src, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tok_cfg, fh, indent=2)
    return f"tokenizer files ({kind}): {', '.join(n for _, n in files)}"


_LLAMA_BLOCK = {"normalization": "RMSNorm", "position_embedding_type": "rope",
               "swiglu": True}
"""The block options transformers' Llama has (and GPT-2 has not), besides any number of
query groups and biases on all four linear layers or none."""


def block_options(model_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's block options from its recorded config["model"], with the defaults
    for the keys older checkpoints lack (they predate the options: GPT-2's block)."""
    heads = model_cfg.get("num_attention_heads")
    groups = model_cfg.get("num_query_groups")
    groups = heads if groups is None else groups
    if type(groups) is not int or groups < 1 or (type(heads) is int and heads % groups):
        raise CheckpointError(f"the checkpoint's config records num_query_groups {groups!r}; "
                              f"expected a divisor of num_attention_heads ({heads!r})")
    hidden = model_cfg.get("hidden_size")
    kv = model_cfg.get("kv_channels")
    if kv is None and type(heads) is int and type(hidden) is int and heads > 0:
        kv = hidden // heads  # checkpoints from before --kv-channels: hidden / heads
    if kv is not None and (type(kv) is not int or kv < 1):
        raise CheckpointError(f"the checkpoint's config records kv_channels {kv!r}; expected a "
                              f"positive integer")
    numbers = {}
    for key, default in (("rotary_percent", 1.0), ("rope_scaling_factor", 8.0),
                         ("rotary_seq_len_interpolation_factor", None)):
        value = model_cfg.get(key, default)
        if value is None and default is None:
            numbers[key] = None
            continue
        if type(value) not in (int, float):
            raise CheckpointError(f"the checkpoint's config records {key} {value!r}; "
                                  f"expected a number")
        numbers[key] = float(value)
    return {"normalization": model_cfg.get("normalization") or "LayerNorm",
            "position_embedding_type": (model_cfg.get("position_embedding_type")
                                        or "learned_absolute"),
            "rotary_percent": numbers["rotary_percent"],
            "rope_scaling": model_cfg.get("rope_scaling", False) is True,
            "rope_scaling_factor": numbers["rope_scaling_factor"],
            "rotary_interleaved": model_cfg.get("rotary_interleaved", False) is True,
            "rotary_seq_len_interpolation_factor":
                numbers["rotary_seq_len_interpolation_factor"],
            "swiglu": model_cfg.get("swiglu", False) is True,
            "squared_relu": model_cfg.get("squared_relu", False) is True,
            "apply_residual_connection_post_layernorm":
                model_cfg.get("apply_residual_connection_post_layernorm", False) is True,
            "qk_layernorm": model_cfg.get("qk_layernorm", False) is True,
            "num_attention_heads": heads,
            "kv_channels": kv,
            "num_query_groups": groups,
            "add_bias_linear": model_cfg.get("add_bias_linear", True) is not False,
            "add_qkv_bias": model_cfg.get("add_qkv_bias", False) is True}


def non_gpt2_flags(model_cfg: Dict[str, Any]) -> List[str]:
    """The flags of a recorded config whose block differs from GPT-2's and BERT's:
    ``megatron.model.transformer.non_gpt2_options`` on its ``block_options`` (an untied
    output layer is not one here: GPT-2 has ``lm_head``)."""
    arch = block_options(model_cfg)
    # an unrecorded head size is hidden / heads by definition (older checkpoints)
    arch["kv_channels"] = model_cfg.get("kv_channels")
    return non_gpt2_options(SimpleNamespace(**arch, hidden_size=model_cfg.get("hidden_size"),
                                            untie_embeddings_and_output_weights=False))


_EXPORT_READS = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
    "max_position_embeddings", "layernorm_epsilon", "openai_gelu", "hidden_dropout",
    "attention_dropout", "init_method_std", "num_tokentypes", "normalization",
    "position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling",
    "rope_scaling_factor", "swiglu", "qk_layernorm", "kv_channels", "num_query_groups",
    "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
    "squared_relu", "rotary_interleaved", "rotary_seq_len_interpolation_factor",
    "apply_residual_connection_post_layernorm"})
"""config["model"] keys the export writes into the transformers model, or refuses."""
_EXPORT_IGNORES = frozenset({
    "seq_length", "padded_vocab_size", "params_dtype", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "compile_layers", "cross_entropy_loss_fusion",
    "attention_backend", "sequence_parallel", "init_method_xavier_uniform",
    "fp32_residual_connection"})
"""config["model"] keys that say how the model was trained, not what it computes: the
training sequence length (max_position_embeddings is the model's), the vocabulary
padding (dropped; the tensors have it), the weights' dtype (the tensors have it),
the residual stream's (--fp32-residual-connection: float32 in fp16/bf16 training),
the recomputation, fusion, attention-kernel and sequence-parallel switches, and how
the initial weights were drawn (--init-method-xavier-uniform: the tensors are the
trained ones)."""


def _check_known_options(model_cfg: Dict[str, Any]) -> None:
    """Refuse a recorded model option this module does not know (not in
    ``_EXPORT_READS`` or ``_EXPORT_IGNORES``) unless it has ``ModelConfig``'s default
    (``refuse_unknown_model_options``)."""
    refuse_unknown_model_options(model_cfg, set(_EXPORT_READS) | set(_EXPORT_IGNORES),
                                 "--to-hf", "a transformers model without it would compute "
                                 "something else")


def _export_target(model_cfg: Dict[str, Any], full: Dict[str, torch.Tensor],
                   is_bert: bool) -> str:
    """"bert", "gpt2" or "llama" (Llama, Qwen2 or Qwen3: ``llama_family``): the
    transformers model that computes what this checkpoint's model computes.  Anything
    else is one UserError naming the flags that leave no such model (GPT-2 weights
    written for an RMSNorm/RoPE/SwiGLU block would load in transformers and silently
    compute something else)."""
    if int(model_cfg.get("num_attention_heads") or 0) < 1:
        raise UserError("--to-hf: the checkpoint's config lacks num_attention_heads")
    _check_known_options(model_cfg)
    flags = non_gpt2_flags(model_cfg)
    arch = block_options(model_cfg)
    if arch["apply_residual_connection_post_layernorm"]:
        raise UserError("--to-hf: this model takes its residuals after the LayerNorm "
                        "(--apply-residual-connection-post-layernorm); transformers' GPT-2, "
                        "Llama, Qwen2/3 and MegatronBert take them before it, so it cannot "
                        "be exported")
    if is_bert:
        if flags:
            raise UserError(f"--to-hf: this BERT was built with {' '.join(flags)}; "
                            f"transformers' MegatronBert has BERT's block only, so it cannot "
                            f"be exported")
        if arch["squared_relu"]:
            raise UserError("--to-hf: this BERT was built with --squared-relu; transformers' "
                            "MegatronBert applies its hidden_act to the LM head's transform "
                            "too, which ours keeps GeLU, so it cannot be exported")
        target = "bert"
    elif not flags:
        target = "gpt2"
    else:
        arch = block_options(model_cfg)
        missing = [f"--{k.replace('_', '-')} {v}" if v is not True else f"--{k}"
                   for k, v in _LLAMA_BLOCK.items() if arch[k] != v]
        # the bias layouts Llama/Qwen2 have are exactly ours: all four, none, q/k/v only;
        # Qwen3 (the query/key norms) has none (its attention_bias would put biases on
        # q, k, v and o_proj, and none in the MLP: no layout of ours)
        model = "LlamaForCausalLM"
        if arch["qk_layernorm"]:
            model = "Qwen3ForCausalLM"
            if arch["add_bias_linear"]:
                missing.append("--disable-bias-linear")
            elif arch["add_qkv_bias"]:
                missing.append("--disable-bias-linear without --add-qkv-bias")
        if missing:
            raise UserError(f"--to-hf: GPT-2 has no equivalent of this GPT's "
                            f"{' '.join(flags)}, and transformers' {model} would also "
                            f"need {' '.join(missing)}; no transformers model matches, so it "
                            f"cannot be exported")
        if arch["rotary_percent"] != 1.0:
            raise UserError(f"--to-hf: this GPT rotates part of each head "
                            f"(--rotary-percent {arch['rotary_percent']:g}); transformers' "
                            f"{model} rotates whole heads (it does not apply "
                            f"partial_rotary_factor), so it cannot be exported")
        if arch["rope_scaling"] and arch["rotary_seq_len_interpolation_factor"] is not None:
            raise UserError(f"--to-hf: this GPT combines --use-rope-scaling with "
                            f"--rotary-seq-len-interpolation-factor "
                            f"{flag_number(arch['rotary_seq_len_interpolation_factor'])}; "
                            f"transformers' {model} takes one rope_type (llama3 or linear), "
                            f"so it cannot be exported")
        target = "llama"
    if not is_bert and "embedding.tokentype_embeddings.weight" in full:
        raise UserError("--to-hf: this GPT has token-type embeddings; transformers' GPT-2, "
                        "Llama and Qwen2/3 have none, so it cannot be exported")
    heads = int(model_cfg["num_attention_heads"])
    groups, kv = arch["num_query_groups"], arch["kv_channels"]
    for name, value in full.items():
        if not name.endswith(f"{_ATTN}.weight"):
            continue
        if target == "llama":
            rows = (heads + 2 * groups) * kv
            if tuple(value.shape) != (rows, model_cfg["hidden_size"]):
                raise CheckpointError(f"--to-hf: {name} is {tuple(value.shape)}; its config "
                                      f"({heads} heads of {kv}, {groups} query groups, hidden "
                                      f"size {model_cfg['hidden_size']}) implies "
                                      f"({rows}, {model_cfg['hidden_size']})")
        elif value.shape[0] != 3 * value.shape[1]:
            raise UserError(f"--to-hf: {name} is {tuple(value.shape)}; only standard "
                            f"multi-head attention (q, k, v of hidden size) exports")
    return target


def check_export_path(load: Optional[str], out_dir: str, flag: str = "--to-hf") -> None:
    """``flag``'s directory (--to-hf, --to-megatron) must be new or empty and outside
    --load: the export replaces it as a whole, so nothing of another model (stale
    tokenizer files, another checkpoint's shards) can stay behind."""
    check_outside(load, out_dir, "--load", flag)
    check_not_a_file(flag, out_dir)
    try:
        entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    except OSError as exc:
        raise UserError(f"{flag} {out_dir}: cannot list it ({exc.strerror}); expected a new "
                        f"or empty directory") from None
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"{flag} {out_dir}: expected a new or empty directory, found one "
                        f"holding {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                        f"({shown}); remove it or choose another {flag}")


def publish_export(staging: str, out_dir: str, flag: str = "--to-hf") -> None:
    """Rename the finished ``staging`` directory to ``out_dir`` (new or empty)."""
    try:
        os.replace(staging, out_dir)  # replaces an empty directory; never a non-empty one
    except OSError as exc:
        raise UserError(f"{flag} {out_dir}: cannot move the export into place "
                        f"({exc.strerror or type(exc).__name__}); expected a new or empty "
                        f"directory") from None


def export_hf(load: str, out_dir: str, *, iteration: Optional[int] = None,
              true_vocab: Optional[int] = None, allow_unsafe: bool = False,
              vocab_flag: Optional[str] = None) -> str:
    """Write checkpoint ``load`` as a transformers model directory ``out_dir`` (new or
    empty).  The files are written into a sibling staging directory that is renamed to
    ``out_dir`` at the end, so a failed or interrupted export leaves no ``out_dir``.
    ``vocab_flag``: the option ``true_vocab`` came from, when a user gave it (it is then
    checked against the checkpoint, ``check_true_vocab``)."""
    from safetensors.torch import save_file

    check_export_path(None, out_dir)
    state = read_full_state(load, iteration, allow_unsafe=allow_unsafe)
    config = state.common.get("config") or {}
    model_cfg = dict(config.get("model") or {})
    if not model_cfg:
        raise CheckpointError(f"--load {load}: the checkpoint records no model config; "
                              f"expected a checkpoint written by this trainer")
    for key in ("hidden_size", "num_attention_heads"):
        if type(model_cfg.get(key)) is not int or model_cfg[key] < 1:
            raise CheckpointError(f"--load {load}: its config records {key} "
                                  f"{model_cfg.get(key)!r}; expected a positive integer")
    if WORD_EMBEDDING not in state.model:
        raise CheckpointError(f"--load {load}: the checkpoint has no {WORD_EMBEDDING}; "
                              f"expected a GPT or BERT checkpoint of this trainer")
    model_cfg.setdefault("num_layers", state.ckpt.num_layers)
    model_cfg.setdefault("ffn_hidden_size", 4 * int(model_cfg["hidden_size"]))
    model_cfg.setdefault("max_position_embeddings", model_cfg.get("seq_length"))
    full = state.model
    is_bert = "lm_head.bias" in full or "embedding.tokentype_embeddings.weight" in full
    target = _export_target(model_cfg, full, is_bert)
    padded = full[WORD_EMBEDDING].shape[0]
    if vocab_flag:
        check_true_vocab(true_vocab, padded, config, vocab_flag)
    vocab = true_vocab_size(config, true_vocab)
    if vocab is None or vocab > padded:
        say(f"note: unpadded vocabulary size unknown (pass --true-vocab-size); exporting "
             f"all {padded} rows")
        vocab = padded
    read = _ReadNames(full)
    try:
        to_hf = {"bert": bert_to_hf, "gpt2": gpt_to_hf, "llama": gpt_to_llama}[target]
        tensors, hf_config = to_hf(read, model_cfg, vocab)
    except KeyError as exc:  # a layer or head its config implies is not in the files
        raise CheckpointError(f"--load {load}: the checkpoint has no {exc.args[0]!r}, which "
                              f"its config (num_layers {model_cfg.get('num_layers')!r}) "
                              f"implies") from None
    except (TypeError, ValueError, RuntimeError) as exc:  # config values, head split
        raise CheckpointError(f"--load {load}: its config does not describe its tensors "
                              f"({type(exc).__name__}: {exc})") from None
    left = sorted(set(full) - read.names)
    if left:  # a tensor of an option the record does not show: never dropped silently
        raise CheckpointError(f"--load {load}: the checkpoint holds {left[0]!r}"
                              f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}, "
                              f"which its recorded config does not account for; the export "
                              f"would drop it, so it is refused")
    dtype = next(iter(tensors.values())).dtype
    hf_config["torch_dtype"] = str(dtype).replace("torch.", "")
    scaling = hf_config.get("rope_scaling") or {}
    positions = hf_config.get("max_position_embeddings")
    if scaling.get("original_max_position_embeddings", 0) >= (positions or 0) > 0:
        say(f"note: config.json keeps max_position_embeddings {positions} (the model's); "
             f"transformers warns that original_max_position_embeddings "
             f"{scaling['original_max_position_embeddings']} should be below it, which "
             f"changes nothing it computes (the llama3 frequencies do not depend on it)")
    data_cfg = config.get("data") or {}
    if not is_bert:
        # GPT2Config's defaults (50256) are GPT-2's ids, outside a smaller vocabulary
        # (transformers warns on loading): the tokenizer's own ids where known, else null
        hf_config.update({"bos_token_id": None, "eos_token_id": None,
                          **_special_token_ids(data_cfg, vocab)})
    check_export_path(None, out_dir)  # again: the checkpoint took a while to read
    # a sibling, so the final rename stays on one file system (atomic)
    staging = f"{os.path.abspath(out_dir)}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(staging), exist_ok=True)
        if os.path.isdir(staging):  # left by a killed export of a process with this pid
            shutil.rmtree(staging)
        os.makedirs(staging)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                  os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w") as fh:
            json.dump(hf_config, fh, indent=2)
        note = _tokenizer_files(data_cfg, staging, int(model_cfg["max_position_embeddings"]))
        publish_export(staging, out_dir)
    except OSError as exc:  # unwritable, disk full: nothing half-written stays
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"--to-hf {out_dir}: cannot write the export "
                        f"({exc.strerror or type(exc).__name__}: "
                        f"{exc.filename or staging})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(note)
    return out_dir


# --------------------------------------------------------------------------- import

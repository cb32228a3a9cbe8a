"""Our full state dicts -> transformers' models, one mapping per target: GPT ->
``GPT2LMHeadModel``, Llama-style GPT -> ``LlamaForCausalLM``/``Qwen2ForCausalLM``/
``Qwen3ForCausalLM``, BERT -> ``MegatronBert*``.  Each returns (the transformers state
dict, its config.json dict) for a target ``megatron.hf_export_target`` has accepted.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from megatron.checkpoint_convert import WORD_EMBEDDING
from megatron.errors import UserError
from megatron.hf_export_target import block_options
from megatron.hf_layouts import (QKV_NAME, LLAMA_FAMILY, reorder_heads, qkv_ours_to_groups,
                                 qkv_ours_to_hf, rotate_half_order)
from megatron.model.transformer import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                        LLAMA3_ORIGINAL_CONTEXT)


def _layers(full: Dict[str, torch.Tensor], num_layers: int):
    for i in range(num_layers):
        yield i, (lambda n, i=i: full[f"encoder.layers.{i}.{n}"])


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
        out[h + "attn.c_attn.weight"] = qkv_ours_to_hf(get(f"{QKV_NAME}.weight"), heads).t()
        out[h + "attn.c_attn.bias"] = qkv_ours_to_hf(get(f"{QKV_NAME}.bias"), heads)
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


def llama_family(arch: Dict[str, Any]) -> str:
    """The ``LLAMA_FAMILY`` key of a Llama-style block (``block_options``) that
    ``export_target`` has accepted."""
    if arch["qk_layernorm"]:
        return "qwen3"
    return "qwen2" if not arch["add_bias_linear"] and arch["add_qkv_bias"] else "llama"


def rope_config(theta: float, scaling_factor: Optional[float],
                interpolation_factor: Optional[float] = None) -> Dict[str, Any]:
    """config.json's RoPE keys.  transformers >= 5 reads ``rope_parameters`` (theta
    inside); older versions the top-level ``rope_theta`` and, for Llama 3.1's scaling
    or linear interpolation, ``rope_scaling`` (the same keys without theta: they warn
    about any other key).  transformers 5 prefers ``rope_scaling`` where both are
    present, so the two always say the same.  ``export_target`` has refused both
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
    Qwen3ForCausalLM state dict, config.json dict).  ``export_target`` has checked
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
            q, k, v = qkv_ours_to_groups(get(f"{QKV_NAME}.{part}"), heads, groups)
            if order is not None:
                q, k = reorder_heads(q, order), reorder_heads(k, order)
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
        "architectures": [LLAMA_FAMILY[family]], "model_type": family,
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
            q, k, v = qkv_ours_to_hf(get(f"{QKV_NAME}.{part}"), heads).chunk(3, dim=0)
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

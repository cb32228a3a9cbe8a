"""Which transformers model computes what a checkpoint's model computes (``export_target``:
GPT-2, Llama/Qwen2/Qwen3 or MegatronBert), from its recorded config["model"] read through
``block_options``; any config no transformers model matches, and any recorded option the
export does not know, is refused with one line naming the flags.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List

import torch

from megatron.checkpoint_convert import refuse_unknown_model_options
from megatron.errors import CheckpointError, UserError
from megatron.hf_layouts import QKV_NAME
from megatron.model.transformer import flag_number, non_gpt2_options


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


EXPORT_READS = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
    "max_position_embeddings", "layernorm_epsilon", "openai_gelu", "hidden_dropout",
    "attention_dropout", "init_method_std", "num_tokentypes", "normalization",
    "position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling",
    "rope_scaling_factor", "swiglu", "qk_layernorm", "kv_channels", "num_query_groups",
    "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
    "squared_relu", "rotary_interleaved", "rotary_seq_len_interpolation_factor",
    "apply_residual_connection_post_layernorm"})
"""config["model"] keys the export writes into the transformers model, or refuses."""
EXPORT_IGNORES = frozenset({
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


def check_known_options(model_cfg: Dict[str, Any]) -> None:
    """Refuse a recorded model option this module does not know (not in
    ``EXPORT_READS`` or ``EXPORT_IGNORES``) unless it has ``ModelConfig``'s default
    (``refuse_unknown_model_options``)."""
    refuse_unknown_model_options(model_cfg, set(EXPORT_READS) | set(EXPORT_IGNORES),
                                 "--to-hf", "a transformers model without it would compute "
                                 "something else")


def export_target(model_cfg: Dict[str, Any], full: Dict[str, torch.Tensor],
                   is_bert: bool) -> str:
    """"bert", "gpt2" or "llama" (Llama, Qwen2 or Qwen3: ``llama_family``): the
    transformers model that computes what this checkpoint's model computes.  Anything
    else is one UserError naming the flags that leave no such model (GPT-2 weights
    written for an RMSNorm/RoPE/SwiGLU block would load in transformers and silently
    compute something else)."""
    if int(model_cfg.get("num_attention_heads") or 0) < 1:
        raise UserError("--to-hf: the checkpoint's config lacks num_attention_heads")
    check_known_options(model_cfg)
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
        if not name.endswith(f"{QKV_NAME}.weight"):
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

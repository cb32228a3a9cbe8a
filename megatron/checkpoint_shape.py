"""Whether a checkpoint fits the model of this run, checked before ``load_state_dict``
reports one line per tensor: the saved tensors against the module (``check_state_fits``)
and the recorded model config against this run's flags (``check_model_shape``), each one
``CheckpointError`` line naming what differs.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from megatron.errors import CheckpointError


def check_state_fits(source: str, state: Dict[str, torch.Tensor], module: torch.nn.Module,
                     strict: bool = True) -> None:
    """One line when saved ``state`` does not fit ``module`` (tensor shapes; with ``strict``
    also missing or unexpected names), raised before ``load_state_dict`` reports one
    line per tensor.  ``source`` names the flag and checkpoint."""
    ours = module.state_dict()
    problems = [f"{k} is {tuple(v.shape)} in the checkpoint, {tuple(ours[k].shape)} here"
                for k, v in state.items() if k in ours and tuple(v.shape) != tuple(ours[k].shape)]
    missing = [k for k in ours if k not in state]
    unexpected = [k for k in state if k not in ours]
    if strict and not problems and (missing or unexpected) and all(
            k.split(".")[0].endswith("head") for k in missing + unexpected):
        # the body fits and only the output heads differ: a checkpoint of another task
        # (MNLI's classification head at RACE) or of pretraining (BERT's lm_head)
        def heads(names: Sequence[str]) -> str:
            return ", ".join(sorted({k.split(".")[0] for k in names})) or "none"
        raise CheckpointError(
            f"{source}: the checkpoint's output heads ({heads(unexpected)}) are not this "
            f"model's ({heads(missing)}): it was saved by another task or model kind; to "
            f"start from its weights with a new head, pass it as --pretrained-checkpoint "
            f"(finetuning) instead of resuming it")
    if strict:
        problems += [f"{k} is missing from the checkpoint" for k in ours if k not in state]
        problems += [f"{k} is in the checkpoint but not in this model" for k in state
                     if k not in ours]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{source}: the checkpoint does not fit this model: "
                              f"{'; '.join(problems[:3])}{more}; was it saved with other model "
                              f"flags (--num-layers, --hidden-size, --ffn-hidden-size, "
                              f"--num-attention-heads, ...)?")


# Model-shape fields of the saved config, and the flags that set them.
_SHAPE_FLAGS = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                ("ffn_hidden_size", "--ffn-hidden-size"),
                ("num_attention_heads", "--num-attention-heads"),
                ("max_position_embeddings", "--max-position-embeddings"),
                ("padded_vocab_size",
                 "vocabulary size (--vocab-file/--vocab-size, --make-vocab-size-divisible-by)"),
                ("num_tokentypes", "token types (GPT vs BERT)"))


# The block's architecture fields, their flags and the value of a checkpoint saved before
# the option existed.  (--init-method-std and --init-method-xavier-uniform are not here:
# they only draw the initial weights, which a resumed run reads from the checkpoint; nor
# is --rotary-seq-len-interpolation-factor: changing it on a loaded RoPE model to stretch
# its context is what position interpolation is for; nor --fp32-residual-connection,
# which like --bf16 sets the precision of the arithmetic, not the weights: a checkpoint
# loads with or without it.)
_ARCHITECTURE_FLAGS = (("normalization", "--normalization", "LayerNorm"),
                       ("position_embedding_type", "--position-embedding-type",
                        "learned_absolute"),
                       ("rotary_base", "--rotary-base", 10000),
                       ("rotary_percent", "--rotary-percent", 1.0),
                       ("rope_scaling", "--use-rope-scaling", False),
                       ("rope_scaling_factor", "--rope-scaling-factor", 8.0),
                       ("rotary_interleaved", "--rotary-interleaved", False),
                       ("swiglu", "--swiglu", False),
                       ("squared_relu", "--squared-relu", False),
                       ("apply_residual_connection_post_layernorm",
                        "--apply-residual-connection-post-layernorm", False),
                       ("qk_layernorm", "--qk-layernorm", False),
                       ("num_query_groups", "--num-query-groups", None),
                       ("kv_channels", "--kv-channels", None),
                       ("add_bias_linear", "biases (--disable-bias-linear)", True),
                       ("add_qkv_bias", "--add-qkv-bias", False),
                       ("untie_embeddings_and_output_weights",
                        "--untie-embeddings-and-output-weights", False),
                       ("layernorm_epsilon", "--norm-epsilon", 1e-5))


def _flag_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_model_shape(root: str, saved_config: Optional[dict], model: Any, *,
                      source_flag: str = "--load", skip: Sequence[str] = ()) -> None:
    """One line naming every flag whose value differs between the checkpoint and this run,
    raised before any ``load_state_dict`` prints dozens of size mismatches.  ``skip``:
    fields the caller checks its own way."""
    saved = (saved_config or {}).get("model")
    if not isinstance(saved, dict):
        return  # a checkpoint without its config (converted, old): load_state_dict checks
    diffs = []
    for name, flag in _SHAPE_FLAGS:
        if name in skip:
            continue
        ours, theirs = getattr(model, name, None), saved.get(name)
        if theirs is None or ours is None or ours == theirs:
            continue
        if name == "padded_vocab_size" and not (ours and theirs):
            continue  # 0: not known (no tokenizer); load_state_dict still checks
        if name == "max_position_embeddings" and (
                getattr(model, "position_embedding_type", None)
                == saved.get("position_embedding_type") == "rope"):
            continue  # no position table: a RoPE model may train on longer sequences
        if name == "max_position_embeddings" and saved.get("seq_length") != model.seq_length:
            flag = "--seq-length/--max-position-embeddings"
        diffs.append(f"{flag} {theirs} in the checkpoint, {ours} in this run")
    for name, flag, default in _ARCHITECTURE_FLAGS:
        if name in skip:
            continue
        ours = getattr(model, name, default)
        theirs = saved.get(name, default)  # a checkpoint from before the option: its default
        if name == "num_query_groups":
            theirs = theirs if theirs is not None else saved.get("num_attention_heads")
        heads, hidden = saved.get("num_attention_heads"), saved.get("hidden_size")
        if name == "kv_channels" and theirs is None and type(heads) is int and heads > 0 \
                and type(hidden) is int:
            theirs = hidden // heads
        if name.startswith(("rotary_", "rope_")) and not (
                getattr(model, "position_embedding_type", None)
                == saved.get("position_embedding_type") == "rope"):
            continue  # RoPE's settings matter only where both sides rotate
        if name == "add_qkv_bias" and (getattr(model, "add_bias_linear", True)
                                       and saved.get("add_bias_linear", True)):
            continue  # every linear layer has its bias anyway
        if ours is None or theirs is None or ours == theirs:
            continue
        diffs.append(f"{flag} {_flag_value(theirs)} in the checkpoint, {_flag_value(ours)} "
                     f"in this run")
    if diffs:
        raise CheckpointError(f"{source_flag} {root}: the checkpoint is of another model shape: "
                              + "; ".join(diffs))

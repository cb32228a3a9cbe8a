"""The tensors of a Megatron-LM legacy checkpoint's rank files in our names, for
``megatron.megatron_lm_import`` (``tools/checkpoint_util.py --from-megatron``).

``our_name`` maps a Megatron-LM tensor name (any version's) to our stage-local one;
``read_shard`` takes one rank file's ``model`` apart into a ``Shard``, refusing what
is not a legacy GPT or BERT with one line; ``args_dict`` and ``checkpoint_version`` read its
``args`` and ``checkpoint_version``; ``global_tensors`` numbers every stage's layers
globally and gathers each tensor's parts over the tensor ranks.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import WORD_EMBEDDING
from megatron.errors import CheckpointError, UserError
from megatron.megatron_lm_files import FLAG, MegatronLMStandIn, CheckpointSource

QKV_NAME = "self_attention.query_key_value"


# ------------------------------------------------------------------------ names
LAYER_KEY = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = ("input_layernorm", QKV_NAME, "self_attention.dense", "post_attention_layernorm",
                "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def _flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _unsupported_hint(name: str) -> str:
    if "_extra_state" in name or "layernorm_qkv" in name or "layernorm_mlp" in name:
        return "Transformer Engine layers (--transformer-impl transformer_engine)"
    if "experts" in name or ".router." in name:
        return "a mixture-of-experts layer"
    if "inter_attention" in name or "decoder." in name:
        return "an encoder-decoder model (T5, RETRO)"
    if "classification_head" in name or "multichoice_head" in name:
        return "a finetuned task model; only pretraining GPT and BERT checkpoints import"
    return "not part of Megatron-LM's legacy GPT or BERT"


def our_name(name: str) -> Optional[str]:
    """Our stage-local name of Megatron-LM tensor ``name`` (``model``'s nested keys joined
    by dots), None for the last stage's tied-embedding copy; ValueError for a tensor of
    anything else."""
    if name.startswith("word_embeddings_for_head."):
        return None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.startswith(("word_embeddings.", "position_embeddings.", "tokentype_embeddings.")):
        name = "embedding." + name  # the oldest files: flat embedding keys
    if name.startswith("transformer."):
        name = "encoder." + name[len("transformer."):]
    name = name.replace(".attention.", ".self_attention.")
    name = re.sub(r"\.input_norm\.", ".input_layernorm.", name)
    name = re.sub(r"\.post_attention_norm\.", ".post_attention_layernorm.", name)
    name = name.replace("encoder.final_norm.", "encoder.final_layernorm.")
    name = name.replace("lm_head.norm.", "lm_head.layernorm.")
    m = LAYER_KEY.match(name)
    if m:
        part, _, kind = m[2].rpartition(".")
        if part in _LAYER_PARTS and kind in ("weight", "bias"):
            return name
    elif name in (WORD_EMBEDDING, "embedding.position_embeddings.weight",
                  "embedding.tokentype_embeddings.weight", "encoder.final_layernorm.weight",
                  "encoder.final_layernorm.bias", "output_layer.weight", "pooler.dense.weight",
                  "pooler.dense.bias", "lm_head.dense.weight", "lm_head.dense.bias",
                  "lm_head.layernorm.weight", "lm_head.layernorm.bias", "lm_head.bias",
                  "binary_head.weight", "binary_head.bias"):
        return name
    raise ValueError(_unsupported_hint(name))


# ------------------------------------------------------------------------ one rank file
@dataclass
class Shard:
    path: str
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Our stage-local name -> tensor."""
    source: Dict[str, str] = field(default_factory=dict)
    """Our stage-local name -> Megatron-LM's name, for messages."""


_MODEL_KEYS = ("language_model", "lm_head", "binary_head", "word_embeddings_for_head")


def read_shard(path: str, payload: Any) -> Shard:
    if not isinstance(payload, dict):
        raise CheckpointError(f"{FLAG} {path}: expected a Megatron-LM checkpoint (a dict), "
                              f"found {type(payload).__name__}")
    if "model" not in payload:
        if "model0" in payload:
            raise UserError(f"{FLAG} {path}: virtual pipeline stages (model0, model1, ...: "
                            f"--num-layers-per-virtual-pipeline-stage) do not import")
        raise CheckpointError(f"{FLAG} {path}: no 'model' entry (found "
                              f"{sorted(map(str, payload))[:6]}); expected model_optim_rng.pt "
                              f"of a Megatron-LM run")
    model = payload["model"]
    if not isinstance(model, dict):
        raise CheckpointError(f"{FLAG} {path}: 'model' is {type(model).__name__}, expected a "
                              f"state dict")
    if "language_model" not in model:
        mcore = any(str(k).startswith(("decoder.", "embedding.", "encoder.")) for k in model)
        if mcore:
            raise UserError(f"{FLAG} {path}: a Megatron Core model state dict (decoder.layers, "
                            f"linear_qkv, ...); only the legacy layout (language_model) "
                            f"imports")
        raise CheckpointError(f"{FLAG} {path}: no model['language_model'] (found "
                              f"{sorted(map(str, model))[:6]})")
    shard = Shard(path)
    for name, value in _flatten(model).items():
        top = name.split(".", 1)[0]
        if top not in _MODEL_KEYS:
            raise UserError(f"{FLAG} {path}: model[{top!r}] is {_unsupported_hint(name)}")
        try:
            ours = our_name(name)
        except ValueError as exc:
            raise UserError(f"{FLAG} {path}: tensor {name!r} is {exc}") from None
        if ours is None:
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            found = (f"a {value.dtype} tensor" if isinstance(value, torch.Tensor)
                     else type(value).__name__)
            raise CheckpointError(f"{FLAG} {path}: {name!r} is {found}, expected a "
                                  f"floating-point tensor")
        if ours in shard.tensors:
            raise CheckpointError(f"{FLAG} {path}: {name!r} and {shard.source[ours]!r} are "
                                  f"the same tensor under two names")
        shard.tensors[ours] = value
        shard.source[ours] = name
    return shard


# ------------------------------------------------------------------------ args
def args_dict(args: Any, path: str) -> Optional[Dict[str, Any]]:
    if args is None:
        return None
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    state = getattr(args, "state", None)
    if isinstance(args, MegatronLMStandIn) and isinstance(state, dict):
        return dict(state)
    raise CheckpointError(f"{FLAG} {path}: 'args' is {type(args).__name__}; expected the "
                          f"run's argparse.Namespace")


def checkpoint_version(payload: Dict[str, Any], path: str) -> float:
    """Megatron-LM's checkpoint_version (0 when absent, as Megatron-LM reads it)."""
    v = payload.get("checkpoint_version", 0)
    if type(v) not in (int, float) or not (v in (0, 1) or v >= 2):
        raise CheckpointError(f"{FLAG} {path}: checkpoint_version {v!r}; expected 0, 1.0 or "
                              f">= 2.0 (the query/key/value orderings Megatron-LM knows)")
    return float(v)


# ------------------------------------------------------------------------ stages
def _layer_counts(src: CheckpointSource, shards: Dict[Tuple[int, int], Shard]) -> List[int]:
    counts = []
    for p in range(src.pp):
        names = set(shards[(0, p)].tensors)
        for t in range(1, src.tp):
            other = set(shards[(t, p)].tensors)
            if other != names:
                diff = sorted(names ^ other)[0]
                has, lacks = ((shards[(0, p)], shards[(t, p)]) if diff in names
                              else (shards[(t, p)], shards[(0, p)]))
                raise CheckpointError(f"{FLAG} {has.path} holds {has.source[diff]!r}, which "
                                      f"{lacks.path} lacks: tensor ranks of one stage must "
                                      f"hold the same tensors")
        local = sorted({int(m[1]) for m in map(LAYER_KEY.match, names) if m})
        if local != list(range(len(local))):
            raise CheckpointError(f"{FLAG} {shards[(0, p)].path}: layers {local[:8]}; expected "
                                  f"a stage's layers numbered 0, 1, ...")
        counts.append(len(local))
    return counts


FoundTensors = Dict[str, List[Tuple[torch.Tensor, str, str]]]
"""Global name -> every tensor rank's part, with its Megatron-LM name and file."""


def global_tensors(src: CheckpointSource, shards: Dict[Tuple[int, int], Shard]
                   ) -> Tuple[FoundTensors, List[int], List[int]]:
    """Every stage's tensors under global layer numbers; the stages' layer counts and
    first layers."""
    counts = _layer_counts(src, shards)
    offsets = [sum(counts[:p]) for p in range(src.pp)]
    found: FoundTensors = {}
    for p in range(src.pp):
        for t in range(src.tp):
            shard = shards[(t, p)]
            for name, tensor in shard.tensors.items():
                m = LAYER_KEY.match(name)
                g = f"encoder.layers.{int(m[1]) + offsets[p]}.{m[2]}" if m else name
                if t == 0 and g in found:
                    raise CheckpointError(f"{FLAG} {shard.path}: {shard.source[name]!r} is also "
                                          f"in {found[g][0][2]}: two stages hold one tensor")
                found.setdefault(g, []).append((tensor, shard.source[name], shard.path))
    return found, counts, offsets

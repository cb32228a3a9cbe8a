"""NVIDIA Megatron-LM's own checkpoints (the legacy ``torch.save`` layout) -> our checkpoints.

``tools/checkpoint_util.py --from-megatron DIR --save OUT --allow-unsafe-checkpoint``
reads a GPT or BERT checkpoint written by Megatron-LM's legacy models (``megatron/model``,
later ``megatron/legacy/model``): NVIDIA's released GPT-345M / BERT-345M or a user's own
run, and writes an iteration-0 checkpoint of ours for ``--load OUT --finetune``,
``tasks/main.py --pretrained-checkpoint OUT`` or ``tools/generate_samples_gpt.py``.

What is read
    ``DIR`` is the ``--save`` directory of the Megatron-LM run (its tracker
    ``latest_checkpointed_iteration.txt`` holds an iteration or ``release``), one
    iteration directory (``iter_0001000``, ``release``), one rank directory or one
    ``model_optim_rng.pt``.  Every rank file ``mp_rank_TT/model_optim_rng.pt``
    (``mp_rank_TT_PPP`` with pipeline stages) of the iteration is read; only its
    ``model``, ``args`` and ``checkpoint_version`` are used.  The optimizer state (and
    ``distrib_optim.pt``), the LR scheduler, the RNG state and the sample counts are
    dropped: the result is a model to finetune or train from, at iteration 0.

The layout
    ``model["language_model"]`` holds ``embedding`` (``word_embeddings``, split by rows
    across tensor ranks; ``position_embeddings``; BERT's ``tokentype_embeddings``),
    ``encoder`` (``transformer`` before 2021) with the stage's layers numbered from 0
    on every pipeline stage, ``pooler`` (BERT) and ``output_layer`` (an untied GPT
    output); beside it BERT's ``lm_head`` (its ``bias`` split by vocabulary rows) and
    ``binary_head``, and ``word_embeddings_for_head`` (the last stage's copy of the
    tied embedding, dropped: it equals the first stage's).  Older layer names
    (``attention.``; ``input_norm``/``post_attention_norm``/``final_norm`` of later
    versions) are renamed to ours.  Column-parallel weights (query/key/value, the first
    MLP weight, their biases) are concatenated by rows across tensor ranks -- SwiGLU's
    [gate_r; up_r] section by section --, row-parallel ones (attention output, second
    MLP weight) by columns; everything else is the same on every rank.

Query/key/value rows
    Each tensor rank's fused QKV rows are ordered by ``checkpoint_version``: version 0
    (and files without one) [q of the rank's heads | k | v], version 1.0 [head,
    head_dim, (q, k, v)], version 2.0 and later [head, (q, k, v), head_dim], which is
    ours; grouped-query attention (version 3) is [group, (its queries, k, v),
    head_dim], also ours.  Each rank's rows are put in our order before the ranks are
    concatenated.

The model config
    comes from the checkpoint's ``args`` (sizes are checked against the tensors):
    layers, hidden size, heads, query groups, kv channels, ffn size, positions,
    sequence length, the padded vocabulary (its rows), the norm and its epsilon, RoPE
    (``rotary_percent``, ``rotary_interleaved``, interpolation), SwiGLU, squared ReLU,
    biases, untied output, post-LayerNorm residuals, dropouts, the tokenizer.  The
    GELU is Megatron-LM's: its fused bias-GELU (``bias_gelu_fusion``, on by default)
    and ``--openai-gelu`` compute the tanh approximation, so either imports as
    ``--openai-gelu``.  A checkpoint without ``args`` (early releases) needs
    ``--num-attention-heads``; the rest is read from the tensors and the GELU is taken
    as the tanh one those versions used.

Refused, one line each
    Without ``--allow-unsafe-checkpoint`` (the files are pickles, which can run code);
    with it, any pickled global outside the allow-list (``megatron_lm_files``): plain
    unpickling is never used.  Megatron Core checkpoints (``torch_dist`` directories;
    ``decoder.layers`` state dicts), Transformer Engine layers, MoE, virtual pipeline
    stages (``model0``, ``model1``), encoder-decoder models, finetuned task heads, and
    any argument whose model this trainer cannot build (ALiBi, ``apply_layernorm_1p``,
    a RoPE base other than 10000, ...).  Missing rank files, a tensor of another shape
    than ``args`` say, or a tensor ``args`` do not account for.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, CheckpointShards, FullState,
                                         check_save_path, recorded_split,
                                         target_stage_counts, true_vocab_size, write_layout)
from megatron.checkpoint_merge import partition_dim_by_name
from megatron.checkpointing import split_text
from megatron.errors import CheckpointError, UserError
from megatron.hf_import import model_flags
from megatron.hf_interop import say
from megatron.megatron_lm_files import (FLAG, PT_FILE, MegatronLMStandIn,  # noqa: F401
                                        _Source, load_megatron_file, locate)

_ATTN = "self_attention.query_key_value"


# ------------------------------------------------------------------------ names
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.(.+)$")
_LAYER_PARTS = ("input_layernorm", _ATTN, "self_attention.dense", "post_attention_layernorm",
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
    m = _LAYER.match(name)
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


@dataclass
class _Shard:
    path: str
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    """Our stage-local name -> tensor."""
    source: Dict[str, str] = field(default_factory=dict)
    """Our stage-local name -> Megatron-LM's name, for messages."""


_MODEL_KEYS = ("language_model", "lm_head", "binary_head", "word_embeddings_for_head")


def _read_shard(path: str, payload: Any) -> _Shard:
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
    shard = _Shard(path)
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
def _args_dict(args: Any, path: str) -> Optional[Dict[str, Any]]:
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


def _version(payload: Dict[str, Any], path: str) -> float:
    """Megatron-LM's checkpoint_version (0 when absent, as Megatron-LM reads it)."""
    v = payload.get("checkpoint_version", 0)
    if type(v) not in (int, float) or not (v in (0, 1) or v >= 2):
        raise CheckpointError(f"{FLAG} {path}: checkpoint_version {v!r}; expected 0, 1.0 or "
                              f">= 2.0 (the query/key/value orderings Megatron-LM knows)")
    return float(v)


def _refuse_args(a: Dict[str, Any], path: str, is_bert: bool) -> None:
    """Arguments whose model this trainer cannot build: one UserError naming them."""
    bad = []
    if a.get("num_experts") not in (None, 0, 1):
        bad.append(f"num_experts {a['num_experts']} (mixture of experts)")
    if a.get("use_mcore_models") is True or a.get("use_legacy_models") is False:
        bad.append("Megatron Core models (use_mcore_models / no --use-legacy-models)")
    if a.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        bad.append(f"virtual_pipeline_model_parallel_size "
                   f"{a['virtual_pipeline_model_parallel_size']}")
    pos = a.get("position_embedding_type")
    if pos not in (None, "learned_absolute", "rope"):
        bad.append(f"position_embedding_type {pos!r}")
    if pos is None and a.get("add_position_embedding") is False \
            and not a.get("use_rotary_position_embeddings"):
        bad.append("no position embedding (add_position_embedding false)")
    if a.get("normalization") not in (None, "LayerNorm", "RMSNorm"):
        bad.append(f"normalization {a['normalization']!r}")
    for key, what in (("apply_layernorm_1p", "zero-centred LayerNorm weights"),
                      ("qk_layernorm", "query/key norms"),
                      ("use_rope_scaling", "Llama 3.1 RoPE scaling"),
                      ("add_decoder", "an encoder-decoder model")):
        if a.get(key) is True:
            bad.append(f"{key} ({what})")
    base = a.get("rotary_base")
    if _rope(a) and base not in (None, 10000):
        bad.append(f"rotary_base {base} (Megatron-LM's legacy models rotate with base 10000 "
                   f"whatever it says)")
    if is_bert and (_rope(a) or a.get("normalization") == "RMSNorm" or a.get("swiglu")
                    or a.get("squared_relu") or a.get("add_bias_linear") is False
                    or a.get("untie_embeddings_and_output_weights")
                    or (a.get("group_query_attention") and a.get("num_query_groups")
                        not in (None, a.get("num_attention_heads")))):
        bad.append("a BERT with Llama-style options (this trainer's BERT has BERT's block)")
    if bad:
        raise UserError(f"{FLAG} {path}: the checkpoint's args record {'; '.join(bad)}, "
                        f"which this trainer's models do not have")


def _rope(a: Dict[str, Any]) -> bool:
    return a.get("position_embedding_type") == "rope" or a.get("use_rotary_position_embeddings") \
        is True


# ------------------------------------------------------------------------ the model config
@dataclass
class MegatronArch:
    is_bert: bool
    layers: int
    hidden: int
    heads: int
    groups: int
    kv: int
    ffn: int
    vocab_rows: int
    positions: Optional[int]
    """Rows of the learned position table (None: RoPE)."""
    seq_length: int
    tokentypes: int
    rms: bool
    bias: bool
    qkv_bias: bool
    swiglu: bool
    untied: bool
    binary: bool


def _int_arg(a: Dict[str, Any], key: str, path: str) -> Optional[int]:
    v = a.get(key)
    if v is None:
        return None
    if type(v) is not int or v < 1:
        raise CheckpointError(f"{FLAG} {path}: args.{key} is {v!r}; expected a positive "
                              f"integer")
    return v


def expected_shapes(arch: MegatronArch) -> Dict[str, Tuple[int, ...]]:
    """Our full tensor names and shapes for ``arch``, in our modules' parameter order."""
    h, e = arch.hidden, {}
    e[WORD_EMBEDDING] = (arch.vocab_rows, h)
    if arch.positions is not None:
        e["embedding.position_embeddings.weight"] = (arch.positions, h)
    if arch.is_bert:
        e["embedding.tokentype_embeddings.weight"] = (arch.tokentypes, h)
    norm = ("weight",) if arch.rms else ("weight", "bias")
    qkv_rows = (arch.heads + 2 * arch.groups) * arch.kv
    ffn1 = arch.ffn * (2 if arch.swiglu else 1)
    for i in range(arch.layers):
        p = f"encoder.layers.{i}."
        for part in norm:
            e[p + f"input_layernorm.{part}"] = (h,)
        e[p + f"{_ATTN}.weight"] = (qkv_rows, h)
        if arch.bias or arch.qkv_bias:
            e[p + f"{_ATTN}.bias"] = (qkv_rows,)
        e[p + "self_attention.dense.weight"] = (h, arch.heads * arch.kv)
        if arch.bias:
            e[p + "self_attention.dense.bias"] = (h,)
        for part in norm:
            e[p + f"post_attention_layernorm.{part}"] = (h,)
        e[p + "mlp.dense_h_to_4h.weight"] = (ffn1, h)
        if arch.bias:
            e[p + "mlp.dense_h_to_4h.bias"] = (ffn1,)
        e[p + "mlp.dense_4h_to_h.weight"] = (h, arch.ffn)
        if arch.bias:
            e[p + "mlp.dense_4h_to_h.bias"] = (h,)
    for part in norm:
        e[f"encoder.final_layernorm.{part}"] = (h,)
    if arch.untied:
        e["output_layer.weight"] = (arch.vocab_rows, h)
    if arch.is_bert:
        if arch.binary:
            e["pooler.dense.weight"], e["pooler.dense.bias"] = (h, h), (h,)
        e["lm_head.bias"] = (arch.vocab_rows,)
        e["lm_head.dense.weight"], e["lm_head.dense.bias"] = (h, h), (h,)
        e["lm_head.layernorm.weight"], e["lm_head.layernorm.bias"] = (h,), (h,)
        if arch.binary:
            e["binary_head.weight"], e["binary_head.bias"] = (2, h), (2,)
    return e


def _local(shape: Tuple[int, ...], name: str, tp: int) -> Tuple[int, ...]:
    dim = partition_dim_by_name(name)
    if dim is None:
        return shape
    out = list(shape)
    out[dim] //= tp
    return tuple(out)


# ------------------------------------------------------------------------ merging ranks
def _qkv_rank_to_ours(t: torch.Tensor, version: float, heads_here: int, kv: int) -> torch.Tensor:
    """One tensor rank's fused QKV rows (weight or bias) in checkpoint ``version``'s order
    -> ours, [head, (q, k, v), head_dim] (Megatron-LM's own reordering on load)."""
    rest = tuple(t.shape[1:])
    if version == 0:  # [(q, k, v), head, head_dim]
        return t.reshape(3, heads_here, kv, *rest).transpose(0, 1).reshape(-1, *rest)
    if version == 1:  # [head, head_dim, (q, k, v)]
        return t.reshape(heads_here, kv, 3, *rest).transpose(1, 2).reshape(-1, *rest)
    return t


def _merge(name: str, parts: List[torch.Tensor], arch: MegatronArch, version: float
           ) -> torch.Tensor:
    dim = partition_dim_by_name(name)
    if dim is None:
        return parts[0]
    tp = len(parts)
    if name.endswith((f"{_ATTN}.weight", f"{_ATTN}.bias")):
        parts = [_qkv_rank_to_ours(p, version, arch.heads // tp, arch.kv) for p in parts]
    if arch.swiglu and "mlp.dense_h_to_4h." in name:  # rank r: [gate_r; up_r]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim)


# ------------------------------------------------------------------------ the conversion
@dataclass
class MegatronModel:
    """A Megatron-LM checkpoint in our terms."""

    full: Dict[str, torch.Tensor]
    model_cfg: Dict[str, Any]
    data_cfg: Dict[str, Any]
    source: _Source
    iteration: Any
    version: float
    notes: List[str]
    unit: int
    """Megatron-LM's --make-vocab-size-divisible-by (128 where args do not say)."""


def _gelu(a: Optional[Dict[str, Any]], arch: MegatronArch, notes: List[str]) -> bool:
    """--openai-gelu: the MLP's GELU is the tanh approximation (Megatron-LM's fused
    bias-GELU or --openai-gelu; files without args: the tanh GELU early versions used)."""
    if a is None:
        return True
    if arch.swiglu or a.get("squared_relu"):
        return False
    fused = bool(a.get("bias_gelu_fusion")) and arch.bias
    tanh = bool(a.get("openai_gelu")) or fused
    if arch.is_bert and fused and not a.get("openai_gelu"):
        notes.append("note: the blocks' GELU is Megatron-LM's fused bias-GELU (the tanh "
                     "approximation, --openai-gelu here) while its BERT LM head used the "
                     "exact GELU; this trainer's BERT takes one GELU for both, so the LM "
                     "head's transform differs by at most ~5e-4 per activation")
    return tanh


def _tokenizer(a: Optional[Dict[str, Any]], notes: List[str]) -> Dict[str, Any]:
    from megatron.tokenizer import TOKENIZER_TYPES

    if a is None:
        notes.append("note: the checkpoint records no tokenizer; give your --tokenizer-type "
                     "and its files when training")
        return {}
    kind = a.get("tokenizer_type")
    if kind not in TOKENIZER_TYPES:
        if kind is not None:
            notes.append(f"note: tokenizer {kind!r} has no equivalent here; none recorded "
                         f"(give --tokenizer-type and its files when training)")
        return {}
    out: Dict[str, Any] = {"tokenizer_type": kind}
    for key in ("vocab_file", "merge_file", "tokenizer_model"):
        if isinstance(a.get(key), str):
            out[key] = a[key]
    if kind == "NullTokenizer" and type(a.get("vocab_size")) is int:
        # the same convention here: --vocab-size data ids, the end-of-document id on top
        out["vocab_size"], out["tokenizer_vocab_size"] = a["vocab_size"], a["vocab_size"] + 1
    missing = [out[k] for k in ("vocab_file", "merge_file", "tokenizer_model")
               if k in out and not os.path.exists(out[k])]
    if missing:
        notes.append(f"note: tokenizer files recorded by the checkpoint are not on this "
                     f"machine ({', '.join(missing)}); give them with --vocab-file / "
                     f"--merge-file / --tokenizer-model when training")
    return out


def read_megatron_lm(path: str, *, allow_unsafe: bool = False,
                     iteration: Optional[int] = None,
                     num_attention_heads: Optional[int] = None) -> MegatronModel:
    """Read and merge the Megatron-LM checkpoint ``path`` (see the module doc)."""
    src = locate(path, iteration)
    notes: List[str] = []
    first = src.files[(0, 0)]
    payload = load_megatron_file(first, allow_unsafe)
    if not isinstance(payload, dict):
        raise CheckpointError(f"{FLAG} {first}: expected a Megatron-LM checkpoint (a dict), "
                              f"found {type(payload).__name__}")
    a = _args_dict(payload.get("args"), first)
    version = _version(payload, first)
    src_iteration = payload.get("iteration")
    if a is not None:  # the rank files the run wrote, before reading the others
        for keys, have, what in ((("tensor_model_parallel_size", "model_parallel_size"),
                                  src.tp, "tensor"),
                                 (("pipeline_model_parallel_size",), src.pp, "pipeline")):
            want = next((a[k] for k in keys if type(a.get(k)) is int), None)
            if want is not None and want != have:
                if want > have:
                    miss = (f"mp_rank_{have:02d}" if what == "tensor" and src.pp == 1 else
                            f"mp_rank_{have:02d}_000" if what == "tensor" else
                            f"mp_rank_00_{have:03d}")
                    raise CheckpointError(f"{FLAG} {src.iter_dir}: args record {keys[0]} "
                                          f"{want} but {have} {what} rank(s) are here: missing "
                                          f"{os.path.join(src.iter_dir, miss, PT_FILE)}")
                raise CheckpointError(f"{FLAG} {src.iter_dir}: {have} {what} ranks, but args "
                                      f"record {keys[0]} {want}")
    shards: Dict[Tuple[int, int], _Shard] = {(0, 0): _read_shard(first, payload)}
    del payload
    for key, f in src.files.items():
        if key == (0, 0):
            continue
        other = load_megatron_file(f, allow_unsafe)
        if isinstance(other, dict) and _version(other, f) != version:
            raise CheckpointError(f"{FLAG} {f}: checkpoint_version {_version(other, f)}, but "
                                  f"{first} has {version}: rank files of two checkpoints")
        shards[key] = _read_shard(f, other)
    return _convert(src, shards, a, version, src_iteration, num_attention_heads, notes)


def _layer_counts(src: _Source, shards: Dict[Tuple[int, int], _Shard]) -> List[int]:
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
        local = sorted({int(m[1]) for m in map(_LAYER.match, names) if m})
        if local != list(range(len(local))):
            raise CheckpointError(f"{FLAG} {shards[(0, p)].path}: layers {local[:8]}; expected "
                                  f"a stage's layers numbered 0, 1, ...")
        counts.append(len(local))
    return counts


_Found = Dict[str, List[Tuple[torch.Tensor, str, str]]]
"""Global name -> every tensor rank's part, with its Megatron-LM name and file."""


def _global_tensors(src: _Source, shards: Dict[Tuple[int, int], _Shard]
                    ) -> Tuple[_Found, List[int], List[int]]:
    """Every stage's tensors under global layer numbers; the stages' layer counts and
    first layers."""
    counts = _layer_counts(src, shards)
    offsets = [sum(counts[:p]) for p in range(src.pp)]
    found: _Found = {}
    for p in range(src.pp):
        for t in range(src.tp):
            shard = shards[(t, p)]
            for name, tensor in shard.tensors.items():
                m = _LAYER.match(name)
                g = f"encoder.layers.{int(m[1]) + offsets[p]}.{m[2]}" if m else name
                if t == 0 and g in found:
                    raise CheckpointError(f"{FLAG} {shard.path}: {shard.source[name]!r} is also "
                                          f"in {found[g][0][2]}: two stages hold one tensor")
                found.setdefault(g, []).append((tensor, shard.source[name], shard.path))
    return found, counts, offsets


def _heads(args: Dict[str, Any], recorded: bool, first: str, heads_flag: Optional[int],
           tp: int, notes: List[str]) -> int:
    heads = _int_arg(args, "num_attention_heads", first)
    if heads is None:
        what = ("no args (an early release?)" if not recorded
                else "no num_attention_heads in its args")
        if heads_flag is None:
            raise UserError(f"{FLAG} {first}: the checkpoint records {what}; give "
                            f"--num-attention-heads N (GPT-345M and BERT-345M: 16)")
        heads = heads_flag
        notes.append(f"note: the checkpoint records {what}: --num-attention-heads {heads} as "
                     f"given; sizes from the tensors"
                     + ("; the tanh GELU (--openai-gelu), LayerNorm epsilon 1e-5 and learned "
                        "positions of those versions" if not recorded else ""))
    elif heads_flag is not None and heads_flag != heads:
        raise UserError(f"--num-attention-heads {heads_flag}: the checkpoint's args record "
                        f"num_attention_heads {heads}; leave the flag out")
    if heads % tp:
        raise CheckpointError(f"{FLAG} {first}: {heads} attention heads do not split over "
                              f"{tp} tensor ranks")
    return heads


def _architecture(found: _Found, args: Dict[str, Any], recorded: bool, src: _Source,
                  counts: List[int], version: float, heads_flag: Optional[int],
                  notes: List[str]) -> MegatronArch:
    """The model the tensors and ``args`` describe, checked against each other."""
    first = src.files[(0, 0)]
    is_bert = any(k.startswith(("lm_head.", "binary_head.")) for k in found)
    _refuse_args(args, first, is_bert)
    if WORD_EMBEDDING not in found:
        raise CheckpointError(f"{FLAG} {first}: no word embedding "
                              f"(language_model.embedding.word_embeddings.weight)")
    emb = found[WORD_EMBEDDING][0][0]
    hidden = _int_arg(args, "hidden_size", first) or emb.shape[1]
    heads = _heads(args, recorded, first, heads_flag, src.tp, notes)
    groups = heads
    if args.get("group_query_attention"):
        groups = _int_arg(args, "num_query_groups", first) or heads
    if heads % groups or groups % src.tp:
        raise CheckpointError(f"{FLAG} {first}: num_query_groups {groups} must divide "
                              f"num_attention_heads {heads} and be a multiple of the "
                              f"{src.tp} tensor ranks")
    if groups != heads and version < 2:
        raise CheckpointError(f"{FLAG} {first}: grouped-query attention in a checkpoint_version "
                              f"{version} file; expected version 3")
    kv = _int_arg(args, "kv_channels", first)
    if kv is None:
        if hidden % heads:
            raise CheckpointError(f"{FLAG} {first}: hidden size {hidden} is not a multiple of "
                                  f"{heads} heads and args record no kv_channels")
        kv = hidden // heads
    swiglu = bool(args.get("swiglu"))
    h4 = found.get("encoder.layers.0.mlp.dense_h_to_4h.weight")
    ffn = _int_arg(args, "ffn_hidden_size", first)
    if ffn is None:
        ffn = (h4[0][0].shape[0] * src.tp // (2 if swiglu else 1)) if h4 else 4 * hidden
    pos_table = found.get("embedding.position_embeddings.weight")
    positions = None
    if not _rope(args):
        positions = (_int_arg(args, "max_position_embeddings", first)
                     or (pos_table[0][0].shape[0] if pos_table else None))
        if positions is None:
            raise CheckpointError(f"{FLAG} {first}: no position embedding "
                                  f"(language_model.embedding.position_embeddings)")
    seq = (_int_arg(args, "seq_length", first) or positions
           or _int_arg(args, "max_position_embeddings", first))
    if seq is None:
        raise CheckpointError(f"{FLAG} {first}: args record neither seq_length nor "
                              f"max_position_embeddings")
    tt = found.get("embedding.tokentype_embeddings.weight")
    tokentypes = tt[0][0].shape[0] if tt else 0
    if tokentypes and not is_bert:
        raise UserError(f"{FLAG} {first}: a GPT with token-type embeddings; this trainer's GPT "
                        f"has none")
    bias = args.get("add_bias_linear", True) is not False
    arch = MegatronArch(is_bert=is_bert, layers=sum(counts), hidden=hidden, heads=heads, groups=groups,
                 kv=kv, ffn=ffn, vocab_rows=emb.shape[0] * src.tp, positions=positions,
                 seq_length=seq, tokentypes=tokentypes or 2,
                 rms=args.get("normalization") == "RMSNorm", bias=bias,
                 qkv_bias=bool(args.get("add_qkv_bias")) and not bias, swiglu=swiglu,
                 untied=bool(args.get("untie_embeddings_and_output_weights")),
                 binary="binary_head.weight" in found)
    layers_arg = _int_arg(args, "num_layers", first)
    if layers_arg is not None and layers_arg != arch.layers:
        raise CheckpointError(f"{FLAG} {src.iter_dir}: args record num_layers {layers_arg}, the "
                              f"rank files hold {arch.layers} layers ({'+'.join(map(str, counts))}"
                              f" over {src.pp} stage(s))")
    padded = _int_arg(args, "padded_vocab_size", first)
    if padded is not None and padded != arch.vocab_rows:
        raise CheckpointError(f"{FLAG} {first}: word embedding {tuple(emb.shape)} on each of "
                              f"{src.tp} tensor ranks ({arch.vocab_rows} rows), args record "
                              f"padded_vocab_size {padded}")
    if is_bert and tt is None:
        notes.append("note: a BERT without token types (no binary head); its token-type table "
                     "is written as zeros, which adds nothing, as this trainer's BERT has one")
    return arch


def _check_tensors(found: _Found, arch: MegatronArch, expected: Dict[str, Tuple[int, ...]],
                   src: _Source, offsets: List[int]) -> None:
    """Every tensor has the shape ``arch`` gives it on its rank, and none is missing."""
    sizes = (f"args: num_layers {arch.layers}, hidden_size {arch.hidden}, num_attention_heads "
             f"{arch.heads}, num_query_groups {arch.groups}, kv_channels {arch.kv}, "
             f"ffn_hidden_size {arch.ffn}, padded vocabulary {arch.vocab_rows}"
             + (f", max_position_embeddings {arch.positions}" if arch.positions else "")
             + f"; tensor size {src.tp}")
    for g, parts in found.items():
        if g not in expected:
            raise CheckpointError(f"{FLAG} {parts[0][2]}: tensor {parts[0][1]!r}, which the "
                                  f"checkpoint's args do not account for ({_what_args_say(arch)})")
        want = _local(expected[g], g, src.tp)
        for tensor, mname, where in parts:
            if tuple(tensor.shape) != want:
                raise CheckpointError(f"{FLAG} {where}: tensor {mname!r} is "
                                      f"{tuple(tensor.shape)}, expected {want} ({sizes})")
    missing = [g for g in expected if g not in found
               and g != "embedding.tokentype_embeddings.weight"]
    if missing:
        stage = 0 if missing[0].startswith("embedding.") else src.pp - 1
        m = _LAYER.match(missing[0])
        if m:
            stage = max(p for p in range(src.pp) if offsets[p] <= int(m[1]))
        raise CheckpointError(f"{FLAG} {src.files[(0, stage)]}: missing {missing[0]} "
                              f"({len(missing)} tensor(s) the args imply are absent; "
                              f"{_what_args_say(arch)})")


def _convert(src: _Source, shards: Dict[Tuple[int, int], _Shard], a: Optional[Dict[str, Any]],
             version: float, src_iteration: Any, heads_flag: Optional[int],
             notes: List[str]) -> MegatronModel:
    found, counts, offsets = _global_tensors(src, shards)
    args = a or {}
    arch = _architecture(found, args, a is not None, src, counts, version, heads_flag, notes)
    expected = expected_shapes(arch)
    _check_tensors(found, arch, expected, src, offsets)
    emb = found[WORD_EMBEDDING][0][0]
    full: Dict[str, torch.Tensor] = {}
    for g in expected:
        if g == "embedding.tokentype_embeddings.weight" and g not in found:
            full[g] = torch.zeros(expected[g], dtype=emb.dtype)
            continue
        full[g] = _merge(g, [p[0] for p in found[g]], arch, version).contiguous().clone()
    model_cfg = _model_config(arch, args if a is not None else None, full, notes)
    data_cfg = _tokenizer(a, notes)
    unit = args.get("make_vocab_size_divisible_by")
    return MegatronModel(full, model_cfg, data_cfg, src, src_iteration, version, notes,
                         unit if type(unit) is int and unit > 0 else 128)


def _what_args_say(arch: MegatronArch) -> str:
    return (f"{'BERT' if arch.is_bert else 'GPT'}, "
            f"{'RMSNorm' if arch.rms else 'LayerNorm'}, "
            f"{'biases' if arch.bias else 'qkv biases only' if arch.qkv_bias else 'no biases'}"
            f"{', SwiGLU' if arch.swiglu else ''}{', RoPE' if arch.positions is None else ''}"
            f"{', untied output' if arch.untied else ''}")


def _model_config(arch: MegatronArch, a: Optional[Dict[str, Any]], full: Dict[str, torch.Tensor],
                  notes: List[str]) -> Dict[str, Any]:
    """Our recorded config["model"] (ModelConfig's fields) for ``arch`` and args ``a``."""
    args = a or {}

    def number(key: str, default: float, *alts: str) -> float:
        for k in (key,) + alts:
            v = args.get(k)
            if type(v) in (int, float) and math.isfinite(v):
                return float(v)
        return default

    rope = _rope(args)
    cfg: Dict[str, Any] = {
        "num_layers": arch.layers, "hidden_size": arch.hidden,
        "num_attention_heads": arch.heads, "ffn_hidden_size": arch.ffn,
        "seq_length": arch.seq_length,
        "max_position_embeddings": (arch.positions if arch.positions is not None
                                    else args.get("max_position_embeddings") or arch.seq_length),
        "padded_vocab_size": arch.vocab_rows,
        "layernorm_epsilon": number("norm_epsilon", 1e-5, "layernorm_epsilon"),
        "hidden_dropout": number("hidden_dropout", 0.1),
        "attention_dropout": number("attention_dropout", 0.1),
        "init_method_std": number("init_method_std", 0.02),
        "openai_gelu": _gelu(a, arch, notes),
        "normalization": "RMSNorm" if arch.rms else "LayerNorm",
        "position_embedding_type": "rope" if rope else "learned_absolute",
        "swiglu": arch.swiglu, "squared_relu": bool(args.get("squared_relu")),
        "kv_channels": arch.kv, "num_query_groups": arch.groups,
        "add_bias_linear": arch.bias, "add_qkv_bias": arch.qkv_bias,
        "untie_embeddings_and_output_weights": arch.untied,
        "apply_residual_connection_post_layernorm":
            bool(args.get("apply_residual_connection_post_layernorm")),
        "num_tokentypes": arch.tokentypes if arch.is_bert else 0,
        "params_dtype": str(full[WORD_EMBEDDING].dtype),
    }
    if rope:
        interp = args.get("rotary_seq_len_interpolation_factor")
        cfg.update(rotary_base=10000, rotary_percent=number("rotary_percent", 1.0),
                   rotary_interleaved=bool(args.get("rotary_interleaved")),
                   rotary_seq_len_interpolation_factor=(float(interp) if interp else None))
    return cfg


# ------------------------------------------------------------------------ writing
def _keeping_divisor(unit: int, rows: int, src_tp: int, tp: int) -> int:
    """The --make-vocab-size-divisible-by that keeps the source's ``rows`` padded rows at
    tensor size ``tp`` (Megatron-LM padded to a multiple of its ``unit`` x its t): the
    unit scaled by src_tp / tp where that is a whole number dividing the rows, else the
    unit."""
    scaled = unit * src_tp
    if scaled % tp == 0 and rows % scaled == 0:
        return scaled // tp
    return unit


def _train_flags(m: MegatronModel, divisible_by: int, tp: int, pp: int, split: str,
                 save: str) -> str:
    """The command that trains (or finetunes) the imported model."""
    cfg = m.model_cfg
    bert = bool(cfg["num_tokentypes"])
    flags = ["pretrain_bert.py" if bert else "pretrain_gpt.py", model_flags(cfg),
             f"--seq-length {cfg['seq_length']}"]
    if cfg.get("rotary_percent", 1.0) != 1.0:
        flags.append(f"--rotary-percent {cfg['rotary_percent']}")
    if cfg.get("rotary_interleaved"):
        flags.append("--rotary-interleaved")
    if cfg.get("rotary_seq_len_interpolation_factor") is not None:
        flags.append(f"--rotary-seq-len-interpolation-factor "
                     f"{cfg['rotary_seq_len_interpolation_factor']:g}")
    if cfg["apply_residual_connection_post_layernorm"]:
        flags.append("--apply-residual-connection-post-layernorm")
    if not cfg["swiglu"] and (cfg["hidden_dropout"], cfg["attention_dropout"]) != (0.1, 0.1):
        flags.append(f"--hidden-dropout {cfg['hidden_dropout']} "
                     f"--attention-dropout {cfg['attention_dropout']}")
    if bert and "binary_head.weight" not in m.full:
        flags.append("--bert-no-binary-head")
    flags.append(f"--make-vocab-size-divisible-by {divisible_by} "
                 f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}{split}")
    data = m.data_cfg
    kind = data.get("tokenizer_type")
    if kind:
        flags.append(f"--tokenizer-type {kind}")
        for key in ("vocab_file", "merge_file", "tokenizer_model"):
            if data.get(key):
                flags.append(f"--{key.replace('_', '-')} {data[key]}")
        if kind == "NullTokenizer" and data.get("vocab_size"):
            flags.append(f"--vocab-size {data['vocab_size']}")
    else:
        flags.append("--tokenizer-type TYPE (and its files: the checkpoint records none)")
    flags.append(f"--load {save} --finetune")
    if bert:
        flags.append(f"(or a task: tasks/main.py --task ... --pretrained-checkpoint {save})")
    return " ".join(flags)


def import_megatron_lm(path: str, save: str, *, tp: int = 1, pp: int = 1,
                       divisible_by: Optional[int] = None, allow_unsafe: bool = False,
                       iteration: Optional[int] = None, true_vocab: Optional[int] = None,
                       num_attention_heads: Optional[int] = None,
                       first: Optional[int] = None, last: Optional[int] = None) -> str:
    """Write Megatron-LM checkpoint ``path`` as an iteration-0 checkpoint of layout
    (``tp``, ``pp``) under ``save``; returns the iteration directory written.

    ``divisible_by``: the vocabulary padding unit of the runs that will load it (default:
    the one keeping Megatron-LM's padded rows at ``tp``, ``_keeping_divisor``).
    ``true_vocab``: --true-vocab-size (for a re-padding when the tokenizer files are not
    here).  ``first``/``last``: the stage split, as --decoder-first/last-pipeline-num-layers.
    A ``save`` holding checkpoints is refused before anything is read."""
    check_save_path(path, save, load_flag=FLAG)
    m = read_megatron_lm(path, allow_unsafe=allow_unsafe, iteration=iteration,
                         num_attention_heads=num_attention_heads)
    rows = m.full[WORD_EMBEDDING].shape[0]
    unit_note = divisible_by is None
    if divisible_by is None:
        divisible_by = _keeping_divisor(m.unit, rows, m.source.tp, tp)
    data = {"make_vocab_size_divisible_by": divisible_by, **m.data_cfg}
    config = {"model": m.model_cfg, "data": data}
    real = true_vocab or true_vocab_size(config)
    if real is not None and not data.get("tokenizer_vocab_size"):
        data["tokenizer_vocab_size"] = int(real)
    layers = m.model_cfg["num_layers"]
    ckpt = CheckpointShards(root=m.source.iter_dir, iteration=0, tensor=1, pipeline=1,
                            num_layers=layers)
    label = m.source.label if m.iteration is None else (
        "release" if m.source.label == "release" else f"iteration {m.iteration}")
    state = FullState(iteration=0, model=m.full, shadow=None, optimizer=None,
                      common={"consumed_train_samples": 0, "consumed_valid_samples": 0,
                              "lr_scheduler": None, "config": config,
                              "megatron_lm_source": {"checkpoint": label,
                                                     "checkpoint_version": m.version}},
                      layout=(1, 1, 1), ckpt=ckpt)
    for note in m.notes:
        say(note)
    out = write_layout(state, save, tp, pp, 1, true_vocab=true_vocab,
                       source=os.path.abspath(path), first=first, last=last,
                       vocab_flag="--true-vocab-size" if true_vocab else None)
    split = split_text(*recorded_split(target_stage_counts(state, pp, first, last), first,
                                       last))
    if unit_note and divisible_by != m.unit:
        say(f"note: --make-vocab-size-divisible-by {divisible_by} keeps the "
             f"{rows} padded vocabulary rows at tensor size {tp} (Megatron-LM's "
             f"{m.unit} x {m.source.tp})")
    say(f"imported Megatron-LM {label} (checkpoint_version {m.version:g}, tensor "
         f"{m.source.tp}, pipeline {m.source.pp}) as iteration 0; its optimizer, LR "
         f"scheduler, RNG state and sample counts are not carried over")
    say(f"train with: {_train_flags(m, divisible_by, tp, pp, split, save)}")
    return out



"""Merge a checkpoint's pipeline stages and tensor partitions into one full state dict,
and cut a full state dict for one stage of any other layout.

The trainer writes one file set per (tensor rank, pipeline stage)
(``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng``; Megatron's ``mp_rank_TT`` at one
stage), read here only through ``megatron.checkpointing.load_payload``.  Stage-local
names number the transformer layers from 0 on every stage; tensor-parallel parameters
hold a contiguous slice of the full tensor along their ``partition_dim``, except
SwiGLU's first MLP weight and bias (``--swiglu``), [gate; up], whose rank r holds
[gate_r; up_r] (stride 2, see ``partition_stride_by_name``).  This module

* merges all files into ONE full state dict with global layer numbers
  (``merge_checkpoint``/``merge_shards``), dropping the last stage's copy of the tied
  word embedding (its gradient is all-reduced with the first stage's, so its value and
  its Adam moments are identical);
* cuts a full state dict for one stage of another layout (``split_for_stage``);
* loads any checkpoint into the stage module of the current run
  (``load_into_stage``: how finetuning reads --pretrained-checkpoint).

Where a module is not at hand, partition dims come from the parameter names
(``partition_dim_by_name``): Megatron's column-parallel layers (QKV, h->4h, vocabulary
tables, an untied output layer) split dim 0, row-parallel ones (attention output, 4h->h)
dim 1; strides from the names and the checkpoint's recorded config
(``partition_stride_by_name``).
"""
from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint_discovery import refuse_hf_model_dir, refuse_iteration_dir
from megatron.checkpoint_files import TRACKER, iteration_dir, load_payload, rank_dir, read_tracker
from megatron.checkpoint_load import check_model_payload
from megatron.checkpoint_payload import payload_exists
from megatron.errors import CheckpointError
from megatron.tensor_parallel.param_init import shard, unshard


def megatron_rank_dir(base: str, t: int, p: int, pp: int) -> str:
    """Megatron's name for a rank directory of a layout with ``pp`` stages."""
    try:
        return rank_dir(base, t, p, pp)  # mp_rank_TT at pp == 1
    except TypeError:  # older rank_dir(base, t, p)
        return rank_dir(base, t, p)


def load_stage_payload(stem: str, allow_unsafe: bool = False) -> Any:
    """``load_payload``; ``allow_unsafe`` reads old pickle checkpoints where supported."""
    if allow_unsafe:
        try:
            return load_payload(stem, allow_unsafe=True)
        except TypeError:
            pass
    return load_payload(stem)

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_EMBEDDING_COPY = "output_word_embeddings.weight"
LAYER_NAME = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<num>\d+)(?P<tail>\..*)$")
# Megatron names a rank directory mp_rank_TT when pp == 1 and mp_rank_TT_PPP otherwise.
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
MODEL_FILE = "model_optim_rng"
# Parameters whose dim 0 is the (padded) vocabulary.
VOCAB_NAMES = (WORD_EMBEDDING, OUTPUT_EMBEDDING_COPY, "lm_head.bias", "output_layer.weight")


def partition_dim_by_name(name: str) -> Optional[int]:
    """Tensor-parallel split dim of a GPT/BERT parameter from its name (None = replicated)."""
    if name in VOCAB_NAMES or name.endswith("word_embeddings.weight"):
        return 0
    if re.search(r"(query_key_value|dense_h_to_4h)\.(weight|bias)$", name):
        return 0
    if re.search(r"(self_attention\.dense|dense_4h_to_h)\.weight$", name):
        return 1
    return None


_STRIDED = re.compile(r"dense_h_to_4h\.(weight|bias)$")


def model_config_of(config: Any) -> Dict[str, Any]:
    """The ``model`` section of a checkpoint's recorded config ({} when absent or not a
    dict: checkpoints converted elsewhere, or hand-made ones, may lack it)."""
    model = config.get("model") if isinstance(config, dict) else None
    return model if isinstance(model, dict) else {}


def partition_stride_by_name(name: str, model_cfg: Optional[Dict[str, Any]]) -> int:
    """Megatron's ``partition_stride`` of a GPT/BERT parameter: in how many equal
    sections the tensor-parallel split cuts it separately.  2 for the first MLP weight
    and bias of a ``--swiglu`` model (``model_cfg`` = the checkpoint's config["model"]):
    they are [gate; up] and rank r holds [gate_r; up_r], so concatenating the ranks'
    parts would interleave gate and up rows.  1 (a contiguous slice) for every other
    tensor, and for checkpoints that predate --swiglu (no ``swiglu`` key)."""
    if (model_cfg or {}).get("swiglu") is True and _STRIDED.search(name):
        return 2
    return 1


def to_global(name: str, layer_offset: int) -> str:
    """Stage-local parameter name -> whole-model name (layer index + offset)."""
    m = LAYER_NAME.match(name)
    if not m or layer_offset == 0:
        return name
    return f"{m['head']}{int(m['num']) + layer_offset}{m['tail']}"


def to_local(name: str, layer_offset: int) -> str:
    m = LAYER_NAME.match(name)
    if not m or layer_offset == 0:
        return name
    return f"{m['head']}{int(m['num']) - layer_offset}{m['tail']}"


@dataclass
class CheckpointShards:
    """Every (tensor rank, stage) model state dict of one saved iteration."""

    root: str
    iteration: int
    tensor: int
    pipeline: int
    num_layers: int
    shards: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = field(default_factory=dict)
    config: Optional[dict] = None
    payloads: Dict[Tuple[int, int], Dict[str, Any]] = field(default_factory=dict)
    """The whole file of every (tensor rank, stage): model, optimizer, scheduler, ..."""
    dirs: Dict[Tuple[int, int], str] = field(default_factory=dict)
    stage_offsets: List[int] = field(default_factory=list)
    """Global number of each stage's first layer (the saved run's stage split, which
    --decoder-first/last-pipeline-num-layers may have made uneven)."""


def rank_dirs(base: str) -> Dict[Tuple[int, int], str]:
    """(tensor rank, stage) -> rank directory of one iteration directory."""
    found = {}
    for entry in sorted(os.listdir(base)):
        m = _RANK_DIR.match(entry)
        if m and os.path.isdir(os.path.join(base, entry)):
            found[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(base, entry)
    return found


def read_checkpoint(root: str, iteration: Optional[int] = None, *,
                    allow_unsafe: bool = False, flag: str = "checkpoint") -> CheckpointShards:
    """Load all shards under ``root`` (latest iteration unless given).  ``allow_unsafe``:
    also read old pickle checkpoints (--allow-unsafe-checkpoint; trusted files only).
    ``flag``: the option ``root`` came from (``--load``...), named by the errors about
    ``root`` itself."""
    if not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root}: expected a checkpoint directory written by "
                              f"--save, found {'a file' if os.path.exists(root) else 'nothing'}")
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            refuse_hf_model_dir(root, flag)
            refuse_iteration_dir(root, flag)
            raise CheckpointError(f"{flag} {root}: no {TRACKER}; is this a directory "
                                  f"written by --save?")
    base = iteration_dir(root, iteration)
    if not os.path.isdir(base):
        raise CheckpointError(f"{flag} {root}: iteration directory {base} is missing")
    dirs = rank_dirs(base)
    if not dirs:
        raise CheckpointError(f"checkpoint {base}: no mp_rank_TT or mp_rank_TT_PPP directories")
    tensor = max(t for t, _ in dirs) + 1
    pipeline = max(p for _, p in dirs) + 1
    missing = [(t, p) for t in range(tensor) for p in range(pipeline)
               if (t, p) not in dirs or not payload_exists(os.path.join(dirs[(t, p)],
                                                                        MODEL_FILE))]
    if missing:
        raise CheckpointError(f"checkpoint {base}: missing model files of (tensor rank, "
                              f"stage) {missing}")
    out = CheckpointShards(root=root, iteration=iteration, tensor=tensor, pipeline=pipeline,
                           num_layers=0, dirs=dirs)
    layers_seen = 0
    saved_layers: Dict[int, List[int]] = {}
    for key in sorted(dirs):
        stem = os.path.join(dirs[key], MODEL_FILE)
        payload = check_model_payload(load_stage_payload(stem, allow_unsafe), stem)
        out.payloads[key] = payload
        out.shards[key] = payload["model"]
        out.config = out.config or payload.get("config")
        if key[0] == 0:
            layers_seen += _num_local_layers(payload["model"])
            if (payload.get("layout") or {}).get("layers"):
                saved_layers[key[1]] = list(payload["layout"]["layers"])
    model_cfg = (out.config or {}).get("model") or {}
    num_layers = model_cfg.get("num_layers")
    if num_layers is not None and (type(num_layers) is not int or num_layers < 1):
        raise CheckpointError(f"checkpoint {base}: its config records num_layers "
                              f"{num_layers!r}; expected a positive integer")
    out.num_layers = int(num_layers or layers_seen)
    out.stage_offsets = _stage_offsets(out, saved_layers, base)
    return out


def _stage_offsets(ckpt: CheckpointShards, saved_layers: Dict[int, List[int]],
                   base: str) -> List[int]:
    """First global layer of each stage: from the layers each stage recorded, else from
    the saved config's --decoder-first/last-pipeline-num-layers, else an even split."""
    if len(saved_layers) == ckpt.pipeline:
        return [saved_layers[s][0] for s in range(ckpt.pipeline)]
    from megatron.model.utils import stage_layer_counts

    par = (ckpt.config or {}).get("parallel") or {}
    try:
        counts = stage_layer_counts(ckpt.num_layers, ckpt.pipeline,
                                    par.get("decoder_first_pipeline_num_layers"),
                                    par.get("decoder_last_pipeline_num_layers"))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {base}: {ckpt.num_layers} layers over "
                              f"{ckpt.pipeline} stages: {exc}") from None
    return [sum(counts[:s]) for s in range(ckpt.pipeline)]


def _num_local_layers(state: Dict[str, torch.Tensor]) -> int:
    nums = {int(m["num"]) for m in (LAYER_NAME.match(k) for k in state) if m}
    return max(nums) + 1 if nums else 0


def merge_checkpoint(ckpt: CheckpointShards,
                     partition_dims: Optional[Dict[str, Optional[int]]] = None
                     ) -> Dict[str, torch.Tensor]:
    """One full (t=1, d=1) state dict with global layer numbers.

    ``partition_dims`` maps full names to split dims; names it lacks fall back to
    ``partition_dim_by_name``.
    """
    return merge_shards(ckpt.shards, ckpt, partition_dims)


def merge_shards(shards: Dict[Tuple[int, int], Dict[str, torch.Tensor]],
                 ckpt: CheckpointShards,
                 partition_dims: Optional[Dict[str, Optional[int]]] = None
                 ) -> Dict[str, torch.Tensor]:
    """Merge per-(tensor rank, stage) dicts keyed by stage-local parameter names (model
    weights, or one optimizer quantity such as Adam's ``exp_avg``) into one full dict.

    The order of the result is stage 0's names, then stage 1's, ...: the parameter order
    of a one-stage model.  Tensors of a partitioned parameter that are not shaped like
    the parameter's slice (Adam's 0-d ``step``) are taken from tensor rank 0.  The
    parts of SwiGLU's [gate; up] weight are put together section by section
    (``partition_stride_by_name``, from the checkpoint's recorded config).
    """
    model_cfg = model_config_of(getattr(ckpt, "config", None))
    offsets = ckpt.stage_offsets or [s * (ckpt.num_layers // ckpt.pipeline)
                                     for s in range(ckpt.pipeline)]
    full: Dict[str, torch.Tensor] = {}
    owner: Dict[str, int] = {}
    for stage in range(ckpt.pipeline):
        for name in list(shards[(0, stage)].keys()):
            if name == OUTPUT_EMBEDDING_COPY and ckpt.pipeline > 1:
                continue  # identical to the first stage's word embedding
            gname = to_global(name, offsets[stage])
            if gname in owner:
                raise CheckpointError(f"checkpoint {ckpt.root}: parameter {gname} appears on "
                                      f"stages {owner[gname]} and {stage}")
            lacking = [t for t in range(ckpt.tensor) if name not in shards[(t, stage)]]
            if lacking:
                raise CheckpointError(f"checkpoint {ckpt.root}: {name} of stage {stage} is "
                                      f"missing on tensor ranks {lacking}; the rank "
                                      f"directories come from different models")
            parts = [shards[(t, stage)][name] for t in range(ckpt.tensor)]
            dim = (partition_dims or {}).get(gname, partition_dim_by_name(gname))
            if ckpt.tensor == 1 or dim is None or parts[0].dim() <= dim:
                full[gname] = parts[0]
            elif len({p.shape[:dim] + p.shape[dim + 1:] for p in parts}) != 1:
                raise CheckpointError(f"checkpoint {ckpt.root}: the tensor-parallel parts of "
                                      f"{gname} on stage {stage} do not fit together (shapes "
                                      f"{[tuple(p.shape) for p in parts]}, split along dim "
                                      f"{dim}); the rank directories come from different "
                                      f"models")
            else:
                stride = partition_stride_by_name(gname, model_cfg)
                if parts[0].shape[dim] % stride:
                    raise CheckpointError(f"checkpoint {ckpt.root}: {gname} on stage {stage} "
                                          f"has {parts[0].shape[dim]} rows per tensor rank, "
                                          f"not [gate; up] halves (its config records "
                                          f"swiglu); the rank files and config disagree")
                full[gname] = unshard(parts, dim, stride)
            owner[gname] = stage
    return full


def _fit_vocab(name: str, tensor: torch.Tensor, rows: int,
               real: Optional[int] = None) -> torch.Tensor:
    """Pad or trim the vocabulary rows when the padded vocab sizes differ.

    New rows copy the checkpoint's last padding row when it has one (``real``, the
    unpadded vocabulary, is below its rows), as ``tools/checkpoint_util.py`` re-pads: a
    padding row is only ever pushed down as an output, so its copies stay unlikely,
    while a zero row gives logit 0, which can be a likely token (a GPT-2 checkpoint
    loaded at t=2 scored WikiText 0.011 worse with zero rows, 0.002 with copies).
    Without padding rows (or ``real`` unknown) new rows are zero."""
    have = tensor.shape[0]
    if have == rows:
        return tensor
    warnings.warn(f"{name}: checkpoint has {have} vocabulary rows, the model "
                  f"{rows} (different vocabulary padding); padding/trimming the unused rows. "
                  f"Output logits of padding rows enter the softmax, so results differ "
                  f"slightly: choose --make-vocab-size-divisible-by to keep the padded size")
    if have > rows:
        return tensor[:rows].clone()
    shape = (rows - have,) + tuple(tensor.shape[1:])
    if real is not None and real < have:
        pad = tensor[-1:].expand(shape).clone()
    else:
        pad = torch.zeros(shape, dtype=tensor.dtype)
    return torch.cat([tensor, pad], 0)


def split_for_stage(full: Dict[str, torch.Tensor], target: Dict[str, Tuple[torch.Size,
                    Optional[int]]], *, layer_offset: int, tp_rank: int, tp_size: int,
                    strides: Optional[Dict[str, int]] = None, real_vocab: Optional[int] = None
                    ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """This stage's state dict from a full one.

    ``target`` maps each local name to (local shape, partition dim or None); ``strides``
    the local names split in sections (SwiGLU's [gate; up]: 2) to their stride, the
    rest being cut in contiguous slices; ``real_vocab``: the unpadded vocabulary, for
    re-padding the vocabulary tables (``_fit_vocab``).  Returns (state dict, local names
    the full dict does not provide).
    """
    out: Dict[str, torch.Tensor] = {}
    missing: List[str] = []
    for name, (shape, dim) in target.items():
        gname = to_global(name, layer_offset)
        if gname not in full and name == OUTPUT_EMBEDDING_COPY:
            gname = WORD_EMBEDDING
        if gname not in full:
            missing.append(name)
            continue
        tensor = full[gname]
        if gname in VOCAB_NAMES or gname.endswith("word_embeddings.weight"):
            tensor = _fit_vocab(gname, tensor, shape[0] * (tp_size if dim == 0 else 1),
                                real_vocab)
        if dim is not None and tp_size > 1:
            stride = (strides or {}).get(name, 1)
            if tensor.shape[dim] % (tp_size * stride):
                sections = f" in each of its {stride} sections" if stride > 1 else ""
                raise CheckpointError(f"{gname}: dim {dim} of size {tensor.shape[dim]} cannot be "
                                 f"split over {tp_size} tensor-parallel ranks{sections}")
            tensor = shard(tensor, dim, tp_rank, tp_size, stride)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{gname}: checkpoint gives shape {tuple(tensor.shape)} for this "
                             f"stage but the model expects {tuple(shape)}; the checkpoint was "
                             f"written for a different model size (--hidden-size, "
                             f"--num-layers, ...)")
        out[name] = tensor.clone()
    return out, missing


def module_targets(module: torch.nn.Module) -> Dict[str, Tuple[torch.Size, Optional[int]]]:
    """(shape, partition dim) of every entry of a stage module's state dict."""
    params = dict(module.named_parameters())
    out = {}
    for name, value in module.state_dict().items():
        p = params.get(name)
        dim = None
        if p is not None and getattr(p, "tensor_model_parallel", False):
            dim = int(p.partition_dim)
        out[name] = (value.shape, dim)
    return out


def module_strides(module: torch.nn.Module) -> Dict[str, int]:
    """Local names of a stage module's parameters split in sections (their
    ``partition_stride`` > 1: SwiGLU's [gate; up]) -> stride."""
    return {name: int(p.partition_stride) for name, p in module.named_parameters()
            if getattr(p, "tensor_model_parallel", False)
            and int(getattr(p, "partition_stride", 1)) > 1}


@dataclass
class LoadReport:
    """What ``load_into_stage`` did."""

    loaded: List[str]
    missing: List[str]
    source_layout: Tuple[int, int]
    iteration: int


def check_same_vocabulary(ckpt: CheckpointShards, vocab_size: int, flag: str) -> None:
    """Refuse a checkpoint whose padded vocabulary is not this run's vocabulary padded
    the checkpoint's way: its rows are then other tokens, not padding.  ``vocab_size``
    is this run's tokenizer vocabulary (unpadded).  Checkpoints without their config
    (converted ones) cannot be checked; their rows are fitted with a warning."""
    from megatron.tokenizer import vocab_size_with_padding

    config = ckpt.config or {}
    padded = (config.get("model") or {}).get("padded_vocab_size")
    divisible = (config.get("data") or {}).get("make_vocab_size_divisible_by")
    tensor = (config.get("parallel") or {}).get("tensor_model_parallel_size")
    if not (padded and divisible and tensor):
        return
    if vocab_size_with_padding(vocab_size, divisible, tensor) != padded:
        raise CheckpointError(
            f"{flag} {ckpt.root}: vocabulary of {padded} rows (padded to a multiple of "
            f"{divisible} x {tensor}) does not come from this run's {vocab_size}-token "
            f"vocabulary (--vocab-file/--vocab-size): the checkpoint was trained with another "
            f"tokenizer; use the vocabulary it was pretrained with")


def load_into_stage(module: torch.nn.Module, root: str, *, layer_offset: int, tp_rank: int,
                    tp_size: int, allow_missing: Sequence[str] = (),
                    iteration: Optional[int] = None, vocab_size: Optional[int] = None,
                    flag: str = "checkpoint", allow_unsafe: bool = False) -> LoadReport:
    """Load checkpoint ``root`` (any layout) into this stage's ``module`` in place.

    Parameters the checkpoint lacks must start with one of ``allow_missing`` (e.g. a
    new task head); anything else missing is an error.  Checkpoint entries this stage
    does not hold (other stages, pretraining heads) are ignored.  ``vocab_size`` (this
    run's unpadded vocabulary): refuse a checkpoint of another vocabulary
    (``check_same_vocabulary``); ``flag`` names the option ``root`` came from;
    ``allow_unsafe``: also read old pickle checkpoints (--allow-unsafe-checkpoint).
    """
    try:
        ckpt = read_checkpoint(root, iteration, allow_unsafe=allow_unsafe, flag=flag)
        config = getattr(module, "config", None)
        if flag != "checkpoint" and config is not None:
            from megatron.checkpoint_shape import check_model_shape
            # a GPT checkpoint for a BERT task, another --hidden-size...: one line, not
            # one size mismatch per tensor (the vocabulary is checked below, padding
            # allowed)
            check_model_shape(root, ckpt.config, config, source_flag=flag,
                              skip=("padded_vocab_size",))
        if vocab_size is not None:
            check_same_vocabulary(ckpt, vocab_size, flag)
    except CheckpointError as exc:
        # every rank reads the whole checkpoint and compares it with the same flags: one
        # line per node says it, not one per rank (what a stage lacks, below, differs
        # between stages and still prints on each)
        exc.every_rank_alike = True
        raise
    targets = module_targets(module)
    full = merge_checkpoint(ckpt)
    try:
        state, missing = split_for_stage(full, targets, layer_offset=layer_offset,
                                         tp_rank=tp_rank, tp_size=tp_size,
                                         strides=module_strides(module), real_vocab=vocab_size)
    except CheckpointError as exc:  # names the tensor; say which checkpoint too
        raise CheckpointError(f"{flag} {root}: {exc}") from None
    unexpected = [n for n in missing if not any(n.startswith(p) for p in allow_missing)]
    if unexpected:
        raise CheckpointError(f"checkpoint {root} (tensor {ckpt.tensor}, pipeline {ckpt.pipeline}) "
                         f"has no value for {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
                         f"; is it a checkpoint of this kind of model?")
    module.load_state_dict(state, strict=False)
    return LoadReport(loaded=sorted(state), missing=missing,
                      source_layout=(ckpt.tensor, ckpt.pipeline), iteration=ckpt.iteration)

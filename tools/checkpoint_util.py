"""Reshard a checkpoint to another (t, d, w) layout, or move it to/from Hugging Face.

Three workflows (``python tools/checkpoint_util.py --help``)::

    # 1. reshard the FULL training state and resume at another layout
    python tools/checkpoint_util.py --load ckpt_t1_d2 --save ckpt_t2_d1 \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1 \\
        --target-data-parallel-size 2
    # 2. export to a transformers model directory (GPT-2, or Megatron-BERT)
    python tools/checkpoint_util.py --load ckpt --to-hf hf_model
    # 3. import a transformers GPT-2 directory, then train with --load OUT [--finetune]
    python tools/checkpoint_util.py --from-hf gpt2_dir --save ckpt_gpt2 \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

The trainer writes one file set per (tensor rank, pipeline stage)
(``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng``; Megatron's ``mp_rank_TT`` at one
stage), read and written only through ``megatron.checkpointing``'s
``load_payload``/``save_payload``.  Stage-local names number the transformer layers from
0 on every stage; tensor-parallel parameters hold a contiguous slice of the full tensor
along their ``partition_dim``.  This module

* merges all files into ONE full state dict with global layer numbers
  (``merge_checkpoint``/``merge_shards``), dropping the last stage's copy of the tied
  word embedding (its gradient is all-reduced with the first stage's, so its value and
  its Adam moments are identical);
* merges the rest of the training state the same way (``read_full_state``): the 2BW
  shadow weights, Adam moments and fp32 master weights (split and merged exactly like
  their parameters), and copies what every rank shares (iteration, consumed samples,
  LR scheduler, grad scaler, the engine's per-batch loss scales);
* cuts it for another layout (``write_layout``), re-padding the vocabulary tables when
  t changes the padded size (Megatron pads to a multiple of
  ``make_vocab_size_divisible_by * t``; new rows copy the last padding row, moments
  too; ``--make-vocab-size-divisible-by`` halved when t doubles keeps the size), and
  writes through a staging directory renamed into place, tracker file last;
* loads any checkpoint into the stage module of the current run
  (``load_into_stage``: how finetuning reads --pretrained-checkpoint).

RNG state (``rng_dp_DDD`` per rank): carried over only where the (t, d) grid is unchanged
and the data-parallel rank exists in both layouts; other ranks start from the streams
``--seed`` gives them (one layout's generator states do not describe another's: dropout
masks are drawn per rank and per slice).  The data position is exact in every case:
the sampler resumes from ``consumed_train_samples`` whatever w is.

Where a module is not at hand (the script), partition dims come from the parameter
names (``partition_dim_by_name``): Megatron's column-parallel layers (QKV, h->4h,
vocabulary tables) split dim 0, row-parallel ones (attention output, 4h->h) dim 1.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.checkpointing import (CHECKPOINT_VERSION, TRACKER, iteration_dir,  # noqa: E402
                                    load_payload, payload_exists, rank_dir, read_tracker,
                                    save_payload)
from megatron.errors import CheckpointError, UserError  # noqa: E402

try:  # the manifest (size + sha256 per file) that training saves write; newer checkpointing
    from megatron.checkpointing import write_manifest  # noqa: E402
except ImportError:  # pragma: no cover - older checkpointing without manifests
    write_manifest = None


def _rank_dir(base: str, t: int, p: int, pp: int) -> str:
    """Megatron's name for a rank directory of a layout with ``pp`` stages."""
    try:
        return rank_dir(base, t, p, pp)  # mp_rank_TT at pp == 1
    except TypeError:  # older rank_dir(base, t, p)
        return rank_dir(base, t, p)


def _load(stem: str, allow_unsafe: bool = False) -> Any:
    """``load_payload``; ``allow_unsafe`` reads old pickle checkpoints where supported."""
    if allow_unsafe:
        try:
            return load_payload(stem, allow_unsafe=True)
        except TypeError:
            pass
    return load_payload(stem)

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_EMBEDDING_COPY = "output_word_embeddings.weight"
_LAYER = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<num>\d+)(?P<tail>\..*)$")
# Megatron names a rank directory mp_rank_TT when pp == 1 and mp_rank_TT_PPP otherwise.
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
MODEL_FILE = "model_optim_rng"
# Parameters whose dim 0 is the (padded) vocabulary.
_VOCAB_NAMES = (WORD_EMBEDDING, OUTPUT_EMBEDDING_COPY, "lm_head.bias", "output_layer.weight")


def partition_dim_by_name(name: str) -> Optional[int]:
    """Tensor-parallel split dim of a GPT/BERT parameter from its name (None = replicated)."""
    if name in _VOCAB_NAMES or name.endswith("word_embeddings.weight"):
        return 0
    if re.search(r"(query_key_value|dense_h_to_4h)\.(weight|bias)$", name):
        return 0
    if re.search(r"(self_attention\.dense|dense_4h_to_h)\.weight$", name):
        return 1
    return None


def to_global(name: str, layer_offset: int) -> str:
    """Stage-local parameter name -> whole-model name (layer index + offset)."""
    m = _LAYER.match(name)
    if not m or layer_offset == 0:
        return name
    return f"{m['head']}{int(m['num']) + layer_offset}{m['tail']}"


def to_local(name: str, layer_offset: int) -> str:
    m = _LAYER.match(name)
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


def rank_dirs(base: str) -> Dict[Tuple[int, int], str]:
    """(tensor rank, stage) -> rank directory of one iteration directory."""
    found = {}
    for entry in sorted(os.listdir(base)):
        m = _RANK_DIR.match(entry)
        if m and os.path.isdir(os.path.join(base, entry)):
            found[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(base, entry)
    return found


def read_checkpoint(root: str, iteration: Optional[int] = None, *,
                    allow_unsafe: bool = False) -> CheckpointShards:
    """Load all shards under ``root`` (latest iteration unless given).  ``allow_unsafe``:
    also read old pickle checkpoints (--allow-unsafe-checkpoint; trusted files only)."""
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint {root}: expected a directory written by --save, "
                              f"found {'a file' if os.path.exists(root) else 'nothing'}")
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"checkpoint {root}: no {TRACKER}; is this a directory "
                                  f"written by --save?")
    base = iteration_dir(root, iteration)
    if not os.path.isdir(base):
        raise CheckpointError(f"checkpoint {root}: iteration directory {base} is missing")
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
    for key in sorted(dirs):
        payload = _load(os.path.join(dirs[key], MODEL_FILE), allow_unsafe)
        out.payloads[key] = payload
        out.shards[key] = payload["model"]
        out.config = out.config or payload.get("config")
        if key[0] == 0:
            layers_seen += _num_local_layers(payload["model"])
    model_cfg = (out.config or {}).get("model", {})
    out.num_layers = int(model_cfg.get("num_layers") or layers_seen)
    if out.num_layers % pipeline:
        raise CheckpointError(f"checkpoint {base}: {out.num_layers} layers cannot be split "
                              f"over {pipeline} stages")
    return out


def _num_local_layers(state: Dict[str, torch.Tensor]) -> int:
    nums = {int(m["num"]) for m in (_LAYER.match(k) for k in state) if m}
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
    the parameter's slice (Adam's 0-d ``step``) are taken from tensor rank 0.
    """
    per_stage = ckpt.num_layers // ckpt.pipeline
    full: Dict[str, torch.Tensor] = {}
    owner: Dict[str, int] = {}
    for stage in range(ckpt.pipeline):
        for name in list(shards[(0, stage)].keys()):
            if name == OUTPUT_EMBEDDING_COPY and ckpt.pipeline > 1:
                continue  # identical to the first stage's word embedding
            gname = to_global(name, stage * per_stage)
            if gname in owner:
                raise CheckpointError(f"checkpoint {ckpt.root}: parameter {gname} appears on "
                                      f"stages {owner[gname]} and {stage}")
            parts = [shards[(t, stage)][name] for t in range(ckpt.tensor)]
            dim = (partition_dims or {}).get(gname, partition_dim_by_name(gname))
            if ckpt.tensor == 1 or dim is None or parts[0].dim() <= dim:
                full[gname] = parts[0]
            else:
                full[gname] = torch.cat(parts, dim)
            owner[gname] = stage
    return full


def _fit_vocab(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad (zeros) or trim the vocabulary rows when the padded vocab sizes differ."""
    if tensor.shape[0] == rows:
        return tensor
    warnings.warn(f"{name}: checkpoint has {tensor.shape[0]} vocabulary rows, the model "
                  f"{rows} (different vocabulary padding); padding/trimming the unused rows. "
                  f"Output logits of padding rows enter the softmax, so results differ "
                  f"slightly: choose --make-vocab-size-divisible-by to keep the padded size")
    if tensor.shape[0] > rows:
        return tensor[:rows].clone()
    pad = torch.zeros((rows - tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], 0)


def split_for_stage(full: Dict[str, torch.Tensor], target: Dict[str, Tuple[torch.Size,
                    Optional[int]]], *, layer_offset: int, tp_rank: int, tp_size: int
                    ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """This stage's state dict from a full one.

    ``target`` maps each local name to (local shape, partition dim or None).  Returns
    (state dict, local names the full dict does not provide).
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
        if gname in _VOCAB_NAMES or gname.endswith("word_embeddings.weight"):
            tensor = _fit_vocab(gname, tensor, shape[0] * (tp_size if dim == 0 else 1))
        if dim is not None and tp_size > 1:
            if tensor.shape[dim] % tp_size:
                raise CheckpointError(f"{gname}: dim {dim} of size {tensor.shape[dim]} cannot be "
                                 f"split over {tp_size} tensor-parallel ranks")
            tensor = torch.chunk(tensor, tp_size, dim=dim)[tp_rank]
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


@dataclass
class LoadReport:
    """What ``load_into_stage`` did."""

    loaded: List[str]
    missing: List[str]
    source_layout: Tuple[int, int]
    iteration: int


def load_into_stage(module: torch.nn.Module, root: str, *, layer_offset: int, tp_rank: int,
                    tp_size: int, allow_missing: Sequence[str] = (),
                    iteration: Optional[int] = None) -> LoadReport:
    """Load checkpoint ``root`` (any layout) into this stage's ``module`` in place.

    Parameters the checkpoint lacks must start with one of ``allow_missing`` (e.g. a
    new task head); anything else missing is an error.  Checkpoint entries this stage
    does not hold (other stages, pretraining heads) are ignored.
    """
    ckpt = read_checkpoint(root, iteration)
    targets = module_targets(module)
    full = merge_checkpoint(ckpt)
    state, missing = split_for_stage(full, targets, layer_offset=layer_offset,
                                     tp_rank=tp_rank, tp_size=tp_size)
    unexpected = [n for n in missing if not any(n.startswith(p) for p in allow_missing)]
    if unexpected:
        raise CheckpointError(f"checkpoint {root} (tensor {ckpt.tensor}, pipeline {ckpt.pipeline}) "
                         f"has no value for {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
                         f"; is it a checkpoint of this kind of model?")
    module.load_state_dict(state, strict=False)
    return LoadReport(loaded=sorted(state), missing=missing,
                      source_layout=(ckpt.tensor, ckpt.pipeline), iteration=ckpt.iteration)


# ------------------------------------------------------------------ full-state resharding
def _name_targets(full: Dict[str, torch.Tensor], num_layers: int, tp: int, pp: int,
                  stage: int, padded_vocab: Optional[int] = None
                  ) -> Tuple[Dict[str, Tuple[torch.Size, Optional[int]]], int]:
    """Local (shape, dim) of a stage's names when no module is available, in the stage
    module's parameter order.  ``padded_vocab``: rows of the vocabulary tables in the
    target layout (default: as in ``full``)."""
    per = num_layers // pp
    offset = stage * per
    targets = {}
    for gname, tensor in full.items():
        m = _LAYER.match(gname)
        if m:
            if not offset <= int(m["num"]) < offset + per:
                continue
        elif gname.startswith("embedding."):
            if stage != 0:
                continue
        elif stage != pp - 1:
            continue
        dim = partition_dim_by_name(gname)
        shape = list(tensor.shape)
        if padded_vocab is not None and _is_vocab(gname):
            shape[0] = padded_vocab
        if dim is not None:
            if shape[dim] % tp:
                raise CheckpointError(f"{gname}: dim {dim} of size {shape[dim]} does not divide "
                                      f"by --target-tensor-parallel-size {tp}")
            shape[dim] //= tp
        targets[to_local(gname, offset)] = (torch.Size(shape), dim)
    tied = "output_layer.weight" not in full and WORD_EMBEDDING in full
    if pp > 1 and stage == pp - 1 and tied:
        shape = list(full[WORD_EMBEDDING].shape)
        shape[0] = (padded_vocab or shape[0]) // tp
        targets[OUTPUT_EMBEDDING_COPY] = (torch.Size(shape), 0)
    return targets, offset


def _is_vocab(gname: str) -> bool:
    return gname in _VOCAB_NAMES or gname.endswith("word_embeddings.weight")


@dataclass
class FullOptimizer:
    """A layout-free optimizer state: every per-parameter quantity as a full tensor."""

    name: str
    """--optimizer (adam, sgd)."""
    tensors: Dict[str, Dict[str, torch.Tensor]]
    """quantity (exp_avg, exp_avg_sq, momentum_buffer, ...) -> global name -> full tensor."""
    scalars: Dict[str, Dict[str, Any]]
    """global name -> per-parameter values that are not split (Adam's step count)."""
    masters: Optional[Dict[str, torch.Tensor]]
    """fp32 master weights by global name (mixed precision), else None."""
    groups: Dict[str, Dict[str, Any]]
    """'decay' / 'no_decay' -> torch param-group hyper-parameters (without 'params')."""
    grad_scaler: Any


@dataclass
class FullState:
    """Everything a checkpoint holds, independent of its (t, d, w) layout."""

    iteration: int
    model: Dict[str, torch.Tensor]
    shadow: Optional[Dict[str, torch.Tensor]]
    optimizer: Optional[FullOptimizer]
    common: Dict[str, Any]
    """Entries every rank file shares: consumed samples, lr_scheduler, engine, config, ..."""
    layout: Tuple[int, int, int]
    """Source (tensor, pipeline, data) sizes."""
    ckpt: CheckpointShards


def _decay_order(shapes: Sequence[Sequence[int]]) -> List[int]:
    """Model-order positions in the order torch numbers them in the optimizer state:
    the weight-decay group (matrices) first, then the no-decay group (biases, norms),
    as ``get_megatron_optimizer`` builds its param groups."""
    decay = [i for i, s in enumerate(shapes) if len(s) >= 2]
    return decay + [i for i, s in enumerate(shapes) if len(s) < 2]


def _stage_optimizer_by_name(opt: Dict[str, Any], names: List[str], where: str
                             ) -> Tuple[Dict[str, Dict[str, torch.Tensor]],
                                        Dict[str, Dict[str, Any]], Optional[Dict[str, Any]],
                                        Dict[str, Dict[str, Any]]]:
    """One stage's ``MegatronOptimizer.state_dict()`` keyed by local parameter names."""
    meta = opt.get("meta") or {}
    shapes = [tuple(s) for s in meta.get("shapes", [])]
    if len(shapes) != len(names):
        raise CheckpointError(f"{where}: optimizer state holds {len(shapes)} parameters, the "
                              f"model {len(names)}; not written by this trainer's optimizer")
    torch_sd = opt["optimizer"]
    order = _decay_order(shapes)
    flat = [int(i) for g in torch_sd["param_groups"] for i in g["params"]]
    if sorted(flat) != list(range(len(names))):
        raise CheckpointError(f"{where}: optimizer param groups number {len(flat)} "
                              f"parameters, expected 0..{len(names) - 1}")
    index_to_name = {idx: names[order[pos]] for pos, idx in enumerate(flat)}
    groups: Dict[str, Dict[str, Any]] = {}
    for g in torch_sd["param_groups"]:
        kinds = {len(shapes[order[flat.index(int(i))]]) >= 2 for i in g["params"]}
        if len(kinds) != 1:
            raise CheckpointError(f"{where}: an optimizer param group mixes matrices and "
                                  f"vectors; expected the decay / no-decay split")
        groups["decay" if kinds.pop() else "no_decay"] = {k: v for k, v in g.items()
                                                          if k != "params"}
    tensors: Dict[str, Dict[str, torch.Tensor]] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for idx, entry in torch_sd["state"].items():
        name = index_to_name[int(idx)]
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors.setdefault(key, {})[name] = value
            else:
                scalars.setdefault(name, {})[key] = value
    masters = None
    if opt.get("fp32_masters") is not None:
        masters = dict(zip(names, opt["fp32_masters"]))
    return tensors, scalars, masters, groups


def read_full_state(root: str, iteration: Optional[int] = None, *,
                    allow_unsafe: bool = False) -> FullState:
    """Merge every file of a checkpoint into one layout-free ``FullState``."""
    ckpt = read_checkpoint(root, iteration, allow_unsafe=allow_unsafe)
    first = ckpt.payloads[(0, 0)]
    layout = first.get("layout") or {}
    data = int(layout.get("data") or 1)
    model = merge_checkpoint(ckpt)
    shadow = None
    if all(p.get("model_shadow") is not None for p in ckpt.payloads.values()):
        shadow = merge_shards({k: p["model_shadow"] for k, p in ckpt.payloads.items()}, ckpt)
    optimizer = None
    if all(p.get("optimizer") is not None for p in ckpt.payloads.values()):
        optimizer = _merge_optimizer(ckpt)
    skip = {"model", "model_shadow", "optimizer", "layout", "iteration", "rng_state"}
    common = {k: v for k, v in first.items() if k not in skip}
    return FullState(iteration=ckpt.iteration, model=model, shadow=shadow,
                     optimizer=optimizer, common=common,
                     layout=(ckpt.tensor, ckpt.pipeline, data), ckpt=ckpt)


def _merge_optimizer(ckpt: CheckpointShards) -> FullOptimizer:
    per_key: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}
    scalars_by_shard, masters_by_shard = {}, {}
    groups: Dict[str, Dict[str, Any]] = {}
    for key, payload in ckpt.payloads.items():
        names = list(payload["model"].keys())
        tensors, scalars, masters, g = _stage_optimizer_by_name(
            payload["optimizer"], names, f"{ckpt.dirs[key]}")
        for quantity, by_name in tensors.items():
            per_key.setdefault(quantity, {})[key] = by_name
        scalars_by_shard[key] = scalars
        masters_by_shard[key] = masters
        for kind, hp in g.items():
            groups.setdefault(kind, hp)
    shards_all = list(ckpt.payloads)
    tensors_full = {}
    for quantity, shards in per_key.items():
        if set(shards) != set(shards_all):
            raise CheckpointError(f"checkpoint {ckpt.root}: optimizer quantity {quantity} is "
                                  f"missing on some ranks")
        tensors_full[quantity] = merge_shards(shards, ckpt)
    scalars_full = merge_shards(scalars_by_shard, _NoSplit(ckpt))  # type: ignore[arg-type]
    masters_full = None
    if all(m is not None for m in masters_by_shard.values()):
        masters_full = merge_shards(masters_by_shard, ckpt)  # type: ignore[arg-type]
    first = ckpt.payloads[(0, 0)]["optimizer"]
    return FullOptimizer(name=first["meta"]["optimizer"], tensors=tensors_full,
                         scalars=scalars_full, masters=masters_full, groups=groups,
                         grad_scaler=first.get("grad_scaler"))


class _NoSplit:
    """A CheckpointShards view with tensor size 1, for values replicated across TP."""

    def __init__(self, ckpt: CheckpointShards) -> None:
        self.root, self.num_layers, self.pipeline, self.tensor = (ckpt.root, ckpt.num_layers,
                                                                  ckpt.pipeline, 1)


def true_vocab_size(config: Optional[dict], override: Optional[int] = None) -> Optional[int]:
    """The unpadded vocabulary size of a checkpoint (None when it cannot be told)."""
    if override:
        return override
    data = (config or {}).get("data") or {}
    try:
        from megatron.config import DataConfig
        from megatron.tokenizer import build_tokenizer
        if data.get("tokenizer_type"):
            return int(build_tokenizer(DataConfig(**data), 1,
                                       vocab_size=data.get("vocab_size")).vocab_size)
    except Exception:  # noqa: BLE001 - vocabulary files not on this machine: fall back
        pass
    return int(data["vocab_size"]) if data.get("vocab_size") else None


def target_padded_vocab(state_rows: int, config: Optional[dict], tp: int,
                        true_vocab: Optional[int]) -> int:
    """Padded vocabulary rows for tensor size ``tp``: Megatron pads to a multiple of
    make_vocab_size_divisible_by * tp, so the table may grow or shrink with tp."""
    from megatron.tokenizer import vocab_size_with_padding

    divisible = int(((config or {}).get("data") or {}).get("make_vocab_size_divisible_by")
                    or 128)
    return vocab_size_with_padding(true_vocab or state_rows, divisible, tp)


def _fit_rows(tensor: torch.Tensor, rows: int, real: Optional[int]) -> torch.Tensor:
    """Cut or extend the vocabulary rows to ``rows``.

    New rows copy the source's last PADDING row when it has one: padding rows are never
    an input and only ever pushed down as outputs, so a copy keeps the new logits as
    unlikely as the old padding ones (a zero row would give logit 0, which can be a
    likely token).  Its optimizer moments are copied alike.  Without padding rows in the
    source, new rows are zero."""
    have = tensor.shape[0]
    if have >= rows:
        return tensor if have == rows else tensor[:rows].clone()
    shape = (rows - have,) + tuple(tensor.shape[1:])
    if real is not None and real < have:
        extra = tensor[-1:].expand(shape).clone()
    else:
        extra = torch.zeros(shape, dtype=tensor.dtype)
    return torch.cat([tensor, extra], 0)


def _repad(full: Dict[str, torch.Tensor], rows: int, real: Optional[int] = None
           ) -> Dict[str, torch.Tensor]:
    """Vocabulary tables (and their optimizer state) fitted to ``rows`` padded rows;
    ``real``: the unpadded vocabulary size (None: unknown)."""
    return {k: (_fit_rows(v, rows, real) if _is_vocab(k) and v.dim() > 0 else v)
            for k, v in full.items()}


def _split(full: Dict[str, torch.Tensor], targets, offset: int, t: int, tp: int
           ) -> Dict[str, torch.Tensor]:
    sub = {n: spec for n, spec in targets.items()
           if to_global(n, offset) in full or n == OUTPUT_EMBEDDING_COPY}
    state, missing = split_for_stage(full, sub, layer_offset=offset, tp_rank=t, tp_size=tp)
    if missing:
        raise CheckpointError(f"cannot place {missing[:4]} in the target layout")
    return state


def _stage_optimizer(opt: FullOptimizer, targets, offset: int, t: int, tp: int,
                     rows: int, real: Optional[int] = None) -> Dict[str, Any]:
    """A ``MegatronOptimizer.state_dict()`` for one (tensor rank, stage) of the target."""
    names = list(targets)
    shapes = [tuple(targets[n][0]) for n in names]
    order = _decay_order(shapes)
    quantities = {q: _split(_repad(full, rows, real), targets, offset, t, tp)
                  for q, full in opt.tensors.items()}
    state: Dict[int, Dict[str, Any]] = {}
    for pos, i in enumerate(order):
        name = names[i]
        gname = to_global(name, offset)
        if name == OUTPUT_EMBEDDING_COPY and gname not in opt.scalars:
            gname = WORD_EMBEDDING
        entry = {k: (v.clone() if torch.is_tensor(v) else v)
                 for k, v in opt.scalars.get(gname, {}).items()}
        for q, by_name in quantities.items():
            if name in by_name:
                entry[q] = by_name[name]
        if entry:
            state[pos] = entry
    n_decay = sum(1 for s in shapes if len(s) >= 2)
    groups = []
    for kind, positions in (("decay", range(n_decay)), ("no_decay", range(n_decay, len(names)))):
        if len(positions):
            if kind not in opt.groups:
                raise CheckpointError(f"the source optimizer has no {kind} parameter group "
                                      f"to copy hyper-parameters from")
            groups.append(dict(opt.groups[kind], params=list(positions)))
    masters = None
    if opt.masters is not None:
        split = _split(_repad(opt.masters, rows, real), targets, offset, t, tp)
        masters = [split[n] for n in names]
    return {"meta": {"optimizer": opt.name, "num_params": len(names),
                     "shapes": [list(s) for s in shapes], "fp32_masters": masters is not None},
            "optimizer": {"state": state, "param_groups": groups},
            "fp32_masters": masters, "grad_scaler": opt.grad_scaler}


def _check_save_path(load: Optional[str], save: str) -> None:
    """--save must not be --load or inside it: a failed rewrite would mix old and new
    files in the only copy of the checkpoint."""
    if load is None:
        return
    src, dst = os.path.realpath(load), os.path.realpath(save)
    if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
        raise UserError(f"--save {save}: expected a directory outside --load {load}, found "
                        f"{'the same directory' if dst == src else 'a directory inside it'}")


def _write_atomically(save: str, iteration: int, write_files) -> str:
    """Write one iteration into ``iter_X.tmp`` and rename it into place; the tracker file
    is rewritten last, so a crash leaves ``save`` as it was.  (Training saves do the
    same; see megatron/checkpointing.py.)"""
    os.makedirs(save, exist_ok=True)
    final = iteration_dir(save, iteration)
    staging = final + ".tmp"
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    write_files(staging)
    aside = None
    if os.path.exists(final):
        aside = f"{final}.old.{os.getpid()}"
        os.replace(final, aside)
    os.replace(staging, final)
    tmp = os.path.join(save, f"{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(str(iteration))
    os.replace(tmp, os.path.join(save, TRACKER))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def write_layout(state: FullState, save: str, tp: int, pp: int, dp: Optional[int] = None,
                 *, true_vocab: Optional[int] = None, source: Optional[str] = None,
                 allow_unsafe: bool = False, divisible_by: Optional[int] = None) -> str:
    """Write ``state`` as a checkpoint for (tp, pp, dp) under ``save``.

    RNG files: a rank whose (tensor rank, stage) position and data-parallel rank exist
    in the source with the same t and d gets its own RNG state back; every other rank
    gets none and keeps the streams ``--seed`` gives it (the RNG state of one layout
    does not describe another: dropout masks are drawn per rank and per slice).
    """
    num_layers = state.ckpt.num_layers
    if num_layers % pp:
        raise UserError(f"--target-pipeline-parallel-size {pp}: expected a divisor of the "
                        f"{num_layers} layers")
    src_t, src_p, src_w = state.layout
    dp = dp or src_w
    config = json_safe(state.common.get("config") or {})
    if divisible_by:  # the resumed run's --make-vocab-size-divisible-by
        config["data"] = dict(config.get("data") or {}, make_vocab_size_divisible_by=divisible_by)
    real = true_vocab_size(config, true_vocab)
    rows = (target_padded_vocab(state.model[WORD_EMBEDDING].shape[0], config, tp, real)
            if WORD_EMBEDDING in state.model else None)
    if config:
        config = dict(config)
        config["parallel"] = dict(config.get("parallel") or {}, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, world_size=tp * pp * dp)
        if rows is not None:
            config["model"] = dict(config.get("model") or {}, padded_vocab_size=rows)
    model = _repad(state.model, rows, real) if rows else state.model
    shadow = (_repad(state.shadow, rows, real) if rows and state.shadow is not None
              else state.shadow)
    same_grid = (src_t, src_p) == (tp, pp) and bool(state.ckpt.dirs)

    def write_files(staging: str) -> None:
        for stage in range(pp):
            targets, offset = _name_targets(model, num_layers, tp, pp, stage, rows)
            for t in range(tp):
                payload = dict(state.common)
                payload.update({
                    "checkpoint_version": CHECKPOINT_VERSION, "iteration": state.iteration,
                    "layout": {"tensor": tp, "pipeline": pp, "data": dp},
                    "model": _split(model, targets, offset, t, tp),
                    "model_shadow": (_split(shadow, targets, offset, t, tp)
                                     if shadow is not None else None),
                    "optimizer": (_stage_optimizer(state.optimizer, targets, offset, t, tp,
                                                   rows or 0, real)
                                  if state.optimizer is not None else None),
                    "config": config})
                if source:
                    payload["converted_from"] = source
                out_dir = _rank_dir(staging, t, stage, pp)
                os.makedirs(out_dir, exist_ok=True)
                save_payload(payload, os.path.join(out_dir, MODEL_FILE))
                if same_grid:
                    src_dir = state.ckpt.dirs[(t, stage)]
                    for d in range(min(dp, src_w)):
                        stem = os.path.join(src_dir, f"rng_dp_{d:03d}")
                        if payload_exists(stem):
                            save_payload(_load(stem, allow_unsafe),
                                         os.path.join(out_dir, f"rng_dp_{d:03d}"))

    def write_all(staging: str) -> None:
        write_files(staging)
        if write_manifest is not None:
            write_manifest(staging, state.iteration, {"tensor": tp, "pipeline": pp, "data": dp})

    return _write_atomically(save, state.iteration, write_all)


def json_safe(config: dict) -> dict:
    return dict(config) if isinstance(config, dict) else {}


def convert(load: str, save: str, tp: int, pp: int, iteration: Optional[int] = None,
            dp: Optional[int] = None, true_vocab: Optional[int] = None,
            allow_unsafe: bool = False) -> str:
    """Rewrite checkpoint ``load`` (full state) for layout (tp, pp, dp) under ``save``."""
    _check_save_path(load, save)
    state = read_full_state(load, iteration, allow_unsafe=allow_unsafe)
    return write_layout(state, save, tp, pp, dp, true_vocab=true_vocab,
                        source=os.path.abspath(load), allow_unsafe=allow_unsafe)


# ---------------------------------------------------------------------------- the script
_EPILOG = """workflows:
  reshard   --load CKPT --save OUT --target-tensor-parallel-size T
            --target-pipeline-parallel-size D [--target-data-parallel-size W]
  export    --load CKPT --to-hf HF_DIR          (GPT-2 or Megatron-BERT for transformers)
  import    --from-hf HF_DIR --save OUT --target-tensor-parallel-size T
            --target-pipeline-parallel-size D   (then train with --load OUT [--finetune])
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="checkpoint_util.py", description=__doc__.split("\n\n")[0],
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help="checkpoint directory written by --save (reshard, export)")
    p.add_argument("--save", help="where to write the converted checkpoint (reshard, import); "
                                  "must not be --load or inside it")
    p.add_argument("--to-hf", metavar="DIR", help="export --load as a Hugging Face "
                   "transformers model directory (safetensors, config.json, tokenizer files)")
    p.add_argument("--from-hf", metavar="DIR", help="import a Hugging Face GPT-2 directory "
                   "(model.safetensors + config.json) into a checkpoint at --save")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None, metavar="T",
                   help="t of the written checkpoint (default: the source's; 1 for import)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None, metavar="D",
                   help="d of the written checkpoint (default: the source's; 1 for import)")
    p.add_argument("--target-data-parallel-size", type=int, default=None, metavar="W",
                   help="w the resumed run will use (default: the source's); decides which "
                        "RNG files are carried over")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--true-vocab-size", type=int, default=None, metavar="N",
                   help="unpadded vocabulary size, when the tokenizer files recorded in the "
                        "checkpoint are not on this machine (needed to re-pad for a new t)")
    p.add_argument("--allow-unsafe-checkpoint", action="store_true",
                   help="read an old pickle (.pt) checkpoint; unpickling can run code, so "
                        "only for files you trust; the output is written in the current format")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="the vocabulary padding unit the resumed/finetuning run will use "
                        "(default: the source checkpoint's; 128 for import).  The padded "
                        "size is a multiple of N x t: halve N when doubling t to keep it, "
                        "and with it the exact losses")
    return p


def main(argv: Optional[Iterable[str]] = None) -> str:
    p = build_parser()
    args = p.parse_args(list(argv) if argv is not None else None)
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_data_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    modes = [m for m, on in (("--to-hf", args.to_hf), ("--from-hf", args.from_hf),
                             ("--save", args.save and not args.from_hf)) if on]
    if len(modes) != 1:
        p.error("choose one workflow: --load X --save Y (reshard), --load X --to-hf Y "
                "(export) or --from-hf X --save Y (import)")
    try:
        if args.from_hf:
            from megatron.hf_interop import import_hf
            if not args.save:
                p.error("--from-hf needs --save")
            _check_save_path(args.from_hf, args.save)
            out = import_hf(args.from_hf, args.save, tp=args.target_tensor_parallel_size or 1,
                            pp=args.target_pipeline_parallel_size or 1,
                            divisible_by=args.make_vocab_size_divisible_by or 128)
        elif not args.load:
            p.error(f"{modes[0]} needs --load CHECKPOINT")
        elif args.to_hf:
            from megatron.hf_interop import export_hf
            _check_save_path(args.load, args.to_hf)
            out = export_hf(args.load, args.to_hf, iteration=args.iteration,
                            true_vocab=args.true_vocab_size,
                            allow_unsafe=args.allow_unsafe_checkpoint)
        else:
            _check_save_path(args.load, args.save)
            state = read_full_state(args.load, args.iteration,
                                    allow_unsafe=args.allow_unsafe_checkpoint)
            tp = args.target_tensor_parallel_size or state.layout[0]
            pp = args.target_pipeline_parallel_size or state.layout[1]
            out = write_layout(state, args.save, tp, pp, args.target_data_parallel_size,
                               true_vocab=args.true_vocab_size,
                               source=os.path.abspath(args.load),
                               allow_unsafe=args.allow_unsafe_checkpoint,
                               divisible_by=args.make_vocab_size_divisible_by)
    except UserError as exc:
        print(f"checkpoint_util.py: error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

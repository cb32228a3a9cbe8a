"""Merge a checkpoint's pipeline stages and tensor partitions, and re-split it.

The trainer writes one ``model`` state dict per (tensor rank, pipeline stage)
(``iter_XXXXXXX/mp_rank_TT_PPP/model_optim_rng.pt``).  Stage-local names number the
transformer layers from 0 on every stage; tensor-parallel parameters hold a contiguous
slice of the full tensor along their ``partition_dim``.  This module

* merges all files into ONE full state dict with global layer numbers
  (``merge_checkpoint``), dropping the last stage's copy of the tied word embedding;
* cuts a full state dict for one stage of another layout (``split_for_stage``), driven
  by the target module's own parameter names, shapes and partition flags;
* loads any checkpoint into the stage module of the current run
  (``load_into_stage``: how finetuning reads --pretrained-checkpoint, whatever
  tensor/pipeline layout pretraining used);
* as a script, rewrites a checkpoint for another layout::

    python tools/checkpoint_util.py --load ckpt_t2_p4 --save ckpt_t1_p2 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2

Where a module is not at hand (the script), partition dims come from the parameter
names (``partition_dim_by_name``): Megatron's column-parallel layers (QKV, h->4h,
vocabulary tables) split dim 0, row-parallel ones (attention output, 4h->h) dim 1.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.checkpointing import (CHECKPOINT_VERSION, TRACKER, iteration_dir,  # noqa: E402
                                    rank_dir, read_tracker)

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_EMBEDDING_COPY = "output_word_embeddings.weight"
_LAYER = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<num>\d+)(?P<tail>\..*)$")
_RANK_DIR = re.compile(r"^mp_rank_(\d+)_(\d+)$")
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
    stage_offsets: List[int] = field(default_factory=list)
    """Global number of each stage's first layer (the saved run's stage split)."""


def read_checkpoint(root: str, iteration: Optional[int] = None) -> CheckpointShards:
    """Load all model shards under ``root`` (latest iteration unless given)."""
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise FileNotFoundError(f"checkpoint {root}: no {TRACKER}; is this a directory "
                                    f"written by --save?")
    base = iteration_dir(root, iteration)
    if not os.path.isdir(base):
        raise FileNotFoundError(f"checkpoint {root}: iteration directory {base} is missing")
    found = {}
    for entry in sorted(os.listdir(base)):
        m = _RANK_DIR.match(entry)
        if m:
            found[(int(m.group(1)), int(m.group(2)))] = os.path.join(base, entry,
                                                                     "model_optim_rng.pt")
    if not found:
        raise FileNotFoundError(f"checkpoint {base}: no mp_rank_TT_PPP directories")
    tensor = max(t for t, _ in found) + 1
    pipeline = max(p for _, p in found) + 1
    missing = [(t, p) for t in range(tensor) for p in range(pipeline) if (t, p) not in found]
    if missing:
        raise FileNotFoundError(f"checkpoint {base}: missing model files of (tensor rank, "
                                f"stage) {missing}")
    out = CheckpointShards(root=root, iteration=iteration, tensor=tensor, pipeline=pipeline,
                           num_layers=0)
    layers_seen = 0
    saved_layers: Dict[int, List[int]] = {}
    for key, path in found.items():
        payload = torch.load(path, map_location="cpu", weights_only=False)
        out.shards[key] = payload["model"]
        out.config = out.config or payload.get("config")
        if key[0] == 0:
            layers_seen += _num_local_layers(payload["model"])
            if (payload.get("layout") or {}).get("layers"):
                saved_layers[key[1]] = list(payload["layout"]["layers"])
    model_cfg = (out.config or {}).get("model", {})
    out.num_layers = int(model_cfg.get("num_layers") or layers_seen)
    out.stage_offsets = _stage_offsets(out, saved_layers, base)
    return out


def _stage_offsets(ckpt: CheckpointShards, saved_layers: Dict[int, List[int]],
                   base: str) -> List[int]:
    """First global layer of each stage: from the layers each stage recorded, else from
    the saved config's --decoder-first/last-pipeline-num-layers, else an even split."""
    if len(saved_layers) == ckpt.pipeline:
        return [saved_layers[s][0] for s in range(ckpt.pipeline)]
    par = (ckpt.config or {}).get("parallel", {})
    from megatron.model.utils import stage_layer_counts
    try:
        counts = stage_layer_counts(ckpt.num_layers, ckpt.pipeline,
                                    par.get("decoder_first_pipeline_num_layers"),
                                    par.get("decoder_last_pipeline_num_layers"))
    except ValueError as exc:
        raise ValueError(f"checkpoint {base}: {ckpt.num_layers} layers over {ckpt.pipeline} "
                         f"stages: {exc}") from None
    return [sum(counts[:s]) for s in range(ckpt.pipeline)]


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
    full: Dict[str, torch.Tensor] = {}
    owner: Dict[str, int] = {}
    for stage in range(ckpt.pipeline):
        local_names = list(ckpt.shards[(0, stage)].keys())
        for name in local_names:
            if name == OUTPUT_EMBEDDING_COPY and ckpt.pipeline > 1:
                continue  # identical to the first stage's word embedding
            gname = to_global(name, ckpt.stage_offsets[stage])
            if gname in owner:
                raise ValueError(f"checkpoint {ckpt.root}: parameter {gname} appears on stages "
                                 f"{owner[gname]} and {stage}")
            parts = [ckpt.shards[(t, stage)][name] for t in range(ckpt.tensor)]
            dim = (partition_dims or {}).get(gname, partition_dim_by_name(gname))
            full[gname] = parts[0] if ckpt.tensor == 1 or dim is None else torch.cat(parts, dim)
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
                raise ValueError(f"{gname}: dim {dim} of size {tensor.shape[dim]} cannot be "
                                 f"split over {tp_size} tensor-parallel ranks")
            tensor = torch.chunk(tensor, tp_size, dim=dim)[tp_rank]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{gname}: checkpoint gives shape {tuple(tensor.shape)} for this "
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
        raise ValueError(f"checkpoint {root} (tensor {ckpt.tensor}, pipeline {ckpt.pipeline}) "
                         f"has no value for {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
                         f"; is it a checkpoint of this kind of model?")
    module.load_state_dict(state, strict=False)
    return LoadReport(loaded=sorted(state), missing=missing,
                      source_layout=(ckpt.tensor, ckpt.pipeline), iteration=ckpt.iteration)


# ---------------------------------------------------------------------------- the script
def _name_targets(full: Dict[str, torch.Tensor], num_layers: int, tp: int, pp: int,
                  stage: int) -> Tuple[Dict[str, Tuple[torch.Size, Optional[int]]], int]:
    """Local (shape, dim) of a stage's names when no module is available."""
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
        if dim is not None:
            if shape[dim] % tp:
                raise ValueError(f"{gname}: dim {dim} of size {shape[dim]} does not divide by "
                                 f"--target-tensor-parallel-size {tp}")
            shape[dim] //= tp
        targets[to_local(gname, offset)] = (torch.Size(shape), dim)
    tied = "output_layer.weight" not in full and WORD_EMBEDDING in full
    if pp > 1 and stage == pp - 1 and tied:
        shape = list(full[WORD_EMBEDDING].shape)
        shape[0] //= tp
        targets[OUTPUT_EMBEDDING_COPY] = (torch.Size(shape), 0)
    return targets, offset


def convert(load: str, save: str, tp: int, pp: int, iteration: Optional[int] = None) -> str:
    """Write the model weights of checkpoint ``load`` to ``save`` for layout (tp, pp)."""
    ckpt = read_checkpoint(load, iteration)
    if ckpt.num_layers % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} does not divide the "
                         f"{ckpt.num_layers} layers")
    full = merge_checkpoint(ckpt)
    out_dir = iteration_dir(save, ckpt.iteration)
    config = dict(ckpt.config or {})
    if "parallel" in config:
        # the converted checkpoint has an even stage split
        config["parallel"] = dict(config["parallel"], tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp,
                                  decoder_first_pipeline_num_layers=None,
                                  decoder_last_pipeline_num_layers=None)
    for stage in range(pp):
        targets, offset = _name_targets(full, ckpt.num_layers, tp, pp, stage)
        for t in range(tp):
            state, missing = split_for_stage(full, targets, layer_offset=offset, tp_rank=t,
                                             tp_size=tp)
            assert not missing, missing
            path = rank_dir(out_dir, t, stage)
            os.makedirs(path, exist_ok=True)
            torch.save({"checkpoint_version": CHECKPOINT_VERSION, "iteration": ckpt.iteration,
                        "consumed_train_samples": 0, "consumed_valid_samples": 0,
                        "layout": {"tensor": tp, "pipeline": pp, "data": 1}, "model": state,
                        "model_shadow": None, "optimizer": None, "lr_scheduler": None,
                        "config": config, "converted_from": os.path.abspath(load)},
                       os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(save, TRACKER), "w") as fh:
        fh.write(str(ckpt.iteration))
    return out_dir


def main(argv: Optional[Iterable[str]] = None) -> str:
    p = argparse.ArgumentParser(description="Re-split a checkpoint's model weights for another "
                                            "tensor/pipeline layout (optimizer state is dropped).")
    p.add_argument("--load", required=True, help="checkpoint directory written by --save")
    p.add_argument("--save", required=True, help="where to write the converted checkpoint")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.target_tensor_parallel_size < 1 or args.target_pipeline_parallel_size < 1:
        p.error("target sizes must be >= 1")
    try:
        out = convert(args.load, args.save, args.target_tensor_parallel_size,
                      args.target_pipeline_parallel_size, args.iteration)
    except (ValueError, FileNotFoundError) as exc:
        print(f"checkpoint_util.py: error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

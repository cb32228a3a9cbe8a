"""Reading one rank's checkpoint back: the rank's files found and verified against the
manifest (``load_checkpoint``), the top-level types a payload must have
(``check_model_payload``), the errors for a checkpoint of another tensor/pipeline layout
or stage split (each printing the ``tools/checkpoint_util.py`` line that converts it),
and ``load_for_run``, which makes every rank raise the same error when one rank's files
do not load.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_discovery import find_checkpoint, recorded_config_at
from megatron.checkpoint_files import (MANIFEST, TRACKER, gather, is_complete, iteration_dir,
                                       load_payload, rank_dir, read_manifest)
from megatron.checkpoint_payload import payload_exists
from megatron.checkpoint_shape import check_model_shape
from megatron.errors import CheckpointError
from megatron.parallel_state import ParallelGroups


def _rank_dir_candidates(root_iter: str, tp_rank: int, pp_rank: int,
                         pipeline_size: int) -> List[str]:
    """Where this rank's files may be: Megatron's name first, then our older one."""
    names = [rank_dir(root_iter, tp_rank, pp_rank, pipeline_size)]
    if pipeline_size == 1:
        names.append(rank_dir(root_iter, tp_rank, pp_rank))
    return names


def _aside_dirs(root: str, iteration: int) -> List[str]:
    """Complete copies of ``iteration`` moved aside by a save of the same iteration."""
    return [d for d in sorted(glob.glob(iteration_dir(root, iteration) + ".old.*"))
            if is_complete(d)]


def split_text(first: Optional[int], last: Optional[int], prefix: str = "") -> str:
    """' --{prefix}decoder-first-pipeline-num-layers N ...' for the given counts."""
    return "".join(f" --{prefix}decoder-{which}-pipeline-num-layers {n}"
                   for which, n in (("first", first), ("last", last)) if n is not None)


def _convert_command(root: str, groups: ParallelGroups,
                     split: Tuple[Optional[int], Optional[int]]) -> str:
    """The tools/checkpoint_util.py line that rewrites ``root`` for this run's layout."""
    return (f"python tools/checkpoint_util.py --load {root} --save NEW_DIR "
            f"--target-tensor-parallel-size {groups.tp_size} --target-pipeline-parallel-size "
            f"{groups.pp_size}{split_text(*split, prefix='target-')}")


def _layout_error(root: str, base: str, saved: str, groups: ParallelGroups,
                  split: Tuple[Optional[int], Optional[int]] = (None, None)) -> CheckpointError:
    return CheckpointError(
        f"--load {root}: {os.path.basename(base)} was saved with {saved}, this run uses tensor "
        f"{groups.tp_size} x pipeline {groups.pp_size} (--tensor-model-parallel-size/"
        f"--pipeline-model-parallel-size); convert it with "
        f"{_convert_command(root, groups, split)}")


def _state_dict_like(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                           for k, v in value.items())


def check_model_payload(payload: Any, stem: str, resume: bool = False) -> Dict[str, Any]:
    """``payload`` (a ``model_optim_rng`` file at ``stem``) has the top-level types loading
    relies on, so a hand-edited or foreign file is one ``CheckpointError`` naming it
    instead of a KeyError or AttributeError halfway through a resume.  ``resume``: the
    iteration and consumed-sample counts must be there too."""
    where = f"{stem}.json" if os.path.exists(f"{stem}.json") else f"{stem}.pt"
    if not isinstance(payload, dict):
        raise CheckpointError(f"{where}: expected a checkpoint object, found "
                              f"{type(payload).__name__}")
    problems = []
    if not _state_dict_like(payload.get("model")):
        problems.append("'model' mapping parameter names to tensors")
    for key in ("model_shadow", "model_predicted"):  # (2BW's older version; predict's P(W))
        if payload.get(key) is not None and not _state_dict_like(payload[key]):
            problems.append(f"{key!r} mapping parameter names to tensors, or null")
    for key in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
        if (key in payload or resume) and (type(payload.get(key)) is not int
                                           or payload[key] < 0):
            problems.append(f"{key!r} an integer >= 0 (found {payload.get(key)!r})")
    config = payload.get("config")
    for key, value in (("layout", payload.get("layout")), ("config", config)) + tuple(
            (f"config.{k}", config.get(k)) for k in ("model", "data", "parallel")
            if isinstance(config, dict)):
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key!r} an object or null (found {type(value).__name__})")
    layers = (payload.get("layout") or {}).get("layers") if isinstance(payload.get("layout"),
                                                                       dict) else None
    if layers is not None and not (isinstance(layers, (list, tuple)) and len(layers) == 2
                                   and all(type(n) is int for n in layers)):
        problems.append(f"'layout.layers' [first, last + 1] (found {layers!r})")
    if problems:
        raise CheckpointError(f"{where}: not a checkpoint this trainer wrote: expected "
                              + "; ".join(problems))
    return payload


def load_checkpoint(root: str, groups: ParallelGroups, *, iteration: Optional[int] = None,
                    map_location: Any = "cpu", allow_unsafe: bool = False,
                    stage_layers: Optional[range] = None,
                    split: Tuple[Optional[int], Optional[int]] = (None, None)
                    ) -> Optional[Dict[str, Any]]:
    """Read and verify this rank's checkpoint files; None when ``root`` holds no checkpoint.

    Raises ``CheckpointError`` (one line) for a checkpoint of another tensor/pipeline
    layout, missing, truncated or corrupt files, and old pickle files without
    ``allow_unsafe``, and for a stage whose saved layers (``stage_layers``: this run's
    global layer numbers of the stage) differ from this run's split.  ``split``: this
    run's --decoder-first/last-pipeline-num-layers, for the conversion command the
    errors print.
    """
    if iteration is None:
        iteration = find_checkpoint(root).iteration
        if iteration is None:
            return None
    base = iteration_dir(root, iteration)
    if not os.path.isdir(base) and _aside_dirs(root, iteration):
        # a re-save of this iteration crashed between moving it aside and renaming the new one
        base = _aside_dirs(root, iteration)[-1]
    if not os.path.isdir(base):
        raise CheckpointError(f"--load {root}: {TRACKER} names iteration {iteration} but "
                              f"{base} does not exist")
    manifest = read_manifest(base)
    if manifest is not None:
        saved = manifest.get("layout", {})
        if saved.get("tensor") != groups.tp_size or saved.get("pipeline") != groups.pp_size:
            raise _layout_error(root, base, f"tensor {saved.get('tensor')} x pipeline "
                                f"{saved.get('pipeline')}", groups, split)
    my_dir = next((d for d in _rank_dir_candidates(base, groups.tp_rank, groups.pp_rank,
                                                   groups.pp_size)
                   if payload_exists(os.path.join(d, "model_optim_rng"))), None)
    if my_dir is None:
        present = sorted(d for d in os.listdir(base) if d.startswith("mp_rank_"))
        if manifest is None and present:
            raise _layout_error(root, base, f"the rank directories {present}", groups, split)
        raise CheckpointError(f"--load {root}: {base} holds no model file for tensor rank "
                              f"{groups.tp_rank}, stage {groups.pp_rank} (found {present})")
    stem = os.path.join(my_dir, "model_optim_rng")
    if manifest is None and not os.path.exists(stem + ".pt") and groups.rank == 0:
        # Final directories appear only by rename, so this one is complete; it was written
        # by a tool that did not call write_manifest, and cannot be verified.
        print(f"WARNING: {base} has no {MANIFEST}: its files are loaded unverified", flush=True)
    payload = check_model_payload(
        load_payload(stem, map_location=map_location, allow_unsafe=allow_unsafe), stem,
        resume=True)
    layout = payload.get("layout") or {}
    if layout.get("tensor") != groups.tp_size or layout.get("pipeline") != groups.pp_size:
        raise _layout_error(root, base, f"tensor {layout.get('tensor')} x pipeline "
                            f"{layout.get('pipeline')}", groups, split)
    saved = layout.get("layers")
    if stage_layers is not None and saved is not None and \
            list(saved) != [stage_layers.start, stage_layers.stop]:
        config = payload.get("config")
        par = config.get("parallel") if isinstance(config, dict) else None
        par = par if isinstance(par, dict) else {}
        theirs = [par.get(f"decoder_{which}_pipeline_num_layers") for which in ("first", "last")]
        theirs = split_text(*(n if type(n) is int else None for n in theirs)).strip() \
            or "neither: an even split"
        raise CheckpointError(
            f"--load {root}: pipeline stage {groups.pp_rank} of the checkpoint holds layers "
            f"{saved[0]}..{saved[1] - 1}, this run's split gives it {stage_layers.start}.."
            f"{stage_layers.stop - 1}; resume with the --decoder-first/last-pipeline-num-"
            f"layers of the run that saved it{' (' + theirs + ')' if par else ''}, or "
            f"convert the checkpoint with {_convert_command(root, groups, split)}")
    rng_stem = os.path.join(my_dir, f"rng_dp_{groups.dp_rank:03d}")
    payload["rng_state"] = (load_payload(rng_stem, allow_unsafe=allow_unsafe)
                            if payload_exists(rng_stem) else None)
    return payload


def load_for_run(root: str, groups: ParallelGroups, model: Any, *, allow_unsafe: bool = False,
                 stage_layers: Optional[range] = None,
                 split: Tuple[Optional[int], Optional[int]] = (None, None)
                 ) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """What ``--load root`` gives this rank: (payload or None for a fresh start, a line to
    print or None).  Collective: a rank that finds its file corrupt, missing or of
    another shape makes every rank raise the same ``CheckpointError``, instead of the
    others waiting for it until the distributed timeout."""
    payload, message, error = None, None, None
    try:
        where = find_checkpoint(root)
        message = where.message
        if where.iteration is not None:
            # the model flags first, from the recorded config: the stage-split and layout
            # errors print a conversion command, which cannot fit another model shape (the
            # padded vocabulary may differ at another t: conversion re-pads it)
            try:
                recorded = recorded_config_at(iteration_dir(root, where.iteration))
            except CheckpointError:
                recorded = None  # no config, or a damaged file: load_checkpoint says which
            check_model_shape(root, recorded, model, skip=("padded_vocab_size",))
            payload = load_checkpoint(root, groups, iteration=where.iteration,
                                      allow_unsafe=allow_unsafe, stage_layers=stage_layers,
                                      split=split)
            check_model_shape(root, payload.get("config"), model)
    except CheckpointError as exc:
        error = str(exc)
    errors = [e for e in gather(error) if e]
    if errors:
        err = CheckpointError(error or errors[0])  # each file names itself
        # one text on every rank (a shape or layout every rank finds alike, or one
        # rank's finding raised by all): printed once per node, not once per rank
        err.every_rank_alike = len(set(errors)) == 1
        raise err
    return payload, message

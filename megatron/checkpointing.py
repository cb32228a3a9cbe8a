"""Checkpoints in Megatron's layout, written so a crash never leaves a fake-complete one.

    SAVE/latest_checkpointed_iteration.txt          "1200"
    SAVE/iter_0001200/mp_rank_TT_PPP/model_optim_rng.pt     (written by data-parallel rank 0)
    SAVE/iter_0001200/mp_rank_TT_PPP/rng_dp_DDD.pt          (every rank's RNG state)

Every rank writes its files into ``iter_XXXXXXX.tmp`` (each file through a temporary
name and ``os.replace``); after a barrier rank 0 renames the directory to its final name
and only then rewrites the tracker file (again via a temporary name).  A crash at any
point leaves either the previous checkpoint as the latest or the new one complete.  An
existing directory of the same iteration is moved aside, not deleted, until the new one
is in place.

With PipeDream-2BW the checkpoint holds both weight versions (``model`` is the newest,
``model_shadow`` the one the next batch uses), so resuming continues the delayed-update
semantics exactly.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron.parallel_state import ParallelGroups

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 1


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir(root_iter: str, tp_rank: int, pp_rank: int) -> str:
    return os.path.join(root_iter, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")


def save_payload(obj: Any, stem: str) -> None:
    """Write one checkpoint file set for ``obj`` (nested dicts/lists of tensors and plain
    values) at ``stem`` (a path without extension), atomically.  The ONE place that
    decides the on-disk format of a payload; ``load_payload`` reads it back."""
    path = stem + ".pt"
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def payload_exists(stem: str) -> bool:
    return os.path.exists(stem + ".pt")


def load_payload(stem: str, map_location: Any = "cpu") -> Any:
    """Read what ``save_payload(obj, stem)`` wrote."""
    return torch.load(stem + ".pt", map_location=map_location, weights_only=False)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def read_tracker(root: str) -> Optional[int]:
    """Latest complete iteration under ``root``, or None if there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from None


@dataclass
class TrainState:
    """Everything besides model/optimizer that resuming must restore."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def save_checkpoint(root: str, state: TrainState, groups: ParallelGroups, *,
                    model_state: Dict[str, Any], shadow_state: Optional[Dict[str, Any]],
                    optimizer, scheduler, rng_state: Any, save_optim: bool = True,
                    extra: Optional[Dict[str, Any]] = None,
                    stage_layers: Optional[range] = None) -> str:
    """Collective over all ranks: every rank must call it at the same iteration.

    ``stage_layers`` (this stage's global layer numbers) is recorded in the layout so a
    resume with another stage split (--decoder-first/last-pipeline-num-layers) stops
    with a clear error instead of loading layers into the wrong places."""
    final = iteration_dir(root, state.iteration)
    staging = final + ".tmp"
    if groups.rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(staging):
            shutil.rmtree(staging)  # leftovers of a crashed save of this same iteration
        os.makedirs(staging)
    _barrier()
    my_dir = rank_dir(staging, groups.tp_rank, groups.pp_rank)
    os.makedirs(my_dir, exist_ok=True)
    if groups.dp_rank == 0:
        payload = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": state.iteration,
            "consumed_train_samples": state.consumed_train_samples,
            "consumed_valid_samples": state.consumed_valid_samples,
            "layout": {"tensor": groups.tp_size, "pipeline": groups.pp_size,
                       "data": groups.dp_size,
                       "layers": ([stage_layers.start, stage_layers.stop]
                                  if stage_layers is not None else None)},
            "model": model_state,
            "model_shadow": shadow_state,
            "optimizer": optimizer.state_dict() if save_optim and optimizer is not None else None,
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
        if extra:
            payload.update(extra)
        save_payload(payload, os.path.join(my_dir, "model_optim_rng"))
    save_payload(rng_state, os.path.join(my_dir, f"rng_dp_{groups.dp_rank:03d}"))
    _barrier()
    if groups.rank == 0:
        aside = None
        if os.path.exists(final):
            aside = f"{final}.old.{int(time.time())}"
            os.replace(final, aside)
        os.replace(staging, final)
        _atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(root: str, groups: ParallelGroups, *, iteration: Optional[int] = None,
                    map_location: Any = "cpu", stage_layers: Optional[range] = None
                    ) -> Optional[Dict[str, Any]]:
    """Read this rank's checkpoint files; None when ``root`` holds no checkpoint.

    Raises a clear error when the checkpoint was written with a different tensor or
    pipeline layout, or when files are missing.
    """
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    base = iteration_dir(root, iteration)
    if not os.path.isdir(base):
        raise FileNotFoundError(f"--load {root}: the tracker names iteration {iteration} but "
                                f"{base} does not exist")
    my_dir = rank_dir(base, groups.tp_rank, groups.pp_rank)
    path = os.path.join(my_dir, "model_optim_rng")
    if not payload_exists(path):
        present = sorted(d for d in os.listdir(base) if d.startswith("mp_rank_"))
        raise FileNotFoundError(
            f"--load {root}: no {path}. The checkpoint holds {present}; it was probably "
            f"saved with another --tensor-model-parallel-size/--pipeline-model-parallel-size "
            f"(this run: tensor {groups.tp_size}, pipeline {groups.pp_size})")
    payload = load_payload(path, map_location=map_location)
    layout = payload.get("layout", {})
    if layout.get("tensor") != groups.tp_size or layout.get("pipeline") != groups.pp_size:
        raise ValueError(f"--load {root}: checkpoint layout tensor={layout.get('tensor')} "
                         f"pipeline={layout.get('pipeline')} does not match this run's "
                         f"tensor={groups.tp_size} pipeline={groups.pp_size}")
    saved = layout.get("layers")
    if stage_layers is not None and saved is not None and \
            list(saved) != [stage_layers.start, stage_layers.stop]:
        from megatron.errors import CheckpointError
        raise CheckpointError(
            f"--load {root}: pipeline stage {groups.pp_rank} of the checkpoint holds layers "
            f"{saved[0]}..{saved[1] - 1}, this run's split gives it {stage_layers.start}.."
            f"{stage_layers.stop - 1}; use the --decoder-first/last-pipeline-num-layers of "
            f"the run that saved it (or convert with tools/checkpoint_util.py)")
    rng_path = os.path.join(my_dir, f"rng_dp_{groups.dp_rank:03d}")
    payload["rng_state"] = load_payload(rng_path) if payload_exists(rng_path) else None
    return payload

"""Checkpoints in Megatron's layout, in a format that cannot run code when loaded, written so
a crash never leaves a fake-complete one.

    SAVE/latest_checkpointed_iteration.txt                      "1200"
    SAVE/iter_0001200/manifest.json                 size + sha256 of every file, the layout
    SAVE/iter_0001200/mp_rank_TT[_PPP]/model_optim_rng.json          (data-parallel rank 0)
    SAVE/iter_0001200/mp_rank_TT[_PPP]/model_optim_rng.safetensors
    SAVE/iter_0001200/mp_rank_TT[_PPP]/rng_dp_DDD.json               (every rank's RNG state)
    SAVE/iter_0001200/mp_rank_TT[_PPP]/rng_dp_DDD.safetensors

The rank directory is Megatron's: ``mp_rank_TT`` when the pipeline has one stage,
``mp_rank_TT_PPP`` otherwise (``checkpoint_files.rank_dir``).

Each file pair is a payload (``megatron.checkpoint_payload``): a safetensors file
holding every tensor and a JSON file holding everything else; nothing is ever unpickled
(old ``model_optim_rng.pt`` pickles load only with ``--allow-unsafe-checkpoint``, through
torch's weights-only unpickler).

Every rank writes its files into ``iter_XXXXXXX.tmp`` (each file through a temporary name
and ``os.replace``) and hashes them; rank 0 gathers the hashes (and any rank's write
error) into ``manifest.json``, renames the directory to its final name and only then
rewrites the tracker file (again via a temporary name).  A crash at any point leaves
either the previous checkpoint as the latest or the new one complete.  An existing
directory of the same iteration is moved aside, not deleted, until the new one is in
place.  Stale staging (``iter_*.tmp``) and moved-aside (``iter_*.old.*``) directories are
removed at the next save.
A save that cannot be written (disk full, no permission, an I/O error on any rank) raises
the same one-line ``CheckpointError`` on every rank, naming the file and the iteration that
stays the latest; its staging directory is removed and the tracker is left as it was.

Loading verifies the size and sha256 of every file the rank reads against the manifest, so
a truncated or bit-flipped file is one ``CheckpointError`` naming it (on every rank: see
``checkpoint_load.load_for_run``).  Tools that write a whole iteration directory
(tools/checkpoint_util.py) call ``checkpoint_files.write_manifest(dir, iteration, layout)``
before their rename; a final directory without a manifest still loads, unverified, with a
warning.  Without a tracker file the newest iteration whose files all match their manifest
is used; a directory of ``iter_*`` directories none of which is complete is an error,
never a fresh start.

With PipeDream-2BW the checkpoint holds both weight versions (``model`` is the newest,
``model_shadow`` the one the next batch uses), so resuming continues the delayed-update
semantics exactly.

This module holds the save protocol (``save_checkpoint``) and ``TrainState``; the file
names, manifest, tracker and verified reads are in ``megatron.checkpoint_files``, what a
``--load`` directory holds in ``megatron.checkpoint_discovery``, reading a rank's files
back in ``megatron.checkpoint_load``, and whether a checkpoint fits the model in
``megatron.checkpoint_shape``.
"""
from __future__ import annotations

import glob
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from megatron.checkpoint_files import (TRACKER, atomic_write_text, file_entries, gather,
                                       is_complete, iteration_dir, rank_dir, read_tracker,
                                       write_manifest)
# The payload format lives in checkpoint_payload; CHECKPOINT_VERSION and save_payload
# stay importable from here.
from megatron.checkpoint_payload import CHECKPOINT_VERSION, save_payload
from megatron.errors import CheckpointError
from megatron.parallel_state import ParallelGroups


@dataclass
class TrainState:
    """Everything besides model/optimizer that resuming must restore."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _raise_if_any(error: Optional[str]) -> None:
    """Collective: when any rank passes an error, every rank raises a CheckpointError
    (its own message, else the first one), instead of the others waiting for it."""
    errors = [e for e in gather(error) if e]
    if errors:
        raise CheckpointError(error or errors[0])


def _remove_stale(root: str) -> None:
    """Leftovers of crashed saves: staging directories, moved-aside iterations, temp files.
    A moved-aside iteration whose replacement never arrived is put back, not deleted."""
    for path in glob.glob(os.path.join(root, "iter_*.old.*")):
        final = path.split(".old.")[0]
        if not os.path.exists(final) and is_complete(path):
            os.replace(path, final)
        else:
            shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(os.path.join(root, "iter_*.tmp")):
        shutil.rmtree(path, ignore_errors=True)
    for path in glob.glob(os.path.join(root, f"{TRACKER}.tmp.*")):
        os.remove(path)


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
    layout = {"tensor": groups.tp_size, "pipeline": groups.pp_size, "data": groups.dp_size}
    error = None
    if groups.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            _remove_stale(root)
            os.makedirs(staging)
        except OSError as exc:
            error = _write_error(root, state.iteration, exc)
    _raise_if_any(error)
    # on every data-parallel rank: a distributed optimizer gathers its shards here
    # (collective), before any rank can stop at a write error
    optim_state = (optimizer.state_dict() if save_optim and optimizer is not None else None)
    try:
        my_dir = rank_dir(staging, groups.tp_rank, groups.pp_rank, groups.pp_size)
        os.makedirs(my_dir, exist_ok=True)
        written: List[str] = []
        if groups.dp_rank == 0:
            payload = {
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": state.iteration,
                "consumed_train_samples": state.consumed_train_samples,
                "consumed_valid_samples": state.consumed_valid_samples,
                "layout": dict(layout, layers=([stage_layers.start, stage_layers.stop]
                                               if stage_layers is not None else None)),
                "model": model_state,
                "model_shadow": shadow_state,
                "optimizer": optim_state,
                "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
            }
            if extra:
                payload.update(extra)
            written += save_payload(payload, os.path.join(my_dir, "model_optim_rng"))
        written += save_payload(rng_state, os.path.join(my_dir, f"rng_dp_{groups.dp_rank:03d}"))
        # Each rank hashes what it wrote (still in the page cache); rank 0 writes the manifest.
        entries = file_entries(staging, written)
    except OSError as exc:  # disk full, permissions, I/O error
        error, entries = _write_error(root, state.iteration, exc), {}
    gathered = gather((error, entries))
    errors = [e for e, _ in gathered if e]
    if errors:
        if groups.rank == 0:  # every rank has stopped writing: free the space it took
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(error or errors[0])
    if groups.rank == 0:
        aside = None
        try:
            write_manifest(staging, state.iteration, layout,
                           {k: v for _, part in gathered for k, v in part.items()})
            if os.path.exists(final):
                aside = f"{final}.old.{int(time.time())}"
                os.replace(final, aside)
            os.replace(staging, final)
            atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
        except OSError as exc:
            # The tracker still names the previous checkpoint, and a copy of this
            # iteration that was moved aside goes back.
            error = _write_error(root, state.iteration, exc)
            shutil.rmtree(staging, ignore_errors=True)
            if aside is not None and not os.path.exists(final):
                os.replace(aside, final)
                aside = None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    _raise_if_any(error)
    return final


def _write_error(root: str, iteration: int, exc: OSError) -> str:
    """One line for a checkpoint that could not be written, saying what stays latest."""
    reason = f"{exc.strerror or exc}: {exc.filename or root}"
    try:
        kept = read_tracker(root)
    except (OSError, CheckpointError):
        kept = None
    latest = (f"the checkpoint of iteration {kept} stays the latest" if kept is not None
              else "no earlier checkpoint was saved")
    return (f"--save {root}: could not write the checkpoint of iteration {iteration} "
            f"({reason}); {latest}")


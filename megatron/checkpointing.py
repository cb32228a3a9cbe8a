"""Checkpoints in Megatron's layout, in a format that cannot run code when loaded, written so
a crash never leaves a fake-complete one.

    SAVE/latest_checkpointed_iteration.txt                      "1200"
    SAVE/iter_0001200/manifest.json                 size + sha256 of every file, the layout
    SAVE/iter_0001200/mp_rank_TT[_PPP]/model_optim_rng.json          (data-parallel rank 0)
    SAVE/iter_0001200/mp_rank_TT[_PPP]/model_optim_rng.safetensors
    SAVE/iter_0001200/mp_rank_TT[_PPP]/rng_dp_DDD.json               (every rank's RNG state)
    SAVE/iter_0001200/mp_rank_TT[_PPP]/rng_dp_DDD.safetensors

The rank directory is Megatron's: ``mp_rank_TT`` when the pipeline has one stage,
``mp_rank_TT_PPP`` otherwise (``rank_dir``).

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
``load_for_run``).  Tools that write a whole iteration directory (tools/checkpoint_util.py)
call ``write_manifest(dir, iteration, layout)`` before their rename; a final directory
without a manifest still loads, unverified, with a warning.  Without a tracker file the
newest iteration whose files all match their manifest is used; a directory of ``iter_*``
directories none of which is complete is an error, never a fresh start.

With PipeDream-2BW the checkpoint holds both weight versions (``model`` is the newest,
``model_shadow`` the one the next batch uses), so resuming continues the delayed-update
semantics exactly.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# The payload format lives in checkpoint_payload; CHECKPOINT_VERSION, UNSAFE_FLAG and
# save_payload stay importable from here.
from megatron.checkpoint_payload import (CHECKPOINT_VERSION, UNSAFE_FLAG,  # noqa: F401
                                         _decode, _read_payload_json, payload_exists,
                                         payload_files, read_payload, save_payload)
from megatron.errors import CheckpointError
from megatron.parallel_state import ParallelGroups

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron-pd2bw-checkpoint"
_ITER_DIR = re.compile(r"^iter_(\d+)$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir(root_iter: str, tp_rank: int, pp_rank: int,
             pipeline_size: Optional[int] = None) -> str:
    """Megatron's per-rank directory: ``mp_rank_TT`` when ``pipeline_size`` is 1,
    ``mp_rank_TT_PPP`` otherwise.  ``pipeline_size=None`` (callers that do not know it)
    gives the ``mp_rank_TT_PPP`` name, which the loader also accepts at one stage."""
    if pipeline_size == 1:
        return os.path.join(root_iter, f"mp_rank_{tp_rank:02d}")
    return os.path.join(root_iter, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")


def _rank_dir_candidates(root_iter: str, tp_rank: int, pp_rank: int,
                         pipeline_size: int) -> List[str]:
    """Where this rank's files may be: Megatron's name first, then our older one."""
    names = [rank_dir(root_iter, tp_rank, pp_rank, pipeline_size)]
    if pipeline_size == 1:
        names.append(rank_dir(root_iter, tp_rank, pp_rank))
    return names


# -- manifest -----------------------------------------------------------------------------------
def sha256_file(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def file_entries(base: str, paths: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Manifest entries (size, sha256) of ``paths``, keyed relative to ``base``."""
    return {os.path.relpath(p, base).replace(os.sep, "/"):
            {"bytes": os.path.getsize(p), "sha256": sha256_file(p)} for p in paths}


def write_manifest(base: str, iteration: int, layout: Dict[str, int],
                   entries: Optional[Dict[str, Dict[str, Any]]] = None) -> str:
    """Write ``base/manifest.json``; ``entries`` default to every file under ``base``
    (tools that write a whole iteration directory in one process)."""
    if entries is None:
        paths = [os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs if f != MANIFEST]
        entries = file_entries(base, sorted(paths))
    doc = {"format": MANIFEST_FORMAT, "version": CHECKPOINT_VERSION, "iteration": iteration,
           "layout": layout, "files": dict(sorted(entries.items()))}
    path = os.path.join(base, MANIFEST)
    _atomic_write_text(path, json.dumps(doc, indent=1))
    return path


def read_manifest(base: str) -> Optional[dict]:
    path = os.path.join(base, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not a readable manifest ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or \
            not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{path}: expected a {MANIFEST_FORMAT!r} manifest")
    if not isinstance(doc.get("layout", {}), dict):
        raise CheckpointError(f"{path}: expected 'layout' to be an object such as "
                              f"{{\"tensor\": 1, \"pipeline\": 1}}, found {doc['layout']!r}")
    for rel, entry in doc["files"].items():
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int
                and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{path}: expected the entry of {rel} to be "
                                  f"{{\"bytes\": int, \"sha256\": str}}, found {entry!r}")
    return doc


def _find_manifest(stem: str) -> Optional[Tuple[str, dict]]:
    """The iteration directory's manifest for a payload at ``stem`` (in it or one below)."""
    here = os.path.dirname(os.path.abspath(stem))
    for base in (here, os.path.dirname(here)):
        manifest = read_manifest(base)
        if manifest is not None:
            return base, manifest
    return None


def verify_files(base: str, manifest: dict, paths: Sequence[str]) -> None:
    """Each of ``paths`` exists with the size and sha256 the manifest records."""
    for path in paths:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(base)).replace(os.sep, "/")
        want = manifest["files"].get(rel)
        if want is None:
            raise CheckpointError(f"{path}: not listed in {os.path.join(base, MANIFEST)}")
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: listed in the manifest but missing")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: corrupt checkpoint file (truncated or altered): "
                                  f"expected {want['bytes']} bytes, found {size}")
        digest = sha256_file(path)
        if digest != want["sha256"]:
            raise CheckpointError(f"{path}: corrupt checkpoint file: expected sha256 "
                                  f"{want['sha256']}, found {digest}")


def load_payload(stem: str, map_location: Any = "cpu", *, allow_unsafe: bool = False,
                 verify: bool = True) -> Any:
    """Read what ``save_payload(obj, stem)`` wrote (``checkpoint_payload.read_payload``).

    When the payload lies in an iteration directory with a manifest (``stem``'s directory
    or its parent), both files are checked against it first (``verify``).  A ``stem.pt``
    pickle of the previous version is refused unless ``allow_unsafe``.
    """
    js_path, st_path = payload_files(stem)
    if verify and os.path.exists(js_path):
        found = _find_manifest(stem)
        if found is not None:
            base, manifest = found
            verify_files(base, manifest, [js_path, st_path])
    return read_payload(stem, map_location, allow_unsafe=allow_unsafe)


def _complete(base: str) -> bool:
    """Every file of the manifest present with its size and checksum."""
    try:
        manifest = read_manifest(base)
        if manifest is None:
            return False
        verify_files(base, manifest, [os.path.join(base, rel) for rel in manifest["files"]])
    except CheckpointError:
        return False
    return True


# -- small helpers ------------------------------------------------------------------------------
def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _raise_if_any(error: Optional[str]) -> None:
    """Collective: when any rank passes an error, every rank raises a CheckpointError
    (its own message, else the first one), instead of the others waiting for it."""
    errors = [e for e in _gather(error) if e]
    if errors:
        raise CheckpointError(error or errors[0])


def _gather(obj: Any) -> List[Any]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        out: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by the tracker file under ``root``, or None if there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(4096).strip()  # a number; a huge file is not one either
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: expected a text file holding an iteration number "
                              f"({getattr(exc, 'strerror', None) or exc})") from None
    if text == "release":
        # Megatron-LM's released weights: torch pickles under release/, which this
        # project never unpickles; its tools export them to Hugging Face, which it reads
        raise CheckpointError(
            f"{path}: names a Megatron-LM 'release' checkpoint (pickle files under "
            f"{os.path.join(root, 'release')}), a format this project does not load; export "
            "it to Hugging Face with Megatron-LM's converter, then import it with "
            "tools/checkpoint_util.py --from-hf (docs/checkpoint_conversion.md)")
    try:
        iteration = int(text) if len(text) <= 18 else -1  # an int64, as Megatron writes
    except ValueError:
        iteration = -1
    if iteration < 0:
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
        raise CheckpointError(f"{path}: expected an iteration number, found {shown}")
    return iteration


def _iteration_dirs(root: str) -> List[int]:
    """Iterations with a final (not staging, not moved-aside) directory, newest first."""
    found = [int(m.group(1)) for m in (_ITER_DIR.match(e) for e in os.listdir(root)) if m]
    return sorted((i for i in found if os.path.isdir(iteration_dir(root, i))), reverse=True)


def newest_iteration(root: str) -> Optional[int]:
    """The newest iteration ``root`` holds a final directory of (None: none, or no
    directory)."""
    found = _iteration_dirs(root) if os.path.isdir(root) else []
    return found[0] if found else None


def existing_checkpoints(root: str) -> Optional[str]:
    """A short description of the checkpoints ``root`` already holds (a tracker file or
    final ``iter_*`` directories), or None when it holds none."""
    if not os.path.isdir(root):
        return None
    names = [os.path.basename(iteration_dir(root, i)) for i in _iteration_dirs(root)]
    tracker = os.path.exists(os.path.join(root, TRACKER))
    if not names and not tracker:
        return None
    what = (f"{len(names)} iteration director{'y' if len(names) == 1 else 'ies'}, the newest "
            f"{names[0]}" if names else "no iteration directory")
    return what + (f", and {TRACKER}" if tracker else "")


# What a Hugging Face ``save_pretrained`` directory holds: its config and its weights.
HF_CONFIG = "config.json"
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
              "pytorch_model.bin.index.json")


def hf_model_files(root: str) -> List[str]:
    """The Hugging Face model files in ``root`` (config.json and a weights file), or []
    when it is not such a directory."""
    if not os.path.isfile(os.path.join(root, HF_CONFIG)):
        return []
    weights = [w for w in HF_WEIGHTS if os.path.isfile(os.path.join(root, w))]
    return [HF_CONFIG] + weights if weights else []


def refuse_hf_model_dir(root: str, flag: str = "--load") -> None:
    """A transformers model directory is not a checkpoint of this trainer: starting from
    scratch over it (as over an empty --load) would silently discard the model the user
    meant to train, so say how to import it."""
    files = hf_model_files(root)
    if files:
        raise CheckpointError(
            f"{flag} {root} looks like a Hugging Face model directory ({', '.join(files)}), "
            f"not a checkpoint of this trainer (no {TRACKER}); import it first: python "
            f"tools/checkpoint_util.py --from-hf {root} --save CKPT "
            f"--target-tensor-parallel-size T --target-pipeline-parallel-size D, then train "
            f"with --load CKPT [--finetune] (docs/checkpoint_conversion.md)")


def refuse_iteration_dir(root: str, flag: str = "--load") -> None:
    """``root`` is one iteration directory of a checkpoint (the path a save prints), not
    the directory --save wrote: starting from scratch over it would drop the weights the
    user pointed at, so name the directory to pass instead."""
    if not os.path.isdir(root):
        return
    found = sorted(e for e in os.listdir(root)
                   if e == MANIFEST or re.match(r"^mp_rank_\d+(_\d+)?$", e))
    if found:
        parent = os.path.dirname(os.path.abspath(root))
        raise CheckpointError(
            f"{flag} {root} is one iteration of a checkpoint ({', '.join(found[:3])}), not "
            f"the directory --save wrote; pass {parent} instead (its {TRACKER} names the "
            f"iteration to load)")


@dataclass
class CheckpointLocation:
    """Which iteration ``--load`` resumes from, and a line saying how it was chosen."""

    iteration: Optional[int]
    message: Optional[str] = None


def find_checkpoint(root: str) -> CheckpointLocation:
    """Decide what ``--load root`` means before anything is read.

    A file is an error; a missing directory (or one holding nothing) is a fresh start,
    but a Hugging Face model directory is an error saying how to import it; the tracker
    names the iteration; without a tracker the newest complete iteration is
    used, and ``iter_*`` directories none of which is complete are an error, so a run
    never starts from scratch over an existing checkpoint.
    """
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"--load {root} is a file; expected the checkpoint directory "
                              f"that --save wrote (the one holding {TRACKER})")
    if not os.path.isdir(root):
        return CheckpointLocation(None, f"--load {root} does not exist; starting from scratch")
    iteration = read_tracker(root)
    if iteration is not None:
        return CheckpointLocation(iteration)
    candidates = _iteration_dirs(root)
    if not candidates:
        refuse_hf_model_dir(root)
        refuse_iteration_dir(root)
        return CheckpointLocation(None, f"--load {root} holds no checkpoint (no {TRACKER}, no "
                                        f"iter_* directories); starting from scratch")
    for it in candidates:
        if _complete(iteration_dir(root, it)):
            return CheckpointLocation(it, f"--load {root}: no {TRACKER}; using the newest "
                                          f"complete checkpoint, iteration {it}")
    raise CheckpointError(
        f"--load {root}: no {TRACKER} and none of the iteration directories "
        f"{[os.path.basename(iteration_dir(root, i)) for i in candidates[:5]]} is complete "
        f"(manifest missing or files not matching it); refusing to start from scratch over "
        f"them: write the iteration to resume into {TRACKER}, or point --load elsewhere")


def read_saved_config(root: str) -> Tuple[int, Dict[str, Any]]:
    """(iteration, the run's config) of the checkpoint ``--load root`` would resume,
    read from the first rank's JSON file alone: no tensors, no pickle."""
    location = find_checkpoint(root)
    if location.iteration is None:
        raise CheckpointError(f"--load {root} holds no checkpoint to read the model flags "
                              f"from ({location.message or 'nothing there'})")
    return location.iteration, recorded_config_at(iteration_dir(root, location.iteration))


def recorded_config_at(base: str) -> Dict[str, Any]:
    """The run's config recorded in the first rank's JSON file of iteration directory
    ``base`` (unverified: no manifest check, no tensors)."""
    from megatron.checkpoint_merge import MODEL_FILE, rank_dirs

    dirs = rank_dirs(base) if os.path.isdir(base) else {}
    if not dirs:
        raise CheckpointError(f"checkpoint {base}: no mp_rank_TT or mp_rank_TT_PPP directories")
    js_path, _ = payload_files(os.path.join(dirs[min(dirs)], MODEL_FILE))
    if not os.path.exists(js_path):
        raise CheckpointError(f"{js_path}: missing (an old pickle checkpoint records no "
                              f"config readable without unpickling; pass the model flags)")
    tree = _read_payload_json(js_path).get("tree")
    try:
        config = _decode((tree if isinstance(tree, dict) else {}).get("config") or {}, {},
                         js_path)
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{js_path}: malformed checkpoint JSON ({type(exc).__name__}: "
                              f"{exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"{js_path}: records no model config; pass the model flags")
    return config


@dataclass
class TrainState:
    """Everything besides model/optimizer that resuming must restore."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def _aside_dirs(root: str, iteration: int) -> List[str]:
    """Complete copies of ``iteration`` moved aside by a save of the same iteration."""
    return [d for d in sorted(glob.glob(iteration_dir(root, iteration) + ".old.*"))
            if _complete(d)]


def _remove_stale(root: str) -> None:
    """Leftovers of crashed saves: staging directories, moved-aside iterations, temp files.
    A moved-aside iteration whose replacement never arrived is put back, not deleted."""
    for path in glob.glob(os.path.join(root, "iter_*.old.*")):
        final = path.split(".old.")[0]
        if not os.path.exists(final) and _complete(path):
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
    gathered = _gather((error, entries))
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
            _atomic_write_text(os.path.join(root, TRACKER), str(state.iteration))
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
    if payload.get("model_shadow") is not None and not _state_dict_like(payload["model_shadow"]):
        problems.append("'model_shadow' mapping parameter names to tensors, or null")
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
    errors = [e for e in _gather(error) if e]
    if errors:
        err = CheckpointError(error or errors[0])  # each file names itself
        # one text on every rank (a shape or layout every rank finds alike, or one
        # rank's finding raised by all): printed once per node, not once per rank
        err.every_rank_alike = len(set(errors)) == 1
        raise err
    return payload, message

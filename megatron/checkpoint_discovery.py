"""What a ``--load`` directory holds before anything is read: its final ``iter_*``
directories, the iteration a resume starts from (``find_checkpoint``: the tracker, else
the newest complete iteration), the refusals of directories that are not a checkpoint of
this trainer (a Hugging Face model, one iteration directory), and the run's config that
a checkpoint records (read from JSON alone).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from megatron.checkpoint_files import (MANIFEST, TRACKER, is_complete, iteration_dir,
                                       read_tracker)
from megatron.checkpoint_payload import _decode, _read_payload_json, payload_files
from megatron.errors import CheckpointError

_ITER_DIR = re.compile(r"^iter_(\d+)$")


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
        if is_complete(iteration_dir(root, it)):
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

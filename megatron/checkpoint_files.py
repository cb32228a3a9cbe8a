"""The files of a checkpoint directory and their integrity: Megatron's names
(``iter_XXXXXXX``, ``mp_rank_TT[_PPP]``, the tracker file), the manifest recording the
size and sha256 of every file, the verified ``load_payload``, and the small write and
collective helpers the save protocol (``megatron.checkpointing``) builds on.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.checkpoint_payload import CHECKPOINT_VERSION, payload_files, read_payload
from megatron.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron-pd2bw-checkpoint"


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
    atomic_write_text(path, json.dumps(doc, indent=1))
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


def is_complete(base: str) -> bool:
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
def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def gather(obj: Any) -> List[Any]:
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

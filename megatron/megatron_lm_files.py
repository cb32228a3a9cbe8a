"""Finding and reading the files of a Megatron-LM legacy checkpoint, for
``megatron.megatron_lm_import`` (``tools/checkpoint_util.py --from-megatron``).

``locate`` turns what the user named (the run's ``--save`` directory, an iteration
directory, a rank directory or one ``model_optim_rng.pt``) into the iteration's rank
files; ``load_megatron_file`` reads one of them only through torch's weights-only
unpickler, and only with ``--allow-unsafe-checkpoint``: the files are pickles.
"""
from __future__ import annotations

import argparse
import os
import re
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.checkpoint_discovery import hf_model_files
from megatron.checkpoint_files import TRACKER
from megatron.checkpoint_payload import UNSAFE_FLAG, numpy_safe_globals, weights_only_refusal
from megatron.errors import CheckpointError, UserError

FLAG = "--from-megatron"
PT_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
_EXPERT_RANK_DIR = re.compile(r"^mp_rank_\d+_\d+_\d+$")


# ------------------------------------------------------------------------ reading files
class MegatronLMStandIn:
    """An inert record standing in for one of Megatron-LM's own classes that a checkpoint
    pickles outside the model: the enums in its ``args`` (``ModelType``,
    ``AttnBackend``, ...) and the loss scaler of old fp16 optimizer states.  The
    unpickler hands it the values the file holds; it keeps them and runs nothing
    (Megatron-LM's code is never imported)."""

    megatron_lm_name = "megatron"

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.megatron_lm_name}{self.args!r}>"


_STAND_IN_PREFIXES = ("megatron.", "fp16.")
"""Modules of Megatron-LM (``fp16.loss_scaler``: its 2019 layout) whose pickled classes
become ``MegatronLMStandIn`` records."""


def _safe_globals() -> List[Any]:
    """What a Megatron-LM checkpoint needs beyond torch's weights-only defaults (tensors,
    dtypes, OrderedDict): ``argparse.Namespace`` (its ``args``) and numpy arrays and
    dtypes (numpy's RNG state, read and dropped), also under the other numpy major
    version's module names.  Nothing that can run code."""
    core = getattr(np, "_core", None) or np.core
    allowed: List[Any] = [argparse.Namespace] + numpy_safe_globals()
    for fn in (core.multiarray._reconstruct, core.multiarray.scalar):
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            allowed.append((fn, f"{module}.{fn.__name__}"))
    return allowed


def _torch_version() -> Tuple[int, int]:
    major, minor = (re.match(r"(\d+)\.(\d+)", torch.__version__) or re.match("(0)(0)", "00")
                    ).groups()
    return int(major), int(minor)


def load_megatron_file(path: str, allow_unsafe: bool) -> Any:
    """The object a Megatron-LM ``model_optim_rng.pt`` holds, read only through
    ``torch.load(weights_only=True)`` with ``_safe_globals`` (plus an inert
    ``MegatronLMStandIn`` for each of Megatron-LM's own classes the file names).  Without
    ``allow_unsafe`` nothing is read."""
    if not allow_unsafe:
        raise CheckpointError(
            f"{FLAG} {path}: Megatron-LM checkpoints are pickle files (torch.save), which can "
            f"run code when loaded, so it is refused; if you trust its source pass "
            f"{UNSAFE_FLAG} (it is then read with torch.load(weights_only=True), allowing only "
            f"tensors, argparse.Namespace, numpy arrays and inert records of Megatron-LM's "
            f"own classes)")
    if _torch_version() < (2, 6):
        raise CheckpointError(
            f"{FLAG} {path}: reading a Megatron-LM checkpoint needs torch >= 2.6 (its "
            f"weights-only unpickler's allow-list by name), found torch {torch.__version__}")
    stand_ins: Dict[str, type] = {}
    mmap = zipfile.is_zipfile(path)  # torch >= 1.6 files: tensors are read when used
    while True:
        allowed = _safe_globals() + [(cls, name) for name, cls in stand_ins.items()]
        try:
            with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pickle-protocol chatter
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is one user error
            name, why = weights_only_refusal(exc)
            if (name is not None and name.startswith(_STAND_IN_PREFIXES)
                    and name not in stand_ins and len(stand_ins) < 64):
                stand_ins[name] = type(name.rsplit(".", 1)[-1], (MegatronLMStandIn,),
                                       {"megatron_lm_name": name})
                continue  # read again with an inert record for it
            if name is not None:
                hint = (" (Transformer Engine / Megatron Core extra state: only the legacy "
                        "model layout imports)" if name in ("_io.BytesIO", "io.BytesIO")
                        else "")
                raise CheckpointError(
                    f"{FLAG} {path}: refused even with {UNSAFE_FLAG}: it references {name}, "
                    f"which is not on the allow-list{hint}") from None
            raise CheckpointError(f"{FLAG} {path}: not a readable torch.save checkpoint "
                                  f"({why})") from None


# ------------------------------------------------------------------------ locating files
@dataclass
class CheckpointSource:
    iter_dir: str
    label: str
    """'release', 'iteration N' or the directory, for messages."""
    files: Dict[Tuple[int, int], str]
    """(tensor rank, stage) -> model_optim_rng.pt."""
    tp: int
    pp: int


def _torch_dist(d: str) -> Optional[str]:
    """A Megatron Core distributed-checkpoint file in directory ``d``, or None."""
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return None
    for n in names:
        if n == ".metadata" or n.endswith(".distcp") or n == "metadata.json":
            return n
    return None


def _rank_dirs(iter_dir: str) -> Dict[Tuple[int, Optional[int]], str]:
    out: Dict[Tuple[int, Optional[int]], str] = {}
    for n in sorted(os.listdir(iter_dir)):
        full = os.path.join(iter_dir, n)
        if not os.path.isdir(full):
            continue
        if _EXPERT_RANK_DIR.match(n):
            raise UserError(f"{FLAG} {full}: an expert-parallel rank directory (MoE); "
                            f"mixture-of-experts models do not import")
        m = _RANK_DIR.match(n)
        if m:
            out[(int(m[1]), None if m[2] is None else int(m[2]))] = full
    return out


def _iteration_dir(root: str, iteration: Optional[int]) -> Tuple[str, str]:
    """(iteration directory, label) of checkpoint root ``root``: ``iteration`` when given,
    else the tracker's."""
    if iteration is not None:
        d = os.path.join(root, f"iter_{iteration:07d}")
        if not os.path.isdir(d):
            raise CheckpointError(f"{FLAG} {root}: --iteration {iteration}: no {d}")
        return d, f"iteration {iteration}"
    tracker = os.path.join(root, TRACKER)
    try:
        with open(tracker) as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{FLAG} {tracker}: not readable ({exc})") from None
    if text == "release":
        d, label = os.path.join(root, "release"), "release"
    elif re.fullmatch(r"\d+", text):
        d, label = os.path.join(root, f"iter_{int(text):07d}"), f"iteration {int(text)}"
    else:
        raise CheckpointError(f"{FLAG} {tracker}: expected an iteration number or 'release', "
                              f"found {text[:40]!r}")
    if not os.path.isdir(d):
        raise CheckpointError(f"{FLAG} {tracker} names {label}, but {d} is missing")
    return d, label


def locate(path: str, iteration: Optional[int] = None) -> CheckpointSource:
    """The rank files of the Megatron-LM checkpoint ``path`` names (see the module doc);
    missing or extra rank files, a Megatron Core or our own checkpoint are one error."""
    if not os.path.exists(path):
        raise CheckpointError(f"{FLAG} {path}: no such file or directory")
    if os.path.isfile(path):
        if path.endswith(".zip"):
            raise UserError(f"{FLAG} {path}: a zip archive; unzip it and give the directory "
                            f"that holds {TRACKER} (or release/)")
        parent = os.path.dirname(os.path.abspath(path))
        if _RANK_DIR.match(os.path.basename(parent)):
            path = parent  # one rank file: the iteration it belongs to
        else:
            return CheckpointSource(parent, path, {(0, 0): path}, 1, 1)
    if _RANK_DIR.match(os.path.basename(os.path.normpath(path))):
        path = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(path, TRACKER)) or iteration is not None:
        iter_dir, label = _iteration_dir(path, iteration)
    else:
        iter_dir, label = path, path
    found = _torch_dist(iter_dir)
    if found:
        raise UserError(f"{FLAG} {iter_dir}: a Megatron Core distributed checkpoint "
                        f"({found}: --ckpt-format torch_dist); only the legacy torch.save "
                        f"layout (mp_rank_TT[_PPP]/{PT_FILE}) imports")
    dirs = _rank_dirs(iter_dir)
    if not dirs:
        subdirs = sorted(n for n in os.listdir(iter_dir) if n == "release"
                         or re.fullmatch(r"iter_\d+", n))
        if subdirs:
            raise CheckpointError(f"{FLAG} {path}: no {TRACKER}; found {', '.join(subdirs[:4])}: "
                                  f"give --iteration N or the iteration directory itself")
        if hf_model_files(iter_dir):
            raise UserError(f"{FLAG} {path}: a Hugging Face model directory; import it with "
                            f"--from-hf")
        raise CheckpointError(f"{FLAG} {path}: expected a Megatron-LM checkpoint ({TRACKER}, "
                              f"or mp_rank_TT[_PPP]/{PT_FILE} directories), found neither")
    staged = {p is not None for _, p in dirs}
    if len(staged) > 1:
        raise CheckpointError(f"{FLAG} {iter_dir}: both mp_rank_TT and mp_rank_TT_PPP "
                              f"directories; expected one layout")
    tp = max(t for t, _ in dirs) + 1
    pp = max(p or 0 for _, p in dirs) + 1
    files: Dict[Tuple[int, int], str] = {}
    for t in range(tp):
        for p in range(pp):
            name = f"mp_rank_{t:02d}" if staged == {False} else f"mp_rank_{t:02d}_{p:03d}"
            d = dirs.get((t, None if staged == {False} else p))
            f = os.path.join(iter_dir, name, PT_FILE)
            if d is None or not os.path.isfile(f):
                ours = d is not None and os.path.isfile(os.path.join(d, "model_optim_rng.json"))
                if ours:
                    raise UserError(f"{FLAG} {iter_dir}: a checkpoint of this trainer "
                                    f"(model_optim_rng.json); read it with --load")
                raise CheckpointError(f"{FLAG} {iter_dir}: missing {f} (tensor rank {t} of "
                                      f"{tp}, stage {p} of {pp})")
            files[(t, p)] = f
    return CheckpointSource(iter_dir, label, files, tp, pp)

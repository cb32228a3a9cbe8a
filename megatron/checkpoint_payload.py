"""One checkpoint payload on disk: a safetensors file holding every tensor plus a JSON
file holding everything else, the seam that decides the format (``save_payload`` /
``load_payload``).  ``megatron.checkpointing`` builds directories, manifests and the
save protocol on top of it.

The JSON tree holds nested dicts, lists, tuples, ints, floats (inf/nan too), strings,
bools, None, torch dtypes and sizes, numpy arrays and scalars and bytes; its leaves point
at tensors by key, and non-string dict keys and tuples are tagged so they come back with
their exact types.  Loading parses JSON and safetensors only; nothing is ever unpickled.
Payloads of the previous version (``.pt`` pickles) load only with ``allow_unsafe=True``
(``--allow-unsafe-checkpoint``), through ``torch.load(weights_only=True)`` and a minimal
allow-list of numpy globals.
"""
from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.errors import CheckpointError

CHECKPOINT_VERSION = 2
"""2: JSON + safetensors payloads with a manifest; 1: pickled ``.pt`` payloads."""
PAYLOAD_FORMAT = "megatron-pd2bw-payload"
UNSAFE_FLAG = "--allow-unsafe-checkpoint"


# -- payload encoding: JSON tree + safetensors ------------------------------------------------
# A JSON object with exactly one key from _TAGS is a tagged value; a dict whose keys are
# not all strings (or that contains a tag name) is stored as a list of [key, value] pairs.
_TENSOR, _TUPLE, _DICT, _FLOAT, _DTYPE, _SIZE, _NDARRAY, _NPSCALAR, _BYTES = (
    "__tensor__", "__tuple__", "__dict__", "__float__", "__dtype__", "__size__",
    "__ndarray__", "__npscalar__", "__bytes__")
_TAGS = frozenset((_TENSOR, _TUPLE, _DICT, _FLOAT, _DTYPE, _SIZE, _NDARRAY, _NPSCALAR, _BYTES))


class _Encoder:
    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}
        self._storages: set = set()

    def _key(self, path: str) -> str:
        path = path.lstrip("/") or "root"
        key, n = path, 1
        while key in self.tensors:
            n += 1
            key = f"{path}#{n}"
        return key

    def _tensor(self, t: torch.Tensor, path: str) -> str:
        if t.layout != torch.strided or t.is_quantized:
            raise TypeError(f"checkpoint payload: {path}: cannot store a {t.layout} tensor")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu").contiguous()  # a fresh copy
        else:
            # safetensors refuses tensors sharing storage (2BW buffers, views, tied
            # weights): a tensor that is not the sole, whole user of its storage is copied.
            storage = t.untyped_storage()
            whole = (t.is_contiguous() and t.storage_offset() == 0
                     and t.numel() * t.element_size() == storage.nbytes())
            if not whole or storage.data_ptr() in self._storages or storage.nbytes() == 0:
                t = t.clone(memory_format=torch.contiguous_format)
            else:
                self._storages.add(storage.data_ptr())
        key = self._key(path)
        self.tensors[key] = t
        return key

    def encode(self, obj: Any, path: str = "") -> Any:
        if isinstance(obj, np.generic):  # before float: np.float64 subclasses float
            return {_NPSCALAR: {"dtype": obj.dtype.str, "value": self.encode(obj.item(), path)}}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {_FLOAT: repr(float(obj))}
        if isinstance(obj, torch.Tensor):
            return {_TENSOR: self._tensor(obj, path)}
        if isinstance(obj, torch.dtype):
            return {_DTYPE: str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.Size):
            return {_SIZE: [int(d) for d in obj]}
        if isinstance(obj, tuple):
            return {_TUPLE: [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not (_TAGS & obj.keys()):
                return {k: self.encode(v, f"{path}/{k}") for k, v in obj.items()}
            return {_DICT: [[self.encode(k, f"{path}/key"), self.encode(v, f"{path}/{k}")]
                            for k, v in obj.items()]}
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError(f"checkpoint payload: {path}: cannot store an object array")
            raw = np.ascontiguousarray(obj).view(np.uint8).reshape(-1)
            data = torch.from_numpy(raw.copy())
            return {_NDARRAY: {"dtype": obj.dtype.str, "shape": list(obj.shape),
                               "data": self._tensor(data, path)}}
        if isinstance(obj, (bytes, bytearray)):
            return {_BYTES: base64.b64encode(bytes(obj)).decode("ascii")}
        raise TypeError(f"checkpoint payload: {path or 'root'}: cannot store a "
                        f"{type(obj).__name__} (tensors, numbers, strings, containers only)")


def _decode(node: Any, tensors: Dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors, where) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1 and next(iter(node)) in _TAGS:
        tag, val = next(iter(node.items()))
        if tag == _TENSOR:
            if val not in tensors:
                raise CheckpointError(f"{where}: tensor {val!r} is missing from the "
                                      f".safetensors file")
            return tensors[val]
        if tag == _TUPLE:
            return tuple(_decode(v, tensors, where) for v in val)
        if tag == _DICT:
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in val}
        if tag == _FLOAT:
            return float(val)  # 'inf', '-inf', 'nan'
        if tag == _DTYPE:
            dtype = getattr(torch, str(val), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{where}: unknown torch dtype {val!r}")
            return dtype
        if tag == _SIZE:
            return torch.Size(val)
        if tag == _NDARRAY:
            dtype = np.dtype(val["dtype"])
            if dtype.hasobject:
                raise CheckpointError(f"{where}: object arrays are not allowed")
            raw = _decode({_TENSOR: val["data"]}, tensors, where).cpu().numpy().tobytes()
            return np.frombuffer(raw, dtype=dtype).reshape(val["shape"]).copy()
        if tag == _NPSCALAR:
            dtype = np.dtype(val["dtype"])
            if dtype.hasobject:
                raise CheckpointError(f"{where}: object scalars are not allowed")
            return dtype.type(_decode(val["value"], tensors, where))
        if tag == _BYTES:
            return base64.b64decode(val)
    return {k: _decode(v, tensors, where) for k, v in node.items()}


def _fsync_replace(tmp: str, path: str) -> None:
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_payload(obj: Any, stem: str) -> List[str]:
    """Write ``obj`` (nested containers of tensors and plain values) as ``stem.safetensors``
    + ``stem.json``, each atomically; the JSON goes last, so its presence means the pair
    is complete.  The ONE place that decides the on-disk format of a payload;
    ``load_payload`` reads it back.  Returns the two paths written.  A failed write (disk
    full, permissions) raises ``OSError`` naming the file, from safetensors too."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    enc = _Encoder()
    tree = enc.encode(obj)
    st_path, js_path = stem + ".safetensors", stem + ".json"
    tmp = f"{st_path}.tmp.{os.getpid()}"
    try:
        save_file(enc.tensors, tmp)
    except SafetensorError as exc:  # an I/O error reads "... (os error 28) ..."
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), st_path) from exc
    _fsync_replace(tmp, st_path)
    doc = {"format": PAYLOAD_FORMAT, "version": CHECKPOINT_VERSION,
           "tensors": os.path.basename(st_path), "tree": tree}
    tmp = f"{js_path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, allow_nan=False, separators=(",", ":"))
    _fsync_replace(tmp, js_path)
    return [st_path, js_path]


def payload_exists(stem: str) -> bool:
    """True when a payload (either format) was written at ``stem``."""
    return os.path.exists(stem + ".json") or os.path.exists(stem + ".pt")


def payload_files(stem: str) -> List[str]:
    return [stem + ".json", stem + ".safetensors"]


def _read_payload_json(js_path: str) -> Dict[str, Any]:
    """The JSON half of a payload, its format checked (no tensors are read)."""
    try:
        with open(js_path) as fh:
            doc = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{js_path}: not a readable checkpoint JSON file ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != PAYLOAD_FORMAT:
        raise CheckpointError(f"{js_path}: expected format {PAYLOAD_FORMAT!r}, found "
                              f"{doc.get('format') if isinstance(doc, dict) else type(doc)!r}")
    return doc


def read_payload(stem: str, map_location: Any = "cpu", *, allow_unsafe: bool = False) -> Any:
    """Read what ``save_payload(obj, stem)`` wrote, without checking it against a manifest
    (``megatron.checkpointing.load_payload`` does that first).  A ``stem.pt`` pickle of the
    previous version is refused unless ``allow_unsafe``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    js_path, st_path = payload_files(stem)
    if not os.path.exists(js_path):
        if os.path.exists(stem + ".pt"):
            return _load_legacy(stem + ".pt", map_location, allow_unsafe)
        raise CheckpointError(f"{js_path}: checkpoint file is missing")
    doc = _read_payload_json(js_path)
    device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
    try:
        tensors = load_file(st_path, device=device)
    except (OSError, SafetensorError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{st_path}: not a readable safetensors file ({exc})") from None
    try:
        return _decode(doc["tree"], tensors, js_path)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{js_path}: malformed checkpoint JSON ({type(exc).__name__}: "
                              f"{exc})") from None


# -- the previous (pickle) format ---------------------------------------------------------------
def numpy_safe_globals() -> list:
    """What numpy RNG state in a pickle needs beyond torch's weights-only defaults: numpy
    arrays, dtypes and scalars.  Nothing that can run code."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, core.multiarray.scalar]
    allowed += [type(np.dtype(t)) for t in ("u4", "i8", "f8", "u1", "f4", "i4", "b1")]
    return allowed


def weights_only_refusal(exc: BaseException) -> Tuple[Optional[str], str]:
    """(the pickled global torch's weights-only unpickler refused, or None; its reason)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    culprit = re.search(r"GLOBAL (\S+)", text)
    # torch's own reason sits between "WeightsUnpickler error:" and its advice
    reason = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\s*\n|$)", text, re.S)
    why = (reason.group(1).splitlines()[0] if reason
           else (text.strip().splitlines() or [type(exc).__name__])[-1])
    return (culprit.group(1) if culprit else None), why


_MEGATRON_LM_HINT = ("; a checkpoint written by NVIDIA Megatron-LM itself imports with "
                     "tools/checkpoint_util.py --from-megatron DIR --save CKPT " + UNSAFE_FLAG)


def _load_legacy(path: str, map_location: Any, allow_unsafe: bool) -> Any:
    if not allow_unsafe:
        raise CheckpointError(
            f"{path} is in the old pickle checkpoint format, which can run arbitrary code when "
            f"loaded, so it is refused; if you trust its source pass {UNSAFE_FLAG} (loads it "
            f"with torch.load(weights_only=True)) and save again to convert it"
            f"{_MEGATRON_LM_HINT}")
    print(f"WARNING: loading {path} in the old pickle format because of {UNSAFE_FLAG} "
          f"(weights-only unpickler, allow-listed globals only)", flush=True)
    # torch < 2.5 has no safe_globals: its weights-only defaults, without numpy, apply
    allow = getattr(torch.serialization, "safe_globals", None)
    try:
        with allow(numpy_safe_globals()) if allow else contextlib.nullcontext(), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pickle-protocol chatter: the error says it all
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is one user error
        culprit, why = weights_only_refusal(exc)
        if culprit:
            why = f"it references {culprit}, which is not on the allow-list"
        # Megatron-LM pickles its args (argparse.Namespace) and its own enums
        hint = (_MEGATRON_LM_HINT if culprit and (culprit == "argparse.Namespace"
                                                  or culprit.startswith("megatron."))
                else "")
        raise CheckpointError(f"{path}: refused to load this old pickle checkpoint even with "
                              f"{UNSAFE_FLAG}: {why}{hint}") from None

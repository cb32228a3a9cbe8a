"""Access to the compiled dataset index builders (``helpers.cpp``).

``pip install .`` / ``pip install -e .`` compile ``helpers.cpp`` into the extension
``megatron.data.helpers_cpp``.  When that extension is missing (a plain source checkout
on ``PYTHONPATH``), the first call here compiles it with the system C++ compiler into a
per-user cache directory (``$MEGATRON_HELPERS_CACHE`` or ``~/.cache/megatron/helpers``),
under a file lock so that concurrently starting ranks compile it only once.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional, Tuple

import numpy as np

_SOURCE = Path(__file__).with_name("helpers.cpp")
_MODULE_NAME = "megatron.data.helpers_cpp"
_module: Optional[ModuleType] = None
# The build_bert_mapping rules this Python expects of the compiled helpers (helpers.cpp
# exports its own as bert_mapping_version).
BERT_MAPPING_VERSION = 2
_thread_lock = threading.Lock()


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """[num_samples + 1, 2] array of (doc_idx position, token offset) of each sample start.

    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length.  dtype is int32
    unless doc_idx has 2**31 or more entries (then int64).
    """
    return get_module().build_sample_idx(sizes, doc_idx, int(seq_length), int(num_epochs),
                                         int(tokens_per_epoch))


def build_blending_indices(weights: np.ndarray, size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) interleaving datasets by ``weights``.

    dataset_index is uint8 for up to 255 datasets, else int32; dataset_sample_index is
    int64.
    """
    return get_module().build_blending_indices(np.asarray(weights, dtype=np.float64), int(size))


def get_module() -> ModuleType:
    """The compiled extension, importing or compiling it on first use."""
    global _module
    if _module is not None:
        return _module
    with _thread_lock:
        if _module is None:
            try:
                from megatron.data import helpers_cpp  # type: ignore[attr-defined]
                _module = helpers_cpp
            except ImportError:
                _module = _load_from_cache()
    return _module


def cache_dir() -> Path:
    """Where a source checkout keeps its compiled helpers."""
    root = os.environ.get("MEGATRON_HELPERS_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "megatron" / "helpers"
    return base.expanduser()


def _load_from_cache() -> ModuleType:
    import pybind11

    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    source = _SOURCE.read_bytes()
    # Key the build by everything that makes a binary incompatible, so an edit of
    # helpers.cpp or a different interpreter never loads a stale library.
    key = hashlib.sha256(source + sys.version.encode() + pybind11.__version__.encode()
                         + suffix.encode()).hexdigest()[:16]
    target_dir = cache_dir() / key
    target = target_dir / f"helpers_cpp{suffix}"
    if not target.exists():
        target_dir.mkdir(parents=True, exist_ok=True)
        with _FileLock(target_dir / "build.lock"):
            if not target.exists():  # another process may have finished meanwhile
                _compile(target, pybind11.get_include())
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, target)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_compiler() -> str:
    candidates = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    for name in candidates:
        if name and shutil.which(name.split()[0]):
            return name
    raise RuntimeError(
        "megatron/data/helpers.cpp must be compiled, but no C++ compiler was found "
        "(looked for $CXX, c++, g++, clang++ on PATH). Install one (e.g. `apt-get install "
        "g++`) or install the package with `pip install .`, which builds the extension.")


def _compile(target: Path, pybind11_include: str) -> None:
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").exists():
        raise RuntimeError(
            f"compiling megatron/data/helpers.cpp needs the Python headers, but "
            f"{python_include}/Python.h is missing (install the python3-dev package).")
    cxx = _find_compiler()
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    cmd = cxx.split() + ["-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
                         f"-I{pybind11_include}", f"-I{python_include}", str(_SOURCE),
                         "-o", str(tmp)]
    if sys.platform == "darwin":
        cmd += ["-undefined", "dynamic_lookup"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling megatron/data/helpers.cpp failed:\n$ {' '.join(cmd)}\n"
                           f"{proc.stderr}")
    os.replace(tmp, target)  # atomic: other ranks never see a half-written library


class _FileLock:
    """Exclusive inter-process lock on a file (fcntl on POSIX, msvcrt on Windows)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fh = None

    def __enter__(self) -> "_FileLock":
        self._fh = open(self._path, "a+b")
        if os.name == "nt":
            import msvcrt
            msvcrt.locking(self._fh.fileno(), msvcrt.LK_LOCK, 1)
        else:
            import fcntl
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fh is not None
        if os.name == "nt":
            import msvcrt
            msvcrt.locking(self._fh.fileno(), msvcrt.LK_UNLCK, 1)
        else:
            import fcntl
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
        self._fh.close()


def build_bert_mapping(docs: np.ndarray, sizes: np.ndarray, max_num_samples: int,
                       max_num_tokens: int, short_seq_prob: float, seed: int,
                       min_num_sent: int, long_sentence_len: int = 512) -> np.ndarray:
    """[n, 3] int64 rows (first sentence, end sentence, target length) of BERT samples.

    ``docs``: sentence boundaries of the documents to use (document i is sentences
    docs[i]..docs[i+1]); ``sizes``: tokens per sentence.  Documents with a sentence of
    more than ``long_sentence_len`` tokens are skipped (Megatron-LM: 512; 0 = keep all).
    The samples of whole epochs are shuffled together and the first ``max_num_samples``
    returned.  See helpers.cpp and the pure Python reference
    ``megatron.data.bert_dataset.build_bert_mapping_py``.
    """
    module = get_module()
    if getattr(module, "bert_mapping_version", 1) < BERT_MAPPING_VERSION:
        # A second library of the same name cannot be loaded into this process, so a
        # stale build can only be fixed by rebuilding it.
        raise RuntimeError(
            f"the compiled dataset helpers {getattr(module, '__file__', module)} predate "
            f"build_bert_mapping version {BERT_MAPPING_VERSION} (megatron/data/helpers.cpp "
            f"changed since they were built): rebuild them with `pip install -e .` (or "
            f"`python setup.py build_ext --inplace`), or delete that file so they are "
            f"compiled on first use")
    return module.build_bert_mapping(np.asarray(docs, dtype=np.int64),
                                     np.asarray(sizes, dtype=np.int32), int(max_num_samples),
                                     int(max_num_tokens), float(short_seq_prob),
                                     int(seed) & ((1 << 64) - 1), int(min_num_sent),
                                     int(long_sentence_len))

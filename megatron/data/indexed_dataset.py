"""Memory-mapped token dataset stored as a ``.bin``/``.idx`` pair.

``{prefix}.bin`` is the raw concatenation of every sequence's tokens in one dtype.
``{prefix}.idx`` describes it (all integers little-endian)::

    offset  size      field
    0       8         magic  b"PD2BWIDX"
    8       8 uint64  version (1)
    16      8 uint64  dtype code (DTYPE_CODES below)
    24      8 uint64  n = number of sequences
    32      8 uint64  m = number of document boundaries (documents + 1)
    40      8 uint64  byte size of the matching .bin file
    48      4*n int32 sizes: tokens per sequence
    ..      8*n int64 pointers: byte offset of each sequence in .bin
    ..      8*m int64 doc_idx: sequence index where each document starts, then n

A document is one or more consecutive sequences (sentences when preprocessing splits
sentences, otherwise exactly one).  Every field is checked when the pair is opened, so
a truncated or mismatched file fails with a ``ValueError`` naming it, never with
garbage tokens mid-training.
"""
from __future__ import annotations

import os
import shutil
import struct
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

MAGIC = b"PD2BWIDX"
VERSION = 1
_HEADER = struct.Struct("<8sQQQQQ")
HEADER_BYTES = _HEADER.size  # 48: keeps every array below 8-byte aligned

DTYPE_CODES: Dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
    6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def best_fitting_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every token id fits with room to spare, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _tmp_name(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


class IndexedDatasetBuilder:
    """Streams sequences into ``bin_path``; ``finalize`` writes the ``.idx``.

    Both files are written under temporary names and renamed only once complete, so a
    crash never leaves a pair that looks valid.
    """

    def __init__(self, bin_path: str, dtype: type = np.int32) -> None:
        self._dtype = np.dtype(dtype)
        if self._dtype not in _CODE_OF:
            raise ValueError(f"{bin_path}: unsupported dtype {self._dtype}; expected one of "
                             f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}")
        self._bin_path = str(bin_path)
        self._tmp_bin = _tmp_name(self._bin_path)
        self._out = open(self._tmp_bin, "wb")
        self._sizes: List[int] = []
        self._doc_idx: List[int] = [0]
        self._nbytes = 0
        # Sizes of merged datasets are appended as arrays, not per-element lists.
        self._merged_sizes: List[np.ndarray] = []

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def add_item(self, tokens: Union[np.ndarray, Sequence[int]]) -> None:
        """Append one sequence."""
        arr = np.asarray(tokens, dtype=self._dtype)
        if arr.ndim != 1:
            raise ValueError(f"{self._bin_path}: add_item expects a 1-D sequence, got shape "
                             f"{arr.shape}")
        self._out.write(arr.tobytes(order="C"))
        self._flush_merged()
        self._sizes.append(int(arr.size))
        self._nbytes += arr.nbytes

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(self._num_sequences())

    def add_index(self, other_prefix: str) -> None:
        """Append every sequence and document of the dataset at ``other_prefix``."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self._dtype:
            raise ValueError(f"{index_file_path(other_prefix)}: dtype {other.dtype} differs "
                             f"from the builder's {self._dtype}")
        base = self._num_sequences()
        self._flush_merged()
        self._merged_sizes.append(np.array(other.sizes, dtype=np.int32))
        self._doc_idx.extend(int(d) + base for d in other.doc_idx[1:])
        with open(data_file_path(other_prefix), "rb") as src:
            shutil.copyfileobj(src, self._out, length=16 << 20)
        self._nbytes += other.bin_nbytes

    def finalize(self, idx_path: str) -> None:
        """Write the index and atomically publish the ``.bin``/``.idx`` pair."""
        if self._doc_idx[-1] != self._num_sequences():
            self.end_document()  # trailing sequences without end_document form a document
        self._out.close()
        self._flush_merged()
        sizes = np.concatenate(self._merged_sizes) if self._merged_sizes else \
            np.zeros(0, np.int32)
        pointers = np.zeros(sizes.size, dtype=np.int64)
        if sizes.size > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self._dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        tmp_idx = _tmp_name(str(idx_path))
        with open(tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self._dtype], sizes.size,
                                 doc_idx.size, self._nbytes))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        # Remove a stale index first: a new .bin beside an old .idx is then never
        # mistaken for a valid pair (the byte count in the header also guards this).
        if os.path.exists(idx_path):
            os.unlink(idx_path)
        os.replace(self._tmp_bin, self._bin_path)
        os.replace(tmp_idx, idx_path)

    def abort(self) -> None:
        """Discard everything written so far (used when preprocessing fails)."""
        if not self._out.closed:
            self._out.close()
        if os.path.exists(self._tmp_bin):
            os.unlink(self._tmp_bin)

    def _num_sequences(self) -> int:
        return len(self._sizes) + sum(s.size for s in self._merged_sizes)

    def _flush_merged(self) -> None:
        if self._sizes:
            self._merged_sizes.append(np.asarray(self._sizes, dtype=np.int32))
            self._sizes = []


class IndexedDataset:
    """Read-only view of a ``.bin``/``.idx`` pair; sequences come back as numpy views."""

    def __init__(self, prefix: str) -> None:
        self._prefix = str(prefix)
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = index_file_path(self._prefix), data_file_path(self._prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path} does not exist")
        header = _read_header(idx_path)
        self._dtype = np.dtype(DTYPE_CODES[header["dtype_code"]])
        n, m = header["num_sequences"], header["num_doc_idx"]
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = HEADER_BYTES
        self._sizes = np.frombuffer(idx, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self._pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self._doc_idx = np.frombuffer(idx, dtype="<i8", count=m, offset=off)
        self._bin_nbytes = header["bin_nbytes"]
        _validate_arrays(idx_path, bin_path, self._sizes, self._pointers, self._doc_idx,
                         self._dtype.itemsize, self._bin_nbytes)
        # mmap cannot map an empty file; an empty dataset has nothing to read anyway.
        self._bin = (np.memmap(bin_path, dtype=self._dtype, mode="r") if self._bin_nbytes
                     else np.zeros(0, dtype=self._dtype))

    # Pickle by path: DataLoader workers re-open the maps instead of copying the data.
    def __getstate__(self) -> dict:
        return {"prefix": self._prefix}

    def __setstate__(self, state: dict) -> None:
        self._prefix = state["prefix"]
        self._open()

    @staticmethod
    def exists(prefix: str) -> bool:
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (int32, read-only)."""
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        """Sequence index where each document starts, followed by len(self) (int64)."""
        return self._doc_idx

    @property
    def bin_nbytes(self) -> int:
        return self._bin_nbytes

    def __len__(self) -> int:
        return int(self._sizes.size)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``idx`` (read-only view)."""
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self._prefix}: sequence {idx} has {size} tokens; cannot read "
                             f"{length} from offset {offset}")
        start = int(self._pointers[idx]) // self._dtype.itemsize + offset
        return self._bin[start:start + length]


def _read_header(idx_path: str) -> dict:
    file_size = os.path.getsize(idx_path)
    if file_size < HEADER_BYTES:
        raise ValueError(f"{idx_path}: truncated index; expected a header of {HEADER_BYTES} "
                         f"bytes but the file has {file_size}")
    with open(idx_path, "rb") as f:
        magic, version, code, n, m, bin_nbytes = _HEADER.unpack(f.read(HEADER_BYTES))
    if magic != MAGIC:
        raise ValueError(f"{idx_path}: not an indexed-dataset index; expected magic {MAGIC!r}, "
                         f"found {magic!r}")
    if version != VERSION:
        raise ValueError(f"{idx_path}: index version {version}; expected {VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path}: unknown dtype code {code}; expected one of "
                         f"{sorted(DTYPE_CODES)}")
    expected = HEADER_BYTES + 12 * n + 8 * m
    if file_size != expected:
        raise ValueError(f"{idx_path}: index is {file_size} bytes but its header ({n} "
                         f"sequences, {m} document boundaries) requires {expected}; the file is "
                         f"truncated or corrupt")
    return {"dtype_code": code, "num_sequences": n, "num_doc_idx": m, "bin_nbytes": bin_nbytes}


def _validate_arrays(idx_path: str, bin_path: str, sizes: np.ndarray, pointers: np.ndarray,
                     doc_idx: np.ndarray, itemsize: int, bin_nbytes: int) -> None:
    bin_size = os.path.getsize(bin_path)
    if bin_size != bin_nbytes:
        raise ValueError(f"{bin_path}: data file is {bin_size} bytes but {idx_path} expects "
                         f"{bin_nbytes}; the .bin is truncated or belongs to another index")
    n = sizes.size
    if n and int(sizes.min()) < 0:
        raise ValueError(f"{idx_path}: negative sequence size; the index is corrupt")
    total = int(sizes.sum(dtype=np.int64)) * itemsize
    if total != bin_nbytes:
        raise ValueError(f"{idx_path}: sizes add up to {total} bytes but the header records "
                         f"{bin_nbytes} bytes in {bin_path}; the index is corrupt")
    if n:
        expected_ptr = np.zeros(n, dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=expected_ptr[1:])
        if not np.array_equal(expected_ptr, pointers):
            raise ValueError(f"{idx_path}: sequence pointers are inconsistent with the sizes "
                             f"array; the index is corrupt")
    if (doc_idx.size == 0 or int(doc_idx[0]) != 0 or int(doc_idx[-1]) != n
            or np.any(np.diff(doc_idx) < 0)):
        raise ValueError(f"{idx_path}: document index must rise from 0 to the number of "
                         f"sequences ({n}); the index is corrupt")

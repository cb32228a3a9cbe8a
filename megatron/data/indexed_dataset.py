"""Memory-mapped token dataset stored as a ``.bin``/``.idx`` pair, in Megatron-LM's format.

``{prefix}.bin`` is the raw concatenation of every sequence's tokens in one dtype.
``{prefix}.idx`` describes it; the layout is Megatron-LM's ``MMIDIDX`` index, so files
preprocessed by Megatron-LM train here unchanged and ours load there (all integers
little-endian, no padding)::

    offset  size      field
    0       9         magic  b"MMIDIDX\\x00\\x00"
    9       8 uint64  version (1)
    17      1 uint8   dtype code (DTYPE_CODES below)
    18      8 uint64  n = number of sequences
    26      8 uint64  m = number of document-index entries (documents + 1)
    34      4*n int32 sizes: tokens per sequence
    ..      8*n int64 pointers: byte offset of each sequence in .bin
    ..      8*m int64 doc_idx: sequence index where each document starts, then n

The dtype codes are Megatron-LM core's ``DType`` enum: 1 uint8, 2 int8, 3 int16,
4 int32, 5 int64, 6 float64, 7 float32, 8 uint16 (older Megatron releases swapped the
two float codes; token files only ever use the integer ones).  Multimodal Megatron
indices may append one int8 "mode" per sequence; it is accepted and ignored.

A document is one or more consecutive sequences (sentences when preprocessing splits
sentences, otherwise exactly one).  Every field is checked when the pair is opened, so
a truncated or mismatched file fails with one ``DataError`` line naming the file, what
was expected and what was found, never with garbage tokens mid-training.  The index is
checked on its own before it is compared with the ``.bin``, so a corrupt ``.idx`` is
blamed on the ``.idx``.

Indices written by earlier versions of this project (magic ``PD2BWIDX``) are still
read, with a one-line deprecation warning; ``python -m megatron.data.indexed_dataset
upgrade PREFIX`` rewrites such a pair in Megatron's format.
"""
from __future__ import annotations

import os
import shutil
import struct
import sys
from typing import Dict, List, Optional, Sequence, Set, Union

import numpy as np

from megatron.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")
HEADER_BYTES = _HEADER.size  # 34

# The format this project wrote before adopting Megatron's (read-only now).
LEGACY_MAGIC = b"PD2BWIDX"
_LEGACY_HEADER = struct.Struct("<8sQQQQQ")  # magic, version, dtype, n, m, .bin bytes

DTYPE_CODES: Dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
    6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}

# Legacy files already reported in this process (one warning per file, not per reopen).
_warned_legacy: Set[str] = set()


def best_fitting_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when every token id fits with room to spare, else int32 (as Megatron-LM)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def _tmp_name(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


def write_index(idx_path: str, dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> None:
    """Write a Megatron ``.idx`` for sequences of ``sizes`` tokens (pointers derived)."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(sizes.size, dtype=np.int64)
    if sizes.size > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[dtype], sizes.size, doc_idx.size))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(doc_idx.astype("<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())


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
        self._sizes.append(int(arr.size))

    def add_documents(self, tokens: Union[np.ndarray, Sequence[int]],
                      sequence_lengths: Sequence[int], sequences_per_document: Sequence[int]
                      ) -> None:
        """Append whole documents at once: ``tokens`` holds their sequences back to back.

        One write and two list extensions per call, however many documents, which is
        what keeps a batched preprocessing loop cheap.
        """
        arr = np.asarray(tokens, dtype=self._dtype)
        if arr.ndim != 1 or int(np.sum(sequence_lengths)) != arr.size \
                or int(np.sum(sequences_per_document)) != len(sequence_lengths):
            raise ValueError(f"{self._bin_path}: add_documents got {arr.size} tokens, "
                             f"{len(sequence_lengths)} sequence lengths adding up to "
                             f"{int(np.sum(sequence_lengths))} and document counts adding up "
                             f"to {int(np.sum(sequences_per_document))}")
        self._out.write(arr.tobytes(order="C"))
        base = self._num_sequences()
        self._sizes.extend(int(n) for n in sequence_lengths)
        self._doc_idx.extend((base + np.cumsum(sequences_per_document, dtype=np.int64)).tolist())

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

    def finalize(self, idx_path: str) -> None:
        """Write the index and atomically publish the ``.bin``/``.idx`` pair."""
        if self._doc_idx[-1] != self._num_sequences():
            self.end_document()  # trailing sequences without end_document form a document
        self._out.close()
        self._flush_merged()
        sizes = np.concatenate(self._merged_sizes) if self._merged_sizes else \
            np.zeros(0, np.int32)
        tmp_idx = _tmp_name(str(idx_path))
        write_index(tmp_idx, self._dtype, sizes, np.asarray(self._doc_idx, dtype=np.int64))
        # Remove a stale index first: a new .bin beside an old .idx is then never
        # mistaken for a valid pair (the size check at open also guards this).
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
        self._open(warn=True)

    def _open(self, warn: bool) -> None:
        idx_path, bin_path = index_file_path(self._prefix), data_file_path(self._prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"{path}: indexed dataset file does not exist; expected both "
                                f"{data_file_path(self._prefix)} and "
                                f"{index_file_path(self._prefix)}")
        header = _read_header(idx_path)
        self.legacy = header["legacy"]
        if self.legacy and warn and idx_path not in _warned_legacy:
            _warned_legacy.add(idx_path)
            print(f"warning: {idx_path} uses the deprecated PD2BWIDX index format; convert it "
                  f"with `python -m megatron.data.indexed_dataset upgrade {self._prefix}`",
                  file=sys.stderr, flush=True)
        self._dtype = np.dtype(DTYPE_CODES[header["dtype_code"]])
        n, m = header["num_sequences"], header["num_doc_idx"]
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = header["header_bytes"]
        self._sizes = np.frombuffer(idx, dtype="<i4", count=n, offset=off)
        off += 4 * n
        self._pointers = np.frombuffer(idx, dtype="<i8", count=n, offset=off)
        off += 8 * n
        self._doc_idx = np.frombuffer(idx, dtype="<i8", count=m, offset=off)
        self._bin_nbytes = _validate_index(idx_path, self._sizes, self._pointers,
                                           self._doc_idx, self._dtype.itemsize)
        _validate_bin(idx_path, bin_path, self._bin_nbytes, header.get("bin_nbytes"))
        # mmap cannot map an empty file; an empty dataset has nothing to read anyway.
        self._bin = (np.memmap(bin_path, dtype=self._dtype, mode="r") if self._bin_nbytes
                     else np.zeros(0, dtype=self._dtype))

    # Pickle by path: DataLoader workers re-open the maps instead of copying the data.
    def __getstate__(self) -> dict:
        return {"prefix": self._prefix}

    def __setstate__(self, state: dict) -> None:
        self._prefix = state["prefix"]
        self._open(warn=False)

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
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the ``.bin`` (int64, read-only)."""
        return self._pointers

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
    """Parse the header of a Megatron (or legacy PD2BWIDX) index and check its length."""
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(max(HEADER_BYTES, _LEGACY_HEADER.size))
    legacy = head.startswith(LEGACY_MAGIC)
    if not legacy and not head.startswith(MAGIC):
        if MAGIC.startswith(head) or LEGACY_MAGIC.startswith(head):
            raise DataError(f"{idx_path}: truncated index; expected a header of "
                            f"{HEADER_BYTES} bytes, found a {file_size}-byte file")
        raise DataError(f"{idx_path}: not an indexed-dataset index; expected magic {MAGIC!r} "
                        f"(Megatron) at the start, found {head[:len(MAGIC)]!r}")
    fmt = _LEGACY_HEADER if legacy else _HEADER
    if file_size < fmt.size:
        raise DataError(f"{idx_path}: truncated index; expected a header of {fmt.size} bytes, "
                        f"found a {file_size}-byte file")
    fields = fmt.unpack(head[:fmt.size])
    if legacy:
        _, version, code, n, m, bin_nbytes = fields
    else:
        _, version, code, n, m = fields
        bin_nbytes = None
    if version != VERSION:
        raise DataError(f"{idx_path}: index version {version}; expected {VERSION}")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code}; expected one of "
                        f"{sorted(DTYPE_CODES)}")
    expected = fmt.size + 12 * n + 8 * m
    # Megatron's multimodal indices carry one extra int8 per sequence at the end.
    allowed = (expected,) if legacy else (expected, expected + n)
    if file_size not in allowed:
        what = "truncated" if file_size < expected else "corrupt (too long)"
        raise DataError(f"{idx_path}: index is {what}; its header ({n} sequences, {m} "
                        f"document-index entries) requires {expected} bytes, found {file_size}")
    return {"legacy": legacy, "dtype_code": code, "num_sequences": n, "num_doc_idx": m,
            "header_bytes": fmt.size, "bin_nbytes": bin_nbytes}


def _validate_index(idx_path: str, sizes: np.ndarray, pointers: np.ndarray,
                    doc_idx: np.ndarray, itemsize: int) -> int:
    """Check the index is self-consistent; returns the .bin size it describes."""
    n = sizes.size
    if n and int(sizes.min()) < 0:
        raise DataError(f"{idx_path}: corrupt index; expected sequence sizes >= 0, found "
                        f"{int(sizes.min())}")
    if n:
        expected_ptr = np.zeros(n, dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * itemsize, out=expected_ptr[1:])
        bad = np.flatnonzero(expected_ptr != pointers)
        if bad.size:
            i = int(bad[0])
            raise DataError(f"{idx_path}: corrupt index; sequence pointers are inconsistent "
                            f"with the sizes array (sequence {i}: expected byte offset "
                            f"{int(expected_ptr[i])}, found {int(pointers[i])})")
    if (doc_idx.size == 0 or int(doc_idx[0]) != 0 or int(doc_idx[-1]) != n
            or np.any(np.diff(doc_idx) < 0)):
        found = doc_idx[:3].tolist() + (["..."] if doc_idx.size > 4 else []) + \
            doc_idx[-1:].tolist() if doc_idx.size else []
        raise DataError(f"{idx_path}: corrupt index; expected a document index rising from "
                        f"0 to the number of sequences ({n}), found {found}")
    return int(sizes.sum(dtype=np.int64)) * itemsize


def _validate_bin(idx_path: str, bin_path: str, nbytes: int, header_nbytes: Optional[int]
                  ) -> None:
    if header_nbytes is not None and header_nbytes != nbytes:
        raise DataError(f"{idx_path}: corrupt index; sizes add up to {nbytes} bytes but the "
                        f"header records {header_nbytes}")
    bin_size = os.path.getsize(bin_path)
    if bin_size != nbytes:
        what = "truncated" if bin_size < nbytes else "too long"
        raise DataError(f"{bin_path}: data file is {what}; {idx_path} expects {nbytes} bytes, "
                        f"found {bin_size} (or the .bin belongs to another index)")


def upgrade(prefix: str) -> None:
    """Rewrite a legacy PD2BWIDX pair in Megatron's format (the .bin is unchanged)."""
    ds = IndexedDataset(prefix)
    if not ds.legacy:
        print(f"{index_file_path(prefix)} is already in Megatron's format")
        return
    idx_path = index_file_path(prefix)
    tmp = _tmp_name(idx_path)
    write_index(tmp, ds.dtype, np.array(ds.sizes), np.array(ds.doc_idx))
    os.replace(tmp, idx_path)
    print(f"rewrote {idx_path} in Megatron's MMIDIDX format")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "upgrade":
        sys.exit("usage: python -m megatron.data.indexed_dataset upgrade PREFIX [PREFIX ...]")
    try:
        for p in sys.argv[2:]:
            upgrade(p)
    except DataError as exc:
        sys.exit(f"error: {exc}")

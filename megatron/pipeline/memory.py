"""Counters of what a pipeline stage holds: stashed activations and weight versions.

Activation bytes are measured, not estimated: while a microbatch's forward runs, a
``saved_tensors_hooks`` pack hook sees every tensor autograd keeps for the backward
pass; we add up the distinct storages among them, leaving out the weights (which are
counted as weight versions).  With stage recomputation the forward runs without
autograd and only the stage input (and the microbatch's data) is stashed.

The hooks cost Python work per saved tensor, so the executor runs them only on the
first batch of a training segment (or every N batches on request): what a microbatch
stashes depends on its position in the batch (same shapes, same layers), never on the
batch, so later microbatches replay the counted bytes of their position and the peaks
stay exact (``StashTracker.count_as`` / ``replay``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterator, Optional, Set

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class StageMemoryStats:
    """Peaks over a run, for one stage."""

    peak_in_flight: int = 0
    """Most microbatches whose forward ran and whose backward did not yet."""
    peak_stashed_bytes: int = 0
    """Most bytes of stashed activations (sum over in-flight microbatches)."""
    peak_weight_versions: int = 0
    """Most weight versions live at once (2BW: 2, others: 1)."""
    weight_bytes_per_version: int = 0
    per_microbatch_bytes: Dict[int, int] = field(default_factory=dict)

    @property
    def peak_weight_bytes(self) -> int:
        return self.peak_weight_versions * self.weight_bytes_per_version

    def as_dict(self) -> dict:
        return {"peak_in_flight": self.peak_in_flight,
                "peak_stashed_activation_bytes": self.peak_stashed_bytes,
                "peak_weight_versions": self.peak_weight_versions,
                "weight_bytes_per_version": self.weight_bytes_per_version,
                "peak_weight_bytes": self.peak_weight_bytes}


class StashTracker:
    """Tracks in-flight microbatches and their stashed bytes on one stage.

    A storage that two in-flight microbatches both keep (a tensor the stage caches and
    every microbatch's layers save, such as the explicit softmax's causal mask) is held
    once, so it is charged once: it moves from the microbatch that first kept it to the
    stage's ``shared`` bytes, which count while any microbatch is in flight.  Two
    in-flight microbatches' storages with the same address are one storage, since a
    stashed storage cannot be freed (and its address reused) before its backward."""

    def __init__(self, weight_ptrs: Set[int]) -> None:
        self.weight_ptrs = weight_ptrs
        self.in_flight: Dict[int, int] = {}
        """Bytes each in-flight microbatch keeps alone."""
        self.shared: Dict[int, int] = {}
        """Storages (address -> bytes) found kept by more than one microbatch."""
        self.stats = StageMemoryStats()
        self.pattern: Dict[Hashable, int] = {}
        """Bytes counted for each position key (microbatch index within its batch)."""
        self._owner: Dict[int, int] = {}      # storage address -> counted microbatch
        self._held: Dict[int, Dict[int, int]] = {}  # counted microbatch -> its storages
        self._key: Dict[int, Hashable] = {}   # counted microbatch -> its position key

    @contextmanager
    def counting(self, microbatch: int, key: Optional[Hashable] = None) -> Iterator[None]:
        """Count the bytes autograd saves during this block for ``microbatch``; with
        ``key``, remember them so that ``replay(m, key)`` can charge them to a later
        microbatch without hooks."""
        seen: Dict[int, int] = {}
        loose = [0]   # bytes of tensors without a storage address (charged as they are)

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in seen and ptr not in self.weight_ptrs and ptr != 0:
                    seen[ptr] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                loose[0] += tensor_bytes(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        own: Dict[int, int] = {}
        for ptr, nbytes in seen.items():
            if ptr in self.shared:
                continue
            other = self._owner.get(ptr)
            if other is not None and other != microbatch and other in self.in_flight:
                self._share(ptr, other)
            else:
                own[ptr] = nbytes
        total = loose[0] + sum(own.values())
        if key is not None:
            self.pattern[key] = total
            self._key[microbatch] = key
        for ptr in own:
            self._owner[ptr] = microbatch
        self._held.setdefault(microbatch, {}).update(own)
        self.add(microbatch, total)

    def _share(self, ptr: int, owner: int) -> None:
        """``ptr``, charged to ``owner``, is kept by another microbatch too: charge it to
        the stage once (the total does not change) and leave it out of ``owner``'s
        position pattern, so replays do not charge it per microbatch."""
        nbytes = self._held[owner].pop(ptr)
        del self._owner[ptr]
        self.shared[ptr] = nbytes
        self.in_flight[owner] -= nbytes
        key = self._key.get(owner)
        if key is not None and key in self.pattern:
            self.pattern[key] -= nbytes

    def knows(self, key: Hashable) -> bool:
        return key in self.pattern

    def replay(self, microbatch: int, key: Hashable) -> None:
        """Charge ``microbatch`` the bytes counted earlier for ``key``."""
        self.add(microbatch, self.pattern[key])

    def forget_pattern(self) -> None:
        """Shapes changed (e.g. another micro-batch shape): count again before replaying
        (and find the shared storages again: a cached mask may be remade)."""
        self.pattern.clear()
        self.shared.clear()

    def stashed_bytes(self) -> int:
        """Bytes the in-flight microbatches keep now: their own, and the shared ones once."""
        if not self.in_flight:
            return 0
        return sum(self.in_flight.values()) + sum(self.shared.values())

    def add(self, microbatch: int, nbytes: int) -> None:
        self.in_flight[microbatch] = self.in_flight.get(microbatch, 0) + nbytes
        self.stats.per_microbatch_bytes.setdefault(microbatch, self.in_flight[microbatch])
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.in_flight))
        self.stats.peak_stashed_bytes = max(self.stats.peak_stashed_bytes,
                                            self.stashed_bytes())

    def release(self, microbatch: int) -> None:
        self.in_flight.pop(microbatch, None)
        self._key.pop(microbatch, None)
        for ptr in self._held.pop(microbatch, {}):
            if self._owner.get(ptr) == microbatch:
                del self._owner[ptr]

    def note_weight_versions(self, live: int, bytes_per_version: int) -> None:
        self.stats.peak_weight_versions = max(self.stats.peak_weight_versions, live)
        self.stats.weight_bytes_per_version = bytes_per_version

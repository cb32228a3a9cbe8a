"""Megatron-LM's --manual-gc: Python's automatic garbage collection off while a run
trains, and collections at the same iterations on every rank instead.

An automatic collection starts whenever one process's allocation counters cross a
threshold, so each rank pauses at its own moment; in a pipeline a pause on one stage
stalls every stage after it.  With --manual-gc the ranks collect after every
--manual-gc-interval iterations (a full collection) and around each evaluation (a full
one before, the young generation after; not with --no-manual-gc-eval).  A stage collects
right after its own optimizer step of that iteration: under the flushing schedules the
stages take it within one batch's drain, under 2BW (no drain) at their own moments a few
microbatches apart, so their pauses overlap only in part there.  The training
steps leave no cyclic garbage here (a collection after each of 12 flush or 2BW steps
finds nothing: tests/unit/test_manual_gc.py), so --manual-gc-interval 0 does not make a
run grow.  The collector's state before the run is restored when training ends.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

from megatron.config import TrainingConfig


class ManualGC:
    """The collections of one training run; inert without --manual-gc."""

    def __init__(self, training: TrainingConfig) -> None:
        self.enabled = training.manual_gc
        self.interval = training.manual_gc_interval
        self.around_evaluations = training.manual_gc_eval
        self._was_enabled = True
        self.collections = 0
        """Collections made so far (full and young-generation ones)."""

    def __enter__(self) -> "ManualGC":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_step(self, iteration: int) -> None:
        """Batch ``iteration`` (0-based) has been applied."""
        if self.enabled and self.interval and (iteration + 1) % self.interval == 0:
            self._collect()

    @contextlib.contextmanager
    def around_evaluation(self) -> Iterator[None]:
        if self.enabled and self.around_evaluations:
            self._collect()
        try:
            yield
        finally:
            if self.enabled and self.around_evaluations:
                self._collect(generation=0)  # what the evaluation made and dropped

    def _collect(self, generation: int = 2) -> None:
        gc.collect(generation)
        self.collections += 1

"""Global batch sizes that change during training, as functions of consumed samples.

Megatron-LM has had two ways to grow the batch early in training, and this module reads
both:

* ``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-LM until 2026, the GPT-3
  scripts): start at START and add INCREMENT, in equal shares of the first SAMPLES
  training samples, until --global-batch-size.  With ``k = (global - START) / INCREMENT``
  increments, the batch after ``c`` consumed samples is ``START + floor(c * k / SAMPLES) *
  INCREMENT`` while ``c <= SAMPLES``, and --global-batch-size after.
* ``--step-batch-size-schedule "THRESHOLD:BATCH ..."`` (Megatron-LM since 2026): the batch
  is BATCH from THRESHOLD on.  Thresholds are tokens (divided by --seq-length into
  samples) and may carry K, M, B or T (10^3 ... 10^12); the first must be 0.

Either becomes one ``BatchSchedule``: sorted (threshold in samples, batch size) points.
The batch size of an iteration depends only on the samples consumed before it, so a
resumed run continues the schedule where it stopped.  Each batch must be whole
microbatches of --micro-batch-size on every data-parallel rank; the pipeline executor
changes its number of microbatches m between training segments, and the training loop
ends a segment wherever the batch size changes.

Pure logic: no process group, no tensors.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


class BatchScheduleError(ValueError):
    """A batch-size schedule that cannot work with the rest of the batch flags."""


def _parse_number(text: str, flag: str) -> int:
    t = text.strip().upper()
    scale = 1
    if t and t[-1] in SUFFIXES:
        scale, t = SUFFIXES[t[-1]], t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise BatchScheduleError(f"{flag}: '{text}' is not a number (suffixes K, M, B, T "
                                 "allowed)") from None
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise BatchScheduleError(f"{flag}: '{text}' must be a non-negative whole number")
    return int(value)


@dataclass(frozen=True)
class BatchSchedule:
    points: Tuple[Tuple[int, int], ...]
    """(first consumed sample, global batch size from there on), thresholds increasing,
    the first at 0."""
    source: str = ""
    """The flag and value it came from, for messages."""

    def __post_init__(self) -> None:
        if not self.points or self.points[0][0] != 0:
            raise BatchScheduleError(f"{self.source}: the first threshold must be 0")
        for (a, _), (b, _) in zip(self.points, self.points[1:]):
            if b <= a:
                raise BatchScheduleError(f"{self.source}: thresholds must increase, got "
                                         f"{a} samples before {b}")
        for _, size in self.points:
            if size <= 0:
                raise BatchScheduleError(f"{self.source}: batch sizes must be positive, "
                                         f"got {size}")

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_rampup(cls, values: Sequence[int], global_batch_size: int) -> "BatchSchedule":
        """Megatron-LM's linear --rampup-batch-size START INCREMENT SAMPLES."""
        if len(values) != 3:
            raise BatchScheduleError(f"--rampup-batch-size takes 3 integers (start batch "
                                     f"size, increment, ramp-up samples), got {len(values)}")
        start, increment, samples = (int(v) for v in values)
        flag = f"--rampup-batch-size {start} {increment} {samples}"
        if start <= 0 or increment <= 0 or samples < 0:
            raise BatchScheduleError(f"{flag}: the start batch size and the increment must "
                                     "be positive and the ramp-up samples >= 0")
        if start > global_batch_size:
            raise BatchScheduleError(f"{flag}: the start batch size is larger than "
                                     f"--global-batch-size ({global_batch_size})")
        if (global_batch_size - start) % increment:
            raise BatchScheduleError(f"{flag}: --global-batch-size ({global_batch_size}) minus "
                                     f"the start batch size must be a multiple of the "
                                     f"increment ({increment})")
        k = (global_batch_size - start) // increment
        points = {0: start}
        # start + j * increment from the first c with floor(c * k / samples) >= j
        for j in range(1, k + 1):
            points[-(-j * samples // k)] = start + j * increment
        return cls(tuple(sorted(points.items())), flag)

    @classmethod
    def parse(cls, text: str, seq_length: Optional[int]) -> "BatchSchedule":
        """Megatron-LM's --step-batch-size-schedule: thresholds in tokens when
        ``seq_length`` is given (converted to whole samples), else in samples."""
        flag = f"--step-batch-size-schedule '{text}'"
        entries = text.replace(",", " ").split()
        if not entries:
            raise BatchScheduleError(f"{flag}: expected THRESHOLD:BATCH_SIZE entries, "
                                     "e.g. '0:256 2B:512'")
        points = []
        for entry in entries:
            threshold, sep, size = entry.partition(":")
            if not sep:
                raise BatchScheduleError(f"{flag}: entry '{entry}' is not THRESHOLD:BATCH_SIZE")
            points.append((_parse_number(threshold, flag), _parse_number(size, flag)))
        points.sort(key=lambda p: p[0])
        if seq_length:  # tokens -> the sample in which that token falls
            for (a, _), (b, _) in zip(points, points[1:]):
                if a // seq_length == b // seq_length:
                    raise BatchScheduleError(
                        f"{flag}: thresholds in tokens fall in the same sample at --seq-length "
                        f"{seq_length} ({a} and {b} tokens are both sample {a // seq_length}); "
                        "thresholds must be whole samples apart")
            points = [(t // seq_length, size) for t, size in points]
        return cls(tuple(points), flag)

    # -- checks -----------------------------------------------------------------------------
    def check(self, micro_batch_size: int, data_parallel_size: int,
              min_microbatches: int = 1, consumed_samples: int = 0) -> None:
        """Every batch from ``consumed_samples`` on must be whole microbatches on every
        data-parallel rank, and at least ``min_microbatches`` of them (PipeDream-2BW:
        m >= pipeline depth).  Batches already trained are not checked: a run resumed on
        more ranks may have passed sizes this layout cannot split (as Megatron-LM)."""
        unit = micro_batch_size * data_parallel_size
        for threshold, size in self.points[self._index(consumed_samples):]:
            if size % unit:
                raise BatchScheduleError(
                    f"{self.source}: the batch of {size} (from sample {threshold:,}) is not a "
                    f"multiple of --micro-batch-size ({micro_batch_size}) x data-parallel size "
                    f"({data_parallel_size}) = {unit}")
            if size // unit < min_microbatches:
                raise BatchScheduleError(
                    f"{self.source}: the batch of {size} (from sample {threshold:,}) is "
                    f"{size // unit} microbatches, fewer than the {min_microbatches} "
                    f"PipeDream-2BW needs (m >= pipeline depth); make every batch at least "
                    f"{min_microbatches * unit}")

    # -- queries ------------------------------------------------------------------------------
    @property
    def final_batch_size(self) -> int:
        return self.points[-1][1]

    @property
    def largest_batch_size(self) -> int:
        return max(size for _, size in self.points)

    def _index(self, consumed: int) -> int:
        return bisect.bisect_right(self.points, (consumed, math.inf)) - 1

    def batch_size_at(self, consumed_samples: int) -> int:
        """Global batch size of the iteration that starts after ``consumed_samples``."""
        return self.points[self._index(consumed_samples)][1]

    def _next_change(self, consumed: int) -> Optional[int]:
        """First threshold after ``consumed`` at which the batch size differs."""
        i = self._index(consumed)
        size = self.points[i][1]
        for threshold, other in self.points[i + 1:]:
            if other != size:
                return threshold
        return None

    def batches_at_this_size(self, consumed_samples: int) -> Optional[int]:
        """Iterations from ``consumed_samples`` on before the batch size changes (None:
        it never changes again)."""
        change = self._next_change(consumed_samples)
        if change is None:
            return None
        size = self.batch_size_at(consumed_samples)
        return -(-(change - consumed_samples) // size)

    def iterations(self, train_samples: int, consumed_samples: int = 0) -> int:
        """Whole batches that fit in ``train_samples`` from ``consumed_samples`` on."""
        n, c = 0, consumed_samples
        while True:
            size = self.batch_size_at(c)
            fit = max(0, train_samples - c) // size
            same = self.batches_at_this_size(c)
            if same is None or fit < same:
                return n + fit
            n += same
            c += same * size

    def samples_after(self, iterations: int, consumed_samples: int = 0) -> int:
        """Consumed samples after ``iterations`` more batches from ``consumed_samples``."""
        left, c = iterations, consumed_samples
        while left > 0:
            size = self.batch_size_at(c)
            same = self.batches_at_this_size(c)
            k = left if same is None else min(left, same)
            c += k * size
            left -= k
        return c

    def sizes(self, iterations: int, consumed_samples: int = 0) -> List[int]:
        """The batch sizes of the next ``iterations`` batches."""
        out, c = [], consumed_samples
        for _ in range(iterations):
            out.append(self.batch_size_at(c))
            c += out[-1]
        return out

    def describe(self, seq_length: Optional[int] = None) -> str:
        """One line for the banner."""
        sizes = [size for _, size in self.points]
        if len(sizes) > 4:
            steps = f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]} ({len(sizes)} sizes)"
        else:
            steps = ", ".join(f"{s} from sample {t:,}" for t, s in self.points)
        return f"{steps}; {self.source}"

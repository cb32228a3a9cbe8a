"""Batch samplers and the pretraining data loader.

Global batch order is fixed by the sample index alone: the samples
``consumed, consumed + 1, ...`` are cut into groups of ``micro_batch_size * dp_size``
and data-parallel rank r takes the r-th ``micro_batch_size`` slice of each group.  So a
run resumed from a checkpoint's ``consumed_samples`` continues with exactly the
micro-batches the uninterrupted run would have seen.
"""
from __future__ import annotations

import signal
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch


class MegatronPretrainingSampler:
    """Yields this data-parallel rank's list of sample indices for each micro-batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True
                 ) -> None:
        if total_samples <= 0:
            raise ValueError(f"MegatronPretrainingSampler: no samples to iterate "
                             f"(total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"MegatronPretrainingSampler: consumed_samples={consumed_samples} "
                             f"must be in [0, total_samples={total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"MegatronPretrainingSampler: data_parallel_rank="
                             f"{data_parallel_rank} outside [0, {data_parallel_size})")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.drop_last = drop_last
        self._group = self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self._group
        if self.drop_last or remaining % self._group == 0:
            return full
        return full + 1

    def __iter__(self) -> Iterator[List[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        end = start + self.micro_batch_size
        group: List[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            group.append(idx)
            if len(group) == self._group:
                yield group[start:end]
                group = []
        if group and not self.drop_last:
            # Every rank yields (possibly empty) so all ranks see the same number of
            # micro-batches and none waits alone in a collective.
            yield group[start:end]


def collate_samples(samples: Sequence[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Stack a list of {"key": array} samples into {"key": LongTensor [batch, ...]}."""
    if not samples:
        return {}
    return {k: torch.from_numpy(np.stack([np.asarray(s[k]) for s in samples])).long()
            for k in samples[0]}


def _loader_worker_ignores_sigterm(worker_id: int) -> None:
    """DataLoader workers outlive a SIGTERM; the rank decides what it means.

    SLURM, torchrun and ``kill -- -PGID`` send SIGTERM to every process of a rank, loader
    workers included.  A worker that died of it failed the rank's next read, so
    --exit-signal-handler could not finish its batch and save.  An ignored SIGTERM costs
    nothing: workers still exit when the loader shuts them down or their parent dies
    (torch's worker watchdog), and SIGKILL still kills them."""
    del worker_id
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_pretraining_data_loader(dataset: Optional[torch.utils.data.Dataset],
                                  consumed_samples: int, micro_batch_size: int,
                                  dp_rank: int, dp_size: int, num_workers: int = 2
                                  ) -> Optional[torch.utils.data.DataLoader]:
    """DataLoader over this rank's micro-batches, starting after ``consumed_samples``.

    Returns None for a None dataset (an empty split) so callers can skip evaluation.
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                         dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=num_workers,
        collate_fn=collate_samples, pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=_loader_worker_ignores_sigterm if num_workers > 0 else None,
        # its own generator: creating an iterator must not draw from the global RNG,
        # or dropout streams would depend on when iterators were made (breaks resume)
        generator=torch.Generator().manual_seed(0))

"""Deterministic weighted interleaving of several datasets."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from megatron.data import helpers


class BlendableDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights``.

    Sample i comes from dataset ``dataset_index[i]``, which is always the dataset that
    lags furthest behind its share, so any prefix of the blend (a few batches) is close
    to the requested mixture.  Within each dataset samples are taken in order 0, 1, ...
    A dataset may be None only if its weight draws no samples.
    """

    def __init__(self, datasets: Sequence[Optional[Any]], weights: Sequence[float],
                 size: int) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendableDataset: {len(datasets)} datasets but "
                             f"{len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"BlendableDataset: weights must be non-negative and not all "
                             f"zero, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = helpers.build_blending_indices(
            self.weights, self.size)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for j, (ds, n) in enumerate(zip(self.datasets, needed)):
            have = 0 if ds is None else len(ds)
            if n > have:
                raise ValueError(f"BlendableDataset: dataset {j} (weight {self.weights[j]:.4g}) "
                                 f"must supply {n} samples but has {have}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Any:
        if not 0 <= idx < self.size:
            raise IndexError(f"BlendableDataset: sample {idx} out of range [0, {self.size})")
        ds = self.datasets[int(self.dataset_index[idx])]
        return ds[int(self.dataset_sample_index[idx])]

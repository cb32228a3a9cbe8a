"""Small helpers shared by the tensor-parallel layers.

``TPInfo`` is the only thing the layers know about process groups: the tensor-parallel
group of this rank, its size and this rank's index in it.  It is built once from the
``ParallelGroups`` container and handed down to every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass(frozen=True)
class TPInfo:
    """Tensor-parallel group, size and rank seen by one process.

    ``group`` is None when the layers run alone (size 1); every communication helper is
    then a no-op, so single-process code pays nothing for tensor parallelism.
    """

    group: Optional[object] = None
    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPInfo: rank {self.rank} / size {self.size} is not a valid "
                             f"tensor-parallel position (need 0 <= rank < size)")
        if self.size > 1 and self.group is None:
            raise ValueError(f"TPInfo: tensor-parallel size {self.size} needs a process group; "
                             f"initialise torch.distributed and build ParallelGroups first")

    @classmethod
    def single(cls) -> "TPInfo":
        """No tensor parallelism: one process holds every partition."""
        return cls()

    @classmethod
    def from_groups(cls, groups) -> "TPInfo":
        """Take the tensor group of a ``megatron.parallel_state.ParallelGroups``."""
        if groups.tp_size == 1:
            return cls()
        return cls(group=groups.tensor, size=groups.tp_size, rank=groups.tp_rank)

    @property
    def is_parallel(self) -> bool:
        """True when a collective is actually needed."""
        return self.size > 1


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact integer division with an error that names what did not divide."""
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what} = {numerator} must be divisible by {denominator} "
                         f"(tensor-model-parallel size or head count)")
    return numerator // denominator


def split_along_last_dim(tensor: torch.Tensor, num_partitions: int) -> List[torch.Tensor]:
    """Views of ``tensor`` cut into ``num_partitions`` equal pieces along the last dim."""
    size = divide(tensor.size(-1), num_partitions, "last dimension")
    return list(torch.split(tensor, size, dim=-1))


def vocab_range(global_vocab_size: int, rank: int, size: int) -> tuple:
    """[first, last) global token ids owned by ``rank`` of a vocab-parallel table."""
    per = divide(global_vocab_size, size, "padded vocab size")
    return rank * per, (rank + 1) * per

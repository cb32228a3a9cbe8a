"""Rank layout and the one container of process groups.

The layout is pure arithmetic (``RankLayout``), unit-tested without torch.distributed.
Ranks are ordered tensor-fastest, then data, then pipeline (Megatron's default):

    rank = tp_rank + t * (dp_rank + w * pp_rank)

so the t ranks of a tensor group are neighbours (same server), the w replicas of a
stage come next (their gradient all-reduce stays inside a server when t * w fits),
and pipeline stages are outermost (only activations cross servers), which is the
orientation the paper recommends.

``ParallelGroups`` holds the torch.distributed groups built from a layout; it is the
single object passed to code that communicates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class RankCoord:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class RankLayout:
    """Pure description of how world_size ranks split into t x w x d."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self) -> None:
        if self.tensor < 1 or self.pipeline < 1:
            raise ValueError("tensor and pipeline sizes must be >= 1")
        if self.world_size % (self.tensor * self.pipeline) != 0:
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor-model-parallel size "
                f"{self.tensor} x pipeline-model-parallel size {self.pipeline}")

    @property
    def data(self) -> int:
        return self.world_size // (self.tensor * self.pipeline)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tensor * (dp + self.data * pp)

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        tp = rank % self.tensor
        dp = (rank // self.tensor) % self.data
        pp = rank // (self.tensor * self.data)
        return RankCoord(tp=tp, dp=dp, pp=pp)

    def tensor_groups(self) -> List[List[int]]:
        return [[self.rank(t, w, p) for t in range(self.tensor)]
                for p in range(self.pipeline) for w in range(self.data)]

    def data_groups(self) -> List[List[int]]:
        return [[self.rank(t, w, p) for w in range(self.data)]
                for p in range(self.pipeline) for t in range(self.tensor)]

    def pipeline_groups(self) -> List[List[int]]:
        return [[self.rank(t, w, p) for p in range(self.pipeline)]
                for w in range(self.data) for t in range(self.tensor)]

    def model_groups(self) -> List[List[int]]:
        """All ranks holding one model replica (tensor x pipeline), one group per replica."""
        return [[self.rank(t, w, p) for p in range(self.pipeline) for t in range(self.tensor)]
                for w in range(self.data)]

    def embedding_groups(self) -> List[List[int]]:
        """First and last stage of each pipeline (they share the tied word embedding)."""
        groups = []
        for ranks in self.pipeline_groups():
            groups.append([ranks[0], ranks[-1]] if len(ranks) > 1 else [ranks[0]])
        return groups

    def all_groups(self) -> Dict[str, List[List[int]]]:
        return {"tensor": self.tensor_groups(), "data": self.data_groups(),
                "pipeline": self.pipeline_groups(), "model": self.model_groups(),
                "embedding": self.embedding_groups()}

    def group_of(self, kind: str, rank: int) -> List[int]:
        for ranks in self.all_groups()[kind]:
            if rank in ranks:
                return ranks
        raise KeyError(f"rank {rank} in no {kind} group")


@dataclass
class ParallelGroups:
    """The process groups one rank takes part in, plus its coordinates.

    With world size 1 (or when torch.distributed is not initialised) every group is
    None and every size is 1, so single-process code runs unchanged.
    """

    layout: RankLayout
    rank: int
    tensor: Optional[object] = None
    data: Optional[object] = None
    pipeline: Optional[object] = None
    model: Optional[object] = None
    embedding: Optional[object] = None
    ranks: Dict[str, List[int]] = field(default_factory=dict)

    # -- coordinates -------------------------------------------------------------------
    @property
    def coord(self) -> RankCoord:
        return self.layout.coord(self.rank)

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def tp_size(self) -> int:
        return self.layout.tensor

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def dp_size(self) -> int:
        return self.layout.data

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` in this rank's pipeline."""
        c = self.coord
        return self.layout.rank(c.tp, c.dp, stage)

    @property
    def prev_rank(self) -> Optional[int]:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @property
    def next_rank(self) -> Optional[int]:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    @property
    def in_embedding_group(self) -> bool:
        return self.pp_size > 1 and (self.is_first_stage or self.is_last_stage)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls(layout=RankLayout(world_size=1), rank=0)

    @classmethod
    def build(cls, layout: RankLayout, rank: int, backend: Optional[str] = None) -> "ParallelGroups":
        """Create every group with torch.distributed.new_group.

        new_group must be called by all ranks for every group, in the same order, so
        each rank walks the whole layout and keeps the groups it belongs to.
        """
        import torch.distributed as dist

        mine: Dict[str, object] = {}
        ranks: Dict[str, List[int]] = {}
        if layout.world_size == 1 or not dist.is_initialized():
            return cls(layout=layout, rank=rank)
        for kind, groups in layout.all_groups().items():
            for members in groups:
                group = dist.new_group(ranks=members, backend=backend)
                if rank in members:
                    mine[kind] = group
                    ranks[kind] = list(members)
        return cls(layout=layout, rank=rank, ranks=ranks, **mine)

    def destroy(self) -> None:
        """Destroy the groups ``build`` created for this rank (never the default group).

        Every group holds sockets and threads (gloo: about three threads and five
        sockets per group); a process that trains more than once (tests, sweeps,
        benchmarks, a notebook) would otherwise keep all of them until it exits.
        Local to this rank (no collective); call it once the groups are idle."""
        import torch.distributed as dist

        live = dist.is_initialized()
        seen = set()
        for kind in ("tensor", "data", "pipeline", "model", "embedding"):
            group = getattr(self, kind)
            setattr(self, kind, None)
            if group is None or id(group) in seen or not live:
                continue
            seen.add(id(group))
            if group is dist.group.WORLD or group is dist.GroupMember.NON_GROUP_MEMBER:
                continue
            dist.destroy_process_group(group)
        self.ranks = {}
        if seen:
            import gc

            # the engine and optimizer that used the groups sit in reference cycles:
            # a group's threads and sockets go when its last reference does
            gc.collect()

    def describe(self) -> str:
        c = self.coord
        return (f"rank {self.rank}: tensor {c.tp}/{self.tp_size} data {c.dp}/{self.dp_size} "
                f"pipeline {c.pp}/{self.pp_size}")


def layout_table(layout: RankLayout) -> List[Tuple[int, int, int, int]]:
    """(rank, tp, dp, pp) for every rank; used by tools that print the layout."""
    return [(r, *(lambda c: (c.tp, c.dp, c.pp))(layout.coord(r))) for r in range(layout.world_size)]

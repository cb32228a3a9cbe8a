"""Rank layout arithmetic, no torch.distributed."""
from __future__ import annotations

import itertools

import pytest

from megatron.parallel_state import ParallelGroups, RankLayout


@pytest.mark.parametrize("world,t,d", [(1, 1, 1), (8, 2, 2), (16, 2, 4), (12, 3, 2), (8, 1, 8),
                                       (8, 8, 1), (24, 2, 3)])
def test_groups_partition_the_world(world, t, d):
    lay = RankLayout(world_size=world, tensor=t, pipeline=d)
    w = world // (t * d)
    for kind, size, count in (("tensor", t, world // t), ("data", w, world // w),
                              ("pipeline", d, world // d), ("model", t * d, w)):
        groups = lay.all_groups()[kind]
        assert len(groups) == count and all(len(g) == size for g in groups)
        assert sorted(itertools.chain(*groups)) == list(range(world))
    for r in range(world):
        c = lay.coord(r)
        assert lay.rank(c.tp, c.dp, c.pp) == r


def test_megatron_order_tensor_fastest_pipeline_outermost():
    lay = RankLayout(world_size=16, tensor=2, pipeline=4)  # w = 2
    assert lay.tensor_groups()[0] == [0, 1]
    assert lay.data_groups()[0] == [0, 2]
    assert lay.pipeline_groups()[0] == [0, 4, 8, 12]
    assert lay.embedding_groups()[0] == [0, 12]
    assert lay.model_groups()[0] == [0, 1, 4, 5, 8, 9, 12, 13]


def test_embedding_group_single_stage():
    lay = RankLayout(world_size=2, tensor=1, pipeline=1)
    assert lay.embedding_groups() == [[0], [1]]


def test_neighbours():
    lay = RankLayout(world_size=8, tensor=2, pipeline=2)  # w = 2
    g = ParallelGroups(layout=lay, rank=5)                 # tp 1, dp 0, pp 1
    assert (g.tp_rank, g.dp_rank, g.pp_rank) == (1, 0, 1)
    assert g.prev_rank == 1 and g.next_rank is None and g.is_last_stage
    assert g.in_embedding_group


@pytest.mark.parametrize("world,t,d", [(6, 4, 1), (8, 3, 1), (4, 1, 3)])
def test_indivisible_world_is_an_error(world, t, d):
    with pytest.raises(ValueError, match="not divisible"):
        RankLayout(world_size=world, tensor=t, pipeline=d)

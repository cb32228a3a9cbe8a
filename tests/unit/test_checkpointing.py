"""Checkpoint layout and crash safety, single process (no process group)."""
from __future__ import annotations

import os

import pytest
import torch

from megatron.checkpointing import (TRACKER, TrainState, iteration_dir, load_checkpoint,
                                    read_tracker, save_checkpoint)
from megatron.parallel_state import ParallelGroups, RankLayout


class _Opt:
    def __init__(self, v):
        self.v = v

    def state_dict(self):
        return {"v": self.v}


def _save(root, it, value):
    groups = ParallelGroups.single()
    return save_checkpoint(str(root), TrainState(iteration=it, consumed_train_samples=it * 8),
                           groups, model_state={"w": torch.full((2,), float(value))},
                           shadow_state=None, optimizer=_Opt(value), scheduler=None,
                           rng_state={"seed": value})


def test_layout_and_round_trip(tmp_path):
    path = _save(tmp_path, 5, 1.5)
    assert path == iteration_dir(str(tmp_path), 5)
    assert os.path.exists(os.path.join(path, "mp_rank_00_000", "model_optim_rng.pt"))
    assert read_tracker(str(tmp_path)) == 5
    payload = load_checkpoint(str(tmp_path), ParallelGroups.single())
    assert payload["iteration"] == 5 and payload["consumed_train_samples"] == 40
    assert torch.equal(payload["model"]["w"], torch.full((2,), 1.5))
    assert payload["optimizer"] == {"v": 1.5} and payload["rng_state"] == {"seed": 1.5}


def test_half_written_save_is_ignored(tmp_path):
    _save(tmp_path, 2, 1.0)
    # a crash during the save of iteration 4 leaves only a staging directory
    staging = iteration_dir(str(tmp_path), 4) + ".tmp"
    os.makedirs(os.path.join(staging, "mp_rank_00_000"))
    open(os.path.join(staging, "mp_rank_00_000", "model_optim_rng.pt"), "wb").write(b"trunc")
    assert read_tracker(str(tmp_path)) == 2
    assert load_checkpoint(str(tmp_path), ParallelGroups.single())["iteration"] == 2
    # the next save of that iteration cleans the staging directory up and succeeds
    _save(tmp_path, 4, 3.0)
    assert not os.path.exists(staging)
    assert load_checkpoint(str(tmp_path), ParallelGroups.single())["optimizer"] == {"v": 3.0}


def test_resave_same_iteration_replaces_it(tmp_path):
    _save(tmp_path, 3, 1.0)
    _save(tmp_path, 3, 2.0)
    assert load_checkpoint(str(tmp_path), ParallelGroups.single())["optimizer"] == {"v": 2.0}
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", TRACKER]


def test_no_checkpoint_returns_none(tmp_path):
    assert load_checkpoint(str(tmp_path), ParallelGroups.single()) is None


def test_layout_mismatch_is_a_clear_error(tmp_path):
    _save(tmp_path, 1, 1.0)
    groups = ParallelGroups(layout=RankLayout(world_size=2, pipeline=2), rank=1)
    with pytest.raises(FileNotFoundError, match="pipeline-model-parallel-size"):
        load_checkpoint(str(tmp_path), groups)


def test_bad_tracker_names_file(tmp_path):
    (tmp_path / TRACKER).write_text("garbage")
    with pytest.raises(ValueError, match=TRACKER):
        read_tracker(str(tmp_path))


def test_stage_split_is_recorded_and_checked(tmp_path):
    """A checkpoint records its stage's layers; another split stops with the flags named."""
    from megatron.errors import CheckpointError

    groups = ParallelGroups.single()
    save_checkpoint(str(tmp_path), TrainState(iteration=1), groups,
                    model_state={"w": torch.zeros(2)}, shadow_state=None, optimizer=_Opt(1.0),
                    scheduler=None, rng_state=None, stage_layers=range(0, 3))
    payload = load_checkpoint(str(tmp_path), groups, stage_layers=range(0, 3))
    assert payload["layout"]["layers"] == [0, 3]
    with pytest.raises(CheckpointError, match="decoder-first/last-pipeline-num-layers"):
        load_checkpoint(str(tmp_path), groups, stage_layers=range(0, 2))

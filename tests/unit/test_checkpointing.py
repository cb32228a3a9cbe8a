"""Checkpoint format, layout and crash safety, single process (no process group)."""
from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch

from megatron.checkpoint_discovery import find_checkpoint
from megatron.checkpoint_files import (MANIFEST, TRACKER, iteration_dir, load_payload, rank_dir,
                                       read_tracker)
from megatron.checkpoint_load import load_checkpoint
from megatron.checkpoint_payload import payload_exists
from megatron.checkpoint_shape import check_model_shape
from megatron.checkpointing import TrainState, save_checkpoint, save_payload
from megatron.config import ModelConfig
from megatron.errors import CheckpointError
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


def _load(root, **kw):
    return load_checkpoint(str(root), ParallelGroups.single(), **kw)


def test_layout_and_round_trip(tmp_path):
    path = _save(tmp_path, 5, 1.5)
    assert path == iteration_dir(str(tmp_path), 5)
    # Megatron's directory name at pipeline size 1; JSON + safetensors, no pickle
    assert sorted(os.listdir(path)) == [MANIFEST, "mp_rank_00"]
    assert sorted(os.listdir(os.path.join(path, "mp_rank_00"))) == [
        "model_optim_rng.json", "model_optim_rng.safetensors", "rng_dp_000.json",
        "rng_dp_000.safetensors"]
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    assert manifest["layout"] == {"tensor": 1, "pipeline": 1, "data": 1}
    assert sorted(manifest["files"]) == ["mp_rank_00/model_optim_rng.json",
                                         "mp_rank_00/model_optim_rng.safetensors",
                                         "mp_rank_00/rng_dp_000.json",
                                         "mp_rank_00/rng_dp_000.safetensors"]
    assert read_tracker(str(tmp_path)) == 5
    payload = _load(tmp_path)
    assert payload["iteration"] == 5 and payload["consumed_train_samples"] == 40
    assert torch.equal(payload["model"]["w"], torch.full((2,), 1.5))
    assert payload["optimizer"] == {"v": 1.5} and payload["rng_state"] == {"seed": 1.5}


def test_directory_written_by_a_tool_without_manifest_loads_unverified(tmp_path, capsys):
    path = _save(tmp_path, 5, 1.5)
    os.remove(os.path.join(path, MANIFEST))
    assert _load(tmp_path)["iteration"] == 5
    assert "has no manifest.json: its files are loaded unverified" in capsys.readouterr().out


def test_rank_dir_names_follow_megatron(tmp_path):
    assert rank_dir("it", 3, 0, pipeline_size=1) == os.path.join("it", "mp_rank_03")
    assert rank_dir("it", 1, 2, pipeline_size=4) == os.path.join("it", "mp_rank_01_002")
    assert rank_dir("it", 1, 0) == os.path.join("it", "mp_rank_01_000")


def _same(a, b, path="root"):
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b), path
    else:
        assert a == b, (path, a, b)


def test_payload_round_trips_exactly(tmp_path):
    rng = random.Random(3)
    npr = np.random.RandomState(5)
    npr.standard_normal(3)  # has a cached gaussian
    base = torch.arange(12.0).reshape(3, 4)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))])
    for p in adam.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    adam.step()
    obj = {
        # storage shared between entries, views and transposes (2BW buffers, tied weights)
        "model": {"w": base, "col": base[:, 1], "t": base.t(), "again": base,
                  "h": torch.ones(2, dtype=torch.float16),
                  "bf": torch.ones(2, dtype=torch.bfloat16),
                  "scalar": torch.tensor(3.5), "empty": torch.empty(0, 5),
                  "mask": torch.tensor([True, False]), "cpu_rng": torch.get_rng_state()},
        "optimizer": adam.state_dict(),                # int param ids as keys, betas tuple
        "engine": {"iteration": 7, "batch_scales": {6: 1.0, 7: 65536.0}},
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1.0, 1, True, None, "s"],
        "dtype": torch.float64, "shape": torch.Size([2, 3]),
        "python_random": rng.getstate(), "numpy_random": npr.get_state(),
        "np_scalars": [np.float64(2.5), np.int64(7), np.float32(0.1)],
        "looks_tagged": {"__tensor__": 1}, "mixed_keys": {1: "a", "1": "b", (2, 3): None},
        "cuda": None, "blob": b"\x00\xff",
    }
    save_payload(obj, str(tmp_path / "p"))
    assert payload_exists(str(tmp_path / "p"))
    back = load_payload(str(tmp_path / "p"))
    _same(obj, back)
    # the restored generators continue the same streams
    rng2, npr2 = random.Random(), np.random.RandomState()
    rng2.setstate(back["python_random"])
    npr2.set_state(back["numpy_random"])
    assert [rng.random(), npr.standard_normal()] == [rng2.random(), npr2.standard_normal()]
    adam.load_state_dict(back["optimizer"])


def test_malformed_json_is_one_error(tmp_path):
    stem = str(tmp_path / "p")
    save_payload({"a": torch.ones(1)}, stem)
    for tree in ({"__tensor__": "nope"}, {"__ndarray__": {"dtype": "O", "shape": [1],
                                                         "data": "a"}}, {"__dict__": 3}):
        doc = {"format": "megatron-pd2bw-payload", "version": 2, "tree": tree}
        open(stem + ".json", "w").write(json.dumps(doc))
        with pytest.raises(CheckpointError, match=r"p\.json"):
            load_payload(stem)


def test_half_written_save_is_ignored_and_stale_dirs_removed(tmp_path):
    _save(tmp_path, 2, 1.0)
    # a crash during the save of iteration 4 leaves only a staging directory; an older
    # crash left a staging directory of iteration 3 and a moved-aside copy
    for name in ("iter_0000004.tmp", "iter_0000003.tmp", "iter_0000002.old.123"):
        os.makedirs(tmp_path / name / "mp_rank_00")
        (tmp_path / name / "mp_rank_00" / "model_optim_rng.json").write_bytes(b"trunc")
    (tmp_path / f"{TRACKER}.tmp.99").write_text("4")
    assert read_tracker(str(tmp_path)) == 2
    assert _load(tmp_path)["iteration"] == 2
    _save(tmp_path, 4, 3.0)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004", TRACKER]
    assert _load(tmp_path)["optimizer"] == {"v": 3.0}


def test_resave_same_iteration_replaces_it(tmp_path):
    _save(tmp_path, 3, 1.0)
    _save(tmp_path, 3, 2.0)
    assert _load(tmp_path)["optimizer"] == {"v": 2.0}
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", TRACKER]


def test_crash_between_move_aside_and_rename_keeps_the_old_copy(tmp_path):
    _save(tmp_path, 3, 1.0)
    final = iteration_dir(str(tmp_path), 3)
    os.replace(final, final + ".old.123")  # the re-save of iteration 3 died right here
    os.makedirs(final + ".tmp")
    assert _load(tmp_path)["optimizer"] == {"v": 1.0}
    _save(tmp_path, 5, 2.0)  # the next save puts it back instead of deleting it
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000005", TRACKER]
    assert _load(tmp_path, iteration=3)["optimizer"] == {"v": 1.0}


def test_no_checkpoint_returns_none(tmp_path):
    assert _load(tmp_path) is None
    where = find_checkpoint(str(tmp_path / "absent"))
    assert where.iteration is None and "does not exist; starting from scratch" in where.message


def test_load_of_a_file_is_an_error(tmp_path):
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file; expected the checkpoint directory"):
        find_checkpoint(str(f))


def test_layout_mismatch_is_a_clear_error(tmp_path):
    _save(tmp_path, 1, 1.0)
    groups = ParallelGroups(layout=RankLayout(world_size=2, pipeline=2), rank=1)
    with pytest.raises(CheckpointError, match=r"tensor 1 x pipeline 1, this run uses tensor 1 "
                                              r"x pipeline 2 .*tools/checkpoint_util.py"):
        load_checkpoint(str(tmp_path), groups)


def test_bad_tracker_names_file(tmp_path):
    (tmp_path / TRACKER).write_text("garbage")
    with pytest.raises(CheckpointError, match=TRACKER):
        read_tracker(str(tmp_path))


def test_model_shape_mismatch_names_the_flags():
    run = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      padded_vocab_size=128)
    saved = {"model": dict(num_layers=4, hidden_size=64, num_attention_heads=4,
                           ffn_hidden_size=256, seq_length=32, max_position_embeddings=32,
                           padded_vocab_size=128)}
    with pytest.raises(CheckpointError) as err:
        check_model_shape("ck", saved, run)
    msg = str(err.value)
    assert "\n" not in msg
    assert "--hidden-size 64 in the checkpoint, 32 in this run" in msg
    assert "--ffn-hidden-size 256 in the checkpoint, 128 in this run" in msg
    assert "--seq-length/--max-position-embeddings 32 in the checkpoint, 16" in msg
    assert "--num-layers" not in msg
    check_model_shape("ck", {"model": dict(saved["model"], hidden_size=32, ffn_hidden_size=128,
                                           seq_length=16, max_position_embeddings=16)}, run)
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
    # the conversion command it prints writes this run's split
    with pytest.raises(CheckpointError, match=r"checkpoint_util.py --load .* "
                       r"--target-pipeline-parallel-size 1 "
                       r"--target-decoder-first-pipeline-num-layers 2$"):
        load_checkpoint(str(tmp_path), groups, stage_layers=range(0, 2), split=(2, None))

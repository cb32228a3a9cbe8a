"""--load of a checkpoint of another model shape names the model flags first, even when
the stage split or the (t, d) layout differs too: the conversion command those errors
print cannot make a checkpoint of another shape fit."""
from __future__ import annotations

import pytest
import torch

from megatron.checkpoint_load import load_for_run
from megatron.checkpointing import TrainState, save_checkpoint
from megatron.config import ModelConfig
from megatron.errors import CheckpointError
from megatron.parallel_state import ParallelGroups, RankLayout


class _Opt:
    def state_dict(self):
        return {"v": 1.0}


def _model(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                padded_vocab_size=128)
    base.update(kw)
    return ModelConfig(**base)


def _save(root, model: ModelConfig, layers: range) -> None:
    record = {k: (str(v) if isinstance(v, torch.dtype) else v)
              for k, v in model.__dict__.items()}
    save_checkpoint(str(root), TrainState(iteration=2), ParallelGroups.single(),
                    model_state={"w": torch.zeros(2)}, shadow_state=None, optimizer=_Opt(),
                    scheduler=None, rng_state=None, stage_layers=layers,
                    extra={"config": {"model": record}})


def test_fewer_layers_names_num_layers_not_the_stage_split(tmp_path):
    _save(tmp_path, _model(num_layers=4), range(0, 4))
    with pytest.raises(CheckpointError) as err:
        load_for_run(str(tmp_path), ParallelGroups.single(), _model(num_layers=2),
                     stage_layers=range(0, 2))
    msg = str(err.value)
    assert "--num-layers 4 in the checkpoint, 2 in this run" in msg
    assert "decoder-first" not in msg and "checkpoint_util" not in msg


def test_other_shape_and_layout_names_the_shape(tmp_path):
    _save(tmp_path, _model(), range(0, 4))
    groups = ParallelGroups(layout=RankLayout(world_size=2, tensor=2), rank=0)
    with pytest.raises(CheckpointError) as err:
        load_for_run(str(tmp_path), groups, _model(hidden_size=64),
                     stage_layers=range(0, 4))
    assert "--hidden-size 32 in the checkpoint, 64 in this run" in str(err.value)


def test_same_shape_other_split_still_gives_the_conversion_command(tmp_path):
    _save(tmp_path, _model(), range(0, 4))
    with pytest.raises(CheckpointError, match="decoder-first/last-pipeline-num-layers"):
        load_for_run(str(tmp_path), ParallelGroups.single(), _model(),
                     stage_layers=range(0, 3))
    payload, _ = load_for_run(str(tmp_path), ParallelGroups.single(), _model(),
                              stage_layers=range(0, 4))
    assert payload["iteration"] == 2


def test_recorded_heads_of_the_wrong_type_are_one_error(tmp_path):
    """A crafted config (with a matching manifest) whose head count is not a number is a
    CheckpointError naming the flag, not a TypeError traceback."""
    saved = {"model": dict(num_layers=4, hidden_size=32, num_attention_heads="4",
                           kv_channels=None)}
    from megatron.checkpoint_shape import check_model_shape
    with pytest.raises(CheckpointError, match="--num-attention-heads 4 in the checkpoint"):
        check_model_shape("ck", saved, _model())


def test_malformed_recorded_config_is_one_error(tmp_path):
    """read_saved_config (--use-checkpoint-args) of a config whose tags do not decode
    is a CheckpointError naming the file, not a TypeError traceback."""
    import json
    import os

    from megatron.checkpoint_discovery import read_saved_config
    _save(tmp_path, _model(), range(0, 4))
    js = os.path.join(tmp_path, "iter_0000002", "mp_rank_00", "model_optim_rng.json")
    doc = json.load(open(js))
    doc["tree"]["config"] = {"__tuple__": 5}
    json.dump(doc, open(js, "w"))
    with pytest.raises(CheckpointError, match="model_optim_rng.json: malformed"):
        read_saved_config(str(tmp_path))


def test_load_of_an_iteration_directory_names_its_parent(tmp_path):
    """--load CKPT/iter_0000002 (the path a save prints) is not a fresh start: it names
    the checkpoint directory to pass instead, for the trainer and the tool alike."""
    from megatron.checkpoint_merge import read_checkpoint
    from megatron.checkpoint_discovery import find_checkpoint
    _save(tmp_path / "ck", _model(), range(0, 4))
    inner = str(tmp_path / "ck" / "iter_0000002")
    for call in (find_checkpoint, read_checkpoint):
        with pytest.raises(CheckpointError) as err:
            call(inner)
        msg = str(err.value)
        assert "is one iteration of a checkpoint" in msg and "\n" not in msg
        assert f"pass {tmp_path / 'ck'} instead" in msg
    # a new, empty or unrelated directory still starts from scratch
    (tmp_path / "empty").mkdir()
    assert find_checkpoint(str(tmp_path / "empty")).iteration is None

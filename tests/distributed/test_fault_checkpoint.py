"""Checkpoint faults a user meets (issue 12): each one is a clear one-line CheckpointError or
a safe recovery, never code execution, silent garbage or a fresh start over old work.

Single-rank trainings run in this process (no process group is needed at world size 1);
the kill -9 case runs in a child process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from megatron.checkpoint_discovery import find_checkpoint
from megatron.checkpoint_files import MANIFEST, TRACKER, iteration_dir, load_payload
from megatron.checkpoint_load import load_checkpoint
from megatron.errors import CheckpointError
from megatron.parallel_state import ParallelGroups
from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _argv(*extra: str, iters: int = 4):
    base = list(TINY)
    base[base.index("--train-iters") + 1] = str(iters)
    return base + list(extra)


def _pretrain(argv):
    import pretrain_gpt
    from megatron.training import pretrain

    return pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                    pretrain_gpt.forward_step, argv=list(argv))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the spawned ranks use: on a shared machine several threads
    per tiny matmul make these in-process trainings several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints of iterations 2 and 4 of the tiny GPT, and its losses."""
    root = str(tmp_path_factory.mktemp("ck") / "ckpt")
    result = _pretrain(_argv("--save", root, "--save-interval", "2"))
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", TRACKER]
    return root, result


def _copy(trained, tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(trained[0], dst)
    return dst


def _model_file(root: str, it: int = 4) -> str:
    return os.path.join(iteration_dir(root, it), "mp_rank_00", "model_optim_rng.safetensors")


# -- untrusted files: no code runs --------------------------------------------------------------
class _Evil:
    """Unpickling this calls open(marker, 'w'): a stand-in for arbitrary code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _old_format_checkpoint(root: str, model_extra) -> str:
    """A checkpoint as the previous version wrote it: pickled .pt files, mp_rank_00_000."""
    d = os.path.join(iteration_dir(root, 3), "mp_rank_00_000")
    os.makedirs(d)
    torch.save({"checkpoint_version": 1, "iteration": 3, "consumed_train_samples": 24,
                "consumed_valid_samples": 0, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                "model": {"w": torch.ones(2)}, "extra": model_extra},
               os.path.join(d, "model_optim_rng.pt"))
    torch.save({"cpu": torch.get_rng_state(), "numpy": np.random.get_state()},
               os.path.join(d, "rng_dp_000.pt"))
    with open(os.path.join(root, TRACKER), "w") as fh:
        fh.write("3")
    return d


@pytest.mark.parametrize("allow_unsafe", [False, True])
def test_crafted_pickle_never_runs(tmp_path, allow_unsafe):
    marker = str(tmp_path / "pwned")
    _old_format_checkpoint(str(tmp_path / "ck"), _Evil(marker))
    assert not os.path.exists(marker)  # torch.save ran __reduce__, not the call it names
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(tmp_path / "ck"), ParallelGroups.single(), allow_unsafe=allow_unsafe)
    assert not os.path.exists(marker)
    msg = str(err.value)
    assert "\n" not in msg and "model_optim_rng.pt" in msg and "--allow-unsafe-checkpoint" in msg
    if not allow_unsafe:
        assert "old pickle checkpoint format" in msg and "arbitrary code" in msg
    else:
        assert re.search(r"it references \S*open, which is not on the allow-list", msg)
    with pytest.raises(CheckpointError):  # the training entry point refuses it too
        _pretrain(_argv("--load", str(tmp_path / "ck"), "--skip-train",
                        *(["--allow-unsafe-checkpoint"] if allow_unsafe else [])))
    assert not os.path.exists(marker)


def test_old_checkpoint_loads_only_with_the_flag(tmp_path, capsys):
    root = str(tmp_path / "ck")
    _old_format_checkpoint(root, {"betas": (0.9, 0.99), 3: 1.5})
    payload = load_checkpoint(root, ParallelGroups.single(), allow_unsafe=True)
    assert "WARNING: loading" in capsys.readouterr().out
    assert payload["iteration"] == 3 and payload["extra"] == {"betas": (0.9, 0.99), 3: 1.5}
    assert torch.equal(payload["model"]["w"], torch.ones(2))
    assert payload["rng_state"]["numpy"][0] == "MT19937"
    assert payload["rng_state"]["numpy"][1].dtype == np.uint32


# -- corrupt files --------------------------------------------------------------------------------
def test_bit_flip_is_named(trained, tmp_path):
    root = _copy(trained, tmp_path)
    path = _model_file(root)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"model_optim_rng.safetensors: corrupt checkpoint "
                                              r"file: expected sha256 [0-9a-f]{64}, found"):
        _pretrain(_argv("--load", root, "--skip-train"))


def test_truncated_file_is_named(trained, tmp_path):
    root = _copy(trained, tmp_path)
    path = _model_file(root)
    size = os.path.getsize(path)
    os.truncate(path, size - 1000)
    with pytest.raises(CheckpointError, match=rf"safetensors: corrupt checkpoint file \(truncated"
                                              rf" or altered\): expected {size} bytes, found "
                                              rf"{size - 1000}"):
        load_payload(path[:-len(".safetensors")])


# -- --load paths -----------------------------------------------------------------------------
def test_deleted_tracker_resumes_from_newest_complete(trained, tmp_path):
    root = _copy(trained, tmp_path)
    os.remove(os.path.join(root, TRACKER))
    assert find_checkpoint(root).iteration == 4
    os.truncate(_model_file(root, 4), 10)  # newest incomplete: the older one is used
    where = find_checkpoint(root)
    assert where.iteration == 2 and "no latest_checkpointed_iteration.txt" in where.message
    result = _pretrain(_argv("--load", root, "--save", root, "--skip-train"))
    assert result.iteration == 2
    assert not os.path.exists(os.path.join(root, TRACKER))  # evaluation only saves nothing
    os.remove(os.path.join(iteration_dir(root, 2), MANIFEST))
    with pytest.raises(CheckpointError, match="refusing to start from scratch"):
        _pretrain(_argv("--load", root, "--save", root))
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004"]  # nothing overwritten


def test_load_of_a_file_is_an_error(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"not a directory")
    with pytest.raises(CheckpointError, match="is a file; expected the checkpoint directory"):
        _pretrain(_argv("--load", str(f)))


def test_other_model_shape_names_the_flag(trained):
    argv = _argv("--load", trained[0], "--skip-train")
    argv[argv.index("--hidden-size") + 1] = "64"
    with pytest.raises(CheckpointError) as err:
        _pretrain(argv)
    msg = str(err.value)
    assert "\n" not in msg and "size mismatch" not in msg
    assert "--hidden-size 32 in the checkpoint, 64 in this run" in msg


# -- issue 11 item 5: evaluation only on a finished run's checkpoint ---------------------------
def test_skip_train_on_final_checkpoint(trained, tmp_path):
    result = _pretrain(_argv("--load", trained[0], "--skip-train"))
    assert result.iteration == 4 and not result.losses
    assert result.eval_losses[4]["lm loss"] > 0


# -- kill -9 during a save ----------------------------------------------------------------------
_KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    import megatron.checkpointing as ck
    real = ck.save_payload
    def dying(obj, stem):
        paths = real(obj, stem)
        if "iter_0000004.tmp" in stem:   # the second save, half written
            os.kill(os.getpid(), signal.SIGKILL)
        return paths
    ck.save_payload = dying
    import pretrain_gpt
    pretrain_gpt.main(sys.argv[1:])
""")


def test_kill_during_save_resumes_from_last_complete(trained, tmp_path):
    root = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _KILL_DURING_SAVE,
                           *_argv("--save", root, "--save-interval", "2")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004.tmp", TRACKER]
    resumed = _pretrain(_argv("--load", root, "--save", root))
    assert sorted(resumed.losses) == [3, 4]
    full = trained[1].losses
    for it in (3, 4):
        assert resumed.losses[it] == full[it]
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000004", TRACKER]


# -- two data-parallel ranks: every rank's files are in the manifest, and a corrupt file of
# one rank stops both at once (not after the distributed timeout) --------------------------
def _dp2_save_then_load(rank: int, world: int, root: str):
    import torch.distributed as dist

    torch.set_num_threads(1)
    _pretrain(_argv("--save", root, iters=2))
    dist.barrier()
    if rank == 0:
        path = os.path.join(iteration_dir(root, 2), "mp_rank_00", "rng_dp_001.safetensors")
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 0x01
        open(path, "wb").write(bytes(data))
    dist.barrier()
    try:
        _pretrain(_argv("--load", root, "--skip-train", iters=2))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_corrupt_file_of_one_rank_stops_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    errors = run_distributed(_dp2_save_then_load, 2, args=(root,), timeout=120)
    manifest = json.loads(open(os.path.join(iteration_dir(root, 2), MANIFEST)).read())
    assert manifest["layout"] == {"tensor": 1, "pipeline": 1, "data": 2}
    assert {"mp_rank_00/rng_dp_000.json", "mp_rank_00/rng_dp_001.safetensors"} <= set(
        manifest["files"])
    for err in errors:
        assert err is not None and "rng_dp_001.safetensors: corrupt checkpoint file" in err

"""Interrupted and failing saves, and what the next run may do with a --save directory.

* a save that cannot be written (disk full, permission lost mid-run) on any rank stops
  every rank with the same one-line CheckpointError; the previous checkpoint stays the
  latest, the half-written staging directory is removed, and --load resumes from it
  (old code: a traceback on the failing rank, "peer rank exited" on the others);
* Ctrl-C to torchrun while the ranks write a checkpoint: the tracker names a complete
  checkpoint, and --load resumes from it;
* a run that does not resume (no --load, or another --load) refuses a --save directory
  that holds checkpoints, before any process group exists (old code: it replaced their
  iterations and moved the tracker back to its own);
* resuming with another --seq-length says that the data does not continue.

Disk full and permission errors are injected by monkeypatching the checkpoint writer:
the tests run as root on CI, where chmod does not stop a write.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron.checkpoint_files import TRACKER, iteration_dir
from megatron.checkpoint_files import is_complete as _complete
from tests.dist_utils import free_port, run_distributed
from tests.distributed.gpt_harness import TINY

REPO = Path(__file__).resolve().parents[2]


def _argv(*extra: str, iters: int = 4) -> list:
    base = list(TINY)
    base[base.index("--train-iters") + 1] = str(iters)
    return base + ["--eval-iters", "0", *extra]


def _pretrain(argv):
    import pretrain_gpt
    from megatron.training import pretrain

    return pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                    pretrain_gpt.forward_step, argv=list(argv))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MEGATRON_DEBUG", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


# ---- disk full on one rank of two pipeline stages --------------------------------------------

def _disk_full_on_stage_1(rank: int, world: int, root: str):
    import torch
    import torch.distributed as dist

    import megatron.checkpointing as ck
    from megatron.errors import CheckpointError

    torch.set_num_threads(1)
    real = ck.save_payload

    def writer(obj, stem):
        if rank == 1 and "iter_0000004.tmp" in stem:  # the second save, on stage 1 only
            path = stem + ".safetensors"
            open(path, "wb").write(b"\0" * 100)  # what a full disk leaves behind
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(obj, stem)

    pp2 = ("--pipeline-model-parallel-size", "2", "--save", root)
    ck.save_payload = writer
    start = time.time()
    try:
        _pretrain(_argv(*pp2, "--save-interval", "2"))
        error = None
    except CheckpointError as exc:
        error = str(exc)
    finally:
        ck.save_payload = real
    seconds = time.time() - start
    dist.barrier()  # rank 0 removes the staging directory after the ranks agreed
    after_failure = sorted(os.listdir(root))
    resumed = _pretrain(_argv(*pp2, "--load", root, iters=5))
    return {"error": error, "seconds": seconds, "after_failure": after_failure,
            "resumed_at": resumed.iteration, "losses": sorted(resumed.losses)}


def test_disk_full_on_one_rank_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(
        tmp_path):
    root = str(tmp_path / "ck")
    res = run_distributed(_disk_full_on_stage_1, 2, args=(root,), timeout=120)
    for r in res:  # the same line on both stages
        msg = r["error"]
        assert msg is not None and "\n" not in msg, msg
        assert msg.startswith(f"--save {root}: could not write the checkpoint of iteration 4 "
                              f"(No space left on device: {root}/iter_0000004.tmp/mp_rank_00_001/")
        assert msg.endswith("; the checkpoint of iteration 2 stays the latest")
        assert r["seconds"] < 60  # agreed at once, not after the distributed timeout
        # the staging directory (and the space it took) is gone; iteration 2 is intact
        assert r["after_failure"] == ["iter_0000002", TRACKER]
        assert r["resumed_at"] == 5
    assert res[1]["losses"] == [3, 4, 5]  # the last stage reports the losses
    assert _complete(iteration_dir(root, 2)) and _complete(iteration_dir(root, 5))
    assert (Path(root) / TRACKER).read_text().strip() == "5"


def test_safetensors_io_error_names_the_file(tmp_path, monkeypatch):
    """safetensors reports a failed write as SafetensorError('... (os error 28)'):
    save_payload turns it into the OSError it is, with the file's name."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from megatron.checkpointing import save_payload

    def full(tensors, path):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as err:
        save_payload({"w": torch.ones(2)}, str(tmp_path / "model"))
    assert err.value.errno == errno.ENOSPC
    assert err.value.filename == str(tmp_path / "model.safetensors")


# ---- through the entry point: one line, exit 2, for each step of a save ----------------------

_FAILING_SAVE = textwrap.dedent("""
    import errno, os, sys
    import megatron.checkpointing as ck
    step = sys.argv.pop(1)
    def fail(path):
        raise OSError(errno.EACCES if step == "staging" else errno.ENOSPC,
                      os.strerror(errno.EACCES if step == "staging" else errno.ENOSPC), path)
    if step == "staging":     # --save made read-only after the first save (chmod 555)
        real_stale = ck._remove_stale
        def stale(root):
            if os.path.exists(os.path.join(root, ck.TRACKER)):
                fail(root + "/iter_0000004.tmp")
            return real_stale(root)
        ck._remove_stale = stale
    elif step == "tracker":   # the disk fills up just before the tracker is rewritten
        real_text = ck.atomic_write_text
        def text(path, content):
            if content == "4":
                fail(path + ".tmp.1")
            return real_text(path, content)
        ck.atomic_write_text = text
    import pretrain_gpt
    from megatron.entry import run_entry_point
    run_entry_point(pretrain_gpt.main)
""")


@pytest.mark.parametrize("step", ["staging", "tracker"])
def test_failed_save_is_one_error_line_and_the_tracker_stays(step, tmp_path):
    root = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-c", _FAILING_SAVE, step,
                           *_argv("--save", str(root), "--save-interval", "2")],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    reason = ("Permission denied: " + str(root / "iter_0000004.tmp") if step == "staging"
              else "No space left on device: " + str(root / TRACKER) + ".tmp.1")
    assert last == (f"error: --save {root}: could not write the checkpoint of iteration 4 "
                    f"({reason}); the checkpoint of iteration 2 stays the latest")
    assert (root / TRACKER).read_text().strip() == "2"
    assert _complete(iteration_dir(str(root), 2))
    assert not list(root.glob("*.tmp"))
    if step == "tracker":  # complete, renamed into place, but not named by the tracker
        assert _complete(iteration_dir(str(root), 4))


# ---- Ctrl-C to torchrun while the ranks write a checkpoint ------------------------------------

_SLOW_WRITER = textwrap.dedent("""
    import os, sys, time
    import megatron.checkpointing as ck
    real = ck.save_payload
    def slow(obj, stem):
        paths = real(obj, stem)
        if "iter_0000003.tmp" in stem:
            print("writing iteration 3", flush=True)
            time.sleep(60)
        return paths
    ck.save_payload = slow
    import pretrain_gpt
    from megatron.entry import run_entry_point
    run_entry_point(pretrain_gpt.main)
""")


def _torchrun(script: Path, argv, out) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", "--master-port", str(free_port()), str(script), *argv],
                            stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=REPO)


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="needs POSIX signals")
def test_ctrl_c_to_torchrun_during_a_save_leaves_a_complete_latest_checkpoint(tmp_path):
    script, log, root = tmp_path / "slow_gpt.py", tmp_path / "out.txt", tmp_path / "ck"
    script.write_text(_SLOW_WRITER)
    pp2 = ["--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo",
           "--distributed-timeout-minutes", "1", "--save", str(root)]
    with open(log, "w") as out:
        proc = _torchrun(script, _argv(*pp2, "--save-interval", "1", iters=100), out)
    try:
        deadline = time.time() + 90
        while "writing iteration 3" not in log.read_text() and proc.poll() is None \
                and time.time() < deadline:
            time.sleep(0.1)
        assert "writing iteration 3" in log.read_text(), log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the launcher
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    # the ranks print one line each (torchrun's agent prints its own traceback)
    assert "\ninterrupted\n" in text, text[-3000:]
    assert f'File "{REPO / "megatron"}' not in text, text[-3000:]
    assert (root / TRACKER).read_text().strip() == "2"
    assert _complete(iteration_dir(str(root), 2))
    assert not (root / "iter_0000003").exists()  # only its staging directory, if anything
    with open(log, "w") as out:
        resumed = _torchrun(REPO / "pretrain_gpt.py",
                            _argv(*pp2, "--load", str(root), "--log-interval", "1", iters=3), out)
        assert resumed.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert f"resumed from {root} at iteration 2" in text
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000002",
                                                      "iter_0000003", TRACKER]
    assert _complete(iteration_dir(str(root), 3))


# ---- a --save directory of another run ----------------------------------------------------

def _validate(argv):
    from megatron.arguments import parse_and_validate

    return parse_and_validate(argv, world_size=1)


def test_a_new_run_refuses_a_save_directory_holding_checkpoints(tmp_path, capsys):
    root = tmp_path / "ck"
    (root / "iter_0000004").mkdir(parents=True)
    (root / TRACKER).write_text("4")
    for extra in ([], ["--load", str(tmp_path / "other")]):
        with pytest.raises(SystemExit) as exc:
            _validate(_argv("--save", str(root), *extra))
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(
            f"error: --save {root} already holds checkpoints (1 iteration directory, the "
            f"newest iter_0000004, and {TRACKER}) and this run does not resume from them")
        assert f"pass --load {root} to continue" in err
    # resuming from it, or only evaluating, is fine
    _validate(_argv("--save", str(root), "--load", str(root) + "/"))
    _validate(_argv("--save", str(root), "--skip-train"))
    # finetuning counts from iteration 0 again: it would overwrite iterations 1..4
    with pytest.raises(SystemExit):
        _validate(_argv("--save", str(root), "--load", str(root), "--finetune"))
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(
        f"error: --finetune with --load and --save both {root}: a finetuning run counts again "
        f"from iteration 0 and would overwrite the checkpoints there (up to iteration 4)")
    imported = tmp_path / "imported"  # an imported checkpoint: iteration 0 only
    (imported / "iter_0000000").mkdir(parents=True)
    (imported / TRACKER).write_text("0")
    _validate(_argv("--save", str(imported), "--load", str(imported), "--finetune"))
    # leftovers of a first save that crashed are not checkpoints
    fresh = tmp_path / "fresh"
    (fresh / "iter_0000002.tmp").mkdir(parents=True)
    _validate(_argv("--save", str(fresh)))
    assert sorted(os.listdir(root)) == ["iter_0000004", TRACKER]


# ---- resuming with another --seq-length ------------------------------------------------------

def test_resume_with_another_seq_length_warns_that_the_data_does_not_continue(tmp_path, capsys):
    import torch

    torch.set_num_threads(1)
    root = str(tmp_path / "ck")
    _pretrain(_argv("--save", root, iters=2))
    argv = _argv("--load", root, "--save", root, iters=3)
    argv[argv.index("--seq-length") + 1] = "8"  # --max-position-embeddings stays 16
    capsys.readouterr()
    assert _pretrain(argv).iteration == 3
    out = capsys.readouterr().out
    assert ("warning: the checkpoint was trained with --seq-length 16, this run uses 8: its "
            "data position (16 consumed samples) counts samples of 16 tokens") in out
    argv = _argv("--load", root, "--save", root, iters=4)
    argv[argv.index("--seq-length") + 1] = "8"
    _pretrain(argv)  # the length the checkpoint was saved with: no warning
    assert "--seq-length" not in capsys.readouterr().out

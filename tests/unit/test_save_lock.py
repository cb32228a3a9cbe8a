"""One training run at a time per --save directory (megatron/save_lock.py): a second
run saving into a directory another live process trains into stops at start-up with one
line naming the holder; the same process may train there again; a killed holder leaves
no stale lock."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.errors import UserError
from megatron.save_lock import lock_save_dir, release_save_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0"]


def _holder(save: Path) -> subprocess.Popen:
    """Another process that holds the lock of ``save`` until killed."""
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from megatron.save_lock import lock_save_dir\n"
            "lock_save_dir(%r); print('held', flush=True); time.sleep(120)" % (str(ROOT), str(save)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    save = tmp_path / "ck"
    holder = _holder(save)
    try:
        with pytest.raises(UserError, match=rf"--save {save} is in use by another training "
                                            rf"run \((pid {holder.pid}|a live process)"):
            lock_save_dir(str(save))
    finally:
        holder.kill()
        holder.wait()
    assert lock_save_dir(str(save))  # the kernel dropped the killed holder's lock
    release_save_dir(str(save))


def test_the_same_process_may_lock_again_and_release(tmp_path):
    save = str(tmp_path / "ck")
    assert lock_save_dir(save) and lock_save_dir(save)
    assert os.listdir(save) == []  # the directory itself is locked: nothing is added
    release_save_dir(save)
    holder = _holder(tmp_path / "ck")  # released: another process takes it
    holder.kill()
    holder.wait()
    release_save_dir(save)  # nothing held: a no-op


def test_pretrain_into_a_directory_in_use_stops_at_start_up(tmp_path):
    save = tmp_path / "ck"
    holder = _holder(save)
    try:
        env = {k: v for k, v in os.environ.items() if k != "MEGATRON_DEBUG"}
        env["PYTHONPATH"] = str(ROOT)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY,
                               "--save", str(save)], capture_output=True, text=True,
                              env=env, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "is in use by another training run" in errors[0]
    if os.path.exists("/proc/locks"):
        assert f"(pid {holder.pid})" in errors[0]
    assert not list(save.glob("iter_*")) and time.monotonic() - start < 120

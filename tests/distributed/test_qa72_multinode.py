"""Multi-node launch, simulated on one machine: two torchrun agents (``--nnodes 2``, one
``--node-rank`` each) on loopback, so global and local ranks differ and there are two
"nodes" sharing one file system.

* A node whose workers never join (its torchrun was started with a mistyped flag) left
  the other node's ranks waiting --distributed-timeout-minutes and then ending in a
  ``DistStoreError: wait timeout ... keys: /default_pg/...`` traceback per rank.  Now:
  one ``error:`` line per node naming the missing rank and the flag.
* The index caches of GPT/BERT datasets were written through a temporary file named by
  the pid alone; two nodes (containers of their own give their workers the same pids)
  writing into one shared cache directory wrote the same temporary file, and the
  second writer's rename failed.
* A cache directory that cannot be written was a Python ``UserWarning`` (with its source
  line) on every rank; now one ``warning:`` line per node.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo"]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_RUN_ID")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_of_another_node_that_never_joins_is_one_line(monkeypatch):
    """Under torchrun the workers meet in their agent's store: a rank whose peer never
    writes its address there timed out with a DistStoreError traceback."""
    import torch.distributed as dist

    from megatron.arguments import parse_and_validate
    from megatron.errors import UserError
    from megatron.initialize import initialize_distributed

    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    port = _free_port()
    # the agent's store (node 0's torchrun holds it); the job's rank 1 never comes
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    _, cfg = parse_and_validate(_without_pipeline(TINY) +
                                ["--distributed-timeout-minutes", "0.02"], world_size=2)
    try:
        with pytest.raises(UserError) as info:
            initialize_distributed(cfg.parallel)
    finally:
        del store
    assert not dist.is_initialized()
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("rank 0: rank 1 of WORLD_SIZE=2 did not join"), message
    assert "--distributed-timeout-minutes 0.02" in message, message
    assert getattr(info.value, "exit_code", 2) == 1
    assert info.value.every_rank_alike  # its node's local rank 0 prints it


def _without_pipeline(argv):
    out = list(argv)
    i = out.index("--pipeline-model-parallel-size")
    del out[i:i + 2]
    return out


def _torchrun() -> str:
    exe = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    if not Path(exe).exists():
        pytest.skip("torchrun is not installed")
    return exe


def _start_node(node: int, port: int, argv, tmp_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = open(tmp_path / f"node{node}.err", "w")
    return subprocess.Popen(
        [_torchrun(), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--monitor-interval",
         "0.2", str(ROOT / "pretrain_gpt.py"), *argv],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=out,
        start_new_session=True)


def _finish(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


@pytest.mark.parametrize("typo_node", [1, 0])
def test_node_started_with_a_mistyped_flag(tmp_path, typo_node):
    """One node's torchrun has a typo: that node prints the flag error once; the other
    node's ranks stop with one line per node saying that a rank never joined (node 1's
    typo: after --distributed-timeout-minutes, naming the missing rank) or that the
    store went away (node 0's typo: its agent, which holds the store, exits), not a
    DistStoreError / DistNetworkError traceback per rank."""
    _torchrun()
    port = _free_port()
    common = TINY + ["--distributed-timeout-minutes", "0.1"]
    procs = [_start_node(node, port, common + (["--trian-iters", "2"] if node == typo_node
                                               else []), tmp_path) for node in (0, 1)]
    _finish(procs, timeout=60)
    errs = [(tmp_path / f"node{node}.err").read_text() for node in (0, 1)]
    bad, good = errs[typo_node], errs[1 - typo_node]
    flag_errors = [ln for ln in bad.splitlines() if ln.startswith("error:")]
    assert len(flag_errors) == 1 and "--trian-iters" in flag_errors[0], bad
    assert "did you mean --train-iters" in flag_errors[0], bad
    waits = [ln for ln in good.splitlines() if ln.startswith("error:")]
    assert len(waits) == 1, good
    if typo_node == 1:
        assert waits[0].startswith("error: rank 0: rank 2 of WORLD_SIZE=4 did not join the "
                                   "job within --distributed-timeout-minutes 0.1"), good
    else:
        assert waits[0].startswith("error: rank 2: "), good
        assert "node 0" in waits[0] or "rank 0 at" in waits[0], good
    for text in errs:  # (torch's own C++ warnings and torchrun's log lines aside)
        assert 'pretrain_gpt.py", line' not in text, text
        for name in ("DistStoreError", "DistNetworkError"):
            assert f"torch.distributed.{name}:" not in text, text
    assert all(p.returncode != 0 for p in procs)


def test_two_writers_with_one_pid_write_their_own_temporary_files(tmp_path, monkeypatch):
    """Two nodes' ranks with the same pid write one index file of a shared cache at once
    (here: the second writer runs in the middle of the first one's write)."""
    from megatron.data import dataset_utils

    array = np.arange(50_000, dtype=np.int64)
    target = tmp_path / "cache" / "key-train_doc_idx.npy"
    real_save = np.save
    calls = []

    def interleaved_save(f, arr, allow_pickle=False):
        calls.append(1)
        if len(calls) == 1:  # the first writer has begun; the other node writes now
            f.write(b"\x93NUMPY")
            dataset_utils.save_npy_atomic(target, arr)
            f.seek(0)
        real_save(f, arr, allow_pickle=allow_pickle)

    monkeypatch.setattr(dataset_utils.np, "save", interleaved_save)
    dataset_utils.save_npy_atomic(target, array)
    monkeypatch.setattr(dataset_utils.np, "save", real_save)
    assert len(calls) == 2
    np.testing.assert_array_equal(np.load(target), array)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    mode = target.stat().st_mode & 0o777
    mask = os.umask(0)
    os.umask(mask)
    assert mode == 0o666 & ~mask, oct(mode)


def _tiny_prefix(tmp_path: Path) -> str:
    from megatron.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "tiny_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        builder.add_item(rng.integers(0, 90, int(rng.integers(5, 30)), dtype=np.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_unwritable_cache_is_one_warning_line_per_node(tmp_path, monkeypatch, capfd,
                                                       local_rank):
    import warnings

    from megatron.data import dataset_utils
    from megatron.data.gpt_dataset import build_train_valid_test_datasets

    prefix = _tiny_prefix(tmp_path)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("RANK", str(2 + int(local_rank)))  # node 1 of a 2-node job
    monkeypatch.setattr(dataset_utils, "_UNWRITABLE_CACHES", set(), raising=False)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Python warning (its source line) any more
        datasets = build_train_valid_test_datasets(
            [prefix], "80,10,10", [20, 4, 4], 8, 1234, data_cache_path=str(blocker / "c"))
    assert all(ds is not None for ds in datasets)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if local_rank == "0":
        assert len(lines) == 1 and lines[0].startswith(
            f"warning: could not cache dataset indices in {blocker / 'c'}"), err
    else:
        assert lines == [], err


@pytest.mark.parametrize("local_rank", [None, "1"])
def test_store_closed_is_one_line_and_left_to_local_rank_0_only_under_torchrun(
        monkeypatch, local_rank):
    """A hand launch (no LOCAL_RANK) counts RANK 0 as the printing rank, and rank 0 is the
    store's holder that went away: there every rank prints its own line."""
    from megatron.initialize import DistributedEnv, _rendezvous_error

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    exc = RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed. Did the "
                       "remote server shutdown or crash?\nException raised from recvBytes")
    err = _rendezvous_error(exc, DistributedEnv(rank=3, world_size=4, local_rank=1), 0.5)
    assert err is not None and err.exit_code == 1
    assert str(err).startswith("rank 3: the rendezvous store at MASTER_ADDR:MASTER_PORT "
                               "127.0.0.1:29500 closed before every rank joined"), str(err)
    assert err.every_rank_alike == (local_rank is not None)

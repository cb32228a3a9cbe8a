"""How a run reads its launcher's environment: a partial or inconsistent set of torchrun's
variables is one ``error:`` line naming the variable, before any process group exists
(no rank waits for a peer that will never come, no silent world-size-1 run)."""
from __future__ import annotations

import socket

import pytest
import torch.distributed

from megatron.arguments import parse_and_validate

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3"]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK")


@pytest.fixture
def launch_env(monkeypatch):
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)

    def set_env(**env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    return set_env


def one_error_line(capsys, argv=TINY) -> str:
    """The launch check's error, before any process group: one line naming the variable."""
    from megatron.errors import UserError
    from megatron.initialize import initialize_distributed

    args, cfg = parse_and_validate(list(argv))
    with pytest.raises(UserError) as info:
        initialize_distributed(cfg.parallel)
    assert not torch.distributed.is_initialized()
    message = str(info.value)
    assert "\n" not in message
    return "error: " + message


def test_rank_without_world_size_is_not_a_silent_single_process_run(launch_env, capsys):
    launch_env(RANK="1", LOCAL_RANK="0")  # LOCAL_RANK 0: this process prints the line
    line = one_error_line(capsys)
    assert "RANK=1" in line and "WORLD_SIZE" in line


def test_world_size_without_rank_does_not_wait_as_rank_0(launch_env, capsys):
    launch_env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    line = one_error_line(capsys)
    assert "WORLD_SIZE=2" in line and "RANK is not set" in line


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT"])
def test_missing_master_address_is_one_line_before_any_wait(launch_env, capsys, missing):
    env = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    del env[missing]
    launch_env(**env)
    line = one_error_line(capsys)
    assert f"{missing} is not set" in line and "torchrun" in line


@pytest.mark.parametrize("env, words", [
    (dict(RANK="2", WORLD_SIZE="2"), "RANK=2"),
    (dict(RANK="-1", WORLD_SIZE="2"), "RANK=-1"),
    (dict(RANK="zero", WORLD_SIZE="2"), "RANK must be an integer"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="x"), "LOCAL_RANK must be an integer"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="http"), "MASTER_PORT must be"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_PORT="70000"), "MASTER_PORT must be"),
])
def test_bad_launch_variables_are_named(launch_env, capsys, env, words):
    full = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", LOCAL_RANK="0")
    full.update(env)
    launch_env(**full)
    line = one_error_line(capsys)
    assert words in line


def test_plain_python_and_rank_zero_alone_still_run_as_one_process(launch_env):
    args, cfg = parse_and_validate(list(TINY))
    assert cfg.parallel.world_size == 1
    launch_env(RANK="0")
    args, cfg = parse_and_validate(list(TINY))
    assert cfg.parallel.world_size == 1


def test_port_in_use_is_one_line_naming_master_port(launch_env):
    """Rank 0 cannot listen on MASTER_PORT: one error naming it, not a DistNetworkError
    traceback."""
    from megatron.errors import UserError
    from megatron.initialize import initialize_distributed

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launch_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        args, cfg = parse_and_validate(list(TINY))
        cfg.parallel.distributed_timeout_minutes = 0.05
        with pytest.raises(UserError) as info:
            initialize_distributed(cfg.parallel)
    message = str(info.value)
    assert f"MASTER_PORT={port}" in message and "in use" in message and "\n" not in message


def test_peer_that_never_joins_is_one_line_naming_the_timeout(launch_env):
    """Rank 1 of 2 whose rank 0 never starts: after --distributed-timeout-minutes, one
    error naming MASTER_ADDR:MASTER_PORT and the flag, not a DistNetworkError traceback."""
    from megatron.errors import UserError
    from megatron.initialize import initialize_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once this closes
    launch_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args, cfg = parse_and_validate(list(TINY) + ["--distributed-timeout-minutes", "0.03"])
    with pytest.raises(UserError) as info:
        initialize_distributed(cfg.parallel)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "--distributed-timeout-minutes" in message
    assert "\n" not in message and getattr(info.value, "exit_code", 2) == 1


def test_rank_0_whose_peers_never_join_is_one_line(launch_env):
    from megatron.errors import UserError
    from megatron.initialize import initialize_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args, cfg = parse_and_validate(list(TINY) + ["--distributed-timeout-minutes", "0.03"])
    with pytest.raises(UserError) as info:
        initialize_distributed(cfg.parallel)
    message = str(info.value)
    assert "1 of WORLD_SIZE=2" in message and "--distributed-timeout-minutes" in message
    assert "\n" not in message


def test_entry_point_prints_a_bad_rank_on_that_rank(tmp_path):
    """End to end: ``RANK=1 python pretrain_gpt.py`` (WORLD_SIZE forgotten) trained alone
    as a world of one; now it exits 2 with one line, printed by that rank although it is
    not rank 0, and without a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(RANK="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "pretrain_gpt.py"), *TINY], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: RANK=1 is outside the world of 1 rank(s)"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "iteration" not in proc.stdout

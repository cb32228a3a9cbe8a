"""torch.distributed set-up from torchrun's environment, seeds and device choice.

Everything that can fail because of the user's input (flags, files) is checked by
``megatron.arguments`` before this module creates any process group, so no rank
ever waits on a peer that has already exited with an argument error.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.config import ParallelConfig
from megatron.errors import UserError
from megatron.parallel_state import ParallelGroups, RankLayout


@dataclass
class DistributedEnv:
    """What torchrun (or a test harness) told this process about the world."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> "DistributedEnv":
        return cls(rank=int(os.environ.get("RANK", "0")),
                   world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))


LAUNCH_HINT = "launch with torchrun (e.g. torchrun --nproc-per-node 4 pretrain_gpt.py ...)"


def check_launch_environment(environ=None, group_exists: bool = False) -> int:
    """The world size torchrun's variables describe; raises ``ArgumentError`` naming the
    variable where they are partial or inconsistent.  Pure (reads ``environ``, default
    ``os.environ``), so every rank runs it before any process group exists.

    No variable at all is one process (``python pretrain_gpt.py``), and so is RANK=0
    alone.  Otherwise RANK must lie in [0, WORLD_SIZE): a RANK without WORLD_SIZE used to
    train alone as a world of 1, and a WORLD_SIZE without RANK waited as rank 0 for
    --distributed-timeout-minutes.  A world of more than one rank needs MASTER_ADDR and
    MASTER_PORT, unless a process group already exists (``group_exists``: a test harness
    or an embedding program made it, and its own rendezvous is done)."""
    from megatron.argument_checks.errors import ArgumentError

    env = os.environ if environ is None else environ

    def own(err: ArgumentError) -> ArgumentError:
        # this rank's own RANK / LOCAL_RANK: it prints the line itself (its node's local
        # rank 0 may have valid values, and a bad LOCAL_RANK cannot say which rank that is)
        err.every_rank_alike = False
        return err

    def integer(key: str, default: str) -> int:
        raw = env.get(key, default)
        try:
            return int(raw)
        except ValueError:
            err = ArgumentError(f"environment variable {key} must be an integer, got '{raw}'")
            raise (own(err) if key in ("RANK", "LOCAL_RANK") else err) from None

    world = integer("WORLD_SIZE", "1")
    if world < 1:
        raise ArgumentError(f"environment variable WORLD_SIZE must be a positive integer, "
                            f"got {world}")
    if group_exists:
        return world
    integer("LOCAL_RANK", "0")
    if world > 1 and "RANK" not in env:
        raise ArgumentError(f"WORLD_SIZE={world} but RANK is not set: every process of a "
                            f"job needs its own RANK in [0, {world}); {LAUNCH_HINT}")
    rank = integer("RANK", "0")
    if not 0 <= rank < world:
        where = (f"WORLD_SIZE={world}" if "WORLD_SIZE" in env
                 else "WORLD_SIZE is not set, so the world is this one process")
        raise own(ArgumentError(
            f"RANK={rank} is outside the world of {world} rank(s) ({where}); set WORLD_SIZE "
            f"to the number of processes of the job and RANK in [0, WORLD_SIZE) on each, or "
            f"neither for one process; {LAUNCH_HINT}"))
    if world > 1:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(key, "").strip():
                raise ArgumentError(f"WORLD_SIZE={world} but {key} is not set (the address "
                                    f"and port of rank 0, the same on every rank); "
                                    f"{LAUNCH_HINT}")
        port = env["MASTER_PORT"].strip()
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ArgumentError(f"environment variable MASTER_PORT must be a TCP port "
                                f"number in [1, 65535], got '{port}'")
    return world


class LaunchError(UserError):
    """The ranks could not meet: rank 0's port is taken, or a peer never joined."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


_STORE_CLOSED = ("Connection was likely closed", "Connection reset by peer", "Broken pipe")
"""How a TCPStore client's wait reports that the store's host went away."""


def _rendezvous_error(exc: BaseException, env: "DistributedEnv",
                      timeout_minutes: float) -> Optional[LaunchError]:
    """``init_process_group``'s store errors as one line naming the variables and the
    flag, or None for an error this does not recognise (kept with its traceback)."""
    text = " ".join(str(exc).split())
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return LaunchError(
            f"MASTER_PORT={os.environ.get('MASTER_PORT')} is already in use on this machine "
            f"(rank 0 listens there for its peers; another job, or a previous run still "
            f"exiting, holds it): choose a free port (torchrun --master-port) for every "
            f"rank", exit_code=2)
    if "waiting for clients" in text:
        joined = text.split("waiting for clients.", 1)[1].split("clients joined", 1)[0].strip()
        count = joined.split("/", 1)[0].strip() if "/" in joined else "fewer"
        return LaunchError(
            f"rank {env.rank}: only {count} of WORLD_SIZE={env.world_size} ranks joined at "
            f"{where} within --distributed-timeout-minutes {timeout_minutes:g}: a rank did "
            f"not start, failed before joining, or was given another MASTER_ADDR, "
            f"MASTER_PORT or WORLD_SIZE (see its own log)", exit_code=1)
    if "wait timeout" in text.lower() and "keys:" in text:
        # the store is up (torchrun's agent holds it, or rank 0 does) but a rank never
        # wrote its address there: under torchrun, another node whose workers failed
        # before joining (a mistyped flag on that node) or never started
        missing = _rank_of_store_key(text.split("keys:", 1)[1])
        who = f"rank {missing}" if missing is not None else "a peer rank"
        err = LaunchError(
            f"rank {env.rank}: {who} of WORLD_SIZE={env.world_size} did not join the job "
            f"within --distributed-timeout-minutes {timeout_minutes:g} ({where}): its "
            f"node's torchrun did not start, or its workers failed before joining (a bad "
            f"flag or file on that node: see that node's own error line), or it was given "
            f"another --nnodes, --nproc-per-node or master address", exit_code=1)
        # every waiting rank of a node meets it at the same moment: one line per node
        err.every_rank_alike = _launcher_numbers_local_ranks()
        return err
    if any(words in text for words in _STORE_CLOSED):
        # the store's host exited while this rank waited in it: under torchrun node 0's
        # agent, which exits as soon as its own workers fail (a mistyped flag on node 0,
        # the --save directory in use)
        err = LaunchError(
            f"rank {env.rank}: the rendezvous store at {where} closed before every rank "
            f"joined: the process holding it exited (under torchrun, node 0's agent, "
            f"which stops when its own workers fail: see node 0's own error line)",
            exit_code=1)
        err.every_rank_alike = _launcher_numbers_local_ranks()
        return err
    if "timed out" in text.lower() and ("connect" in text.lower() or "client" in text.lower()):
        return LaunchError(
            f"rank {env.rank}: could not reach rank 0 at {where} within "
            f"--distributed-timeout-minutes {timeout_minutes:g}: rank 0 did not start, "
            f"failed before listening, or runs with another MASTER_ADDR / MASTER_PORT "
            f"(see its own log)", exit_code=1)
    return None


def _launcher_numbers_local_ranks() -> bool:
    """LOCAL_RANK is set (torchrun): an error every rank of a node meets may be left to
    its local rank 0.  A hand launch without it counts RANK 0 as that rank, which may be
    the very rank that is missing, so there every rank prints its own line."""
    return "LOCAL_RANK" in os.environ


def _rank_of_store_key(keys: str) -> Optional[int]:
    """The rank a gloo rendezvous key names (its last path component, as in
    ``/default_pg/0//cpu//0/2``: the address of rank 2, which rank 0 waited for), or None
    when the text holds no such key (another backend's keys name no rank this way)."""
    first = keys.strip().split(",")[0].strip().strip("[]").strip()
    last = first.rsplit("/", 1)[-1]
    return int(last) if "/cpu/" in first and last.isdigit() else None


def check_same_command_line(mine: Optional[Dict[str, object]]) -> None:
    """Every rank of the default process group ran the same command line (``mine``: this
    rank's ``megatron.arguments.command_line_values``, None to skip).  Two nodes started
    with different flags trained silently and inconsistently before: another --seed gave
    the replicas other weights, another --num-layers another stage split.  One
    all-gather of a few kilobytes; every rank raises the same one-line ``UserError``
    naming the flags that differ and which ranks had which value.  Runs before any
    other group is built, so no rank waits in a group its peers do not create."""
    if mine is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    everyone: List[Optional[Dict[str, object]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    message = command_line_difference(everyone)
    if message is not None:
        from megatron.errors import alike_on_every_rank

        raise alike_on_every_rank(UserError(message))


def _rank_ranges(ranks: List[int]) -> str:
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def command_line_difference(everyone: List[Optional[Dict[str, object]]],
                            shown: int = 4) -> Optional[str]:
    """One line naming the flags whose values differ between ranks, or None.

    Each entry: {"values": {name: repr of its value}, "given": [flags on the command
    line]}.  Flags given on some rank's command line come first; values derived from
    them (a stage split, a batch count) only when no given flag differs."""
    values = [e["values"] for e in everyone]  # type: ignore[index]
    given = set().union(*(e["given"] for e in everyone))  # type: ignore[index]
    names = sorted(set().union(*values))
    differ = [n for n in names if len({v.get(n, "<absent>") for v in values}) > 1]
    if not differ:
        return None
    flags = [n for n in differ if n in given] or differ
    parts = []
    for name in flags[:shown]:
        by_value: Dict[str, List[int]] = {}
        for rank, v in enumerate(values):
            by_value.setdefault(str(v.get(name, "<absent>")), []).append(rank)
        shown_values = [f"{_short(value)} on {_rank_ranges(ranks)}"
                        for value, ranks in sorted(by_value.items(), key=lambda kv: kv[1][0])]
        parts.append(f"{name} is " + " and ".join(shown_values))
    more = len(flags) - shown
    return ("the ranks of this job were started with different command lines (every rank "
            "needs the same flags: start each node's torchrun with the same command): "
            + "; ".join(parts) + (f"; and {more} more" if more > 0 else ""))


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[:limit - 3] + "..."


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def resolve_backend(requested: Optional[str], existing: Optional[str]) -> str:
    """The backend this rank uses: an already created process group's (a test harness
    or an embedding program made it) wins over the flag, the flag over the default."""
    if existing is not None:
        return existing
    return requested or default_backend()


def select_device(backend: str, local_rank: int, cuda_available: bool,
                  device_count: int) -> torch.device:
    """Where this rank keeps its tensors.  Pure: the caller passes what torch.cuda says.

    gloo ranks always use the CPU, even where CUDA is visible: gloo cannot send CUDA
    tensors (it fails with ``writev ... Bad address``), and a CPU run should not depend
    on whether a GPU happens to be installed.  nccl ranks use GPU ``local_rank``.
    """
    if backend != "nccl":
        return torch.device("cpu")
    if not cuda_available or device_count < 1:
        raise RuntimeError("--distributed-backend nccl needs CUDA, but no GPU is visible")
    return torch.device("cuda", local_rank % device_count)


def check_gpus_for_local_ranks(backend: str, local_world_size: int, device_count: int) -> None:
    """nccl needs one GPU per local rank: two ranks on one GPU die inside NCCL with
    'Duplicate GPU detected' on every rank.  Raise one readable line before any process
    group exists instead."""
    if backend != "nccl" or local_world_size <= device_count:
        return
    from megatron.arguments import ArgumentError

    raise ArgumentError(
        f"--distributed-backend nccl needs one GPU per local rank: torchrun started "
        f"{local_world_size} ranks on this node (LOCAL_WORLD_SIZE) but {device_count} GPU(s) "
        f"are visible; start at most {device_count} rank(s) per node (--nproc-per-node "
        f"{max(device_count, 1)}) or use --distributed-backend gloo (CPU)")


def device_for(local_rank: int, backend: str) -> torch.device:
    device = select_device(backend, local_rank, torch.cuda.is_available(),
                           torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def initialize_distributed(parallel: ParallelConfig) -> tuple[ParallelGroups, torch.device]:
    """Create the default process group (if the world has more than one rank, or one
    was already created by a test harness) and every parallel group from the layout.

    The timeout bounds every collective and p2p wait: a rank whose peer died raises
    instead of hanging forever.  It bounds the rendezvous of a hand-made launch too
    (torchrun's agents meet before the workers start, under torchrun's own
    ``--rdzv-conf timeout=``).

    Before any wait: torchrun's variables must make a whole launch
    (``check_launch_environment``).  Then: rank 0's port taken or a peer that never
    joins is one ``LaunchError`` line, and every rank checks that all ran the same
    command line (``check_same_command_line``) before the parallel groups are built.
    """
    check_launch_environment(group_exists=dist.is_initialized())
    env = DistributedEnv.from_environ()
    existing = dist.get_backend() if dist.is_initialized() else None
    backend = resolve_backend(parallel.distributed_backend, existing)
    device = device_for(env.local_rank, backend)
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized() and env.world_size > 1:
        kwargs = dict(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        if backend == "nccl":
            kwargs["device_id"] = device
        try:
            dist.init_process_group(**kwargs)
        except dist.DistError as exc:
            err = _rendezvous_error(exc, env, parallel.distributed_timeout_minutes)
            if err is None:
                raise
            raise err from exc
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    if world != parallel.world_size:
        raise RuntimeError(f"the process group has {world} ranks but the configuration was "
                           f"validated for {parallel.world_size}")
    check_same_command_line(parallel.command_line)
    layout = RankLayout(world_size=world, tensor=parallel.tensor_model_parallel_size,
                        pipeline=parallel.pipeline_model_parallel_size)
    groups = ParallelGroups.build(layout, rank)
    return groups, device


def set_random_seed(seed: int, groups: ParallelGroups, device: torch.device,
                    data_parallel_random_init: bool = False) -> None:
    """Seed python, numpy and torch as Megatron-LM does: pipeline stage p adds 100 p
    (its layers differ, so its dropout streams should too); data-parallel replica r
    adds 10 r only under ``--data-parallel-random-init``, so by default every replica
    draws the same dropout masks (for other data).  Tensor-parallel ranks share the
    default stream and use the model-parallel tracker inside partitioned regions.
    Weights do not depend on any of this (see megatron.tensor_parallel.param_init):
    they are identical on every replica either way."""
    from megatron.tensor_parallel.random import model_parallel_seed

    stage_seed = seed + 100 * groups.pp_rank
    if data_parallel_random_init:
        stage_seed += 10 * groups.dp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed % (2 ** 32))
    torch.manual_seed(stage_seed)
    model_parallel_seed(stage_seed, groups.tp_rank, device)


def barrier_with_message(what: str) -> None:
    """A barrier whose failure names what the ranks were waiting for."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise RuntimeError(f"rank {dist.get_rank()}: a peer rank did not reach '{what}' "
                           "(it probably failed; see its log)") from exc


PARENT_CHECK_ENV = "MEGATRON_EXIT_WITH_PARENT"
"""1: always exit when the parent process dies; 0: never; unset: only under torchrun."""


def exit_when_parent_dies(poll_seconds: float = 1.0) -> bool:
    """Kill this worker when the process that started it (torchrun's agent) dies.

    Without it a ``kill -9`` of the agent leaves the workers training (and saving) as
    orphans.  Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, delivered by the kernel the
    moment the parent exits; elsewhere a daemon thread notices ``os.getppid()`` change
    within ``poll_seconds``.  SIGKILL, not SIGTERM: the peers are dying as well, so a
    --exit-signal-handler save could only hang.

    Only under torchrun (TORCHELASTIC_RUN_ID is set) unless MEGATRON_EXIT_WITH_PARENT
    says otherwise: a plain ``nohup python pretrain_gpt.py &`` must survive its shell.
    Returns whether the check is active.
    """
    wanted = os.environ.get(PARENT_CHECK_ENV)
    if wanted is None:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return False
    elif wanted.strip() in ("", "0"):
        return False
    parent = os.getppid()
    if not _set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent, poll_seconds),
                         name="parent-death-check", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the check was armed
        _die_orphaned()
    return True


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MALLOC_MMAP_THRESHOLD = 32 * 2 ** 20
"""Host allocations below this come from the heap (glibc's largest allowed on 64-bit)."""
MALLOC_TRIM_THRESHOLD = 2 ** 30
"""Free heap memory glibc keeps for reuse instead of giving it back to the OS."""


def tune_host_malloc() -> bool:
    """Ask glibc's malloc to keep freed memory for the next microbatch.

    With glibc's defaults a CPU training step hands the activation memory of every
    microbatch back to the OS (heap trimming, and mmap for blocks over its adaptive
    threshold) and faults it in again on the next one: measured on this project's
    2-core CPU, 340-470 minor page faults and 0.6-0.8 ms of system time per forward of
    the planner-validation GPT (4 x 128, b = 4), and the forward's CPU time 10-13%
    above the same stage timed on its own.  With the thresholds above, none.  Process-
    wide, not undone; returns False (and changes nothing) where the C library is not
    glibc.  ``--no-host-malloc-tuning`` leaves glibc's defaults."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's malloc has no mallopt
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD))


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        return libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, poll_seconds: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_seconds)
    _die_orphaned()


def _die_orphaned() -> None:
    print(f"[pid {os.getpid()}] the launching process (torchrun agent) died; exiting",
          file=sys.stderr, flush=True)
    os._exit(1)


def half_matmul_slowdown(dtype: torch.dtype, size: int = 128, reps: int = 5) -> float:
    """Time of a ``size``-cube matmul in ``dtype`` over the same in float32, on this CPU.

    CPUs without native half-precision kernels (no AVX512-FP16 / AMX) run float16 matmuls
    through slow fallbacks: the issue measured a 4-layer hidden-64 GPT at 4.4 s per
    iteration in fp16 against 10 ms in fp32.  Others (AMX Xeons) are as fast as fp32.
    So the warning measures the machine it runs on (a few milliseconds) instead of
    quoting a number from elsewhere."""
    import time

    def best(dt: torch.dtype) -> float:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=gen).to(dt)
        b = torch.randn(size, size, generator=gen).to(dt)
        torch.mm(a, b)  # first call: kernel selection, not timed
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(dtype) / max(best(torch.float32), 1e-9)


def precision_warning(params_dtype: torch.dtype, device: torch.device,
                      slowdown: Optional[float]) -> Optional[str]:
    """One line warning about low-precision weights on a CPU, or None.

    ``--fp16`` on a CPU always warns (its loss scaling buys nothing there, and float16
    is slow on many CPUs); ``--bf16`` warns only where it measured more than 2x slower
    than float32.  ``slowdown``: ``half_matmul_slowdown(params_dtype)``."""
    if device.type != "cpu" or params_dtype not in (torch.float16, torch.bfloat16):
        return None
    flag = "--fp16" if params_dtype == torch.float16 else "--bf16"
    cost = (f"a {'float16' if flag == '--fp16' else 'bfloat16'} matmul takes "
            f"{slowdown:.1f}x the time of float32 on this CPU" if slowdown is not None
            else "half precision is slow on many CPUs")
    if flag == "--bf16" and (slowdown is None or slowdown <= 2.0):
        return None
    return (f"warning: {flag} on a CPU device: {cost} (bench/cpu_precision.py times a "
            f"whole training step); drop {flag} (float32) for CPU runs, or train on a GPU")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy of a batch tensor that does not stall the CPU.

    On CUDA the source is pinned (the DataLoader's pin_memory already did that, else it
    is pinned here through torch's caching host allocator) and copied with
    ``non_blocking=True``: the CPU goes on launching the forward while the copy runs,
    and stream ordering keeps the kernels after it.  Pageable copies were 6 % of an
    H100's time on GPT-345M.  On the CPU it is a no-op (same tensor, no copy)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    if tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)

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
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.config import ParallelConfig
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
    instead of hanging forever.
    """
    env = DistributedEnv.from_environ()
    existing = dist.get_backend() if dist.is_initialized() else None
    backend = resolve_backend(parallel.distributed_backend, existing)
    device = device_for(env.local_rank, backend)
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized() and env.world_size > 1:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise RuntimeError(f"WORLD_SIZE={env.world_size} but {key} is not set: launch with "
                                   "torchrun (e.g. torchrun --nproc-per-node 4 pretrain_gpt.py ...)")
        kwargs = dict(backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    if world != parallel.world_size:
        raise RuntimeError(f"the process group has {world} ranks but the configuration was "
                           f"validated for {parallel.world_size}")
    layout = RankLayout(world_size=world, tensor=parallel.tensor_model_parallel_size,
                        pipeline=parallel.pipeline_model_parallel_size)
    groups = ParallelGroups.build(layout, rank)
    return groups, device


def set_random_seed(seed: int, groups: ParallelGroups, device: torch.device) -> None:
    """Seed python, numpy and torch.  Pipeline stages get different seeds (their layers
    are different, so their dropout streams should be too); data-parallel replicas get
    different seeds as well; tensor-parallel ranks share the default stream and use the
    model-parallel tracker for dropout inside partitioned regions."""
    from megatron.tensor_parallel.random import model_parallel_seed

    stage_seed = seed + 100 * groups.pp_rank + 10 * groups.dp_rank
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

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


def device_for(local_rank: int, backend: str) -> torch.device:
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("--distributed-backend nccl needs CUDA, but no GPU is visible")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_distributed(parallel: ParallelConfig) -> tuple[ParallelGroups, torch.device]:
    """Create the default process group (if the world has more than one rank, or one
    was already created by a test harness) and every parallel group from the layout.

    The timeout bounds every collective and p2p wait: a rank whose peer died raises
    instead of hanging forever.
    """
    env = DistributedEnv.from_environ()
    backend = parallel.distributed_backend or default_backend()
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

"""Spawn N gloo ranks on CPU for multi-rank tests.

    results = run_distributed(fn, world_size=4, args=(cfg,))

``fn(rank, world_size, *args)`` runs in a fresh process with torch.distributed already
initialised (gloo, free localhost port); its return value (picklable) comes back in the
list ``results`` indexed by rank.  An exception on any rank fails the test with that
rank's traceback; a rank that does not finish within ``timeout`` seconds fails it too,
so a deadlock never hangs the suite, and a rank process that dies without reporting
(killed, or unable to start) fails it within seconds.

Inside ``with forked_ranks():`` the ranks fork from a server process instead (see there).
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any],
            queue, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        # plain pickle: tensors travel by value, not as shared-memory handles that die
        # with this process
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


_start = {"context": mp.get_context("spawn"), "timeout_cap": math.inf}


@contextlib.contextmanager
def forked_ranks(timeout_cap: float = 300.0):
    """Inside, the ranks of ``run_distributed`` fork from a server process that has imported
    torch and its compiler (torch.optim imports it) instead of each starting a fresh
    interpreter, which spends ~4 s of CPU on those imports: most of a bench's quick or
    smoke run, which calls this module from its own process.  Each rank is still a new
    process of its own.  ``timeout_cap`` bounds every call's timeout, so a run that hangs
    fails in minutes, not at the limit a bench sets for its full runs (hours)."""
    forkserver = mp.get_context("forkserver")
    forkserver.set_forkserver_preload(["torch", "torch._dynamo"])
    saved = dict(_start)
    _start.update(context=forkserver, timeout_cap=timeout_cap)
    try:
        yield
    finally:
        _start.update(saved)


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (),
                    timeout: float = 120.0) -> List[Any]:
    ctx = _start["context"]
    timeout = min(timeout, _start["timeout_cap"])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, tuple(args), queue, timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    reported: List[int] = []
    errors = []
    deadline = time.monotonic() + timeout + 30
    dead_since: Optional[float] = None
    errors_at = 0.0
    try:
        while len(reported) < world_size:
            try:
                rank, ok, out = queue.get(timeout=1.0)
            except queue_mod.Empty:
                now = time.monotonic()
                # a rank that exited without reporting (killed, or died while
                # unpickling its function at start-up) never will: give its message,
                # if any, a moment to arrive through the queue, then stop waiting
                dead = [r for r, p in enumerate(procs)
                        if r not in reported and p.exitcode is not None]
                if dead:
                    dead_since = dead_since or now
                    if now - dead_since > 5.0:
                        errors += [f"--- rank {r} ---\nexited with code {procs[r].exitcode} "
                                   f"without reporting a result" for r in dead]
                        break
                if errors and now - errors_at > 20.0:
                    break  # the others are probably stuck waiting for the failed rank
                if now > deadline:
                    if errors:
                        break
                    raise RuntimeError(f"a rank did not report within {timeout + 30:.0f}s "
                                       f"(deadlock or crash); ranks reported so far: "
                                       f"{reported}") from None
                continue
            reported.append(rank)
            if ok:
                results[rank] = pickle.loads(out)
            else:
                if not errors:
                    errors_at = time.monotonic()
                errors.append(f"--- rank {rank} ---\n{out}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return results

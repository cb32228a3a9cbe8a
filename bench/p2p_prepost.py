"""Receives posted ahead of their action against posted when needed (gloo, CPU ranks).

    PYTHONPATH=. python bench/p2p_prepost.py [--quick] [--reps 6] [--runs 2bw:2 flush:2 2bw:4]

gloo sends a message's payload only after the receiver has posted its buffer, so a
receive posted when its action runs waits a round trip between the two processes' I/O
threads.  ``megatron.pipeline.p2p.P2PCommunicator(prepost_receives=True)`` posts each
channel's next receive just before it waits on the one before it; the engine does so by
default on gloo when the node has a core per compute thread (``prepost_pays``).  This
bench measures three modes side by side: posted when needed, posted ahead, and posted
ahead but each next receive only once the wait on the one before it returned (how
session 8 posted them; ``P2PCommunicator.post_next_before_wait = False``):

(a) two ranks alone: rank 0 sends a [2, 64, 128] fp32 message (64 KiB) every 1 ms of
    compute, rank 1 computes 3 ms between receives; the mean and median time rank 1
    waits in a receive, the runs of the modes interleaved;
(b) the small GPT of ``bench/pipeline_breakdown.py`` (hidden 128, m=8, one thread per
    rank) under each ``schedule:d`` of ``--runs``, traced: the batch period on stage 0
    (median over the steady batches of a run, median over ``--reps`` interleaved runs)
    and the time stage 1 spends in receives, per mode.  At d=4 the four ranks share this
    machine's two cores, the case ``prepost_pays`` turns it off for.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, median, write_results  # noqa: E402

MODES = ("posted when needed", "posted ahead", "posted ahead, after the wait")
"""The third: each next receive posted just after the wait on the one before it returned
(session 8's way, ``P2PCommunicator.post_next_before_wait = False``); the engine posts
it just before that wait."""
KEYS = {"posted when needed": "when_needed", "posted ahead": "ahead",
        "posted ahead, after the wait": "ahead_after_wait"}


@contextlib.contextmanager
def receive_mode(mode: str):
    """The engine's receives posted ``mode`` while inside."""
    from bench.pipeline_schedules import receives_on_demand
    from megatron.pipeline.p2p import P2PCommunicator

    before = P2PCommunicator.post_next_before_wait
    P2PCommunicator.post_next_before_wait = mode != "posted ahead, after the wait"
    try:
        with receives_on_demand(mode == "posted when needed"):
            yield
    finally:
        P2PCommunicator.post_next_before_wait = before
SHAPE = (2, 64, 128)


def _compute(seconds: float) -> None:
    import torch

    end = time.perf_counter() + seconds
    a = torch.randn(64, 64)
    while time.perf_counter() < end:
        a = (a @ a) * 1e-4


def _latency_worker(rank: int, world: int, messages: int, reps: int) -> Dict[str, List[float]]:
    """Per mode, rank 1's mean receive wait of each run (seconds)."""
    import torch
    import torch.distributed as dist

    from megatron.pipeline.p2p import P2PCommunicator

    out: Dict[str, List[float]] = {m: [] for m in MODES}
    medians: Dict[str, List[float]] = {m: [] for m in MODES}
    for rep in range(reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            p2p = P2PCommunicator(None if rank == 0 else 0, 1 if rank == 0 else None, SHAPE,
                                  torch.float32, torch.device("cpu"),
                                  prepost_receives=mode != "posted when needed")
            p2p.post_next_before_wait = mode == "posted ahead"
            dist.barrier()
            if rank == 0:
                p2p.expect_receives(0, 0)
                for i in range(messages):
                    _compute(0.001)
                    p2p.send_forward(torch.full(SHAPE, float(i)))
                p2p.wait_all()
            else:
                p2p.expect_receives(messages, 0)
                waits = []
                for i in range(messages):
                    _compute(0.003)
                    start = time.perf_counter()
                    msg = p2p.recv_forward()
                    waits.append(time.perf_counter() - start)
                    if msg[0, 0, 0].item() != i:
                        raise RuntimeError(f"message {i} arrived as {msg[0, 0, 0].item()}")
                out[mode].append(statistics.fmean(waits))
                medians[mode].append(statistics.median(waits))
    return {"mean": out, "median": medians}


def _gpt_worker(rank: int, world: int, runs: List[Dict[str, Any]]) -> None:
    import pretrain_gpt
    from megatron.training import pretrain

    for run in runs:
        with contextlib.redirect_stdout(io.StringIO()), receive_mode(run["mode"]):
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                     pretrain_gpt.forward_step, argv=run["argv"])


def bench_gpt(schedule: str, d: int, reps: int, quick: bool) -> Dict[str, Any]:
    from bench.pipeline_breakdown import analyse, gpt_argv
    from tests.dist_utils import run_distributed

    m = 4 if quick else 8
    iters = 6 if quick else 10
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for rep in range(reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                trace = f"{tmp}/{rep}_{MODES.index(mode)}.json"
                runs.append({"mode": mode, "trace": trace,
                             "argv": gpt_argv(schedule, d, quick, iters, trace)})
        run_distributed(_gpt_worker, d, args=(runs,), timeout=1200)
        per: Dict[str, Dict[str, List[float]]] = {m_: {"period": [], "recv": []} for m_ in MODES}
        for run in runs:
            a = analyse(run["trace"][:-5] + "_rank{rank}.json", d, m, 2)
            per[run["mode"]]["period"].append(a["period_s"])
            per[run["mode"]]["recv"].append(a["stages"][1]["recv_wait_ms"] / 1e3)
    row: Dict[str, Any] = {"schedule": schedule, "d": d, "m": m, "reps": reps}
    for mode in MODES:
        key = KEYS[mode]
        row[f"period_s_{key}"] = median(per[mode]["period"])
        row[f"periods_s_{key}"] = per[mode]["period"]
        row[f"stage1_recv_wait_s_{key}"] = median(per[mode]["recv"])
    row["speedup_ahead"] = row["period_s_when_needed"] / row["period_s_ahead"]
    row["speedup_ahead_after_wait"] = (row["period_s_when_needed"]
                                       / row["period_s_ahead_after_wait"])
    return row


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    from tests.dist_utils import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs (tests)")
    p.add_argument("--reps", type=int, default=None, help="interleaved runs per mode "
                   "(default 6, quick 1)")
    p.add_argument("--runs", nargs="+", default=None,
                   help="schedule:d pairs for part (b) (default 2bw:2 flush:2 2bw:4; "
                        "quick 2bw:2)")
    p.add_argument("--out-dir", default=None, help="where to write p2p_prepost.json")
    args = p.parse_args(argv)
    reps = args.reps or (1 if args.quick else 6)
    pairs = args.runs or (["2bw:2"] if args.quick else ["2bw:2", "flush:2", "2bw:4"])
    try:
        runs = [(s, int(d)) for s, d in (x.split(":") for x in pairs)]
    except ValueError:
        p.error(f"--runs {' '.join(pairs)}: expected schedule:d pairs such as 2bw:2")
    t0 = time.perf_counter()
    messages = 40 if args.quick else 200
    lat = run_distributed(_latency_worker, 2, args=(messages, reps), timeout=600)[1]
    latency = [{"mode": mode, "mean_wait_s": median(lat["mean"][mode]),
                "median_wait_s": median(lat["median"][mode]),
                "mean_wait_s_per_run": lat["mean"][mode]} for mode in MODES]
    print(format_table(["receives", "mean wait ms", "median wait ms", "mean per run (ms)"],
                       [[r["mode"], r["mean_wait_s"] * 1e3, r["median_wait_s"] * 1e3,
                         " ".join(f"{w * 1e3:.2f}" for w in r["mean_wait_s_per_run"])]
                        for r in latency],
                       title=f"(a) two ranks, {messages} messages of 64 KiB, receiver "
                             f"computing 3 ms between receives"))
    rows = [bench_gpt(s, d, reps, args.quick) for s, d in runs]
    print(format_table(["schedule", "d", "ms/batch when needed", "ms/batch ahead",
                        "ms/batch ahead, after wait", "speedup ahead",
                        "speedup ahead, after wait", "stage-1 recv ms when needed",
                        "stage-1 recv ms ahead", "stage-1 recv ms ahead, after wait"],
                       [[r["schedule"], r["d"], r["period_s_when_needed"] * 1e3,
                         r["period_s_ahead"] * 1e3, r["period_s_ahead_after_wait"] * 1e3,
                         r["speedup_ahead"], r["speedup_ahead_after_wait"],
                         r["stage1_recv_wait_s_when_needed"] * 1e3,
                         r["stage1_recv_wait_s_ahead"] * 1e3,
                         r["stage1_recv_wait_s_ahead_after_wait"] * 1e3] for r in rows],
                       title=f"(b) small GPT, traced, median of {reps} interleaved runs per mode"))
    payload = {"command": "PYTHONPATH=. python bench/p2p_prepost.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "quick": args.quick,
        "latency": latency, "gpt": rows, "bench_seconds": time.perf_counter() - t0}
    path = write_results("p2p_prepost", payload, Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

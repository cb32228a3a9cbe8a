"""Where a training step's time goes on a GPU: torch.profiler over the trainer's steps.

Runs ``pretrain`` on GPT-345M (or ``--layers``/``--hidden``) with mock data and records
a few steady-state iterations with torch.profiler; prints the operators with the most GPU
time and the most CPU time, the step's GPU busy fraction and the host-device copies, and
writes gpu_profile.json (and a Chrome trace with ``--trace``)::

    PYTHONPATH=. python bench/gpu_profile.py --micro-batch-size 8 1

Without a GPU it says so and stops (``--dry-run`` runs a 2-layer model on the CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_command, format_table, write_results  # noqa: E402
from bench.convergence import git_revision  # noqa: E402
from bench.throughput import DRY_RUN_MODEL, GPT_345M, gpu_trainer_argv  # noqa: E402


def profile_trainer(model: Dict[str, int], mb: int, gbs: int, precision: str,
                    extra: List[str], wait: int, active: int, trace: Optional[Path],
                    top: int) -> Dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    import pretrain_gpt
    from megatron.training import pretrain

    m = gbs // mb
    iters = wait + 1 + active + 1
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    calls = [0]
    prof = profile(activities=acts, schedule=schedule(wait=wait, warmup=1, active=active),
                   record_shapes=False)

    def step(data_iterator, model_):
        if calls[0] and calls[0] % m == 0:
            prof.step()
        calls[0] += 1
        return pretrain_gpt.forward_step(data_iterator, model_)

    argv = gpu_trainer_argv(model, precision, mb, gbs, iters, extra)
    with prof, contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, step, argv=argv)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    use_cuda = torch.cuda.is_available()

    def dev_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    rows = [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "self_device_ms": dev_us(e) / 1e3,
             "kernel": str(getattr(e, "device_type", "")).endswith("CUDA")} for e in events]
    # kernels alone: an operator's self device time repeats its kernels' time
    device_total = sum(r["self_device_ms"] for r in rows if r["kernel"])
    cpu_total = sum(r["self_cpu_ms"] for r in rows if not r["kernel"])
    by_dev = sorted(rows, key=lambda r: -r["self_device_ms"])[:top]
    by_cpu = sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top]
    copies = [r for r in rows if "Memcpy" in r["name"] or "memcpy" in r["name"].lower()]
    # wall time of the active window: from the profiler's own step spans
    step_spans = [e for e in events if e.key.startswith("ProfilerStep")]
    wall_ms = sum(e.cpu_time_total for e in step_spans) / 1e3 if step_spans else None
    return {"micro_batch_size": mb, "global_batch_size": gbs, "precision": precision,
            "extra": extra, "active_iterations": active, "wall_ms_active": wall_ms,
            "device_ms_total": device_total if use_cuda else None,
            "cpu_self_ms_total": cpu_total,
            "device_busy_fraction": (device_total / wall_ms if use_cuda and wall_ms else None),
            "top_device": by_dev, "top_cpu": by_cpu, "copies": copies}


def show(r: Dict[str, Any]) -> None:
    head = (f"micro batch {r['micro_batch_size']}, global {r['global_batch_size']}, "
            f"{r['precision']} {' '.join(r['extra'])}: {r['active_iterations']} iterations, "
            f"wall {r['wall_ms_active'] or 0:.0f} ms")
    if r["device_ms_total"] is not None:
        head += (f", GPU kernels {r['device_ms_total']:.0f} ms "
                 f"(busy {100 * (r['device_busy_fraction'] or 0):.0f}%)")
    print(head)
    print(format_table(["operator", "calls", "self GPU ms", "self CPU ms"],
                       [[x["name"][:60], x["count"], x["self_device_ms"], x["self_cpu_ms"]]
                        for x in r["top_device"]], title="  by GPU time"))
    print(format_table(["operator", "calls", "self CPU ms", "self GPU ms"],
                       [[x["name"][:60], x["count"], x["self_cpu_ms"], x["self_device_ms"]]
                        for x in r["top_cpu"]], title="  by CPU time"))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[8, 1])
    p.add_argument("--microbatches", type=int, default=4, help="m per iteration (default 4)")
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--extra", default="", help="more trainer flags, one string")
    p.add_argument("--active", type=int, default=3, help="iterations recorded")
    p.add_argument("--wait", type=int, default=3, help="iterations skipped first")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--trace", default=None, help="folder for Chrome traces (one per run)")
    p.add_argument("--dry-run", action="store_true", help="a 2-layer model on the CPU")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu_profile: skipped (no CUDA device; --dry-run checks the code on the CPU)")
        return {"status": "skipped"}
    model = DRY_RUN_MODEL if args.dry_run else GPT_345M
    runs = []
    for mb in args.micro_batch_size:
        trace = (Path(args.trace) / f"trace_b{mb}.json") if args.trace else None
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
        r = profile_trainer(model, mb, mb * args.microbatches, args.precision,
                            args.extra.split(), args.wait, args.active, trace, args.top)
        show(r)
        runs.append(r)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # a --dry-run profiles a 2-layer model: its JSON says so, so that the results page
    # does not show it as GPT-345M's profile
    payload = {"command": bench_command("bench/gpu_profile.py", argv),
               "status": "dry run" if args.dry_run else "measured", "dry_run": args.dry_run,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
               "torch": torch.__version__, "model": model, "runs": runs, "git": git_revision()}
    path = write_results("gpu_profile", payload, Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()

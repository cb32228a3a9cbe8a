"""What glibc's malloc costs a CPU training step, with and without the trainer's tuning.

    PYTHONPATH=. python bench/host_malloc.py [--quick] [--rounds 3] [--out-dir DIR]

By default a CPU rank calls ``megatron.initialize.tune_host_malloc`` (mallopt: trim
threshold 1 GiB, mmap threshold 32 MiB), so the activation memory a microbatch frees is
reused by the next one instead of being handed back to the OS and faulted in again;
``--no-host-malloc-tuning`` keeps glibc's defaults.  This bench trains the same GPT both
ways, each run in fresh processes (mallopt is process-wide), alternating the order
round by round, and reports per batch on every rank: wall time (median over batches
after warm-up), minor page faults, and the process's user and system CPU time.
The goal is not a number: tuning must remove the page faults and not be slower.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_command, format_table, median, write_results  # noqa: E402
from bench.trainer_overhead import FULL_MODEL, QUICK_MODEL, trainer_argv  # noqa: E402

WARMUP_BATCHES = 3
CONFIGS = (("d=1 flush", 1, "flush"), ("d=2 flush", 2, "flush"), ("d=2 2bw", 2, "2bw"))
VARIANTS = ("tuned", "glibc default")


def run_argv(model: Dict[str, int], d: int, schedule: str, iters: int, tuned: bool) -> List[str]:
    argv = trainer_argv(model, iters)
    argv[argv.index("--pipeline-schedule") + 1] = schedule
    argv += ["--pipeline-model-parallel-size", str(d)]
    return argv + ([] if tuned else ["--no-host-malloc-tuning"])


def _worker(rank: int, world: int, argv: List[str], m: int) -> Dict[str, List[float]]:
    """Per batch of this rank: wall seconds, minor faults, user and system CPU seconds."""
    import pretrain_gpt
    from megatron.training import pretrain

    stamps: List[tuple] = []
    calls = [0]

    def forward_step(data_iterator, model):
        if calls[0] % m == 0:
            use = resource.getrusage(resource.RUSAGE_SELF)
            stamps.append((time.perf_counter(), use.ru_minflt, use.ru_utime, use.ru_stime))
        calls[0] += 1
        return pretrain_gpt.forward_step(data_iterator, model)

    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, forward_step,
                 argv=argv)
    steps = [tuple(b - a for a, b in zip(x, y)) for x, y in zip(stamps, stamps[1:])]
    steps = steps[WARMUP_BATCHES:]
    return {"seconds": [s[0] for s in steps], "minor_faults": [s[1] for s in steps],
            "user_s": [s[2] for s in steps], "sys_s": [s[3] for s in steps]}


def measure(model: Dict[str, int], rounds: int, iters: int, timeout: float) -> List[Dict[str, Any]]:
    from tests.dist_utils import run_distributed

    m = 16 // 4  # trainer_argv's global batch 16, micro batch 4
    rows = []
    for name, d, schedule in CONFIGS:
        runs: Dict[str, List[List[Dict[str, List[float]]]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                argv = run_argv(model, d, schedule, iters, variant == "tuned")
                runs[variant].append(run_distributed(_worker, d, args=(argv, m),
                                                     timeout=timeout))
        for variant in VARIANTS:
            per_round = [median(ranks[0]["seconds"]) for ranks in runs[variant]]
            ranks = range(d)
            rows.append({
                "configuration": name, "variant": variant,
                "seconds_per_batch": median(per_round), "round_medians_s": per_round,
                "minor_faults_per_batch": [median([x for run in runs[variant]
                                                   for x in run[k]["minor_faults"]])
                                           for k in ranks],
                "user_ms_per_batch": [1e3 * median([x for run in runs[variant]
                                                    for x in run[k]["user_s"]]) for k in ranks],
                "sys_ms_per_batch": [1e3 * median([x for run in runs[variant]
                                                   for x in run[k]["sys_s"]]) for k in ranks]})
        tuned, default = rows[-2], rows[-1]
        paired = [b / a for a, b in zip(tuned["round_medians_s"], default["round_medians_s"])]
        tuned["speedup"] = default["seconds_per_batch"] / tuned["seconds_per_batch"]
        tuned["paired_round_speedups"] = paired
    return rows


def print_rows(rows: List[Dict[str, Any]]) -> None:
    fmt = lambda xs, p: "/".join(f"{x:.{p}f}" for x in xs)  # noqa: E731
    table = [[r["configuration"], r["variant"], 1e3 * r["seconds_per_batch"],
              fmt(r["minor_faults_per_batch"], 0), fmt(r["user_ms_per_batch"], 1),
              fmt(r["sys_ms_per_batch"], 2),
              f"{r['speedup']:.3f}" if "speedup" in r else "",
              " ".join(f"{x:.3f}" for x in r.get("paired_round_speedups", []))]
             for r in rows]
    print(format_table(["configuration", "malloc", "ms/batch", "minor faults/batch (rank 0/1)",
                        "user ms/batch", "sys ms/batch", "tuned speedup", "per round"],
                       table, title="CPU training step with and without the host malloc "
                                    "tuning (fresh processes per run, order alternating)"))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, one round (tests)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    p.add_argument("--out-dir", default=None, help="where to write host_malloc.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rounds = args.rounds or (1 if args.quick else 3)
    model = QUICK_MODEL if args.quick else FULL_MODEL
    iters = WARMUP_BATCHES + (4 if args.quick else 12)
    rows = measure(model, rounds, iters, timeout=600)
    print_rows(rows)
    result = {"command": bench_command("bench/host_malloc.py", argv),
              "quick": args.quick, "model": model, "micro_batch_size": 4,
              "global_batch_size": 16, "rounds": rounds, "iters": iters,
              "warmup_batches": WARMUP_BATCHES, "rows": rows,
              "bench_seconds": time.perf_counter() - t0}
    path = write_results("host_malloc", result, args.out_dir)
    print(f"wrote {path} ({result['bench_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()

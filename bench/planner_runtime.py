#!/usr/bin/env python
"""How long Algorithm 1 takes: the planner's search for N in {8, 64, 256, 1024} GPUs.

    python bench/planner_runtime.py            # prints a table, writes bench/results/planner_runtime.json
    python bench/planner_runtime.py --out-dir DIR   # writes DIR/planner_runtime.json instead

The paper (section 6, "Planning Algorithms") says its planner "takes a fraction of a
second with a closed-form cost model".  We time our search for GPT-3.8B on modelled
p3.16xlarge servers (global batch <= 4096), over (w, d) only and over (t, w, d).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import bench_command, write_results  # noqa: E402
from megatron.pipeline.planner import get_hardware, get_model, search  # noqa: E402

SIZES = (8, 64, 256, 1024)
REPEATS = 5


def time_search(num_gpus: int, tensor_parallel: bool) -> dict:
    model, hw = get_model("gpt-3.8b"), get_hardware("p3.16xlarge")
    times, rows = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()
        rows = search(model, hw, num_gpus, 4096, tensor_parallel=tensor_parallel)
        times.append(time.perf_counter() - start)
    best = rows[0]
    return {"num_gpus": num_gpus, "tensor_parallel": tensor_parallel,
            "candidates": len(rows), "fitting": sum(r.fits for r in rows),
            "first_s": times[0], "median_s": statistics.median(times),
            "best": best.config.describe().strip() if best.fits else None,
            "best_samples_per_s": best.predicted_samples_per_s}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default=None, help="where to write planner_runtime.json "
                                                   "(default bench/results)")
    args = p.parse_args(argv)
    results = [time_search(n, tp) for tp in (False, True) for n in SIZES]
    print(f"{'N':>6} {'search t':>9} {'candidates':>11} {'fit':>5} {'first ms':>9} "
          f"{'median ms':>10}  best (predicted samples/s)")
    for r in results:
        print(f"{r['num_gpus']:>6} {'yes' if r['tensor_parallel'] else 'no':>9} "
              f"{r['candidates']:>11} {r['fitting']:>5} {1e3 * r['first_s']:>9.1f} "
              f"{1e3 * r['median_s']:>10.1f}  {r['best']} ({r['best_samples_per_s']:.0f})")
    payload = {"command": bench_command("bench/planner_runtime.py", argv),
               "model": "gpt-3.8b", "cluster": "p3.16xlarge", "max_batch_size": 4096,
               "repeats": REPEATS, "results": results}
    out = write_results("planner_runtime", payload, args.out_dir)
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()

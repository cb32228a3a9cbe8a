"""What a training segment's schedule costs each rank before its first action.

    PYTHONPATH=. python bench/segment_setup.py [--quick] [--repeats 5] [--out-dir DIR]

The training loop runs the engine in segments between drain points: with the default
--max-consecutive-skipped-steps 10, 100 batches under 2BW and 10 under flush/gpipe/none
(``megatron/training_loop.py``), and every evaluation is a forward-only segment.  Each
segment needs the schedule's action list.  ``build_schedule`` makes every stage's list
(and, for 2BW, places the steps by simulating them), which is what every segment paid
before the executor kept its stage's list per segment shape
(``megatron.pipeline.stage_plan.StagePlans``).  For each (schedule, d, m, batches) this
prints, side by side in one run on this machine's CPU:

* ``build ms``: median milliseconds of ``build_schedule`` (a segment before; now the
  first segment of each shape only), and the same per batch of the segment;
* ``cached us``: median microseconds of ``StagePlans.get`` once the shape is known
  (every later segment);
* ``stage KiB`` / ``all KiB``: memory of the one stage's list kept against every
  stage's lists (tracemalloc).

The cost is CPU time on every rank, in series with the GPU work of the segment's first
batches; the bench measures it here because it does not depend on the accelerator.
"""
from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_command, format_table, median, write_results  # noqa: E402
from megatron.pipeline.schedules import build_schedule  # noqa: E402
from megatron.pipeline.stage_plan import StagePlans  # noqa: E402

FULL = [("flush", 4, 8, 10, False), ("2bw", 4, 8, 100, False),
        ("flush", 8, 64, 10, False), ("2bw", 8, 32, 100, False),
        ("2bw", 8, 64, 100, False), ("flush", 8, 64, 10, True),
        ("2bw", 16, 128, 100, False)]  # tools/plan.py's pick for GPT-3.8B on 64 V100s
QUICK = [("flush", 2, 4, 10, False), ("2bw", 2, 4, 20, False), ("2bw", 4, 8, 10, True)]


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times)


def _bytes(fn) -> int:
    tracemalloc.start()
    try:
        kept = fn()
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del kept
    return size


def measure(name: str, d: int, m: int, batches: int, forward_only: bool,
            repeats: int) -> Dict[str, Any]:
    def build():
        return build_schedule(name, d, m, batches, forward_only=forward_only)

    plans = StagePlans(stage=0)
    plans.get(name, d, m, batches, forward_only)  # the first segment of this shape
    build_s = _timed(build, repeats)
    cached_s = _timed(lambda: plans.get(name, d, m, batches, forward_only),
                      max(repeats, 100))
    assert plans.builds == 1, plans.builds
    stage_bytes = _bytes(lambda: StagePlans(stage=0).get(name, d, m, batches, forward_only))
    all_bytes = _bytes(build)
    return {"schedule": name, "d": d, "m": m, "batches": batches,
            "forward_only": forward_only, "build_seconds": build_s,
            "build_seconds_per_batch": build_s / batches, "cached_seconds": cached_s,
            "stage_bytes": stage_bytes, "all_stages_bytes": all_bytes}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (CI smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed builds per shape")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the JSON goes (default bench/results)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    rows: List[Dict[str, Any]] = [measure(*shape, repeats=args.repeats)
                                  for shape in (QUICK if args.quick else FULL)]
    table = format_table(
        ["schedule", "d", "m", "batches", "build ms", "build ms/batch", "cached us",
         "stage KiB", "all KiB"],
        [[r["schedule"] + (" eval" if r["forward_only"] else ""), r["d"], r["m"],
          r["batches"], r["build_seconds"] * 1e3, r["build_seconds_per_batch"] * 1e3,
          r["cached_seconds"] * 1e6, r["stage_bytes"] / 1024, r["all_stages_bytes"] / 1024]
         for r in rows])
    print(table)
    path = write_results("segment_setup", {
        "quick": args.quick, "command": bench_command("bench/segment_setup.py", argv),
        "rows": rows,
        "note": "build_seconds: what every segment of this shape cost each rank before "
                "the executor kept its stage's list (StagePlans); cached_seconds: every "
                "segment after the first of its shape now"},
        args.out_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does a rank's host memory stay flat over a long evaluation?  (CPU, gloo ranks)

    PYTHONPATH=. python bench/eval_memory.py [--quick] [--eval-iters 400] [--out-dir DIR]

Each configuration trains 2 batches, then evaluates --eval-iters validation batches at
the end of training, one forward-only segment (``PipelineEngine.evaluate``), in fresh
processes.  Every rank records its resident set size (``/proc/self/statm``) after each
forward of that evaluation, and the table gives, for the rank that grew most, the RSS
after its first forwards and at its end, and the growth per 100 forwards, over the whole
evaluation and over its second half (a heap that steps up a few times and then stays is
bounded; one that holds something per microbatch keeps growing in the second half too).  (A second
evaluation would start on a heap the first one had already grown, and hide the growth.)
Session 14's audit found evaluation growing
without bound: the executor kept every microbatch's loss, and a new float64 sum per
batch, until the segment ended; each small tensor pinned the heap above the
activations a forward had freed (t=2 on 2 ranks: 862 MB at --eval-iters 400 against
377 MB now; a WikiText-103 evaluation at t2 d2 was OOM-killed at 11 GB).  Flat means
a growth per 100 batches near 0 MB.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, write_results  # noqa: E402
from bench.convergence import git_revision  # noqa: E402
from bench.trainer_overhead import FULL_MODEL, QUICK_MODEL, trainer_argv  # noqa: E402

# (name, world size, extra flags)
CONFIGS = (("t=2 (2 ranks)", 2, ["--tensor-model-parallel-size", "2"]),
           ("d=2 (2 ranks)", 2, ["--pipeline-model-parallel-size", "2"]),
           ("w=2 (2 ranks)", 2, []))
SKIP_BATCHES = 10
"""RSS is read from this evaluation batch on (allocator and caches warm up first)."""


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _worker(rank: int, world: int, argv: List[str]) -> List[float]:
    """This rank's RSS (MB) after each forward of the run's first evaluation segment."""
    import pretrain_gpt
    from megatron.pipeline.engine import PipelineEngine
    from megatron.training import pretrain

    segments: List[List[float]] = []
    original = PipelineEngine._forward

    def recording(self, action, seg):
        original(self, action, seg)
        if not seg.train:
            if getattr(seg, "_bench_rss", None) is None:  # a new evaluation segment
                seg._bench_rss = []
                segments.append(seg._bench_rss)
            seg._bench_rss.append(_rss_mb())

    PipelineEngine._forward = recording
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                     pretrain_gpt.forward_step, argv=argv)
    finally:
        PipelineEngine._forward = original
    return segments[0] if segments else []


def measure(model: Dict[str, int], eval_iters: int, timeout: float) -> List[Dict[str, Any]]:
    from tests.dist_utils import run_distributed

    rows = []
    for name, world, extra in CONFIGS:
        argv = trainer_argv(model, 2) + extra
        argv[argv.index("--eval-iters") + 1] = str(eval_iters)
        argv[argv.index("--eval-interval") + 1] = "1000"  # only the end-of-training one
        traces = run_distributed(_worker, world, args=(argv,), timeout=timeout)
        per_rank = []
        for rank, trace in enumerate(traces):
            if len(trace) <= SKIP_BATCHES:
                continue
            start, end = trace[SKIP_BATCHES], trace[-1]
            forwards = len(trace) - SKIP_BATCHES
            half = len(trace) // 2
            per_rank.append({"rank": rank, "forwards": len(trace), "rss_start_mb": start,
                             "rss_end_mb": end, "rss_peak_mb": max(trace),
                             "growth_mb_per_100_forwards": 100 * (end - start) / forwards,
                             "second_half_growth_mb_per_100_forwards":
                                 100 * (end - trace[half]) / (len(trace) - half)})
        worst = max(per_rank, key=lambda r: r["growth_mb_per_100_forwards"])
        rows.append({"configuration": name, "eval_iters": eval_iters, "ranks": per_rank,
                     **{k: v for k, v in worst.items() if k != "rank"},
                     "worst_rank": worst["rank"]})
    return rows


def print_rows(rows: List[Dict[str, Any]]) -> None:
    table = [[r["configuration"], r["eval_iters"], r["worst_rank"], r["forwards"],
              r["rss_start_mb"], r["rss_end_mb"], r["rss_peak_mb"],
              r["growth_mb_per_100_forwards"], r["second_half_growth_mb_per_100_forwards"]]
             for r in rows]
    print(format_table(["configuration", "eval iters", "rank", "eval forwards",
                        f"RSS at forward {SKIP_BATCHES} (MB)", "RSS at end (MB)", "peak (MB)",
                        "growth MB / 100 forwards", "in the second half"], table,
                       title="Host memory over one long evaluation (the rank that grew most)"))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 20 batches (tests)")
    p.add_argument("--eval-iters", type=int, default=None,
                   help="validation batches of the evaluation (default 400, quick 20)")
    p.add_argument("--out-dir", default=None, help="where to write eval_memory.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model = QUICK_MODEL if args.quick else FULL_MODEL
    eval_iters = args.eval_iters or (20 if args.quick else 400)
    rows = measure(model, eval_iters, timeout=900)
    print_rows(rows)
    command = "PYTHONPATH=. python bench/eval_memory.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    result = {"command": command.strip(), "git": git_revision(), "quick": args.quick,
              "model": model, "micro_batch_size": 4,
              "global_batch_size": 16, "skip_batches": SKIP_BATCHES, "rows": rows,
              "bench_seconds": time.perf_counter() - t0}
    path = write_results("eval_memory", result, args.out_dir)
    print(f"wrote {path} ({result['bench_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()

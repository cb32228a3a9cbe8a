"""The first stage's end-of-batch chain under Flush: sums by exchange against all_reduce.

    PYTHONPATH=. python bench/step_chain.py [--quick] [--reps 6] [--iters 30]

Under a flushing 1F1B schedule the first stage finishes a batch's backward passes last,
and from then until its first forward of the next batch every other stage waits for
it: the tied-embedding gradient sum (``R@``), the optimizer's agreement and update
(``S@``), then the first forward.  ``megatron.exchange`` makes the two sums by direct
exchange on gloo instead of gloo's ``all_reduce``.  This bench trains the small GPT of
``bench/pipeline_schedules.py`` (d=2, m=8, one thread per rank) under flush with the
executor's trace on, the two ways interleaved ``--reps`` times, and reports per way
(medians over the steady batches of all runs):

* chain: stage 0, from the start of ``R@t`` to the start of batch t+1's first forward;
* ``R@`` and ``S@`` on stage 0, wall and thread CPU time;
* the batch period on stage 0 (first forward to first forward).

The chain isolates what the exchange changes from the stages' compute, whose run-to-run
spread on a shared 2-core machine is larger than the whole effect.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, median, write_results  # noqa: E402

WAYS = ("exchange", "all_reduce")


def chain_samples(events: Sequence[Any], first_batch: int) -> Dict[str, List[float]]:
    """Per steady batch t of one rank-0 trace (``TraceEvent``s of a training run, as
    ``megatron.pipeline.trace.load_trace`` reads them): chain, R@/S@ wall and CPU, and
    the period, in seconds."""
    by_batch: Dict[int, Dict[str, Any]] = {}
    for e in events:
        if e.batch is None:
            continue
        slot = by_batch.setdefault(e.batch, {})
        if e.op not in slot:  # the first F of a batch is its first forward
            slot[e.op] = e
    out: Dict[str, List[float]] = {k: [] for k in (
        "chain", "reduce_wall", "reduce_cpu", "step_wall", "step_cpu", "period")}
    for t in sorted(by_batch):
        nxt = by_batch.get(t + 1)
        cur = by_batch[t]
        if t < first_batch or nxt is None or not {"R@", "S@", "F"} <= set(cur) or "F" not in nxt:
            continue
        out["chain"].append(nxt["F"].start - cur["R@"].start)
        out["reduce_wall"].append(cur["R@"].duration)
        out["reduce_cpu"].append(cur["R@"].cpu)
        out["step_wall"].append(cur["S@"].duration)
        out["step_cpu"].append(cur["S@"].cpu)
        out["period"].append(nxt["F"].start - cur["F"].start)
    return out


def _worker(rank: int, world: int, reps: int, iters: int, trace_dir: str, quick: bool
            ) -> Optional[Dict[str, Dict[str, List[float]]]]:
    import pretrain_gpt
    from bench.pipeline_schedules import gpt_argv, sums_by_all_reduce
    from megatron.pipeline.trace import load_trace
    from megatron.training import pretrain

    samples: Dict[str, Dict[str, List[float]]] = {w: {} for w in WAYS}
    for r in range(reps):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            trace = Path(trace_dir) / f"{way}.json"
            argv = gpt_argv("flush", quick, iters) + ["--timeline-file", str(trace)]
            with contextlib.redirect_stdout(io.StringIO()), \
                    sums_by_all_reduce(way == "all_reduce"):
                pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                         pretrain_gpt.forward_step, argv=argv)
            if rank == 0:
                events, _ = load_trace(Path(trace_dir) / f"{way}_rank0.json")
                for k, v in chain_samples(events, first_batch=3).items():
                    samples[way].setdefault(k, []).extend(v)
    return samples if rank == 0 else None


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="2 reps of 8 batches of pipeline_schedules.py's quick GPT (tests)")
    p.add_argument("--reps", type=int, default=None, help="interleaved runs per way (default 6)")
    p.add_argument("--iters", type=int, default=None, help="batches per run (default 30)")
    p.add_argument("--out-dir", default=None, help="where to write step_chain.json")
    args = p.parse_args(argv)
    import torch

    from bench.pipeline_schedules import _microbatches, gpt_argv
    from tests.dist_utils import run_distributed

    torch.set_num_threads(1)  # as each rank runs (tests.dist_utils); recorded in the JSON

    reps = args.reps or (2 if args.quick else 6)
    iters = args.iters or (8 if args.quick else 30)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        samples = run_distributed(_worker, 2, args=(reps, iters, tmp, args.quick),
                                  timeout=1800)[0]
    rows = []
    for way in WAYS:
        s = samples[way]
        rows.append({"way": way, "batches": len(s["chain"]),
                     **{f"{k}_ms": median(v) * 1e3 for k, v in s.items()}})
    base = rows[1]
    for r in rows:
        r["chain_saved_ms"] = base["chain_ms"] - r["chain_ms"]
        r["period_over_all_reduce"] = r["period_ms"] / base["period_ms"]
    print(format_table(
        ["sums by", "batches", "chain ms", "R@ wall/CPU ms", "S@ wall/CPU ms", "period ms",
         "chain saved ms", "period / all_reduce"],
        [[r["way"], r["batches"], r["chain_ms"],
          f"{r['reduce_wall_ms']:.2f}/{r['reduce_cpu_ms']:.2f}",
          f"{r['step_wall_ms']:.2f}/{r['step_cpu_ms']:.2f}", r["period_ms"],
          r["chain_saved_ms"], r["period_over_all_reduce"]] for r in rows],
        title=f"stage 0 under flush, small GPT d=2 m="
              f"{_microbatches(gpt_argv('flush', args.quick, iters))}, {reps} interleaved "
              f"runs of {iters} batches per way (medians over steady batches)"))
    payload = {"command": "PYTHONPATH=. python bench/step_chain.py " + " ".join(
                   argv if argv is not None else sys.argv[1:]),
               "quick": args.quick, "reps": reps, "iters": iters, "rows": rows,
               "bench_seconds": time.perf_counter() - t0}
    path = write_results("step_chain", payload, args.out_dir)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

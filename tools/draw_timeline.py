"""Draw a pipeline timeline (paper Figure 2/3 style) from a simulation or a real run.

Simulated, with the paper's unit costs (forward 1, backward 2)::

    python tools/draw_timeline.py --schedule 2bw --stages 4 --microbatches 8 --batches 3 \
        --output docs/figures/timeline_2bw_d4_m8.png [--chrome-trace out.json]

From the per-rank files a traced training run wrote::

    python tools/draw_timeline.py --trace 'run/timeline_rank*.json' --output run/timeline.png \
        [--trace-batches 100:103]
"""
from __future__ import annotations

import argparse
import glob
import math
import os
import re
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.pipeline.schedules import SCHEDULES, STEP_PLACEMENTS, build_schedule  # noqa: E402
from megatron.pipeline.simulator import simulate, unit_cost  # noqa: E402
from megatron.pipeline.timeline_plot import image_path_problem, plot_timeline  # noqa: E402
from megatron.errors import UserError, check_parents_are_directories  # noqa: E402
from megatron.arguments import OneLineParser  # noqa: E402
from megatron.pipeline.trace import load_traces, save_chrome_trace, window_events  # noqa: E402


_RANK_IN_NAME = re.compile(r"rank(\d+)\D*$")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--schedule", choices=SCHEDULES, help="simulate this schedule")
    src.add_argument("--trace", help="glob (quote it) or comma-separated list of "
                     "timeline_rank*.json files written by a traced run")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages d (simulation)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per batch m")
    p.add_argument("--batches", type=int, default=1, help="batches in the segment")
    p.add_argument("--forward-cost", type=float, default=1.0)
    p.add_argument("--backward-cost", type=float, default=2.0)
    p.add_argument("--comm-latency", type=float, default=0.0)
    p.add_argument("--no-step-barrier", action="store_true",
                   help="do not model STEP as a barrier across stages")
    p.add_argument("--step-placement", choices=STEP_PLACEMENTS, default="aligned",
                   help="where 2bw puts each STEP (see megatron/pipeline/schedules.py)")
    p.add_argument("--color-by", choices=("auto", "batch", "version"), default="auto",
                   help="box colour: batch, or weight version (auto: version for 2bw)")
    p.add_argument("--trace-batches", default=None, metavar="A:B",
                   help="with --trace: draw only batches A..B-1 of the run (a long run's "
                        "whole timeline is too dense to read)")
    p.add_argument("--title", default=None)
    p.add_argument("--output", required=True, help="image file to write (.png, .pdf, .svg)")
    p.add_argument("--chrome-trace", default=None,
                   help="also write the events as a Chrome/Perfetto trace JSON")
    return p.parse_args(argv)


def _batch_range(text: str) -> List[int]:
    try:
        first, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--trace-batches: expected A:B (first batch, end), got {text!r}") from None
    if not 0 <= first < stop:
        raise UserError(f"--trace-batches {text}: expected 0 <= A < B")
    return [first, stop]


def _load_trace_flag(trace: str):
    """load_traces for --trace, with a missing or unreadable file a one-line UserError
    naming the flag and the pattern rather than a traceback; a rank or stage of the run
    with no file or no events is a warning line (the drawing would lack its row)."""
    expected = f"--trace {trace!r}: expected timeline_rank*.json files written by a traced run"
    if any(c in trace for c in "*?["):
        paths = sorted(glob.glob(trace))
        if not paths:
            raise UserError(f"{expected}, no file matches it")
    else:
        paths = [p for p in trace.split(",") if p]
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing or not paths:
            raise UserError(f"{expected}, found no file {', '.join(missing)}".rstrip())
    try:
        events, meta = load_traces(paths)
    except (OSError, ValueError) as exc:  # unreadable, not JSON, not a trace file
        raise UserError(f"{expected}; cannot read them: {exc}") from exc
    gaps = _trace_gaps(paths, events, meta)
    if gaps:
        print(f"draw_timeline.py: warning: --trace {trace!r}: {gaps}; the drawing lacks "
              f"their rows", file=sys.stderr)
    return events, meta


def _ranks(values) -> str:
    return ", ".join(str(v) for v in sorted(values))


def _trace_gaps(paths: List[str], events, meta: dict) -> Optional[str]:
    """Which ranks of the traced run have no file, and which of its stages no event.

    Ranks come from the file names (``timeline_rank{r}.json``, as training writes
    them); the run had at least the highest rank + 1, and at least stages x
    data-parallel ranks when the files record those."""
    notes = []
    numbers = [_RANK_IN_NAME.search(os.path.basename(p)) for p in paths]
    stages, data = meta.get("stages"), meta.get("data_parallel")
    if all(numbers):
        found = {int(m.group(1)) for m in numbers}
        total = max(found) + 1
        if type(stages) is int and type(data) is int:
            total = max(total, stages * data)
        missing = set(range(total)) - found
        if missing:
            notes.append(f"no file for rank(s) {_ranks(missing)} (found rank(s) {_ranks(found)} "
                         f"of a run of at least {total})")
    if type(stages) is int and events:
        empty = set(range(stages)) - {e.stage for e in events}
        if empty:
            notes.append(f"no event of stage(s) {_ranks(empty)} of {stages}")
    return "; ".join(notes) or None


def trace_title(meta: dict, batches: Optional[List[int]] = None) -> str:
    """Default title of a traced run's drawing: schedule, d, m and w as the trace files
    record them (``stages``, ``microbatches``, ``data_parallel``), the ranks, and the
    batch window drawn (``[first, stop)``, shown as ``first-last``)."""
    parts = [str(meta.get("schedule") or "unknown schedule")]
    for key, label in (("stages", "d"), ("microbatches", "m"), ("data_parallel", "w")):
        if type(meta.get(key)) is int:
            parts.append(f"{label}={meta[key]}")
    ranks = meta.get("ranks")
    if isinstance(ranks, list) and ranks:
        parts.append(f"ranks {_ranks(ranks)}")
    title = "traced run: " + ", ".join(parts)
    if batches:
        first, stop = batches
        title += f"; batch {first}" if stop - first == 1 else f"; batches {first}-{stop - 1}"
    return title


def _check_flags(args: argparse.Namespace) -> None:
    """One UserError naming the flag, before anything is simulated, drawn or written."""
    for flag, path in (("--output", args.output), ("--chrome-trace", args.chrome_trace)):
        if path:
            _check_writable_path(flag, path)
    problem = image_path_problem(args.output)
    if problem:
        raise UserError(f"--output {args.output}: {problem}")
    if not args.schedule:
        return
    for flag in ("--stages", "--microbatches", "--batches"):
        value = getattr(args, flag[2:])
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.schedule == "2bw" and args.microbatches < args.stages:
        raise UserError(f"--microbatches {args.microbatches}: --schedule 2bw needs "
                        f"--microbatches >= --stages ({args.stages})")
    for flag, positive in (("--forward-cost", True), ("--backward-cost", True),
                           ("--comm-latency", False)):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            expected = "a positive number" if positive else "a number >= 0"
            raise UserError(f"{flag} must be {expected}, got {value:g}")


def _check_writable_path(flag: str, path: str) -> None:
    """A directory at ``path``, or a file where one of its parent directories should be,
    is one error now rather than an OSError traceback after the drawing."""
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory; expected a file name")
    check_parents_are_directories(flag, path)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    _check_flags(args)
    if args.schedule:
        schedule = build_schedule(args.schedule, args.stages, args.microbatches, args.batches,
                                  step_placement=args.step_placement)
        result = simulate(schedule, unit_cost(args.forward_cost, args.backward_cost),
                          comm_latency=args.comm_latency,
                          step_barrier=not args.no_step_barrier,
                          # as the executor does: 2BW's step agreement waits for batch b+2
                          deferred_steps=args.schedule == "2bw" and not args.no_step_barrier)
        events, name = result.events, args.schedule
        title = args.title or (
            f"{name}: d={args.stages} stages, m={args.microbatches} microbatches per batch, "
            f"{args.batches} batch(es), forward {args.forward_cost:g}, backward "
            f"{args.backward_cost:g}\nsimulated makespan {result.makespan:g}, bubble "
            f"fraction {result.bubble_fraction:.1%}")
        time_label = "time (simulated units)"
        chrome_unit = 1e3
        print(f"{name} d={args.stages} m={args.microbatches} batches={args.batches}: makespan "
              f"{result.makespan:g}, bubble fraction {result.bubble_fraction:.3f}, peak "
              f"in-flight {result.peak_in_flight}, weight versions "
              f"{result.peak_weight_versions}")
    else:
        events, meta = _load_trace_flag(args.trace)
        if args.trace_batches:
            try:
                events = window_events(events, *_batch_range(args.trace_batches))
            except ValueError as exc:
                raise UserError(f"--trace-batches {args.trace_batches}: {exc}") from None
        name = str(meta.get("schedule", ""))
        title = args.title or trace_title(
            meta, _batch_range(args.trace_batches) if args.trace_batches else None)
        time_label = "time (s)"
        chrome_unit = 1e6
    color_by = args.color_by
    if color_by == "auto":
        color_by = "version" if name == "2bw" else "batch"
    for flag, path in (("--output", args.output), ("--chrome-trace", args.chrome_trace)):
        if not path:
            continue
        try:
            if flag == "--output":
                plot_timeline(events, title=title, color_by=color_by, time_label=time_label,
                              output=path)
            else:
                save_chrome_trace(path, events, time_unit_us=chrome_unit)
        except OSError as exc:  # unwritable, disk full
            raise UserError(f"{flag} {path}: cannot write it "
                            f"({exc.strerror or type(exc).__name__})") from None
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

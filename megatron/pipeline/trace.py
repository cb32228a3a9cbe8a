"""Timeline events of a pipeline run, their JSON files and Chrome/Perfetto export.

Both the simulator and the real executor describe what happened as a list of
``TraceEvent`` (one per executed action, times in seconds or in simulated units).  The
executor writes one file per rank, ``timeline_rank{r}.json``, with ``save_trace``;
``load_traces`` merges several of them for drawing.

Clock alignment: ``load_traces`` shifts each file's times so that the rank's origin is
0.  The origin is ``meta["clock_origin"]`` when the file has it (the executor should
store there the time, on the same clock as its events, at which the rank left the
barrier that starts the traced run), else the rank's earliest event start.  The
fallback is exact only if every rank's first action began at the common start; a rank
whose first recorded action started later (a simulated receive that waited, say) is
shifted too far left.  Ranks' clocks are never compared with each other, so the only
error with ``clock_origin`` is the barrier's exit skew (microseconds on one machine).
"""
from __future__ import annotations

import glob as globlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

TRACE_FORMAT_VERSION = 1


@dataclass(slots=True)
class TraceEvent:
    """One executed action: who ran it, what it was, and when.

    ``action`` is the compact text (``"2F5"``), ``op`` the ``Op`` value (``"F"``,
    ``"SA"``, ``"S@"``, ...).  ``version`` is the weight version used by a forward or
    backward (optional; the drawer colours 2BW timelines by it).
    """

    rank: int
    stage: int
    action: str
    op: str
    microbatch: Optional[int]
    batch: Optional[int]
    start: float
    end: float
    version: Optional[int] = None
    cpu: Optional[float] = None
    """CPU seconds the executing thread spent in the action (executor traces only)."""

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "TraceEvent":
        known = {f.name for f in fields(cls)}
        missing = {"rank", "stage", "action", "op", "start", "end"} - set(data)
        if missing:
            raise ValueError(f"TraceEvent.from_dict: missing keys {sorted(missing)} in {data}")
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs.setdefault("microbatch", None)
        kwargs.setdefault("batch", None)
        return cls(**kwargs)


def save_trace(path: Union[str, Path], events: Sequence[TraceEvent],
               meta: Optional[Dict[str, Any]] = None) -> None:
    """Write ``events`` and free-form ``meta`` (schedule, d, m, ...) as JSON."""
    payload = {"format_version": TRACE_FORMAT_VERSION, "meta": dict(meta or {}),
               "events": [e.to_dict() for e in events]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f)


def load_trace(path: Union[str, Path]) -> Tuple[List[TraceEvent], Dict[str, Any]]:
    """Read a file written by ``save_trace``; returns ``(events, meta)``."""
    try:
        with open(path) as f:
            payload = json.load(f)
    except RecursionError:
        raise ValueError(f"load_trace: {path} is not a trace file (JSON nested too "
                         f"deeply)") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("events"), list):
        raise ValueError(f"load_trace: {path} is not a trace file (no 'events' list)")
    bad = next((e for e in payload["events"] if not isinstance(e, dict)
                or not all(type(e.get(k)) in (int, float) for k in ("start", "end"))), None)
    if bad is not None:
        raise ValueError(f"load_trace: {path} is not a trace file (event {bad!r:.80} is not "
                         f"an object with numeric 'start' and 'end')")
    if not isinstance(payload.get("meta", {}), dict):
        raise ValueError(f"load_trace: {path} is not a trace file ('meta' is not an object)")
    events = [TraceEvent.from_dict(e) for e in payload["events"]]
    return events, dict(payload.get("meta", {}))


def load_traces(paths: Union[str, Iterable[Union[str, Path]]]
                ) -> Tuple[List[TraceEvent], Dict[str, Any]]:
    """Merge per-rank trace files (a glob pattern or a list of paths).

    Each file's events are shifted so that its clock origin is 0 (see the module
    docstring on clock alignment).  ``meta`` is the first file's, with ``ranks`` added.
    """
    if isinstance(paths, (str, Path)):
        files = sorted(globlib.glob(str(paths)))
        if not files:
            raise FileNotFoundError(f"load_traces: no file matches {str(paths)!r}")
    else:
        files = [str(p) for p in paths]
    merged: List[TraceEvent] = []
    meta: Dict[str, Any] = {}
    ranks: List[int] = []
    for i, file in enumerate(files):
        events, file_meta = load_trace(file)
        if i == 0:
            meta = file_meta
        if not events:
            continue
        origin = float(file_meta.get("clock_origin", min(e.start for e in events)))
        for e in events:
            e.start -= origin
            e.end -= origin
        merged.extend(events)
        ranks.extend(sorted({e.rank for e in events}))
    merged.sort(key=lambda e: (e.start, e.rank))
    meta["ranks"] = sorted(set(ranks))
    return merged, meta


def window_events(events: Sequence[TraceEvent], first: int, stop: int) -> List[TraceEvent]:
    """The events of batches ``first <= batch < stop`` (and batch-less events inside their
    time span), shifted so the window starts at 0: a long run's whole timeline is too
    dense to read, a few batches of it show the schedule."""
    kept = [e for e in events if e.batch is not None and first <= e.batch < stop]
    if not kept:
        raise ValueError(f"no traced action belongs to batches {first}..{stop - 1}")
    t0, t1 = min(e.start for e in kept), max(e.end for e in kept)
    kept += [e for e in events if e.batch is None and t0 <= e.start and e.end <= t1]
    out = [TraceEvent(**{**e.to_dict(), "start": e.start - t0, "end": e.end - t0})
           for e in kept]
    out.sort(key=lambda e: (e.start, e.rank))
    return out


def to_chrome_trace(events: Sequence[TraceEvent], time_unit_us: float = 1e6) -> Dict[str, Any]:
    """Chrome trace-event format (chrome://tracing, ui.perfetto.dev).

    One process ("pipeline"), one thread per rank named after its stage (in a simulation
    rank == stage, so one thread per stage), an ``"X"`` (complete) event per action named
    by its short form (``F5``) with microbatch/batch/version in ``args``.
    ``time_unit_us`` converts event times to microseconds: 1e6 for times in seconds;
    simulated unit costs read well with 1e3.
    """
    trace: List[Dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "pipeline"}}]
    named = set()
    for e in sorted(events, key=lambda ev: (ev.rank, ev.start)):
        if e.rank not in named:
            named.add(e.rank)
            trace.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": e.rank,
                          "args": {"name": f"stage {e.stage} (rank {e.rank})"}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": e.rank,
                          "args": {"sort_index": e.stage}})
        prefix = str(e.stage)
        short = e.action[len(prefix):] if e.action.startswith(prefix) else e.action
        trace.append({
            "ph": "X", "name": short, "cat": e.op, "pid": 0, "tid": e.rank,
            "ts": e.start * time_unit_us, "dur": max(e.end - e.start, 0.0) * time_unit_us,
            "args": {"microbatch": e.microbatch, "batch": e.batch, "version": e.version,
                     "action": e.action},
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def save_chrome_trace(path: Union[str, Path], events: Sequence[TraceEvent],
                      time_unit_us: float = 1e6) -> None:
    """Write ``to_chrome_trace(events)`` as JSON to ``path``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_chrome_trace(events, time_unit_us), f)

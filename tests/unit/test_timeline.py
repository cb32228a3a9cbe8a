"""Trace files, Chrome trace export and the timeline drawing (PNG) tool."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.simulator import simulate, unit_cost
from megatron.pipeline.timeline_plot import plot_timeline
from megatron.pipeline.trace import (TraceEvent, load_trace, load_traces, save_chrome_trace,
                                     save_trace, to_chrome_trace)

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_tool():
    spec = importlib.util.spec_from_file_location("draw_timeline",
                                                  REPO / "tools" / "draw_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_event_dict_round_trip() -> None:
    e = TraceEvent(rank=3, stage=1, action="1B7", op="B", microbatch=7, batch=1, start=0.5,
                   end=2.5, version=0)
    assert TraceEvent.from_dict(e.to_dict()) == e
    assert e.duration == 2.0
    # Files without the optional fields still load.
    old = {"rank": 0, "stage": 0, "action": "0S@0", "op": "S@", "start": 1.0, "end": 1.0}
    assert TraceEvent.from_dict(old).microbatch is None
    with pytest.raises(ValueError, match="missing keys \\['end'\\]"):
        TraceEvent.from_dict({"rank": 0, "stage": 0, "action": "0F0", "op": "F", "start": 0})


def test_save_load_and_merge_aligns_clocks(tmp_path: Path) -> None:
    result = simulate(build_schedule("flush", 2, 3), unit_cost())
    offsets = {0: 1000.0, 1: 5000.25}  # two ranks with unrelated clocks

    def write(folder: Path, with_origin: bool) -> None:
        for rank, offset in offsets.items():
            mine = [TraceEvent(**{**e.to_dict(), "start": e.start + offset,
                                  "end": e.end + offset})
                    for e in result.events if e.rank == rank]
            meta = {"schedule": "flush", "rank": rank}
            if with_origin:
                meta["clock_origin"] = offset
            save_trace(folder / f"timeline_rank{rank}.json", mine, meta)

    key = lambda e: (e.rank, e.action, e.start, e.end)  # noqa: E731
    write(tmp_path, with_origin=True)
    events, meta = load_trace(tmp_path / "timeline_rank1.json")
    assert meta["rank"] == 1 and events[0].action == "1RA0" and events[0].start == 5001.25
    merged, meta = load_traces(str(tmp_path / "timeline_rank*.json"))
    assert meta["ranks"] == [0, 1] and meta["schedule"] == "flush"
    assert sorted(map(key, merged)) == sorted(map(key, result.events))
    same, _ = load_traces([tmp_path / "timeline_rank0.json", tmp_path / "timeline_rank1.json"])
    assert sorted(map(key, same)) == sorted(map(key, merged))
    # Without an origin each rank starts at its first event: the simulated rank 1 waited
    # one forward for its first message, so it lands one unit early.
    write(tmp_path / "no_origin", with_origin=False)
    merged, _ = load_traces(str(tmp_path / "no_origin" / "timeline_rank*.json"))
    shifted = {e.action: e.start for e in merged}
    assert shifted["0F0"] == 0.0 and shifted["1RA0"] == 0.0 and shifted["1F0"] == 0.0
    with pytest.raises(FileNotFoundError, match="no file matches"):
        load_traces(str(tmp_path / "nothing*.json"))


def test_chrome_trace_structure(tmp_path: Path) -> None:
    result = simulate(build_schedule("2bw", 2, 2, 2), unit_cost())
    trace = to_chrome_trace(result.events, time_unit_us=1e3)
    complete = [t for t in trace["traceEvents"] if t["ph"] == "X"]
    assert len(complete) == len(result.events)
    threads = {t["tid"]: t["args"]["name"] for t in trace["traceEvents"]
               if t["ph"] == "M" and t["name"] == "thread_name"}
    assert threads == {0: "stage 0 (rank 0)", 1: "stage 1 (rank 1)"}
    b3 = next(t for t in complete if t["args"]["action"] == "1B3")
    src = next(e for e in result.events if e.action == "1B3")
    assert b3["name"] == "B3" and b3["tid"] == 1 and b3["cat"] == "B"
    assert b3["ts"] == src.start * 1e3 and b3["dur"] == 2 * 1e3
    assert b3["args"]["microbatch"] == 3 and b3["args"]["batch"] == 1
    assert b3["args"]["version"] == 0
    path = tmp_path / "chrome.json"
    save_chrome_trace(path, result.events)
    assert json.loads(path.read_text())["traceEvents"][0]["ph"] == "M"


def test_plot_writes_png(tmp_path: Path) -> None:
    result = simulate(build_schedule("2bw", 4, 4, 3), unit_cost())
    out = tmp_path / "fig" / "t.png"
    plot_timeline(result.events, title="2bw", color_by="version", output=out)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    with pytest.raises(ValueError, match="color_by"):
        plot_timeline(result.events, color_by="stage")
    with pytest.raises(ValueError, match="no events"):
        plot_timeline([])


def test_draw_timeline_cli_simulated_and_from_trace(tmp_path: Path, capsys) -> None:
    tool = _load_tool()
    png, chrome = tmp_path / "sim.png", tmp_path / "sim.json"
    assert tool.main(["--schedule", "flush", "--stages", "3", "--microbatches", "4",
                      "--output", str(png), "--chrome-trace", str(chrome)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "makespan 18, bubble fraction 0.333" in capsys.readouterr().out
    events = [e for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in events} >= {"F0", "B3", "S@0"}

    result = simulate(build_schedule("gpipe", 2, 2), unit_cost())
    for rank in (0, 1):
        save_trace(tmp_path / f"timeline_rank{rank}.json",
                   [e for e in result.events if e.rank == rank], {"schedule": "gpipe"})
    png2 = tmp_path / "real.png"
    assert tool.main(["--trace", str(tmp_path / "timeline_rank*.json"),
                      "--output", str(png2)]) == 0
    assert png2.read_bytes().startswith(PNG_MAGIC)


def test_window_keeps_the_chosen_batches_from_time_zero() -> None:
    from megatron.pipeline.trace import window_events

    def ev(batch, start, op="F"):
        return TraceEvent(rank=0, stage=0, action=f"0{op}{batch}", op=op, microbatch=batch,
                          batch=batch, start=start, end=start + 1.0)

    events = [ev(b, 10.0 * b) for b in range(5)]
    events.append(TraceEvent(rank=0, stage=0, action="x", op="X", microbatch=None, batch=None,
                             start=21.0, end=21.5))
    out = window_events(events, 2, 4)
    assert [e.batch for e in out] == [2, None, 3]
    assert out[0].start == 0.0 and out[-1].start == 10.0
    assert events[2].start == 20.0  # the input is not modified
    with pytest.raises(ValueError, match="batches 7..8"):
        window_events(events, 7, 9)

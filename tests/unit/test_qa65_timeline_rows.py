"""Timeline drawing: one row per rank when a stage has data-parallel replicas.

A traced run with w > 1 (the README's CPU demo: d=2, w=2) has two ranks per stage.  Drawn
on one row per stage, the replicas' boxes land on top of each other ("00", "8 8").
"""
from __future__ import annotations

from typing import List

from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.simulator import simulate, unit_cost
from megatron.pipeline.timeline_plot import plot_timeline
from megatron.pipeline.trace import TraceEvent


def _replicated(w: int) -> List[TraceEvent]:
    """A d=2 gpipe simulation with each stage's events copied onto w ranks
    (rank = stage * w + replica, as the trainer lays ranks out), slightly shifted."""
    events = simulate(build_schedule("gpipe", 2, 2), unit_cost()).events
    out = []
    for e in events:
        for r in range(w):
            out.append(TraceEvent(rank=e.stage * w + r, stage=e.stage, action=e.action,
                                  op=e.op, microbatch=e.microbatch, batch=e.batch,
                                  start=e.start + 0.1 * r, end=e.end + 0.1 * r,
                                  version=e.version))
    return out


def _compute_boxes(fig):
    """(y centre, x) of every F/B box: the boxes drawn at zorder 2 with a black edge."""
    ax = fig.axes[0]
    return [(round(p.get_y() + p.get_height() / 2, 3), round(p.get_x(), 3))
            for p in ax.patches if p.get_zorder() == 2 and p.get_height() == 0.76]


def test_replicas_of_a_stage_get_rows_of_their_own() -> None:
    import matplotlib.pyplot as plt

    fig = plot_timeline(_replicated(2))
    try:
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels == ["stage 0, rank 0", "stage 0, rank 1", "stage 1, rank 2",
                          "stage 1, rank 3"]
        boxes = _compute_boxes(fig)
        assert len(boxes) == 16  # 2 stages x 2 ranks x (2 F + 2 B)
        assert len(set(boxes)) == 16, "two ranks' boxes drawn at the same place"
        assert sorted({y for y, _ in boxes}) == [0.0, 1.0, 2.0, 3.0]
    finally:
        plt.close(fig)


def test_one_rank_per_stage_keeps_stage_rows() -> None:
    import matplotlib.pyplot as plt

    fig = plot_timeline(_replicated(1))
    try:
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels == ["stage 0", "stage 1"]
        assert sorted({y for y, _ in _compute_boxes(fig)}) == [0.0, 1.0]
    finally:
        plt.close(fig)


def _load_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "draw_timeline.py"
    spec = importlib.util.spec_from_file_location("draw_timeline_qa65", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trace_title_names_the_run_and_the_window() -> None:
    """A traced run's default title says which run it is (schedule, d, m, w) and which
    batches are drawn, as the README's demo command draws batches 100..102 of a d=2, w=2
    run: "traced run 2bw (ranks [0, 1, 2, 3])" said neither."""
    tool = _load_tool()
    meta = {"schedule": "2bw", "stages": 2, "microbatches": 4, "data_parallel": 2,
            "ranks": [0, 1, 2, 3]}
    assert tool.trace_title(meta, [100, 103]) == (
        "traced run: 2bw, d=2, m=4, w=2, ranks 0, 1, 2, 3; batches 100-102")
    assert tool.trace_title(meta, [7, 8]).endswith("; batch 7")
    assert tool.trace_title({"schedule": "flush", "ranks": [0, 1]}) == (
        "traced run: flush, ranks 0, 1")

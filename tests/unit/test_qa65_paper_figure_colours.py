"""bench/paper_reproduction.py: a system has the same colour in paper_throughput.png and
paper_memory.png (docs/paper_reproduction.md shows both).  Before the fix Flush was green
in one and orange in the other, GPipe the reverse, inter-layer and tensor MP swapped."""
from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.colors import to_hex

import bench.paper_reproduction as pr


def _rows():
    rows = []
    for name, gpus, _, batches in pr.PANELS:
        for batch in batches:
            for j, (label, _, _) in enumerate(pr.SYSTEMS):
                rows.append({"model": name, "gpus": gpus, "batch": batch, "system": label,
                             "samples_per_s": 10.0 + j, "memory_gib": 5.0 + j,
                             "config": {"b": 4}})
    return rows


def _bar_colours(monkeypatch, draw, tmp_path: Path):
    """{label: hex colour} of the bars ``draw`` puts on its figure's axes."""
    figures = []
    monkeypatch.setattr(pr.plt, "close", lambda fig=None: figures.append(fig))
    draw(_rows(), tmp_path / "f.png")
    fig = figures[0]
    out = {}
    ax = fig.axes[0]
    for container in ax.containers:
        label = container.get_label()
        out[label] = to_hex(container.patches[0].get_facecolor())
    matplotlib.pyplot.close(fig)
    return out


def test_each_system_has_one_colour_across_the_paper_figures(monkeypatch, tmp_path) -> None:
    throughput = _bar_colours(monkeypatch, pr.plot_throughput, tmp_path)
    memory = _bar_colours(monkeypatch, pr.plot_memory, tmp_path)
    labels = [label for label, _, _ in pr.SYSTEMS]
    assert set(labels) <= set(throughput)
    memory = {k: v for k, v in memory.items() if k in labels}
    assert set(memory) == set(labels)
    assert {k: memory[k] for k in labels} == {k: throughput[k] for k in labels}
    assert len(set(throughput[k] for k in labels)) == len(labels)

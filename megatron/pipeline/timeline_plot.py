"""Draw a pipeline timeline in the style of the PipeDream-2BW paper's Figures 2 and 3.

One row per stage (worker; per rank when a stage has data-parallel replicas), time to
the right.  Forward passes are light boxes and
backward passes dark boxes of the same hue, with the microbatch id (0-indexed) inside;
the hue follows the batch, or the weight version for 2BW.  Optimizer steps, where a new
weight version is generated, are cross-hatched markers; idle time is the grey row
background showing through.  Works on simulated events and on merged real traces.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from megatron.pipeline.trace import TraceEvent  # noqa: E402

# Colour-blind friendly hues (Okabe-Ito, minus black/yellow which read badly as boxes).
_HUES = ["#0072B2", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#E69F00", "#8C564B",
         "#7F7F7F"]
_STEP_COLOUR = "#1B5E20"


def _shade(colour: str, towards_white: float) -> Tuple[float, float, float]:
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * towards_white, g + (1 - g) * towards_white,
            b + (1 - b) * towards_white)


def _colour_key(e: TraceEvent, color_by: str) -> int:
    if color_by == "version" and e.version is not None:
        return e.version
    return e.batch if e.batch is not None else 0


def image_formats() -> List[str]:
    """File extensions (without the dot) ``plot_timeline(output=...)`` can write."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return sorted(FigureCanvasAgg.get_supported_filetypes())


def image_path_problem(output: Union[str, Path]) -> Optional[str]:
    """What is wrong with ``output`` as an image file name (its extension names no format
    matplotlib writes), or None.  Checked before drawing: savefig would fail at the end."""
    ext = Path(output).suffix.lstrip(".").lower()
    formats = image_formats()
    if ext in formats:
        return None
    others = ", ".join(f".{f}" for f in formats if f not in ("png", "pdf", "svg"))
    found = f"'.{ext}'" if ext else "no extension"
    return (f"expected an image file name ending in .png, .pdf or .svg (or {others}), "
            f"found {found}")


def timeline_rows(events: Sequence[TraceEvent]
                  ) -> Tuple[Dict[Tuple[int, int], int], List[str]]:
    """Row of each ``(stage, rank)`` (top to bottom: by stage, then rank) and the rows'
    labels.  A stage with data-parallel replicas (w > 1, several ranks per stage) gets a
    row per rank, labelled ``stage s, rank r``: on one row their boxes would overlap.
    With one rank per stage (every simulation) a row is labelled ``stage s``."""
    keys = sorted({(e.stage, e.rank) for e in events})
    replicated = len(keys) > len({s for s, _ in keys})
    labels = [f"stage {s}, rank {r}" if replicated else f"stage {s}" for s, r in keys]
    return {k: i for i, k in enumerate(keys)}, labels


def plot_timeline(events: Sequence[TraceEvent], *, title: str = "",
                  color_by: str = "batch", time_label: str = "time",
                  output: Optional[Union[str, Path]] = None, dpi: int = 150):
    """Draw ``events`` (all stages) and return the matplotlib Figure.

    ``color_by`` is ``"batch"`` or ``"version"`` (the weight version of each F/B, the
    paper's colouring of 2BW).  With ``output`` the figure is saved there (PNG/PDF/SVG by
    extension; another extension is a ValueError before anything is drawn) and closed.
    """
    if color_by not in ("batch", "version"):
        raise ValueError(f"plot_timeline: color_by must be 'batch' or 'version', got {color_by!r}")
    problem = image_path_problem(output) if output is not None else None
    if problem:
        raise ValueError(f"plot_timeline: cannot write {str(output)!r}: {problem}")
    row, row_labels = timeline_rows(events)
    if not row:
        raise ValueError("plot_timeline: no events to draw")
    t0 = min(e.start for e in events)
    makespan = max(e.end for e in events) - t0
    compute = [e for e in events if e.op in ("F", "B")]
    min_box = min((e.duration for e in compute if e.duration > 0), default=makespan / 50 or 1)

    width_in = min(max(9.0, 0.2 * makespan / min_box), 26.0)
    fig, ax = plt.subplots(figsize=(width_in, 0.9 + 0.55 * len(row)))
    for i in row.values():
        ax.add_patch(Rectangle((0, i - 0.42), makespan, 0.84, facecolor="#EDEDED",
                               edgecolor="none", zorder=0))
    pts_per_unit = (width_in * 0.85 * 72) / max(makespan, 1e-12)
    keys: Dict[int, str] = {}
    for e in compute:
        key = _colour_key(e, color_by)
        hue = keys.setdefault(key, _HUES[key % len(_HUES)])
        face = _shade(hue, 0.55) if e.op == "F" else _shade(hue, 0.0)
        x, y = e.start - t0, row[(e.stage, e.rank)]
        ax.add_patch(Rectangle((x, y - 0.38), e.duration, 0.76, facecolor=face,
                               edgecolor="black", linewidth=0.5, zorder=2))
        label = str(e.microbatch)
        size = min(9.0, e.duration * pts_per_unit / (0.7 * len(label) + 0.6))
        if size >= 4:
            ax.text(x + e.duration / 2, y, label, ha="center", va="center", fontsize=size,
                    color="black" if e.op == "F" else "white", zorder=3)
    _draw_steps(ax, events, row, t0, min_box)
    _draw_reduces(ax, events, row, t0)

    ax.set_xlim(0, makespan + 0.3 * min_box)
    ax.set_ylim(len(row) - 0.5, -0.5)
    ax.set_yticks(range(len(row)))
    ax.set_yticklabels(row_labels)
    ax.set_xlabel(time_label)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(handles=_legend(keys, color_by), loc="upper left", bbox_to_anchor=(1.005, 1.0),
              fontsize=7, frameon=False)
    fig.tight_layout()
    if output is not None:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(output, dpi=dpi)
        plt.close(fig)
    return fig


def _draw_steps(ax, events: Sequence[TraceEvent], row: Dict[Tuple[int, int], int], t0: float,
                min_box: float) -> None:
    """Cross-hatched marker at each STEP (new weight version b + 1 after batch b)."""
    marker = 0.3 * min_box
    for e in events:
        if e.op != "S@":
            continue
        width = max(e.duration, marker)
        x = e.start - t0 if e.duration >= marker else e.start - t0 - marker / 2
        ax.add_patch(Rectangle((x, row[(e.stage, e.rank)] - 0.45), width, 0.9, facecolor="white",
                               edgecolor=_STEP_COLOUR, hatch="xxxx", linewidth=0.8, zorder=4))


def _draw_reduces(ax, events: Sequence[TraceEvent], row: Dict[Tuple[int, int], int],
                  t0: float) -> None:
    """Data-parallel gradient all-reduces, when they took measurable time."""
    for e in events:
        if e.op == "R@" and e.duration > 0:
            ax.add_patch(Rectangle((e.start - t0, row[(e.stage, e.rank)] - 0.2), e.duration, 0.4,
                                   facecolor="#BDBDBD", edgecolor="#616161", linewidth=0.5,
                                   zorder=2))


def _legend(keys: Dict[int, str], color_by: str) -> List[Patch]:
    handles: List[Patch] = []
    name = "weights v" if color_by == "version" else "batch "
    for key, hue in sorted(keys.items()):
        handles.append(Patch(facecolor=_shade(hue, 0.55), edgecolor="black", linewidth=0.5,
                             label=f"{name}{key} forward"))
        handles.append(Patch(facecolor=hue, edgecolor="black", linewidth=0.5,
                             label=f"{name}{key} backward"))
    handles.append(Patch(facecolor="white", edgecolor=_STEP_COLOUR, hatch="xxxx",
                         label="optimizer step\n(new weight version)"))
    handles.append(Patch(facecolor="#EDEDED", edgecolor="none", label="idle"))
    return handles

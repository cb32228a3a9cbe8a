"""Markdown formatting shared by tools/make_results.py and its renderers."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

MAX_ROWS = 40


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1e5 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        if len(v) > 8 or any(isinstance(x, (dict, list)) for x in v):
            return f"({len(v)} values)"
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, dict):
        return f"({len(v)} fields)"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def records_table(records: List[Dict[str, Any]], max_rows: int = MAX_ROWS) -> str:
    """A list of flat-ish dicts as a table (scalar fields only, first-seen column order)."""
    cols: List[str] = []
    for r in records:
        for k, v in r.items():
            if k not in cols and is_scalar(v):
                cols.append(k)
    text = md_table(cols, [[r.get(c) for c in cols] for r in records[:max_rows]])
    if len(records) > max_rows:
        text += f"\n\n({len(records) - max_rows} more rows in the JSON)"
    return text


def pct(x: float) -> str:
    return f"{x * 100:+.2f}%"


def or_not_reached(v: Optional[float]) -> Any:
    return "not reached" if v is None else v

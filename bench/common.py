"""Helpers shared by the benches: machine description, tables, JSON results, and the
GPT set-up the trainer does (so a bench can rebuild the same model and data by hand).

Every bench prints a table and writes ``bench/results/<name>.json`` with
``write_results``; the JSON always carries ``machine`` (platform, CPU count, torch
version, date) because absolute times on a shared CPU are only indicative.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"

if str(REPO_ROOT) not in sys.path:
    # benches run as scripts (python bench/x.py): make the repo importable without install
    sys.path.insert(0, str(REPO_ROOT))


def machine_info() -> Dict[str, Any]:
    """Where and when the numbers were measured."""
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of an empty list (did the bench record any step?)")
    return float(statistics.median(values))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 title: Optional[str] = None) -> str:
    """A plain fixed-width table; floats get 3 significant decimals."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1e4 else f"{v:.4g}"
        return "-" if v is None else str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h)
              for i, h in enumerate(headers)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in text)
    return "\n".join(lines)


def write_results(name: str, payload: Dict[str, Any], out_dir: Optional[Path] = None) -> Path:
    """Write ``payload`` plus ``machine`` to ``<out_dir>/<name>.json``; returns the path."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    data = {"bench": name, "machine": machine_info(), **payload}
    # serialise first, then replace the file in one step: a value JSON cannot hold (or
    # any failure on the way) leaves the previous results as they were, never a
    # truncated file in their place
    text = json.dumps(data, indent=2, sort_keys=False, default=_jsonable) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def bench_command(script: str, argv: Optional[Sequence[str]]) -> str:
    """The command line that reproduces a bench run, for its JSON's ``command``:
    ``script`` (e.g. ``bench/memory.py``) with ``argv`` (``sys.argv[1:]`` when None),
    shell-quoted."""
    import shlex

    args = list(argv) if argv is not None else sys.argv[1:]
    return " ".join(["PYTHONPATH=. python", script, *(shlex.quote(a) for a in args)])


def figure_entry(figure: Path) -> str:
    """How a bench's JSON names a figure it wrote: relative to the repository when inside
    it (so docs/RESULTS.md can link it), else the path as given."""
    figure = Path(figure)
    return str(figure.relative_to(REPO_ROOT)) if figure.is_relative_to(REPO_ROOT) \
        else str(figure)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"write_results: cannot store {type(obj).__name__} in JSON")


def mock_gpt_argv(m: Dict[str, int], iters: int) -> List[str]:
    """Trainer flags of a small float32 GPT on random tokens, without dropout (so runs
    that differ in one switch compute the same function): ``m`` gives layers, hidden,
    heads, seq, vocab and micro_batch; 4 microbatches per batch."""
    return [
        "--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
        "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
        "--max-position-embeddings", str(m["seq"]), "--vocab-size", str(m["vocab"]),
        "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--micro-batch-size", str(m["micro_batch"]),
        "--global-batch-size", str(4 * m["micro_batch"]), "--train-iters", str(iters),
        "--lr", "1e-3", "--lr-decay-style", "constant", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--seed", "5", "--log-interval", "1000",
        "--eval-interval", "100000", "--eval-iters", "1", "--num-workers", "0"]


def gpt_config(argv: List[str]) -> Tuple[Any, Any]:
    """``(cfg, tokenizer)`` exactly as ``megatron.training.pretrain`` derives them from
    ``argv`` (padded vocabulary included), for building the same GPT outside the trainer."""
    from megatron.arguments import parse_and_validate
    from megatron.tokenizer import build_tokenizer, vocab_size_with_padding

    args, cfg = parse_and_validate(list(argv))
    tokenizer = build_tokenizer(cfg.data, cfg.parallel.tensor_model_parallel_size,
                                vocab_size=getattr(args, "vocab_size", None))
    cfg.model.padded_vocab_size = vocab_size_with_padding(
        tokenizer.vocab_size, cfg.data.make_vocab_size_divisible_by,
        cfg.parallel.tensor_model_parallel_size)
    return cfg, tokenizer


def first_reach(curve: Dict[Any, float], target: float) -> Optional[float]:
    """First (linearly interpolated) iteration where ``curve`` is at ``target`` or below.

    ``curve`` maps iteration -> loss; keys may be ints or strings (as read from JSON)."""
    pts = sorted((int(k), v) for k, v in curve.items())
    for i, (it, v) in enumerate(pts):
        if v <= target:
            if i == 0:
                return float(it)
            it0, v0 = pts[i - 1]
            return it0 + (it - it0) * (v0 - target) / (v0 - v)
    return None


def run_tool(args: List[str], who: str, log=None) -> None:
    """Run one of the repository's tools (``tools/x.py ...``) and fail loudly."""
    import subprocess

    proc = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True)
    if log is not None:
        log.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{who}: `{' '.join(args)}` failed:\n{proc.stdout}\n{proc.stderr}")


def write_corpus(corpus: Path, docs: List[str], source: str, who: str, log=None) -> str:
    """Write ``docs`` as loose JSON lines (or the stdlib demo corpus when there are none)
    unless ``corpus`` exists; return a description of where the text came from."""
    if not corpus.is_file():
        if docs:
            with open(corpus, "w", encoding="utf-8") as f:
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
        else:
            print(f"[{who}] real text unavailable ({source}); using the demo corpus")
            run_tool(["tools/make_demo_corpus.py", "--output", str(corpus)], who, log)
    return source if docs else "tools/make_demo_corpus.py (stdlib documentation strings)"

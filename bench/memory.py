"""Memory per pipeline stage: none / gpipe / flush / 2bw, with and without recompute.

    PYTHONPATH=. python bench/memory.py            # a few minutes on 2 CPU cores
    PYTHONPATH=. python bench/memory.py --quick    # d=2 only
    PYTHONPATH=. python bench/memory.py --quick --smoke   # seconds (tests)

A small GPT (mock data) is trained for a few iterations on d gloo CPU ranks for several
(d, m, b).  On every stage we read, from the live objects after training:

* weights: the pipeline engine's peak number of live weight versions x bytes per
  version (PipeDream-2BW keeps 2, every other schedule 1);
* masters: the fp32 master copies the optimizer keeps for fp16/bf16 weights (0 in fp32);
* optimizer state: bytes of every tensor in the torch optimizer's state (Adam moments);
* stashed activations: the engine's measured peak of bytes saved for backward, summed
  over in-flight microbatches (``megatron/pipeline/memory.py`` counts them with
  saved-tensor hooks), and the measured bytes of ONE microbatch's stash.

Beside the measurement, the paper's worst-case formula (section 3.1), filled with the
measured stage weight bytes |W_s| and per-microbatch stash bytes a_s:

    2bw: 2|W_s| + d a_s    flush: |W_s| + d a_s    gpipe: |W_s| + m a_s    none: |W_s| + a_s

(with --recompute-activations a_s is the stage input only).  The paper's worst case is
stage 0, which holds min(d, m) in-flight microbatches under 1F1B; stage s holds
min(d - s, m).  The bench checks that the measured bytes equal the formula on stage 0
and the per-stage count on the others.  The formula's transient term
|A_total(b)|/d (one microbatch's full activations while it is recomputed) is not a stash
and is not counted on either side.  Figure (paper Figure 6 style):
docs/figures/memory_per_schedule.png.  Results: bench/results/memory.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO_ROOT, bench_command, figure_entry, format_table,  # noqa: E402
                          write_results)
from bench.convergence import git_revision  # noqa: E402

SCHEDULES = ("none", "gpipe", "flush", "2bw")
FIGURE = REPO_ROOT / "docs" / "figures" / "memory_per_schedule.png"
MIB = 2.0 ** 20


def model_argv(quick: bool, smoke: bool) -> List[str]:
    hidden, seq, vocab = (32, 16, 256) if smoke else (128, 128, 2048)
    return ["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--vocab-size", str(vocab), "--make-vocab-size-divisible-by", "128",
            "--tokenizer-type", "NullTokenizer", "--mock-data"]


def configs(quick: bool, smoke: bool) -> List[Dict[str, Any]]:
    """(d, m, b, precision) points; each runs every schedule with and without recompute."""
    if smoke:
        return [dict(d=2, m=2, b=1, precision="fp32")]
    pts = [dict(d=2, m=4, b=2, precision="fp32"), dict(d=2, m=8, b=2, precision="fp32"),
           dict(d=2, m=4, b=2, precision="bf16")]
    if not quick:
        pts += [dict(d=4, m=8, b=2, precision="fp32"), dict(d=4, m=16, b=1, precision="fp32")]
    return pts


def run_argv(base: List[str], c: Dict[str, Any], schedule: str, recompute: bool,
             iters: int) -> List[str]:
    argv = base + ["--micro-batch-size", str(c["b"]), "--global-batch-size", str(c["b"] * c["m"]),
                   "--pipeline-model-parallel-size", str(c["d"]),
                   "--pipeline-schedule", schedule, "--distributed-backend", "gloo",
                   "--train-iters", str(iters), "--lr", "1e-4", "--seed", "1234",
                   "--log-interval", "100000", "--eval-interval", "100000", "--eval-iters", "0",
                   "--num-workers", "0"]
    if c["precision"] != "fp32":
        argv.append(f"--{c['precision']}")
    if recompute:
        argv.append("--recompute-activations")
    return argv


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _stage_numbers(engine: Any, optimizer: Any) -> Dict[str, Any]:
    stats = engine.tracker.stats
    per_mb = list(stats.per_microbatch_bytes.values())
    masters = (sum(p.numel() * p.element_size() for p in optimizer.main_params)
               if optimizer.use_masters else 0)
    return {"stage": engine.stage, "weight_versions": stats.peak_weight_versions,
            "weight_bytes_per_version": stats.weight_bytes_per_version,
            "weight_bytes": stats.peak_weight_bytes, "master_bytes": masters,
            "optimizer_state_bytes": _tensor_bytes(list(optimizer.optimizer.state.values())),
            "stash_bytes": stats.peak_stashed_bytes, "peak_in_flight": stats.peak_in_flight,
            "microbatch_stash_bytes": max(per_mb) if per_mb else 0,
            "microbatch_stash_bytes_min": min(per_mb) if per_mb else 0}


def _worker(rank: int, world: int, runs: List[Tuple[Dict[str, Any], List[str]]]
            ) -> List[Dict[str, Any]]:
    import torch

    import megatron.training as training
    import pretrain_gpt

    torch.set_num_threads(1)
    captured: Dict[str, Any] = {}
    original = training.setup_model_and_optimizer

    def capture(*args, **kwargs):
        # keep the engine and optimizer pretrain() builds, to read their state afterwards
        out = original(*args, **kwargs)
        captured["optimizer"], captured["engine"] = out[1], out[3]
        return out

    training.setup_model_and_optimizer = capture
    out = []
    try:
        for key, argv in runs:
            with contextlib.redirect_stdout(io.StringIO()):
                training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                  pretrain_gpt.forward_step, argv=argv)
            out.append({**key, **_stage_numbers(captured["engine"], captured["optimizer"])})
            captured.clear()
    finally:
        training.setup_model_and_optimizer = original
    return out


def formula_in_flight(schedule: str, d: int, m: int) -> int:
    """The paper's worst-case number of stashed microbatches on a stage."""
    if schedule == "none":
        return 1
    if schedule == "gpipe":
        return m
    return min(d, m)


def stage_in_flight(schedule: str, d: int, m: int, stage: int) -> int:
    """Exact stashed microbatches on ``stage`` under each schedule (1F1B: d - stage)."""
    if schedule in ("flush", "2bw"):
        return min(d - stage, m)
    return formula_in_flight(schedule, d, m)


def add_formula(row: Dict[str, Any]) -> Dict[str, Any]:
    versions = 2 if row["schedule"] == "2bw" else 1
    n = formula_in_flight(row["schedule"], row["d"], row["m"])
    row["formula_in_flight"] = n
    row["stage_in_flight"] = stage_in_flight(row["schedule"], row["d"], row["m"], row["stage"])
    row["formula_weight_bytes"] = versions * row["weight_bytes_per_version"]
    row["formula_stash_bytes"] = n * row["microbatch_stash_bytes"]
    row["formula_bytes"] = row["formula_weight_bytes"] + row["formula_stash_bytes"]
    row["stage_formula_bytes"] = (row["formula_weight_bytes"]
                                  + row["stage_in_flight"] * row["microbatch_stash_bytes"])
    row["measured_bytes"] = row["weight_bytes"] + row["stash_bytes"]
    row["total_bytes"] = (row["weight_bytes"] + row["master_bytes"]
                          + row["optimizer_state_bytes"] + row["stash_bytes"])
    return row


def measure(cfgs: Sequence[Dict[str, Any]], base: List[str], iters: int,
            timeout: float) -> List[Dict[str, Any]]:
    from tests.dist_utils import run_distributed

    rows: List[Dict[str, Any]] = []
    for d in sorted({c["d"] for c in cfgs}):
        runs = []
        for index, c in enumerate(cfgs):
            if c["d"] != d:
                continue
            for recompute in (False, True):
                for s in SCHEDULES:
                    key = {**c, "config": index, "schedule": s, "recompute": recompute}
                    runs.append((key, run_argv(base, c, s, recompute, iters)))
        per_rank = run_distributed(_worker, d, args=(runs,), timeout=timeout)
        for rank_rows in per_rank:
            rows += [add_formula(r) for r in rank_rows]
    rows.sort(key=lambda r: (r["config"], r["recompute"], SCHEDULES.index(r["schedule"]),
                             r["stage"]))
    return rows


def check_formula(rows: List[Dict[str, Any]]) -> List[str]:
    """Runs whose measured weights + stash differ from the formula: the paper's worst
    case on stage 0, the per-stage 1F1B count (d - s in flight) on the others."""
    bad = []
    for r in rows:
        want = r["formula_bytes"] if r["stage"] == 0 else r["stage_formula_bytes"]
        if r["measured_bytes"] != want:
            bad.append(f"{r['schedule']} d={r['d']} m={r['m']} b={r['b']} {r['precision']} "
                       f"recompute={r['recompute']} stage {r['stage']}: measured "
                       f"{r['measured_bytes']} B vs formula {want} B")
    return bad


def config_label(r: Dict[str, Any]) -> str:
    return f"d={r['d']} m={r['m']} b={r['b']} {r['precision']}"


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    """One panel per (d, m, b, precision): worst stage's stacked bytes per schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = list(dict.fromkeys(config_label(r) for r in rows))
    width = max(10.0, 3.4 * len(labels) + 1)
    fig, axes = plt.subplots(1, len(labels), figsize=(width, 4.8), squeeze=False)
    parts = (("weight_bytes", "weights (all versions)", "tab:blue"),
             ("master_bytes", "fp32 masters", "tab:cyan"),
             ("optimizer_state_bytes", "optimizer state", "tab:gray"),
             ("stash_bytes", "stashed activations", "tab:orange"))
    for ax, label in zip(axes[0], labels):
        mine = [r for r in rows if config_label(r) == label]
        for i, s in enumerate(SCHEDULES):
            for j, rc in enumerate((False, True)):
                stage_rows = [r for r in mine if r["schedule"] == s and r["recompute"] == rc]
                worst = max(stage_rows, key=lambda r: r["total_bytes"])
                x = i + (j - 0.5) * 0.4
                bottom = 0.0
                for key, _, color in parts:
                    h = worst[key] / MIB
                    ax.bar(x, h, 0.38, bottom=bottom, color=color, edgecolor="black", lw=0.4,
                           hatch="//" if rc else None)
                    bottom += h
                formula = (worst["formula_bytes"] + worst["master_bytes"]
                           + worst["optimizer_state_bytes"]) / MIB
                ax.plot([x - 0.19, x + 0.19], [formula, formula], color="black", lw=1.6)
        ax.set_xticks(range(len(SCHEDULES)))
        ax.set_xticklabels(SCHEDULES)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("MiB, worst stage")
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=c, label=t) for _, t, c in parts]
    handles += [Patch(facecolor="white", edgecolor="black", hatch="//",
                      label="with --recompute-activations"),
                plt.Line2D([], [], color="black", lw=1.6,
                           label="paper formula (+ masters + optimizer state)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Memory of the worst pipeline stage, small GPT on CPU ranks (each pair: "
                 "without / with activation recomputation)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_rows(rows: List[Dict[str, Any]]) -> None:
    table = [[config_label(r), r["schedule"], "yes" if r["recompute"] else "no", r["stage"],
              r["weight_versions"], r["weight_bytes"] / MIB, r["master_bytes"] / MIB,
              r["optimizer_state_bytes"] / MIB, r["peak_in_flight"],
              r["microbatch_stash_bytes"] / MIB, r["stash_bytes"] / MIB,
              r["measured_bytes"] / MIB, r["stage_formula_bytes"] / MIB, r["formula_bytes"] / MIB]
             for r in rows]
    print(format_table(["config", "schedule", "recomp", "stage", "versions", "weights MiB",
                        "masters MiB", "optim MiB", "in-flight", "stash/mb MiB", "stash MiB",
                        "W+stash MiB", "stage formula", "paper worst"], table,
                       title="measured bytes per stage beside the paper's formula"))


# ---------------------------------------------------------------------------------------
# layer-level vs stage-level recomputation at d=1 (--layer-recompute)
# ---------------------------------------------------------------------------------------
RECOMPUTE_VARIANTS = (
    ("none", []),
    ("stage (--recompute-activations)", ["--recompute-activations"]),
    ("uniform 1", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "1"]),
    ("uniform 2", ["--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "2"]),
    ("block 2", ["--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", "2"]),
)


def recompute_argv(smoke: bool) -> List[str]:
    # big enough that one microbatch's activations (attention scores: b x heads x s x s)
    # dwarf the weights, the optimizer state and the allocator's noise
    hidden, seq, b, vocab = (32, 32, 2, 256) if smoke else (256, 512, 8, 2048)
    return ["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--vocab-size", str(vocab), "--tokenizer-type", "NullTokenizer", "--mock-data",
            "--micro-batch-size", str(b), "--global-batch-size", str(2 * b),
            "--pipeline-schedule", "flush", "--distributed-backend", "gloo",
            "--train-iters", "2", "--lr", "1e-4", "--seed", "1234", "--log-interval", "100000",
            "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0"]


def _rss_worker(rank: int, world: int, argv: List[str]) -> Dict[str, Any]:
    """One training run in a fresh process: the executor's stash counters and the
    process's peak resident set (ru_maxrss: everything, including the activations
    rebuilt during the backward pass, which no counter sees)."""
    import resource

    import torch

    import megatron.training as training
    import pretrain_gpt

    torch.set_num_threads(1)
    captured: Dict[str, Any] = {}
    original = training.setup_model_and_optimizer

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        captured["engine"] = out[3]
        captured["rss_after_setup"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return out

    training.setup_model_and_optimizer = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            training.pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                              pretrain_gpt.forward_step, argv=argv)
    finally:
        training.setup_model_and_optimizer = original
    stats = captured["engine"].tracker.stats
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"stash_bytes": stats.peak_stashed_bytes,
            "microbatch_stash_bytes": max(stats.per_microbatch_bytes.values()),
            "peak_rss_bytes": peak * 1024, "rss_after_setup_bytes":
            captured["rss_after_setup"] * 1024}


def measure_layer_recompute(smoke: bool) -> List[Dict[str, Any]]:
    from tests.dist_utils import run_distributed

    rows = []
    for name, extra in RECOMPUTE_VARIANTS:
        r = run_distributed(_rss_worker, 1, args=(recompute_argv(smoke) + extra,), timeout=600)[0]
        r["variant"] = name
        r["flags"] = extra
        r["training_peak_bytes"] = r["peak_rss_bytes"] - r["rss_after_setup_bytes"]
        rows.append(r)
    return rows


def print_layer_recompute(rows: List[Dict[str, Any]]) -> None:
    base = rows[0]
    print(format_table(
        ["recomputation", "stash/mb MiB", "peak stash MiB", "peak RSS MiB",
         "RSS growth in training MiB", "vs none"],
        [[r["variant"], r["microbatch_stash_bytes"] / MIB, r["stash_bytes"] / MIB,
          r["peak_rss_bytes"] / MIB, r["training_peak_bytes"] / MIB,
          r["training_peak_bytes"] / max(base["training_peak_bytes"], 1)] for r in rows],
        title="d=1 (flush, m=2): stash = executor's saved-tensor counters (exact); RSS = "
              "process peak (includes the activations rebuilt in the backward pass)"))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="d=2 configurations only")
    p.add_argument("--smoke", action="store_true", help="with --quick: a tiny model (tests)")
    p.add_argument("--iters", type=int, default=3,
                   help="training iterations per run (2BW needs >= 2 for its second version)")
    p.add_argument("--out-dir", default=None, help="where to write memory.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    p.add_argument("--layer-recompute", action="store_true",
                   help="only compare layer-level and stage-level recomputation at d=1 "
                        "(writes memory_recompute.json)")
    args = p.parse_args(argv)
    if args.layer_recompute:
        t0 = time.perf_counter()
        rows = measure_layer_recompute(args.smoke)
        print_layer_recompute(rows)
        payload = {"command": bench_command("bench/memory.py", argv),
                   # a --smoke run is a tiny model: the page must say so
                   "smoke": args.smoke, "model_argv": recompute_argv(args.smoke), "rows": rows,
                   "bench_seconds": time.perf_counter() - t0}
        path = write_results("memory_recompute", payload, args.out_dir)
        print(f"wrote {path}")
        return payload
    if args.smoke and not args.quick:
        p.error("--smoke is a variant of --quick; pass both")
    if args.iters < 2:
        p.error(f"--iters must be >= 2 (2BW creates its second weight version at the first "
                f"step), got {args.iters}")
    t0 = time.perf_counter()
    base = model_argv(args.quick, args.smoke)
    cfgs = configs(args.quick, args.smoke)
    rows = measure(cfgs, base, args.iters, timeout=1800)
    print_rows(rows)
    mismatches = check_formula(rows)
    print("measured weights + stash equal the formula on every stage of every run"
          if not mismatches else "formula mismatches on stage 0:\n  " + "\n  ".join(mismatches))
    figure = Path(args.figure) if args.figure else FIGURE
    plot(rows, figure)
    payload = {
        "command": ("PYTHONPATH=. python bench/memory.py "
                   + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
                   ).strip(),
        "quick": args.quick, "smoke": args.smoke, "model_argv": base, "iters": args.iters,
        "configs": cfgs, "rows": rows, "formula_mismatches": mismatches,
        "figures": [figure_entry(figure)],
        "git": git_revision(), "bench_seconds": time.perf_counter() - t0}
    path = write_results("memory", payload, args.out_dir)
    print(f"wrote {path} and {figure} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

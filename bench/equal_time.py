"""Time to Flush's final loss when each variant trains for Flush's wall-clock budget.

    PYTHONPATH=. python bench/equal_time.py                  # GPT and BERT, ~15 min
    PYTHONPATH=. python bench/equal_time.py --model gpt --lr 1e-3
    PYTHONPATH=. python bench/equal_time.py --smoke          # seconds (tests)

bench/convergence.py and bench/convergence_bert.py compare the variants at equal
iterations: every run gets Flush's ``--train-iters`` and so Flush's learning-rate
schedule.  A variant that is faster per iteration never uses its speed there; a user
sizes ``--train-iters`` to a time budget instead.  This bench asks the question that
way, with the same models, data, seeds and hyperparameters as those two benches:

1. the time per iteration of flush and 2bw, side by side (interleaved rounds, the
   fastest of each kept): GPT at d=4 (4 CPU ranks; ``--time-depth`` to change),
   BERT at d=2 (its 2 layers);
2. each variant's ``--train-iters`` = the iterations that fit in the time Flush needs
   for its N.  The flush warm-up variant (``--2bw-mitigation warmup``) runs its first
   ``--warmup-fraction`` at Flush's time and the rest at 2BW's, and keeps that
   fraction of its longer run; every run's lr schedule (5% warm-up, cosine to lr/10)
   follows its own length, as Flush's does;
3. Flush trains N iterations and each variant its own number, d=1 for GPT (the update
   rules are proven invariant to d), d=2 for BERT;
4. printed and written to ``bench/results/equal_time.json``: each run's final
   validation loss (equal time), the iteration and the time at which the variant first
   reaches Flush's final loss (linear between evaluations) and Flush's time over that.

``--time-source simulated`` replaces step 1's measured times by a projection: the same
timing runs write the executor's per-action trace, ``bench/pipeline_breakdown.py``'s
analysis takes each stage's median CPU time of F and B and its other CPU work per batch,
and the project's simulator gives flush's and 2bw's period with those costs and one
core (or GPU) per stage -- what a machine with a processor per stage would do, which
this 2-core box cannot show at d=4.  A projection, not a measurement: the results say
so.  A mitigation that keeps 2BW's schedule (predict, dc) is projected with flush/2bw's
F and B and its own run's other CPU work per batch (the extra optimizer passes).

Figure: docs/figures/equal_time.png (validation loss against modelled time).
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import convergence as gpt_bench  # noqa: E402
from bench import convergence_bert as bert_bench  # noqa: E402
from bench.common import (REPO_ROOT, figure_entry, first_reach, format_table,  # noqa: E402
                          write_results)

FIGURE = REPO_ROOT / "docs" / "figures" / "equal_time.png"
TIMED = ("flush", "2bw")


def budget_iterations(variant: str, flush_iters: int, seconds: Dict[str, float],
                      warmup_fraction: float) -> Tuple[int, int]:
    """(iterations, flush warm-up iterations) of ``variant`` in Flush's time for
    ``flush_iters`` iterations; the warm-up is ``warmup_fraction`` of the run."""
    budget = flush_iters * seconds["flush"]
    if variant == "flush":
        return flush_iters, 0
    if variant == "2bw+warmup":
        per_iter = warmup_fraction * seconds["flush"] + (1 - warmup_fraction) * seconds["2bw"]
        iters = int(budget / per_iter)
        return iters, int(round(warmup_fraction * iters))
    if variant not in seconds:
        raise ValueError(f"no measured time per iteration for {variant!r}")
    return int(budget / seconds[variant]), 0


def modelled_seconds(variant: str, iteration: float, seconds: Dict[str, float],
                     warmup_iters: int) -> float:
    """Seconds to reach ``iteration``: iterations x measured time per iteration (the
    warm-up's first ``warmup_iters`` at Flush's time)."""
    if variant == "2bw+warmup":
        head = min(iteration, warmup_iters)
        return head * seconds["flush"] + (iteration - head) * seconds["2bw"]
    return iteration * seconds[variant]


def break_even_ratio(variant: str, reach: Optional[float], flush_reach: float,
                     warmup_iters: int) -> Optional[float]:
    """The speed ratio (Flush's s/iteration over the variant's 2BW-schedule s/iteration)
    at which a run that first reaches Flush's final loss at iteration ``reach`` gets there
    exactly when Flush first does (iteration ``flush_reach``: its last evaluation, unless
    its validation loss was that low earlier); above it the variant is sooner.  The
    reach iteration is held fixed (a different ratio would also change the run's length
    and so its lr schedule a little).  None if the variant never reaches it, reaches it
    inside its Flush-schedule warm-up (then the ratio does not matter), or cannot be
    sooner at any speed."""
    if reach is None or variant == "flush":
        return None
    if variant == "2bw+warmup":
        if reach <= warmup_iters or flush_reach <= warmup_iters:
            return None
        return (reach - warmup_iters) / (flush_reach - warmup_iters)
    return reach / flush_reach


def _speedup(name: str, reach: Optional[float], flush_reach: float, warm: int,
             seconds: Dict[str, float]) -> Optional[float]:
    """Flush's time to its final loss over this run's (both first reaches)."""
    if reach is None or reach == 0:
        return None
    return (modelled_seconds("flush", flush_reach, seconds, 0)
            / modelled_seconds(name, reach, seconds, warm))


def round_list(row: Dict[str, Any]) -> str:
    """A run's speedups to Flush's final loss with each timing round's times, as text."""
    values = row.get("speedup_to_flush_final_per_round")
    if not values:
        return "-"
    return " ".join("-" if v is None else f"{v:.3f}" for v in values)


def summarize(curves: Dict[str, Dict[int, float]], plan: Dict[str, Dict[str, int]],
              seconds: Dict[str, float],
              rounds: Optional[Dict[str, List[float]]] = None) -> Dict[str, Dict[str, Any]]:
    """Per run: final loss, its gap to Flush's, when it first reaches Flush's final loss
    and how much sooner than Flush first does (in modelled seconds; Flush's validation
    loss may touch its final value before the last evaluation).  With ``rounds`` (each timed
    variant's s/iteration in every timing round), also that speedup with each round's
    times instead of the fastest ones: the spread the timing noise puts on it."""
    flush = curves["flush"]
    target = flush[max(flush)]
    flush_reach = first_reach(flush, target)
    out = {}
    for name, valid in curves.items():
        reach = first_reach(valid, target)
        end = max(valid)
        warm = plan[name]["warmup_iters"]
        t = None if reach is None else modelled_seconds(name, reach, seconds, warm)
        row = {"train_iters": plan[name]["train_iters"], "warmup_iters": warm,
               "modelled_seconds": modelled_seconds(name, end, seconds, warm),
               "final_valid": valid[end],
               "relative_to_flush": (valid[end] - target) / target,
               "reaches_flush_final_at": reach, "seconds_to_flush_final": t,
               "speedup_to_flush_final": _speedup(name, reach, flush_reach, warm, seconds),
               "break_even_speed_ratio": break_even_ratio(name, reach, flush_reach, warm)}
        if rounds:
            n = min(len(v) for v in rounds.values())
            per_round = [{k: v[r] for k, v in rounds.items()} for r in range(n)]
            if all(name in sec or name == "2bw+warmup" for sec in per_round):
                row["speedup_to_flush_final_per_round"] = [
                    _speedup(name, reach, flush_reach, warm, sec) for sec in per_round]
        out[name] = row
    return out


def time_variants(model: str, s: Dict[str, Any], data: Dict[str, str], lr: float,
                  rounds: int, iters: int, depth: int, names: List[str],
                  trace_dir: Optional[str] = None) -> Dict[str, Any]:
    """Fastest measured seconds per iteration of each of ``names`` (interleaved rounds,
    so a load spike on a shared machine hits every variant): {"measured": {name: s}}.
    With ``trace_dir`` the runs also write their traces, and "simulated" holds flush's
    and 2bw's period from the simulator with one core per stage and the stage costs of
    the least disturbed round of each, "stage_costs" those costs."""
    runs = []
    for r in range(rounds):
        for name in names:
            short = dict(s, iters=iters)
            if model == "gpt":
                a = gpt_bench.gpt_argv(name, short, data, depth, 1, lr)
            else:
                a = bert_bench.pretrain_argv(name, short, data["data_path"], None, depth)
            for flag, value in (("--eval-interval", str(10 * iters)), ("--eval-iters", "1"),
                                ("--lr-warmup-iters", "1")):
                a = gpt_bench._set_flag(a, flag, value)
            if trace_dir is not None:
                a = a + ["--timeline-file", f"{trace_dir}/{name}{r}.json"]
            runs.append((f"time{r}:{name}", a))
    if model == "gpt":
        res = gpt_bench.run_groups([runs], depth, 1)
    else:
        res = gpt_bench.run_groups([(runs, [])], depth, 1, worker=bert_bench._worker)["pretrain"]
    per_round = {name: [res[f"time{r}:{name}"]["seconds_per_iteration"]
                        for r in range(rounds)] for name in names}
    out: Dict[str, Any] = {"measured": {name: min(v) for name, v in per_round.items()},
                           "rounds": per_round}
    if trace_dir is not None:
        from bench.pipeline_breakdown import analyse, measured_stage_costs, simulated_period

        best = {}
        for name in names:
            found = [analyse(f"{trace_dir}/{name}{r}_rank{{rank}}.json", depth, s["m"], 2)
                     for r in range(rounds)]
            best[name] = min(found, key=lambda a: a["period_s"])
        costs = measured_stage_costs(best["flush"], best["2bw"])
        out["simulated"] = {name: simulated_period(name, costs, s["m"], 8) for name in TIMED}
        out["stage_costs"] = costs
        # a mitigation computes the same forward and backward passes as 2bw and adds
        # optimizer work: its own run's other CPU work per batch on top of those F and B
        for name in names:
            if name not in TIMED:
                own = [dict(c, other_ms=max(0.0, st["other_cpu_ms"]))
                       for c, st in zip(costs, best[name]["stages"])]
                out["simulated"][name] = simulated_period("2bw", own, s["m"], 8)
                out.setdefault("mitigation_stage_costs", {})[name] = own
    return out


def train(model: str, s: Dict[str, Any], data: Dict[str, str], lr: float,
          plan: Dict[str, Dict[str, int]], jobs: int) -> Dict[str, Dict[int, float]]:
    """Validation curves of every planned run (name -> {iteration: lm loss})."""
    runs = []
    for name, p in plan.items():
        sized = dict(s, iters=p["train_iters"])
        if model == "gpt":
            a = gpt_bench.gpt_argv(name, sized, data, 1, 1, lr)
        else:
            a = bert_bench.pretrain_argv(name, dict(sized, lr=lr), data["data_path"], None)
        if name == "2bw+warmup":
            a = a + ["--2bw-flush-warmup-iters", str(p["warmup_iters"])]
        runs.append((name, a))
    # every run's training set is built for the longest run's samples: the index
    # mapping's shuffle depends on the sample count, and runs of different lengths
    # must see the same samples in the same order
    samples = max(p["train_iters"] for p in plan.values()) * s["mbs"] * s["m"]
    if model == "gpt":
        res = gpt_bench.run_groups([([r], samples) for r in runs], 1, jobs)
        return {n: {int(k): v for k, v in res[n]["valid"].items()} for n, _ in runs}
    res = gpt_bench.run_groups([([r], [], samples) for r in runs], 2, jobs,
                               worker=bert_bench._worker)["pretrain"]
    return {n: bert_bench.curve(res[n]["valid"], "lm loss") for n, _ in runs}


def plot(results: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        seconds, target = res["seconds_per_iteration"], res["flush_final_valid"]
        for name, curve in res["curves"].items():
            label, color, ls = gpt_bench.STYLES.get(name, (name, None, "-"))
            warm = res["plan"][name]["warmup_iters"]
            its = sorted(int(k) for k in curve)
            ax.plot([modelled_seconds(name, i, seconds, warm) for i in its],
                    [curve[i] for i in its], color=color, ls=ls, marker="o", ms=2.5,
                    label=f"{label}, {res['plan'][name]['train_iters']} it: "
                          f"{curve[its[-1]]:.3f}")
        ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"Flush's final {target:.3f}")
        lo = min(min(c.values()) for c in res["curves"].values())
        ax.set_ylim(lo - 0.05, target + 0.6)
        source = ("simulated s/iteration, a core per stage" if res.get("time_source") == "simulated"
                  else "measured s/iteration")
        ax.set_xlabel(f"seconds (iterations x {source} at d={res['time_depth']})")
        ax.set_ylabel("validation lm loss (nats/token)")
        ax.set_title(f"{res['model'].upper()}, peak lr {res['lr']:g}: equal time budget"
                     + (" (projected)" if res.get("time_source") == "simulated" else ""),
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    projected = any(r.get("time_source") == "simulated" for r in results)
    fig.suptitle("Each run trains for Flush's time (--train-iters sized from the "
                 + ("simulated time per iteration with a core per stage, a projection"
                    if projected else "measured time per iteration")
                 + "); the tail of each curve", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("gpt", "bert", "both"), default="both")
    p.add_argument("--smoke", action="store_true", help="tiny models, seconds (tests)")
    p.add_argument("--variants", nargs="+", default=["2bw+warmup"],
                   choices=[v for v in gpt_bench.VARIANTS if v != "flush"],
                   help="what runs against Flush (default: the flush warm-up)")
    p.add_argument("--warmup-fraction", type=float, default=0.5,
                   help="share of the 2bw+warmup run under Flush (default 0.5)")
    p.add_argument("--lr", type=float, nargs="+", default=None,
                   help="GPT peak learning rates (default 1e-3 3e-4); BERT uses its bench's")
    p.add_argument("--time-source", choices=("measured", "simulated"), default="measured",
                   help="s/iteration measured here (default), or projected by the simulator "
                        "for a processor per stage from the measured stage costs")
    p.add_argument("--time-depth", type=int, default=None,
                   help="pipeline stages d of GPT's timing runs (default 4, smoke 2; BERT "
                        "always 2, its layer count); d=2 is what a 2-core machine runs with "
                        "a core per stage")
    p.add_argument("--time-rounds", type=int, default=None, help="default 3 (smoke 1)")
    p.add_argument("--time-iters", type=int, default=None, help="default 30 (smoke 2)")
    p.add_argument("--jobs", type=int, default=2, help="runs trained at the same time")
    p.add_argument("--work-dir", default=None, help="data cache (default: the benches')")
    p.add_argument("--out-dir", default=None, help="where to write equal_time.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    args = p.parse_args(argv)
    if not 0.0 <= args.warmup_fraction < 1.0:
        p.error(f"--warmup-fraction {args.warmup_fraction}: expected 0 <= f < 1")
    simulated = args.time_source == "simulated"
    rounds = args.time_rounds or (1 if args.smoke else 3)
    time_iters = args.time_iters or (2 if args.smoke else 30)
    models = ["gpt", "bert"] if args.model == "both" else [args.model]
    t0 = time.perf_counter()
    results = []
    for model in models:
        bench = gpt_bench if model == "gpt" else bert_bench
        s = bench.model_settings(args.smoke, args.smoke)
        work = Path(args.work_dir) if args.work_dir else None
        if model == "gpt":
            data = gpt_bench.prepare_data(work or Path("/tmp/megatron-bench/convergence"),
                                          s["vocab"], s["max_chars"] or None)
            lrs = args.lr or ([1e-3] if args.smoke else [1e-3, 3e-4])
            depth = min(args.time_depth or (2 if args.smoke else 4), s["layers"])
        else:
            data = bert_bench.prepare_data(work or Path("/tmp/megatron-bench/convergence_bert"),
                                           s["max_chars"] or None)
            lrs, depth = [s["lr"]], 2
        # the warm-up variant is timed as its two parts: Flush and 2BW
        timed = list(TIMED) + [v for v in args.variants if v not in (*TIMED, "2bw+warmup")]
        print(f"[equal_time] {model}: timing {', '.join(timed)} at d={depth} ...", flush=True)
        with tempfile.TemporaryDirectory() as traces:
            timing = time_variants(model, s, data, lrs[0], rounds, time_iters, depth, timed,
                                   traces if simulated else None)
        seconds = timing["simulated" if simulated else "measured"]
        if simulated:
            print(f"[equal_time] {model}: s/iteration measured at d={depth} "
                  + ", ".join(f"{k} {v:.4f}" for k, v in timing["measured"].items())
                  + "; projected for a core per stage "
                  + ", ".join(f"{k} {v:.4f}" for k, v in seconds.items()), flush=True)
        plan = {}
        for name in ["flush", *args.variants]:
            iters, warm = budget_iterations(name, s["iters"], seconds, args.warmup_fraction)
            plan[name] = {"train_iters": iters, "warmup_iters": warm}
        for lr in lrs:
            print(f"[equal_time] {model} lr {lr:g}: "
                  + ", ".join(f"{n} {p['train_iters']} it" for n, p in plan.items()),
                  flush=True)
            curves = train(model, s, data, lr, plan, args.jobs)
            summary = summarize(curves, plan, seconds,
                                None if simulated else timing["rounds"])
            print(format_table(
                ["run", "iterations", "of them Flush", "modelled s", "final valid loss",
                 "vs Flush", "reaches Flush's final at", "s to it", "Flush s / s to it",
                 "per timing round", "sooner if Flush s/it over its 2BW s/it >"],
                [[n, v["train_iters"], v["warmup_iters"], v["modelled_seconds"],
                  v["final_valid"], f"{v['relative_to_flush'] * 100:+.2f}%",
                  v["reaches_flush_final_at"], v["seconds_to_flush_final"],
                  v["speedup_to_flush_final"], round_list(v), v["break_even_speed_ratio"]]
                 for n, v in summary.items()],
                title=f"{model.upper()} peak lr {lr:g}: each run sized to Flush's "
                      f"{s['iters']} iterations of time (s/iteration at d={depth}"
                      + (", PROJECTED for a core per stage" if simulated else "") + ": "
                      + ", ".join(f"{k} {v:.4f}" for k, v in seconds.items()) + ")"))
            results.append({"model": model, "lr": lr, "time_depth": depth,
                            "time_source": args.time_source,
                            "measured_seconds_per_iteration": timing["measured"],
                            "measured_rounds": timing["rounds"],
                            "stage_costs": timing.get("stage_costs"),
                            "mitigation_stage_costs": timing.get("mitigation_stage_costs"),
                            "seconds_per_iteration": seconds, "plan": plan,
                            "flush_iters": s["iters"],
                            "flush_final_valid": summary["flush"]["final_valid"],
                            "summary": summary, "curves": curves})
    figure = Path(args.figure) if args.figure else FIGURE
    plot(results, figure)
    payload = {
        "command": ("PYTHONPATH=. python bench/equal_time.py " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))).strip(),
        "smoke": args.smoke, "variants": args.variants, "time_source": args.time_source,
        "warmup_fraction": args.warmup_fraction,
        "timing": {"rounds": rounds, "iterations": time_iters, "kept": "fastest round",
                   "every_round": "runs[].measured_rounds"},
        "runs": results, "git": gpt_bench.git_revision(),
        "figures": [figure_entry(figure)],
        "bench_seconds": time.perf_counter() - t0}
    path = write_results("equal_time", payload, args.out_dir)
    print(f"wrote {path} and {figure} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

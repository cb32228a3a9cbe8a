#!/usr/bin/env python
"""The paper's section 5 on modelled p3.16xlarge servers, beside the paper's own numbers.

    python bench/paper_reproduction.py [--no-sim] [--out-dir DIR] [--figure-dir DIR]

Everything here is a *prediction* of the planner's closed-form cost model (Appendix A),
cross-checked by the event simulator on the same stage costs (``--no-sim`` skips it);
nothing is measured on GPUs.  Writes bench/results/paper_reproduction.json and
docs/figures/paper_*.png; docs/paper_reproduction.md discusses the results.

Protocol of section 5.2, as the paper states it: activation recomputation on, "the
largest per-GPU microbatch size that fits", the global batch fixed per point, 8-way
model parallelism for GPT-2.2B (8 and 64 GPUs) and 16-way for GPT-3.8B (64 GPUs),
data parallelism across the remaining GPUs.  The batch sizes of the figure are not in
the paper's text except 2048; we use 64/256 on 8 GPUs and 512/2048 on 64 GPUs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatron.pipeline.planner import (Config, CostModel, CostOptions, ModelSpec,  # noqa: E402
                                       best_plan, get_hardware)
from megatron.pipeline.planner import get_model as get_preset  # noqa: E402
from megatron.pipeline.planner.hardware import GiB  # noqa: E402
from megatron.pipeline.planner.search import search_microbatch  # noqa: E402

HW = get_hardware("p3.16xlarge")
# The paper's Megatron kept each layer's attention probabilities (its fused softmax
# kernel): the planner's --attention-backend local, Korthikanti's 5 a s^2 b bytes; and
# its loss ran on a float32 copy of the logits (ModelSpec.fp32_logits).
PAPER_MEGATRON = dict(attention_backend="local", fp32_logits=True)
# 2BW's weight all-reduce hidden behind the next batch whatever its length, as Appendix A
# prices it (tools/plan.py prices what this executor hides: CostOptions.appendix_a_2bw)
APPENDIX_A = CostOptions(appendix_a_2bw=True)


def get_model(name: str) -> ModelSpec:
    """A preset as the paper ran it."""
    from dataclasses import replace
    return replace(get_preset(name), **PAPER_MEGATRON)
SYSTEMS = [  # label, schedule, model parallelism kind
    ("PipeDream-2BW", "2bw", "pipeline"), ("PipeDream-Flush", "flush", "pipeline"),
    ("GPipe", "gpipe", "pipeline"), ("Inter-layer MP", "none", "pipeline"),
    ("Tensor MP", "none", "tensor"), ("GPipe, stash-limited", "gpipe", "stash-limited")]
# One colour per system, the same in every figure (paper_throughput and paper_memory).
SYSTEM_COLOURS = {"PipeDream-2BW": "#1f77b4", "PipeDream-Flush": "#2ca02c",
                  "GPipe": "#ff7f0e", "Inter-layer MP": "#9467bd", "Tensor MP": "#d62728",
                  "GPipe, stash-limited": "#8c564b"}
PANELS = [  # model, GPUs, model-parallel size, (small, large) global batch
    ("gpt-2.2b", 8, 8, (64, 256)), ("gpt-2.2b", 64, 8, (512, 2048)),
    ("gpt-3.8b", 64, 16, (512, 2048))]
MICROBATCHES = [1, 2, 4, 8, 16, 32, 64]

# Claims of section 5.2 quoted from the paper's text (LaTeX macros expanded), with the
# two systems compared and the panels (model, GPUs, batch) the claim is about.
CLAIMS = [
    ("On a single node, PipeDream-2BW is faster than tensor MP by 1.3x.", 1.3,
     "PipeDream-2BW", "Tensor MP", "one server"),
    ("This grows to 20x on 64 GPUs for the model with 3.8 billion parameters", 20.0,
     "PipeDream-2BW", "Tensor MP", "3.8B"),
    ("Compared to inter-layer MP, pipelining with flushes increases throughput by up to 4.1x "
     "for small batch sizes", 4.1, "PipeDream-Flush", "Inter-layer MP", "2.2B small"),
    ("and by up to 5.3x for large batch sizes, on the 2.2-billion model.", 5.3,
     "PipeDream-Flush", "Inter-layer MP", "2.2B large"),
    ("2BW is up to 6.1x faster than inter-layer MP.", 6.1, "PipeDream-2BW", "Inter-layer MP",
     "2.2B"),
    ("PipeDream-2BW outperforms corresponding GPipe configurations at the same global batch "
     "size by up to 3.2x", 3.2, "PipeDream-2BW", "GPipe", "all"),
    ("[GPipe has] 2.1x worse throughput than PipeDream-Flush at low batch sizes", 2.1,
     "PipeDream-Flush", "GPipe", "small"),
    ("and 3x at high batch sizes.", 3.0, "PipeDream-Flush", "GPipe", "large"),
    ("At low batch size, PipeDream-2BW is up to 1.6x faster [than PipeDream-Flush].", 1.6,
     "PipeDream-2BW", "PipeDream-Flush", "small"),
    ("With more gradient accumulation (batch size of 2048), this speedup drops to 15%.", 1.15,
     "PipeDream-2BW", "PipeDream-Flush", "2048"),
]


SHORT = {"PipeDream-2BW": "2bw", "PipeDream-Flush": "flush", "GPipe": "gpipe",
         "Inter-layer MP": "inter-layer", "Tensor MP": "tensor"}


def _points(scope: str) -> List[tuple]:
    pts = [(m, n, b, i) for m, n, _, bs in PANELS for i, b in enumerate(bs)]
    keep = {"one server": lambda p: p[1] == 8, "3.8B": lambda p: p[0] == "gpt-3.8b",
            "2.2B small": lambda p: p[0] == "gpt-2.2b" and p[3] == 0,
            "2.2B large": lambda p: p[0] == "gpt-2.2b" and p[3] == 1,
            "2.2B": lambda p: p[0] == "gpt-2.2b", "all": lambda p: True,
            "small": lambda p: p[3] == 0, "large": lambda p: p[3] == 1,
            "2048": lambda p: p[2] == 2048}[scope]
    return [p[:3] for p in pts if keep(p)]


def shape(kind: str, num_gpus: int, mp: int) -> Dict[str, int]:
    w = num_gpus // mp
    return dict(t=mp, w=w, d=1) if kind == "tensor" else dict(t=1, w=w, d=mp)


def stash_limited_gpipe(cm: CostModel, shp: Dict[str, int], batch: int):
    """Our reading of the paper's GPipe baseline (section 5.3: it "runs out of memory at a
    batch size of 64" for GPT-2.2B on 8 GPUs, "only a batch size of 32 fits"): every
    in-flight microbatch keeps its full activations, so at most m' microbatches fit per
    flush and a batch takes B / (w b m') flushes.  Best (b, m') by throughput."""
    best = None
    for b in MICROBATCHES:
        per_pipe = batch // (shp["w"] * b)
        if per_pipe < 1 or batch % (shp["w"] * b):
            break
        for m in sorted((k for k in range(1, per_pipe + 1) if per_pipe % k == 0), reverse=True):
            cfg = Config(b=b, m=m, recompute=False, schedule="gpipe", **shp)
            est = cm.estimate(cfg)
            if not cm.fits(est):
                continue
            flushes = per_pipe // m
            # the weight all-reduce happens once per batch, not once per flush
            seconds = flushes * est.batch_time_s - (flushes - 1) * cm.exposed_allreduce(
                list(est.stages))
            if best is None or batch / seconds > best[1]:
                best = (cfg, batch / seconds, est)
            break
    return best


def largest_fitting(cm: CostModel, schedule: str, shp: Dict[str, int], batch: int
                    ) -> Optional[Config]:
    """The paper's protocol: the largest b (with recompute) that fits at global batch B."""
    chosen = None
    for b in MICROBATCHES:
        if batch % (shp["w"] * b):
            break
        m = batch // (shp["w"] * b)
        if schedule == "2bw" and m < shp["d"]:
            break
        cfg = Config(b=b, m=m, recompute=True, schedule=schedule, **shp)
        if not cm.fits(cm.estimate(cfg, keep_stages=False)):
            break
        chosen = cfg
    return chosen


def simulated_throughput(cfg: Config, model: ModelSpec) -> Optional[float]:
    try:
        from megatron.pipeline.planner.simulate import simulated_batch_time
    except ImportError:
        return None
    return cfg.global_batch / simulated_batch_time(cfg, model, HW, batches=1,
                                                 options=APPENDIX_A)


def throughput_experiment(simulate: bool) -> List[dict]:
    rows = []
    for name, n, mp, batches in PANELS:
        model = get_model(name)
        cm = CostModel(model, HW, APPENDIX_A)
        for batch in batches:
            for label, schedule, kind in SYSTEMS:
                shp = shape(kind, n, mp)
                row = dict(model=name, gpus=n, mp=mp, batch=batch, system=label)
                if kind == "stash-limited":
                    found = stash_limited_gpipe(cm, shp, batch)
                    row.update(config=asdict(found[0]) if found else None, fits=bool(found))
                    if found:
                        row.update(samples_per_s=found[1], best_b_samples_per_s=found[1],
                                   memory_gib=found[2].memory_per_gpu_bytes / GiB,
                                   bubble=found[2].bubble_fraction, sim_samples_per_s=None)
                    rows.append(row)
                    continue
                cfg = largest_fitting(cm, schedule, shp, batch)
                best_b = search_microbatch(cm, shp["t"], shp["w"], shp["d"], schedule, True,
                                           batch, exact_batch=True)
                row.update(config=asdict(cfg) if cfg else None, fits=cfg is not None,
                           best_b=best_b.config.b if best_b.fits else None,
                           best_b_samples_per_s=best_b.predicted_samples_per_s
                           if best_b.fits else None)
                if cfg:
                    est = cm.estimate(cfg)
                    row.update(samples_per_s=est.samples_per_s,
                               memory_gib=est.memory_per_gpu_bytes / GiB,
                               bubble=est.bubble_fraction,
                               sim_samples_per_s=simulated_throughput(cfg, model)
                               if simulate else None)
                rows.append(row)
    return rows


def _tput(rows, model, gpus, batch, system, key="samples_per_s") -> Optional[float]:
    for r in rows:
        if (r["model"], r["gpus"], r["batch"], r["system"]) == (model, gpus, batch, system):
            return r.get(key)
    return None


def _max_ratio(rows, num: str, den: str, points, key="samples_per_s",
               den_key: Optional[str] = None) -> Optional[float]:
    vals = []
    for model, gpus, batch in points:
        a = _tput(rows, model, gpus, batch, num, key)
        b = _tput(rows, model, gpus, batch, den, den_key or key)
        if a and b:
            vals.append(a / b)
    return max(vals) if vals else None


def claim_table(rows: List[dict]) -> List[dict]:
    """Our speedup for each quoted claim: max over the claim's panels, under the paper's
    protocol (largest b that fits), with each system's best b, and, for claims about
    GPipe, best-b numerator against the stash-limited GPipe (also at its best b)."""
    out = []
    for quote, paper, num, den, scope in CLAIMS:
        pts = _points(scope)
        ours = _max_ratio(rows, num, den, pts)
        row = dict(quote=quote, section="5.2", paper=paper, numerator=num, denominator=den,
                   scope=scope, ours=ours, ours_over_paper=ours / paper if ours else None,
                   ours_best_b=_max_ratio(rows, num, den, pts, key="best_b_samples_per_s"))
        if den == "GPipe":
            row["ours_vs_stash_limited_gpipe"] = _max_ratio(
                rows, num, "GPipe, stash-limited", pts, key="best_b_samples_per_s",
                den_key="samples_per_s")
        out.append(row)
    return out


def planner_depths() -> List[dict]:
    """Section 5.2: the planner recommends 8-deep for 2.2B and 16-deep for 3.8B (64 GPUs)."""
    out = []
    for name, paper_d in (("gpt-2.2b", 8), ("gpt-3.8b", 16)):
        for batch in (512, 2048):
            best = best_plan(get_model(name), HW, 64, batch, schedules=["2bw"],
                             options=APPENDIX_A)
            exposed = best_plan(get_model(name), HW, 64, batch, schedules=["2bw"],
                                options=CostOptions(overlap_grad_reduce_2bw=False))
            out.append(dict(model=name, batch=batch, paper_depth=paper_d, ours=asdict(best.config),
                            samples_per_s=best.predicted_samples_per_s,
                            ours_allreduce_exposed=asdict(exposed.config)))
    return out


def planning_sweep() -> List[dict]:
    """Section 5.4 figure: GPT-1.3B, 64 GPUs, 2bw throughput vs batch for (d, b) pairs,
    with the weight all-reduce hidden (Appendix A) and exposed (a blocking REDUCE_GRADS)."""
    model = get_model("gpt-1.3b")
    hidden = CostModel(model, HW, APPENDIX_A)
    exposed = CostModel(model, HW, CostOptions(overlap_grad_reduce_2bw=False))
    out = []
    for d, b in ((4, 4), (8, 16), (8, 32)):
        w = 64 // d
        for batch in (512, 1024, 2048, 4096, 8192):
            m = batch // (w * b)
            if m < d:
                continue
            cfg = Config(w=w, d=d, b=b, m=m, recompute=True, schedule="2bw")
            est = hidden.estimate(cfg)
            out.append(dict(d=d, b=b, batch=batch, fits=hidden.fits(est),
                            samples_per_s=est.samples_per_s,
                            exposed_samples_per_s=exposed.estimate(cfg).samples_per_s,
                            memory_gib=est.memory_per_gpu_bytes / GiB))
    return out


def memory_ordering() -> List[dict]:
    """Section 5.3 on GPT-2.2B, 8 GPUs, batch 64: "GPipe runs out of memory at a batch size
    of 64"; Flush is slightly above inter-layer MP; 2BW above Flush "but still lower than
    GPipe's".  Same (b, m) for every system so that only the schedule differs."""
    model = get_model("gpt-2.2b")
    cm = CostModel(model, HW, APPENDIX_A)
    out = []
    for b in (1, 8):
        for label, schedule, recompute in (("Inter-layer MP", "none", True),
                                           ("PipeDream-Flush", "flush", True),
                                           ("PipeDream-2BW", "2bw", True),
                                           ("GPipe", "gpipe", True),
                                           ("GPipe, no recompute", "gpipe", False)):
            est = cm.estimate(Config(w=1, d=8, b=b, m=64 // b, recompute=recompute,
                                     schedule=schedule))
            out.append(dict(b=b, m=64 // b, system=label, memory_gib=est.memory_per_gpu_bytes
                            / GiB, fits=cm.fits(est)))
    return out


def max_model_size() -> List[dict]:
    """Section 5.5: largest GPT (seq 512) that 2bw fits per depth on 64 x 16 GB, b = 1."""
    out = []
    for d in (1, 2, 4, 8, 16, 32, 64):
        best = None
        for h in (1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192):
            lo, hi, fit = 1, 512 // d, 0
            while lo <= hi:   # largest layers-per-stage that fits; memory grows with it
                k = (lo + hi) // 2
                model = ModelSpec(num_layers=k * d, hidden_size=h, num_attention_heads=h // 128,
                                  seq_length=512, vocab_size=50304, **PAPER_MEGATRON)
                cm = CostModel(model, HW, APPENDIX_A)
                est = cm.estimate(Config(w=64 // d, d=d, b=1, m=d, recompute=True,
                                         schedule="2bw"), keep_stages=False)
                if cm.fits(est):
                    fit, lo = k, k + 1
                else:
                    hi = k - 1
            if fit:
                model = ModelSpec(num_layers=fit * d, hidden_size=h, num_attention_heads=h // 128,
                                  seq_length=512, vocab_size=50304, **PAPER_MEGATRON)
                if best is None or model.num_params > best["params"]:
                    best = dict(d=d, hidden=h, layers=fit * d, params=model.num_params)
        out.append(best or dict(d=d, hidden=None, layers=0, params=0))
    return out


def plot_throughput(rows: List[dict], path: Path) -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.2))
    for ax, (name, n, mp, batches) in zip(axes, PANELS):
        width = 0.14
        for j, (label, _, _) in enumerate(SYSTEMS):
            xs, ys = [], []
            for i, batch in enumerate(batches):
                v = _tput(rows, name, n, batch, label)
                xs.append(i + (j - 2.5) * width)
                ys.append(v or 0.0)
                if not v:
                    ax.text(xs[-1], 1.1, "OOM", rotation=90, ha="center", fontsize=7)
            ax.bar(xs, ys, width, label=label, color=SYSTEM_COLOURS[label])
        ax.set_yscale("log")
        ax.set_ylim(1, None)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("global batch size")
        ax.set_title(f"GPT {name[4:].upper()}, {mp}-way MP, {n} x V100")
    axes[0].set_ylabel("predicted samples / s (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(SYSTEMS), fontsize=9)
    fig.suptitle("Modelled p3.16xlarge: predicted throughput per system (recompute on, largest "
                 "microbatch that fits; stash-limited GPipe: no recompute, several flushes)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(rows: List[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4))
    name, n, _, batches = PANELS[0]
    width = 0.14
    for j, (label, _, _) in enumerate(SYSTEMS):
        for i, batch in enumerate(batches):
            r = next(r for r in rows if (r["model"], r["gpus"], r["batch"], r["system"])
                     == (name, n, batch, label))
            ax.bar(i + (j - 2.5) * width, r.get("memory_gib", 0.0), width,
                   color=SYSTEM_COLOURS[label], label=label if i == 0 else None)
            if r["config"]:
                ax.text(i + (j - 2.5) * width, 0.3, f"b={r['config']['b']}", rotation=90,
                        ha="center", fontsize=7, color="white")
    ax.axhline(HW.gpu_memory_bytes / GiB, color="k", ls="--", lw=1, label="16 GiB V100")
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("global batch size")
    ax.set_ylabel("predicted memory per GPU (GiB)")
    ax.set_title("GPT 2.2B on 8 x V100: worst-stage memory of each system's configuration")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.set_ylim(0, 19)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_planning(sweep: List[dict], sizes: List[dict], path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for k, (d, mb) in enumerate(sorted({(r["d"], r["b"]) for r in sweep})):
        pts = [r for r in sweep if (r["d"], r["b"]) == (d, mb) and r["fits"]]
        xs = [r["batch"] for r in pts]
        a.plot(xs, [r["samples_per_s"] for r in pts], "o-", color=f"C{k}",
               label=f"(d={d}, b={mb}) all-reduce hidden")
        a.plot(xs, [r["exposed_samples_per_s"] for r in pts], "s--", color=f"C{k}",
               label=f"(d={d}, b={mb}) all-reduce exposed")
    a.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in sweep})
    a.set_xticks(batches, [str(x) for x in batches])
    a.set_xlabel("global batch size")
    a.set_ylabel("predicted samples / s")
    a.set_title("GPT 1.3B, 64 x V100, PipeDream-2BW (cf. paper section 5.4)")
    a.legend(fontsize=7)
    ds = [s["d"] for s in sizes]
    b.bar(range(len(ds)), [s["params"] / 1e9 for s in sizes], color="C0")
    for i, s in enumerate(sizes):
        b.text(i, s["params"] / 1e9 + 0.4, f"{s['params'] / 1e9:.1f}B\nh={s['hidden']}",
               ha="center", fontsize=7)
    b.axhline(30, color="k", ls="--", lw=1, label='paper: "almost 30 billion"')
    b.set_xticks(range(len(ds)), [str(d) for d in ds])
    b.set_xlabel("pipeline depth d (w = 64 / d)")
    b.set_ylabel("largest GPT that fits (billion parameters)")
    b.set_title("Max model size with 2BW on 64 x 16 GB (cf. section 5.5)")
    b.set_ylim(0, 1.2 * max(36.0, max(s["params"] for s in sizes) / 1e9))
    b.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(rows, claims, depths, sweep, sizes, memory) -> None:
    print(f"{'model':9} {'GPUs':>4} {'batch':>5}  {'system':20} {'config':26} "
          f"{'samples/s':>9} {'sim':>8} {'GiB':>5} {'bubble':>6}")
    for r in rows:
        c = r["config"]
        conf = (f"w={c['w']} d={c['d']} t={c['t']} b={c['b']} m={c['m']}" if c else "OOM")
        sim = r.get("sim_samples_per_s")
        print(f"{r['model']:9} {r['gpus']:>4} {r['batch']:>5}  {r['system']:20} {conf:26} "
              f"{r.get('samples_per_s', 0):>9.2f} {sim if sim is None else round(sim, 2)!s:>8} "
              f"{r.get('memory_gib', 0):>5.1f} {100 * r.get('bubble', 0):>5.1f}%")
    print(f"\n{'claim (section 5.2)':30} {'paper':>6} {'ours':>6} {'ratio':>6} "
          f"{'best b':>6} {'vs stash-limited GPipe':>22}")
    for c in claims:
        def f(v):
            return f"{v:.2f}" if v else "-"
        label = f"{SHORT[c['numerator']]}/{SHORT[c['denominator']]}, {c['scope']}"
        print(f"{label:30} "
              f"{c['paper']:>6.2f} {f(c['ours']):>6} {f(c['ours_over_paper']):>6} "
              f"{f(c['ours_best_b']):>6} {f(c.get('ours_vs_stash_limited_gpipe')):>22}")
    print("\nplanner depth (64 GPUs, 2bw): " + "; ".join(
        f"{d['model']} B={d['batch']}: paper d={d['paper_depth']}, ours d={d['ours']['d']} "
        f"(all-reduce exposed: d={d['ours_allreduce_exposed']['d']})" for d in depths))
    print("memory, GPT-2.2B, 8 GPUs, batch 64 (GiB): " + ", ".join(
        f"{r['system']} b={r['b']}: {r['memory_gib']:.1f}" + ("" if r["fits"] else " OOM")
        for r in memory))
    print("max model size per depth (64 x 16 GB): " + ", ".join(
        f"d={s['d']}: {s['params'] / 1e9:.1f}B" for s in sizes))
    print("GPT-1.3B 64 GPUs sweep, samples/s with all-reduce hidden / exposed: " + ", ".join(
        f"(d={r['d']},b={r['b']},B={r['batch']}) {r['samples_per_s']:.0f}/"
        f"{r['exposed_samples_per_s']:.0f}" + ("" if r["fits"] else " OOM") for r in sweep))


def main(argv: Optional[List[str]] = None) -> Dict:
    from bench.common import bench_command, figure_entry, write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator cross-check")
    parser.add_argument("--out-dir", default=None,
                        help="where to write paper_reproduction.json (default bench/results)")
    parser.add_argument("--figure-dir", default=None,
                        help="where to write paper_*.png (default docs/figures)")
    args = parser.parse_args(argv)
    rows = throughput_experiment(simulate=not args.no_sim)
    claims = claim_table(rows)
    depths, sweep, sizes = planner_depths(), planning_sweep(), max_model_size()
    memory = memory_ordering()
    print_report(rows, claims, depths, sweep, sizes, memory)
    figs = Path(args.figure_dir) if args.figure_dir else REPO / "docs" / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    plot_throughput(rows, figs / "paper_throughput.png")
    plot_memory(rows, figs / "paper_memory.png")
    plot_planning(sweep, sizes, figs / "paper_planning.png")
    payload = dict(
        command=bench_command("bench/paper_reproduction.py", argv),
        hardware=asdict(HW), models={m: asdict(get_model(m)) for m in
                                     ("gpt-1.3b", "gpt-2.2b", "gpt-3.8b")},
        throughput=rows, claims=claims, planner_depths=depths, planning_sweep=sweep,
        memory_same_config=memory, max_model_size=sizes,
        figures=[figure_entry(figs / f"paper_{k}.png")
                 for k in ("throughput", "memory", "planning")])
    out = write_results("paper_reproduction", payload, args.out_dir)
    print(f"\nwrote {out} and {figs}/paper_{{throughput,memory,planning}}.png")
    return payload


if __name__ == "__main__":
    main()

"""Generate docs/RESULTS.md from the JSON the benches write (bench/results/*.json).

    python tools/make_results.py                       # rewrite docs/RESULTS.md
    python tools/make_results.py --check               # exit 1 if the page is stale
    python tools/make_results.py --results DIR --output FILE

Nothing on the page is typed by hand: for every bench it shows the table(s), the
figure(s), the exact command that made the numbers, the machine and the date, all read
from the bench's JSON.  The convergence, memory and throughput benches get a headline
and tables of their own; every other bench's JSON is rendered generically (its scalar
fields and its lists of records).  Benches whose JSON is missing are listed with the
command that would produce it.  Bench JSON in a subfolder of the results folder
(``bench/results/<group>/<name>.json``, e.g. the 2BW staleness-mitigation runs in
bench/results/mitigations/) becomes an extra section ``<group>_<name>`` right after its
bench's own section.  The convergence renderers read both the two-schedule JSON (flush
vs 2bw) and the per-variant JSON (flush, 2bw, 2bw+predict, 2bw+dc, 2bw+warmup).  The
output depends only on the JSON files and the figures present, so regenerating an
unchanged tree gives the same bytes.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = REPO_ROOT / "bench" / "results"
DEFAULT_OUTPUT = REPO_ROOT / "docs" / "RESULTS.md"
sys.path.insert(0, str(REPO_ROOT))
from bench.common import first_reach  # noqa: E402 - one definition for benches and page
from tools.results_format import (fmt, is_scalar, md_table, or_not_reached,  # noqa: E402
                                  pct, records_table)
from tools.results_gpu import (render_convergence_gpu, render_cross_entropy_fusion,  # noqa: E402
                               render_gpu_profile, render_planner_validation_cuda,
                               render_throughput_cuda)

# Benches the page expects, in page order (others found in the results folder follow).
KNOWN = ("convergence", "convergence_bert", "memory", "throughput", "pipeline_schedules",
         "trainer_overhead", "preprocess_throughput", "planner_runtime", "paper_reproduction")
# Figures of benches whose JSON does not list them (globs under the repository root).
FIGURE_GLOBS = {"pipeline_schedules": ["docs/figures/timeline_real_*.png"],
                "paper_reproduction": ["docs/figures/paper_*.png"]}
SKIP_KEYS = {"bench", "machine", "command", "figures", "notes"}


def bench_summary(name: str) -> Optional[str]:
    """First line of bench/<name>.py's module docstring (read without importing it)."""
    path = REPO_ROOT / "bench" / f"{name}.py"
    if not path.is_file():
        return None
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except SyntaxError:
        return None
    return doc.strip().splitlines()[0] if doc else None


def figure_paths(name: str, data: Dict[str, Any], repo: Path) -> List[str]:
    listed = data.get("figures")
    if isinstance(listed, list) and listed:
        return [str(p) for p in listed]
    globs = FIGURE_GLOBS.get(name, [f"docs/figures/{name}_*.png"])
    found: List[str] = []
    for g in globs:
        found += sorted(str(p.relative_to(repo)) for p in repo.glob(g))
    return found


# Result files whose name is not their bench script's: (script, the flag that writes them).
SCRIPT_OF = {"planner_validation_cuda": ("planner_validation", "--cuda"),
             "throughput_cuda": ("throughput", "--cuda-only"),
             "memory_recompute": ("memory", "--layer-recompute"),
             "trainer_overhead_compile_layers": ("trainer_overhead", "--compile-layers")}
# Flags a JSON without ``command`` still shows it ran with: (field, flag).
FLAG_FIELDS = (("compile_layers", "--compile-layers"), ("quick", "--quick"), ("smoke", "--smoke"))


def command_of(name: str, data: Dict[str, Any]) -> str:
    """The recorded command, else the invocation of the script that writes such a JSON
    (never a script that does not exist: a results name like ``planner_validation_cuda``
    is written by ``bench/planner_validation.py --cuda``)."""
    if data.get("command"):
        return f"`{str(data['command']).strip()}`"
    script, first = SCRIPT_OF.get(name, (name, None))
    flags = [first] if first else []
    flags += [flag for field, flag in FLAG_FIELDS if data.get(field) and flag not in flags]
    if data.get("dry_run") or data.get("status") == "dry run":
        flags.append("--dry-run")
    args = "".join(f" {f}" for f in flags)
    return (f"`PYTHONPATH=. python bench/{script}.py{args}` (not recorded in the JSON: the "
            f"bench's documented invocation)")


def machine_of(data: Dict[str, Any]) -> str:
    m = data.get("machine")
    if not isinstance(m, dict):
        extra = [f"{k} {data[k]}" for k in ("python", "machine", "device") if is_scalar(data.get(k))
                 and data.get(k) is not None]
        return "not recorded" + (f" ({', '.join(extra)})" if extra else "")
    parts = [m.get("platform"), m.get("processor"),
             f"{m.get('cpu_count')} CPUs" if m.get("cpu_count") else None,
             f"torch {m.get('torch')}" if m.get("torch") else None,
             f"{m.get('torch_threads')} torch threads" if m.get("torch_threads") else None,
             f"GPU {m['cuda']}" if m.get("cuda") else "no GPU",
             ("load average " + ", ".join(f"{x:.1f}" for x in m["load_average"]))
             if m.get("load_average") else None]
    return "; ".join(p for p in parts if p)


def date_of(data: Dict[str, Any]) -> str:
    m = data.get("machine")
    if isinstance(m, dict) and m.get("date"):
        return str(m["date"])
    return "not recorded in the JSON"


# ---------------------------------------------------------------------------------------
# bench-specific sections
# ---------------------------------------------------------------------------------------
def _flush_reaches_2bw(run: Dict[str, Any]) -> Optional[float]:
    s = run["summary"]
    if "flush_reaches_2bw_final_at" in s:
        return s["flush_reaches_2bw_final_at"]
    return first_reach(run["curves"]["flush"]["valid"], s["final_valid_2bw"])


def _reach_text(run: Dict[str, Any]) -> str:
    s = run["summary"]
    extra = s.get("extra_iterations_2bw")
    if extra is None:
        back = _flush_reaches_2bw(run)
        return ("2BW does not reach Flush's final validation loss within the run"
                + ("" if back is None else f" (Flush was at 2BW's final loss by iteration "
                                           f"{back:.0f})"))
    return (f"2BW reaches Flush's final validation loss {extra:+.0f} iterations after Flush "
            f"does (at {s['2bw_reaches_target_at']:.0f} vs {s['flush_reaches_target_at']:.0f})")


def render_convergence(d: Dict[str, Any]) -> List[str]:
    """GPT convergence: the per-variant format (flush, 2bw and its mitigations) when every
    run has ``variants``, else the older two-schedule format."""
    if has_variants(d):
        return render_convergence_variants(d)
    return render_convergence_two(d)


def render_convergence_two(d: Dict[str, Any]) -> List[str]:
    """The two-schedule format (flush vs 2bw, no ``variants``)."""
    runs = d["runs"]
    heads = [f"at peak lr {r['lr']:g}, validation loss after {r['summary']['final_iteration']} "
             f"iterations is {r['summary']['final_valid_2bw']:.4f} (2BW) vs "
             f"{r['summary']['final_valid_flush']:.4f} (PipeDream-Flush, vanilla Adam), "
             f"{r['summary']['relative_difference'] * 100:+.2f}%; {_reach_text(r)}"
             for r in runs]
    st = d["settings"]
    out = ["**Headline:** " + "; ".join(heads) + ".",
           f"Model: GPT, {st['layers']} layers, hidden {st['hidden']}, {st['heads']} heads, "
           f"seq {st['seq']}, vocab {st['vocab']}; d={d['depth']}, w={d['width']}, "
           f"m={st['m']}, b={st['mbs']}, global batch {d['global_batch_size']}, "
           f"{st['iters']} iterations, cosine decay to lr/10. Data: {d['data_source']}.",
           md_table(["peak lr", "final valid loss, flush", "final valid loss, 2bw",
                     "relative difference", "2bw reaches flush's final at", "flush reaches it at",
                     "flush reaches 2bw's final at",
                     "seconds/iteration flush", "seconds/iteration 2bw"],
                    [[f"{r['lr']:g}", r["summary"]["final_valid_flush"],
                      r["summary"]["final_valid_2bw"],
                      f"{r['summary']['relative_difference'] * 100:+.2f}%",
                      or_not_reached(r["summary"]["2bw_reaches_target_at"]),
                      r["summary"]["flush_reaches_target_at"], _flush_reaches_2bw(r),
                      r["table"][0]["seconds_per_iteration"],
                      r["table"][1]["seconds_per_iteration"]] for r in runs])]
    if len(runs) > 1:
        by_gap = sorted(runs, key=lambda r: r["lr"])
        out.append("The gap between the schedules changes with the learning rate: "
                   + ", ".join(f"{r['summary']['relative_difference'] * 100:+.2f}% at peak lr "
                               f"{r['lr']:g}" for r in by_gap) + ".")
    out.append(_bert_pointer(d))
    return out


def _bert_pointer(d: Dict[str, Any]) -> str:
    """Where the BERT half (paper Table 1) of the convergence evidence is."""
    bert = d.get("bert_mnli") or {}
    if bert.get("results"):
        return ("BERT pretraining + MNLI finetuning (paper Table 1): see "
                "[convergence_bert](#convergence_bert) (`" + bert.get("command", "") + "`).")
    return (f"BERT pretraining + MNLI finetuning (paper Table 1): "
            f"**{bert.get('status', 'TODO')}** - {bert.get('reason', 'not recorded')}.")


def render_convergence_bert(d: Dict[str, Any]) -> List[str]:
    """BERT convergence: per-variant format when the JSON has ``variants``, else the
    older two-schedule format."""
    if has_variants(d):
        return render_convergence_bert_variants(d)
    return render_convergence_bert_two(d)


def render_convergence_bert_two(d: Dict[str, Any]) -> List[str]:
    """BERT pretraining losses of both schedules, then the Table 1 style MNLI rows."""
    sm, st = d["summary"], d["settings"]
    head = (f"**Headline:** BERT validation masked-LM loss after {sm['final_iteration']} "
            f"iterations is {sm['final_valid_lm_2bw']:.4f} (2BW) vs "
            f"{sm['final_valid_lm_flush']:.4f} (PipeDream-Flush, vanilla Adam), "
            f"{sm['relative_difference_lm'] * 100:+.2f}% (from {sm['first_valid_lm_flush']:.4f} "
            f"at the first evaluation, iteration {st['eval_interval']}); {MNLI_NOT_EVIDENCE}")
    return [head, _bert_model_line(d), records_table(d["pretraining"]), *_mnli_lines(d)]


MNLI_NOT_EVIDENCE = "MNLI accuracies are from a handful of examples and are not evidence."


def _bert_model_line(d: Dict[str, Any]) -> str:
    st = d["settings"]
    return (f"Model: BERT, {st['layers']} layers, hidden {st['hidden']}, {st['heads']} heads, "
            f"seq {st['seq']}, uncased WordPiece vocabulary; d={d['depth']}, w={d['width']}, "
            f"m={st['m']}, b={st['mbs']}, global batch {d['global_batch_size']}, "
            f"{st['iters']} iterations, peak lr {st['lr']:g}. Data: {d['data_source']}.")


def _mnli_lines(d: Dict[str, Any]) -> List[str]:
    st = d["settings"]
    return [f"MNLI finetuning ({st['ft_epochs']} epochs, lr {st['ft_lr']:g}, same settings for "
            f"every row), accuracy after the last epoch:",
            records_table(d["mnli_table"]),
            f"*{d['mnli_caveat']}*"]


# ---------------------------------------------------------------------------------------
# convergence, per-variant format: flush, 2bw and 2BW with each staleness mitigation
# ---------------------------------------------------------------------------------------
class VariantRun(NamedTuple):
    """One learning rate of a per-variant convergence JSON."""
    lr: float
    final_iteration: int
    variants: Dict[str, Dict[str, Any]]  # name -> final_valid, relative_to_flush, ...


def has_variants(d: Dict[str, Any]) -> bool:
    """Whether a convergence JSON has per-variant summaries (GPT: in every run; BERT:
    at the top level)."""
    if isinstance(d.get("runs"), list):
        return bool(d["runs"]) and all(isinstance(r.get("variants"), dict) for r in d["runs"])
    return isinstance(d.get("variants"), dict)


def variant_runs(d: Dict[str, Any]) -> List[VariantRun]:
    if isinstance(d.get("runs"), list):
        return [VariantRun(float(r["lr"]), int(r["summary"]["final_iteration"]), r["variants"])
                for r in d["runs"]]
    return [VariantRun(float(d["settings"]["lr"]), int(d["summary"]["final_iteration"]),
                       d["variants"])]


def _iterations_text(runs: Sequence[VariantRun]) -> str:
    return " / ".join(str(i) for i in sorted({r.final_iteration for r in runs}))


def _gap_clauses(runs: Sequence[VariantRun]) -> List[str]:
    """'<variant> +x% at lr a and +y% at lr b' for every variant but Flush (no lr when
    there is only one)."""
    names = [n for r in runs for n in r.variants if n != "flush"]
    out = []
    for name in dict.fromkeys(names):
        gaps = [pct(r.variants[name]["relative_to_flush"])
                + (f" at lr {r.lr:g}" if len(runs) > 1 else "")
                for r in runs if name in r.variants]
        out.append(f"{name} {' and '.join(gaps)}")
    return out


def _reach_clause(runs: Sequence[VariantRun]) -> str:
    """Which 2BW variants get down to Flush's final validation loss, and when."""
    hits = []
    for r in runs:
        flush_s = r.variants["flush"].get("seconds_to_flush_final")
        for name, v in r.variants.items():
            at = v.get("reaches_flush_final_at")
            if name == "flush" or at is None:
                continue
            sec = v.get("seconds_to_flush_final")
            hits.append(f"{name} at lr {r.lr:g} by iteration {at:.0f}"
                        + ("" if sec is None or flush_s is None
                           else f" ({sec:.1f} s vs {flush_s:.1f} s for Flush)"))
    within = f"within {_iterations_text(runs)} iterations"
    if not hits:
        return f"no 2BW variant reaches Flush's final loss {within}"
    return f"reaching Flush's final loss {within}: " + ", ".join(hits)


def _variants_headline(runs: Sequence[VariantRun], what: str) -> str:
    by_lr = sorted(runs, key=lambda r: r.lr)
    flush = ", ".join(f"{r.variants['flush']['final_valid']:.4f} at lr {r.lr:g}" for r in by_lr)
    return (f"**Headline:** {what} after {_iterations_text(runs)} iterations relative to "
            f"PipeDream-Flush (vanilla Adam; Flush ends at {flush}): "
            + "; ".join(_gap_clauses(by_lr)) + f"; {_reach_clause(by_lr)}.")


def _timing_line(d: Dict[str, Any]) -> str:
    t = d["timing"]
    line = (f"Seconds/iteration measured separately, side by side at d={t['depth']} "
            f"({t['iterations']} iterations per run, fastest of {t['rounds']} interleaved "
            f"round(s)); time to Flush's final loss = iterations to reach it x that time.")
    if any("2bw+warmup" in r.variants for r in variant_runs(d)):
        line += (f" 2bw+warmup runs Flush's schedule for its first {d['warmup_iters']} "
                 f"iterations, then 2BW's: it is not timed separately (its time uses Flush's "
                 f"seconds/iteration for those iterations, then 2BW's).")
    return line


def _seconds_per_iteration_text(name: str, v: Dict[str, Any]) -> Any:
    if v.get("seconds_per_iteration") is not None:
        return v["seconds_per_iteration"]
    return "not timed (flush's, then 2bw's)" if name == "2bw+warmup" else "not timed"


def _time_to_flush_final_text(v: Dict[str, Any]) -> str:
    if v.get("reaches_flush_final_at") is None:
        return "not reached"
    sec = v.get("seconds_to_flush_final")
    return "-" if sec is None else f"{sec:.1f}"


def variant_table(run: VariantRun, timing_depth: int) -> str:
    """One row per variant: final loss, gap to Flush, when (iteration, seconds) it
    reaches Flush's final loss, its measured seconds/iteration and, where the JSON has
    it, the time each needs to reach the loss both reach."""
    common = any("seconds_to_common_target" in v for v in run.variants.values())
    rows = [[name, f"{v['final_valid']:.4f}", pct(v["relative_to_flush"]),
             "not reached" if v.get("reaches_flush_final_at") is None
             else f"{v['reaches_flush_final_at']:.0f}",
             _seconds_per_iteration_text(name, v), _time_to_flush_final_text(v)]
            + ([_common_target_text(v)] if common else [])
            for name, v in run.variants.items()]
    return md_table(["variant", "final valid loss", "vs flush",
                     "iteration reaching flush's final loss",
                     f"seconds/iteration at d={timing_depth}",
                     "seconds to flush's final loss"]
                    + (["time to the loss both reach: variant s / flush s (flush/variant)"]
                       if common else []), rows)


def _common_target_text(v: Dict[str, Any]) -> str:
    t_v, t_f = v.get("seconds_to_common_target"), v.get("flush_seconds_to_common_target")
    if t_v is None or t_f is None:
        return "-"
    return f"{t_v:.1f} / {t_f:.1f} ({t_f / t_v:.2f}x) at {v['common_target']:.4f}"


def _variant_tables(d: Dict[str, Any]) -> List[str]:
    out = []
    for run in variant_runs(d):
        out += [f"Peak lr {run.lr:g}, validation loss after {run.final_iteration} iterations:",
                variant_table(run, int(d["timing"]["depth"]))]
    return out


def _gpt_model_line(d: Dict[str, Any]) -> str:
    st = d["settings"]
    return (f"Model: GPT, {st['layers']} layers, hidden {st['hidden']}, {st['heads']} heads, "
            f"seq {st['seq']}, vocab {st['vocab']}; loss curves at d={d['depth']}, "
            f"w={d['width']}, m={st['m']}, b={st['mbs']}, global batch "
            f"{d['global_batch_size']}, {st['iters']} iterations, cosine decay to lr/10. "
            f"Data: {d['data_source']}.")


def render_convergence_variants(d: Dict[str, Any]) -> List[str]:
    """GPT: headline, settings, one table per learning rate, pointer to the BERT half."""
    head = _variants_headline(variant_runs(d), "GPT validation loss")
    return [head, _gpt_model_line(d), _timing_line(d), *_variant_tables(d), _bert_pointer(d)]


def render_convergence_bert_variants(d: Dict[str, Any]) -> List[str]:
    """BERT: headline, settings, the variant table, the two schedules' rows, MNLI."""
    head = _variants_headline(variant_runs(d), "BERT validation masked-LM loss")
    return [f"{head[:-1]}; {MNLI_NOT_EVIDENCE}", _bert_model_line(d), _timing_line(d),
            *_variant_tables(d),
            "Flush and 2BW pretraining rows (masked-LM and sentence-order validation losses; "
            "seconds/iteration of these loss-curve runs):",
            records_table(d["pretraining"]), *_mnli_lines(d)]


def render_memory(d: Dict[str, Any]) -> List[str]:
    rows = d["rows"]
    mib = 2.0 ** 20
    worst: Dict[tuple, Dict[str, Any]] = {}
    for r in rows:
        key = (r["d"], r["m"], r["b"], r["precision"], r["recompute"], r["schedule"])
        if key not in worst or r["total_bytes"] > worst[key]["total_bytes"]:
            worst[key] = r
    table = [[f"d={r['d']} m={r['m']} b={r['b']} {r['precision']}", r["schedule"],
              r["recompute"], r["stage"], r["weight_versions"], r["weight_bytes"] / mib,
              r["master_bytes"] / mib, r["optimizer_state_bytes"] / mib, r["peak_in_flight"],
              r["stash_bytes"] / mib, r["formula_bytes"] / mib, r["total_bytes"] / mib]
             for r in worst.values()]
    mism = d.get("formula_mismatches") or []
    out = [_memory_headline(list(worst.values()), mism),
           md_table(["config", "schedule", "recompute", "worst stage", "weight versions",
                     "weights MiB", "fp32 masters MiB", "optimizer state MiB",
                     "in-flight microbatches", "stash MiB", "paper formula (W + stash) MiB",
                     "total MiB"], table),
           f"Per-stage rows ({len(rows)}) are in the JSON. "
           + ("Measured weights + stash equal the formula on every stage of every run."
              if not mism else f"Formula mismatches: {'; '.join(mism)}")]
    return out


def _memory_headline(worst: List[Dict[str, Any]], mismatches: List[str]) -> str:
    # the configuration where the schedules differ most: most microbatches per stage
    big = max(worst, key=lambda r: (r["precision"] == "fp32", r["m"] / r["d"], r["m"]))
    pick = {r["schedule"]: r for r in worst if not r["recompute"] and r["d"] == big["d"]
            and r["m"] == big["m"] and r["b"] == big["b"] and r["precision"] == big["precision"]}
    if not all(s in pick for s in ("gpipe", "flush", "2bw")):
        return "**Headline:** (incomplete memory results)"
    g, f, t = (pick[s]["stash_bytes"] for s in ("gpipe", "flush", "2bw"))
    w = pick["2bw"]["weight_bytes"] / max(1, pick["flush"]["weight_bytes"])
    return (f"**Headline:** at d={big['d']}, m={big['m']}, b={big['b']} the worst stage "
            f"stashes {g / f:.2f}x more activation bytes under GPipe than under "
            f"PipeDream-Flush ({pick['gpipe']['peak_in_flight']} vs "
            f"{pick['flush']['peak_in_flight']} microbatches in flight); 2BW stashes as much "
            f"as Flush ({t / max(1, f):.2f}x) and holds {w:.0f}x the weights (2 versions).")


def render_throughput(d: Dict[str, Any]) -> List[str]:
    syn, gpt = d.get("synthetic") or [], d.get("gpt") or []
    out = []
    if syn:
        small = min(r["global_batch_size"] for r in syn)
        big = max(r["global_batch_size"] for r in syn)
        sp = {r["global_batch_size"]: r["over_flush"] for r in syn if r["schedule"] == "2bw"}
        out.append(f"**Headline:** with synthetic stages (d={syn[0]['d']}), 2BW is "
                   f"{sp[small]:.2f}x as fast as PipeDream-Flush at global batch {small} and "
                   f"{sp[big]:.2f}x at {big} (ideal {(small + syn[0]['d'] - 1) / small:.2f}x "
                   f"and {(big + syn[0]['d'] - 1) / big:.2f}x): the advantage shrinks as the "
                   f"batch grows.")
        out.append(f"(a) Synthetic stages, forward {d['forward_s'] * 1e3:g} ms, backward "
                   f"{d['backward_s'] * 1e3:g} ms per microbatch per stage:")
        out.append(md_table(["schedule", "global batch", "samples/s", "ideal samples/s",
                             "measured/ideal", "vs flush", "vs gpipe"],
                            [[r["schedule"], r["global_batch_size"], r["samples_per_s"],
                              r["ideal_samples_per_s"], r["measured_over_ideal"],
                              r["over_flush"], r["over_gpipe"]] for r in syn]))
    if gpt:
        tbw = sorted((r for r in gpt if r["schedule"] == "2bw"),
                     key=lambda r: r["global_batch_size"])
        rounds = gpt[0].get("rounds", 1)
        out.append(f"(b) Small GPT on 2 CPU ranks (d=2, b={gpt[0]['b']}, best of {rounds} "
                   f"round(s)): 2BW runs at "
                   + ", ".join(f"{r['over_flush']:.2f}x" for r in tbw)
                   + " PipeDream-Flush's throughput at global batch "
                   + ", ".join(str(r["global_batch_size"]) for r in tbw)
                   + ". Real compute on two shared CPU cores: differences of a few percent "
                     "are within the noise.")
        out.append(md_table(["schedule", "global batch", "samples/s", "vs flush", "vs gpipe"],
                            [[r["schedule"], r["global_batch_size"], r["samples_per_s"],
                              r["over_flush"], r["over_gpipe"]] for r in gpt]))
    cuda = d.get("cuda_gpt_345m") or {}
    if cuda.get("status") == "measured":
        out.append(f"(c) GPT-345M on one {cuda['device']} (peak {fmt(cuda.get('peak_flops'))} "
                   f"FLOP/s, {cuda.get('peak_note', '')}):")
        out.append(md_table(["precision", "seconds/iteration", "TFLOP/s", "MFU"],
                            [[r["precision"], r["seconds_per_iteration"], r["tflops"], r["mfu"]]
                             for r in cuda["rows"]]))
    else:
        out.append(f"(c) GPT-345M single-GPU TFLOP/s and MFU: **{cuda.get('status', 'not run')}**"
                   f" ({cuda.get('reason', 'not recorded')}).")
    return out


def render_generic(d: Dict[str, Any]) -> List[str]:
    out = []
    scalars = [(k, v) for k, v in d.items() if k not in SKIP_KEYS and is_scalar(v)]
    if scalars:
        out.append(md_table(["field", "value"], scalars))
    for k, v in d.items():
        if k in SKIP_KEYS:
            continue
        out += _generic_value(k, v, depth=0)
    return out


def _generic_value(key: str, v: Any, depth: int) -> List[str]:
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        return [f"`{key}`:", records_table(v)]
    if isinstance(v, dict) and depth < 2:
        out = []
        sc = [(k, x) for k, x in v.items() if is_scalar(x)]
        nested = [(k, x) for k, x in v.items() if not is_scalar(x)]
        if sc and len(sc) <= 30:
            out += [f"`{key}`:", md_table(["field", "value"], sc)]
        for k, x in nested:
            out += _generic_value(f"{key}.{k}", x, depth + 1)
        return out
    return []


def render_equal_time(d: Dict[str, Any]) -> List[str]:
    from bench.equal_time import round_list

    projected = d.get("time_source") == "simulated"
    if projected:
        out = [f"**Projected, not measured:** each run's --train-iters is what fits in "
               f"Flush's time for its iterations, at the s/iteration the simulator gives "
               f"for one core (or GPU) per stage, fed with the per-stage CPU costs traced in "
               f"{d['timing']['rounds']} interleaved timing rounds on this machine (its "
               f"measured s/iteration are listed beside them); the flush warm-up keeps "
               f"{d['warmup_fraction']:.0%} of its run under Flush.  The losses are real "
               f"training runs."]
    else:
        out = [f"Each run's --train-iters is what fits in Flush's time for its iterations "
               f"(s/iteration measured side by side, fastest of {d['timing']['rounds']} "
               f"interleaved rounds); the flush warm-up keeps "
               f"{d['warmup_fraction']:.0%} of its run under Flush."]
    for r in d["runs"]:
        sec = ", ".join(f"{k} {v:.4f}" for k, v in r["seconds_per_iteration"].items())
        if projected:
            meas = ", ".join(f"{k} {v:.4f}"
                             for k, v in r.get("measured_seconds_per_iteration", {}).items())
            out.append(f"**{r['model'].upper()}, peak lr {fmt(r['lr'])}** (s/iteration at "
                       f"d={r['time_depth']}, projected for a core per stage: {sec}; "
                       f"measured here: {meas}):")
        else:
            out.append(f"**{r['model'].upper()}, peak lr {fmt(r['lr'])}** (s/iteration at "
                       f"d={r['time_depth']}: {sec}):")
        rounds = r.get("measured_rounds")
        if rounds and not projected:
            out.append("s/iteration in each timing round: " + "; ".join(
                f"{k} " + " ".join(f"{x:.4f}" for x in v) for k, v in rounds.items()))
        out.append(md_table(
            ["run", "iterations", "of them Flush", "modelled s", "final valid loss",
             "vs Flush", "reaches Flush's final at", "s to it", "Flush s / s to it",
             "per timing round", "sooner if Flush s/it over its 2BW s/it >"],
            [[n, v["train_iters"], v["warmup_iters"], v["modelled_seconds"], v["final_valid"],
              pct(v["relative_to_flush"]), or_not_reached(v["reaches_flush_final_at"]),
              v["seconds_to_flush_final"], v["speedup_to_flush_final"], round_list(v),
              v.get("break_even_speed_ratio", "-")]
             for n, v in r["summary"].items()]))
    return out


RENDERERS: Dict[str, Callable[[Dict[str, Any]], List[str]]] = {
    "convergence": render_convergence, "convergence_bert": render_convergence_bert,
    "memory": render_memory, "throughput": render_throughput,
    "convergence_gpu": render_convergence_gpu, "throughput_cuda": render_throughput_cuda,
    "planner_validation_cuda": render_planner_validation_cuda,
    "gpu_profile": render_gpu_profile, "equal_time": render_equal_time,
    "cross_entropy_fusion": render_cross_entropy_fusion}


# ---------------------------------------------------------------------------------------
# the page
# ---------------------------------------------------------------------------------------
class Entry(NamedTuple):
    """One section of the page: its title (and anchor), the bench that wrote the JSON,
    the JSON (None: not run yet), and the JSON's path when it is not ``<results>/<name>``."""
    name: str
    bench: str
    data: Optional[Dict[str, Any]]
    source: Optional[str] = None


def section(entry: Entry, repo: Path, out_md: Path) -> str:
    name, bench, data = entry.name, entry.bench, entry.data
    lines = [f"## {name}"]
    script = SCRIPT_OF.get(bench, (bench, None))[0]
    summary = bench_summary(script)
    if summary:
        lines.append(f"*{summary}* (`bench/{script}.py`)")
    if data is None:
        lines.append(f"Not run yet: `PYTHONPATH=. python bench/{name}.py` writes "
                     f"`bench/results/{name}.json`.")
        return "\n\n".join(lines)
    if data.get("smoke") or data.get("quick"):
        lines.append("**Quick mode** (`--quick`): a reduced run, indicative only.")
    if data.get("dry_run") or data.get("status") == "dry run":
        lines.append("**Dry run** (`--dry-run`): a tiny model, to check that the code runs; "
                     "its numbers mean nothing.")
    git = data.get("git") if isinstance(data.get("git"), dict) else {}
    code = ""
    if git.get("commit"):
        dirty = " with uncommitted changes in the tree" if git.get("dirty") else ""
        code = f"\n- code: commit {git['commit'][:12]}{dirty}"
    where = f"- results: `{entry.source}`\n" if entry.source else ""
    lines.append(f"{where}- command: {command_of(bench, data)}\n- machine: {machine_of(data)}\n"
                 f"- date: {date_of(data)}{code}")
    if data.get("notes"):  # a caveat added to the JSON after the run
        lines.append(f"**Note:** {data['notes']}")
    renderer = RENDERERS.get(bench, render_generic)
    try:
        lines += renderer(data)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        lines.append(f"(the JSON does not have the fields this page expects: "
                     f"{type(exc).__name__}: {exc}; shown generically)")
        lines += render_generic(data)
    for fig in figure_paths(name, data, repo):
        target = (repo / fig).resolve()
        if not any(target.is_relative_to(root.resolve()) for root in (repo, out_md.parent)):
            # a figure left where the bench wrote it (/tmp/...): the page must not depend
            # on where this checkout is, nor on what that machine has in /tmp
            lines.append(f"(figure `{fig}` is outside the repository: not linked)")
            continue
        rel = os.path.relpath(target, out_md.parent.resolve()).replace(os.sep, "/")
        lines.append(f"![{Path(fig).stem}]({rel})" if target.is_file()
                     else f"(figure `{fig}` is missing)")
    return "\n\n".join(lines)


def load_results(results_dir: Path) -> Dict[str, Dict[str, Any]]:
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            data = {"error": f"could not read {path.name}: {exc}"}
        if isinstance(data, dict):
            out[path.stem] = data
    return out


def load_extra_results(results_dir: Path, repo: Path) -> List[Entry]:
    """Bench JSON in subfolders (``<results>/<group>/<name>.json``: a bench rerun with
    other options, e.g. bench/results/mitigations/), as sections ``<group>_<name>``.
    Only files that say which bench wrote them (``bench``) count."""
    out = []
    for sub in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        for stem, data in load_results(sub).items():
            if isinstance(data.get("bench"), str):
                out.append(Entry(f"{sub.name}_{stem}", data["bench"], data,
                                 _display_path(sub / f"{stem}.json", repo)))
    return out


def _display_path(path: Path, repo: Path) -> str:
    return os.path.relpath(path, repo).replace(os.sep, "/") if path.is_relative_to(repo) \
        else str(path)


def page_entries(results_dir: Path, repo: Path) -> List[Entry]:
    """Top-level results in page order, each followed by the subfolder results of the
    same bench; subfolder results of other benches come last."""
    results = load_results(results_dir)
    extras = load_extra_results(results_dir, repo)
    names = list(KNOWN) + sorted(n for n in results if n not in KNOWN)
    out: List[Entry] = []
    for n in names:
        out.append(Entry(n, n, results.get(n)))
        out += [e for e in extras if e.bench == n]
    return out + [e for e in extras if e.bench not in names]


HEADLINE_BENCHES = ("convergence", "convergence_bert", "memory", "throughput")


def headline_of(entry: Entry) -> Optional[str]:
    """The first line of a bench-specific section when it is a headline."""
    if entry.data is None or entry.bench not in HEADLINE_BENCHES:
        return None
    try:
        first = RENDERERS[entry.bench](entry.data)[0]
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return first[len("**Headline:** "):] if first.startswith("**Headline:**") else None


def build_page(results_dir: Path, out_md: Path, repo: Path = REPO_ROOT) -> str:
    entries = page_entries(results_dir, repo)
    rel_results = _display_path(results_dir, repo)
    sources = f"`{rel_results}/*.json`" + (
        f" and `{rel_results}/*/*.json`" if any(e.source for e in entries) else "")
    parts = ["# Results",
             f"Generated by `python tools/make_results.py` from {sources}; do "
             "not edit by hand (rerun a bench, then the tool).  Absolute times come from "
             "shared CPU machines and are indicative; ratios between schedules measured in "
             "the same run are the evidence.",
             "Contents: " + ", ".join(f"[{e.name}](#{e.name})" for e in entries)]
    heads = [f"- {e.name}: {h}" for e in entries for h in [headline_of(e)] if h]
    if heads:
        parts.append("## Headline numbers\n\n" + "\n".join(heads))
    parts += [section(e, repo, out_md) for e in entries]
    return "\n\n".join(parts) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(DEFAULT_RESULTS), help="folder of bench JSON files")
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="Markdown page to write")
    p.add_argument("--check", action="store_true",
                   help="do not write; exit 1 when the page differs from what the JSON gives")
    args = p.parse_args(argv)
    results_dir, out_md = Path(args.results).resolve(), Path(args.output).resolve()
    if not results_dir.is_dir():
        p.error(f"--results {results_dir}: no such folder (run a bench first)")
    page = build_page(results_dir, out_md)
    if args.check:
        current = out_md.read_text(encoding="utf-8") if out_md.is_file() else ""
        if current != page:
            print(f"{out_md} is stale: run `python tools/make_results.py`", file=sys.stderr)
            return 1
        print(f"{out_md} is up to date")
        return 0
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(page, encoding="utf-8")
    count = sum(e.data is not None for e in page_entries(results_dir, REPO_ROOT))
    print(f"wrote {out_md} from {count} result files")
    return 0


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

"""The GPU benches' sections of docs/RESULTS.md (tools/make_results.py): the H100
convergence, throughput, cross-entropy, planner-validation and profile JSON."""
from __future__ import annotations

from typing import Any, Dict, List

from tools.results_format import fmt, md_table, or_not_reached, pct


def render_convergence_gpu(d: Dict[str, Any]) -> List[str]:
    summ = d["summary"]
    flush = summ["flush"]
    others = [(n, v) for n, v in summ.items() if n != "flush"]
    best = min(others, key=lambda nv: nv[1]["final_valid"]) if others else None
    m = d["model"]
    out = []
    if best:
        out.append(f"**Headline:** on one {d['device']}, GPT {m['layers']} x {m['hidden']} "
                   f"(seq {m['seq']}, batch {m['gbs']}, lr {fmt(d['lr'])} cosine, "
                   f"{d['precision']}) after {d['iters']} iterations: Flush reaches validation "
                   f"loss {flush['final_valid']:.3f}; the best 2BW variant ({best[0]}) ends at "
                   f"{best[1]['final_valid']:.3f} ({pct(best[1]['relative_to_flush'])}), and "
                   + ("no 2BW variant reaches Flush's final loss within the run."
                      if all(v["reaches_flush_final_at"] is None for _, v in others)
                      else "some variants reach Flush's final loss (table)."))
    corpus = d.get("corpus") or {}
    out.append(f"Corpus: {corpus.get('source', '?')}, {fmt(corpus.get('tokens'))} GPT-2 "
               f"tokens in {fmt(corpus.get('documents'))} files. Loss curves at d=1 (the "
               f"semantics are proven invariant to d); seconds per iteration measured per "
               f"variant in a separate short run without evaluation on the same GPU (at d=1 "
               f"they show each mitigation's optimizer cost, not 2BW's pipeline gain).")
    out.append(md_table(["variant", "final validation loss", "vs Flush",
                         "iterations to Flush's final", "s/iteration", "s to Flush's final"],
                        [[n, v["final_valid"], pct(v["relative_to_flush"]),
                          or_not_reached(v["reaches_flush_final_at"]),
                          v["seconds_per_iteration"], v["seconds_to_flush_final"]]
                         for n, v in summ.items()]))
    its = sorted({int(k) for v in summ.values() for k in v.get("gap_at", {})})
    pick = [i for i in its if i in (100, 200, 400, 600, 800, 1000) or i == its[-1]]
    rows = []
    for n, v in summ.items():
        if n == "flush":
            continue
        gaps = {int(k): x for k, x in v.get("gap_at", {}).items()}
        rows.append([n] + [gaps.get(i) for i in pick])
    if rows:
        out.append("Validation-loss gap to Flush (nats) at equal iterations:")
        out.append(md_table(["variant"] + [f"it {i}" for i in pick], rows))
    return out


def render_throughput_cuda(d: Dict[str, Any]) -> List[str]:
    cuda = d["cuda_gpt_345m"]
    if cuda.get("status") != "measured":
        return [f"GPT-345M on a GPU: **{cuda.get('status')}** ({cuda.get('reason', '')})."]
    rows = cuda["rows"]
    b8 = [r for r in rows if r["name"] == "trainer" and r["precision"] == "bf16"
          and r["micro_batch_size"] == 8]
    ratios = cuda.get("b1_trainer_over_plain_compiled", {})
    best = max((r for r in rows if r["name"].startswith("trainer") and r["precision"] == "bf16"
                and r["micro_batch_size"] == 8 and r.get("mfu")),
               key=lambda r: r["mfu"], default=None)
    out = []
    if b8:
        flags = best["name"][len("trainer"):].strip() if best else ""
        with_flags = (f" ({100 * best['mfu']:.1f}% with {flags})"
                      if best and flags and best["mfu"] > b8[0]["mfu"] else "")
        out.append(f"**Headline:** {cuda['device']}: the trainer reaches "
                   f"{100 * b8[0]['mfu']:.1f}% MFU in bf16 at micro batch 8{with_flags} "
                   f"(goal 40%); at micro batch 1 its step takes "
                   f"{ratios.get('trainer', float('nan')):.2f}x that of transformers' GPT-2 "
                   f"under torch.compile (goal <= 0.9).")
    out.append(f"{cuda['model']}; peak {fmt(cuda.get('peak_flops'))} FLOP/s "
               f"({cuda.get('peak_note', '')}); side by side in one process:")
    out.append(md_table(["run", "precision", "micro batch", "global batch", "s/iteration",
                         "TFLOP/s", "MFU"],
                        [[r["name"], r["precision"], r["micro_batch_size"],
                          r["global_batch_size"], r["seconds_per_iteration"], r["tflops"],
                          r["mfu"]] for r in rows]))
    if ratios:
        out.append("Micro batch 1, trainer step / plain compiled step: "
                   + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()) + ".")
    return out


def render_cross_entropy_fusion(d: Dict[str, Any]) -> List[str]:
    if d.get("status") not in ("measured", "dry run"):
        return [f"Cross-entropy fusion on a GPU: **{d.get('status')}**."]
    out = []
    b8 = [r for r in d["trainer"] if r["micro_batch_size"] == 8]
    if b8 and b8[0].get("fused_mfu"):
        r = b8[0]
        out.append(f"**Headline:** {d['device']}: --cross-entropy-loss-fusion makes the "
                   f"trainer's GPT-345M bf16 step at micro batch 8 {r['speedup']:.2f}x faster "
                   f"({r['default_s']:.3f} -> {r['fused_s']:.3f} s, MFU "
                   f"{100 * r['default_mfu']:.1f}% -> {100 * r['fused_mfu']:.1f}%).")
    mib = lambda v: None if v is None else v / 2 ** 20  # noqa: E731
    out.append("The loss alone (forward + backward, median of alternating rounds; peak: "
               "allocator bytes above the logits during the pass, the pass's own copy of "
               "the logits included):")
    out.append(md_table(["micro batch", "tokens", "chunked ms", "fused ms", "speedup",
                         "peak MiB chunked", "peak MiB fused", "logits MiB"],
                        [[r["micro_batch_size"], r["tokens"], r["chunked_ms"], r["fused_ms"],
                          r["speedup"], mib(r["chunked_peak_bytes"]), mib(r["fused_peak_bytes"]),
                          mib(r["logits_bytes"])] for r in d["loss_alone"]]))
    out.append("The trainer (m = 4, dropout 0.1), alternating runs:")
    out.append(md_table(["micro batch", "global batch", "default s/it", "fused s/it", "speedup",
                         "default runs", "fused runs", "MFU default", "MFU fused"],
                        [[r["micro_batch_size"], r["global_batch_size"], r["default_s"],
                          r["fused_s"], r["speedup"],
                          " ".join(f"{x:.4f}" for x in r["default_samples_s"]),
                          " ".join(f"{x:.4f}" for x in r["fused_samples_s"]),
                          r["default_mfu"], r["fused_mfu"]] for r in d["trainer"]]))
    return out


def render_planner_validation_cuda(d: Dict[str, Any]) -> List[str]:
    if d.get("status") != "measured":
        return [f"Planner validation on a GPU: **{d.get('status')}** ({d.get('reason', '')})."]
    rows = d["rows"]
    settings = (d.get("profile") or {}).get("settings", {})
    per_sync = settings.get("runs_per_sync", 1)
    out = [f"**Headline:** {d['device']}, {d['precision']}, d=1 flush: the planner's step "
           f"time is within {100 * d['goal']:.0f}% of the trainer's for {d['within_goal']} of "
           f"{len(rows)} micro batch sizes (profile timed with {per_sync} run(s) per "
           f"synchronisation)."]
    out.append(md_table(["micro batch", "m", "predicted s/step", "measured s/step",
                         "predicted/measured", "within goal"],
                        [[r["micro_batch_size"], r["m"], r["predicted_s"], r["measured_s"],
                          r["ratio"], r["within_goal"]] for r in rows]))
    return out


def render_gpu_profile(d: Dict[str, Any]) -> List[str]:
    out = []
    for r in d["runs"]:
        head = (f"micro batch {r['micro_batch_size']}, global {r['global_batch_size']}, "
                f"{r['precision']} {' '.join(r.get('extra') or [])}: "
                f"{r['active_iterations']} profiled iterations, {fmt(r['wall_ms_active'])} ms "
                f"of wall clock")
        if r.get("busy_note"):
            head += f" ({r['busy_note']})"
        out.append(head)
        out.append(md_table(["operator (by GPU time)", "calls", "self GPU ms", "self CPU ms"],
                            [[x["name"][:70], x["count"], x["self_device_ms"], x["self_cpu_ms"]]
                             for x in r["top_device"][:10]]))
        out.append(md_table(["operator (by CPU time)", "calls", "self CPU ms", "self GPU ms"],
                            [[x["name"][:70], x["count"], x["self_cpu_ms"], x["self_device_ms"]]
                             for x in r["top_cpu"][:10]]))
    return out

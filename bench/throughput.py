"""Throughput versus global batch size for none / gpipe / flush / 2bw.

    PYTHONPATH=. python bench/throughput.py            # ~5 min on 2 CPU cores
    PYTHONPATH=. python bench/throughput.py --quick    # ~1 min
    PYTHONPATH=. python bench/throughput.py --quick --smoke   # seconds (tests)

(a) Synthetic stages of fixed cost, d=4, w=1, b=1: every stage's forward sleeps F and
its backward 2F (``SleepStage`` from bench/pipeline_schedules.py), so four ranks on two
cores behave like four busy accelerators.  The global batch is m microbatches.
(b) The real small GPT at d=2 (two gloo CPU ranks), global batch m x b.

Both are trained by ``megatron.training.pretrain``; throughput is the global batch over
the steady-state batch period on stage 0 (first forward of batch k to that of batch
k+1, median over batches after the first; for (b), the best of 3 rounds run one after
the other, because real compute on shared cores suffers bursts of load from other
processes).  Beside (a), the ideal periods (F+B units):
none d*m, gpipe and flush m+d-1, 2bw m: 2BW's advantage (m+d-1)/m is largest at small
batches, as in the paper's Figures 5 and 7.

(c) With a CUDA GPU: single-GPU training throughput of GPT-345M (24 layers, hidden 1024,
seq 1024) in TFLOP/s and model-FLOPs utilisation under bf16 and fp16 (with and without
--compile-layers) at micro batch 8, and at micro batch 1 the trainer beside a plain
PyTorch loop around transformers' GPT-2 of the same shape under torch.compile, with the
device named; skipped with a note on CPU-only machines (``--gpu-dry-run`` runs the same
code on the CPU with a 2-layer model).

Figure: docs/figures/throughput_vs_batch.png.  Results: bench/results/throughput.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO_ROOT, figure_entry, RESULTS_DIR, format_table, median,  # noqa: E402
                          write_results)
from bench.convergence import git_revision  # noqa: E402

SCHEDULES = ("none", "gpipe", "flush", "2bw")
FIGURE = REPO_ROOT / "docs" / "figures" / "throughput_vs_batch.png"
SYNTHETIC_STAGES = 4
# Dense peak FLOP/s (tensor cores, bf16/fp16) by device-name fragment, for MFU; the
# first fragment found in torch.cuda.get_device_name() wins, so variants come before
# their family.  None: a variant whose peak NVIDIA does not publish (AWS's A10G), so no
# MFU is printed rather than one against another card's peak.
PEAK_FLOPS = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
              ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12),
              ("A10G", None), ("A10", 125e12), ("L4", 121e12), ("V100", 125e12),
              ("T4", 65e12))


def ideal_period_units(schedule: str, d: int, m: int) -> int:
    """Steady-state batch period in units of F+B."""
    return {"none": d * m, "gpipe": m + d - 1, "flush": m + d - 1, "2bw": m}[schedule]


def _timed(forward_step: Callable, m: int, stamps: List[float]) -> Callable:
    calls = [0]

    def step(data_iterator, model):
        if calls[0] % m == 0:
            stamps.append(time.perf_counter())
        calls[0] += 1
        return forward_step(data_iterator, model)

    return step


def _worker(rank: int, world: int, runs: List[Dict[str, Any]]) -> List[List[float]]:
    """Stage-0 batch start times of each run (other ranks return empty lists)."""
    import torch

    import pretrain_gpt
    from megatron.training import pretrain

    torch.set_num_threads(1)
    out = []
    for run in runs:
        stamps: List[float] = []
        if run["kind"] == "synthetic":
            from bench.pipeline_schedules import sleep_forward_step, sleep_model_provider

            provider = partial(sleep_model_provider, forward_s=run["forward_s"])
            step = sleep_forward_step
        else:
            provider, step = pretrain_gpt.model_provider, pretrain_gpt.forward_step
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(pretrain_gpt.datasets_provider, provider, _timed(step, run["m"], stamps),
                     argv=run["argv"])
        out.append(stamps if rank == 0 else [])
    return out


def common_argv(schedule: str, d: int, m: int, b: int, batches: int) -> List[str]:
    return ["--micro-batch-size", str(b), "--global-batch-size", str(b * m),
            "--pipeline-model-parallel-size", str(d), "--pipeline-schedule", schedule,
            "--distributed-backend", "gloo", "--train-iters", str(batches),
            "--lr", "1e-4", "--seed", "1234", "--log-interval", "100000",
            "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0",
            "--tokenizer-type", "NullTokenizer", "--mock-data"]


def synthetic_argv(schedule: str, m: int, batches: int) -> List[str]:
    w = 8  # SleepStage's activation width; the model flags only satisfy the validator
    return ["--num-layers", str(SYNTHETIC_STAGES), "--hidden-size", str(w),
            "--num-attention-heads", "1", "--seq-length", str(w),
            "--max-position-embeddings", str(w), "--vocab-size", "16",
            *common_argv(schedule, SYNTHETIC_STAGES, m, 1, batches)]


def gpt_argv(schedule: str, m: int, b: int, batches: int, smoke: bool) -> List[str]:
    hidden, seq = (32, 16) if smoke else (128, 64)
    return ["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--vocab-size", "1024", "--hidden-dropout", "0", "--attention-dropout", "0",
            *common_argv(schedule, 2, m, b, batches)]


def measure(kind: str, world: int, runs: List[Dict[str, Any]], rounds: int, timeout: float
            ) -> List[Dict[str, Any]]:
    """Run every configuration ``rounds`` times, round after round, so that a burst of
    load from other processes hits one round of each rather than all of one; a
    configuration's period is the median of its best round (contention only slows)."""
    from tests.dist_utils import run_distributed

    stamps = run_distributed(_worker, world, args=(runs * rounds,), timeout=timeout)[0]
    per_config: Dict[int, List[List[float]]] = {}
    for i, st in enumerate(stamps):
        per_config.setdefault(i % len(runs), []).append(
            [b - a for a, b in zip(st, st[1:])][1:])  # the first period warms up
    rows = []
    for i, run in enumerate(runs):
        round_medians = [median(p) for p in per_config[i]]
        period = min(round_medians)
        row = {"kind": kind, "schedule": run["schedule"], "d": run["d"], "m": run["m"],
               "b": run["b"], "global_batch_size": run["m"] * run["b"],
               "seconds_per_batch": period, "samples_per_s": run["m"] * run["b"] / period,
               "rounds": rounds, "round_seconds_per_batch": round_medians,
               "timed_batches_per_round": len(per_config[i][0])}
        if kind == "synthetic":
            ideal = ideal_period_units(run["schedule"], run["d"], run["m"]) * 3 * run["forward_s"]
            row.update(ideal_seconds_per_batch=ideal, ideal_samples_per_s=run["m"] / ideal,
                       measured_over_ideal=ideal / period)
        rows.append(row)
    by = {(r["schedule"], r["m"]): r for r in rows}
    for r in rows:
        for other in ("flush", "gpipe"):
            r[f"over_{other}"] = r["samples_per_s"] / by[(other, r["m"])]["samples_per_s"]
    return rows


def bench_synthetic(ms: Sequence[int], forward_s: float, batches: int, rounds: int
                    ) -> List[Dict[str, Any]]:
    runs = [dict(kind="synthetic", schedule=s, d=SYNTHETIC_STAGES, m=m, b=1, forward_s=forward_s,
                 argv=synthetic_argv(s, m, batches)) for m in ms for s in SCHEDULES]
    return measure("synthetic", SYNTHETIC_STAGES, runs, rounds, timeout=1800)


def bench_gpt(ms: Sequence[int], b: int, batches: int, rounds: int, smoke: bool
              ) -> List[Dict[str, Any]]:
    runs = [dict(kind="gpt", schedule=s, d=2, m=m, b=b, argv=gpt_argv(s, m, b, batches, smoke))
            for m in ms for s in SCHEDULES]
    return measure("gpt", 2, runs, rounds, timeout=1800)


def _peak_flops(name: str) -> Optional[float]:
    for fragment, flops in PEAK_FLOPS:
        if fragment in name:
            return flops
    return None


GPT_345M = {"layers": 24, "hidden": 1024, "heads": 16, "seq": 1024, "vocab": 50257}
DRY_RUN_MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 512}
"""The GPT of the dry runs (--gpu-dry-run here, --dry-run of bench/cross_entropy_fusion.py
and bench/gpu_profile.py), which check on a CPU that the code runs: in bf16, whose
matrix products a CPU without AVX-512 BF16 emulates at ~20x float32's time, hence tiny."""
# (name, precision, micro batch, global batch, extra trainer flags or None for the plain
# PyTorch GPT-2 under torch.compile): MFU at b=8, and the trainer against the plain
# model at b=1 (what pipelines run), side by side in one process.  The rows the goals
# read come first: a GPU lease that runs out still leaves them in the JSON.
FUSION = "--cross-entropy-loss-fusion"
GPU_ROWS = (("trainer", "bf16", 8, 32, []),
            (f"trainer {FUSION}", "bf16", 8, 32, [FUSION]),
            ("plain GPT-2, torch.compile", "bf16", 8, 32, None),
            ("trainer", "bf16", 1, 4, []),
            (f"trainer {FUSION}", "bf16", 1, 4, [FUSION]),
            ("plain GPT-2, torch.compile", "bf16", 1, 4, None),
            (f"trainer {FUSION} --compile-layers", "bf16", 8, 32, [FUSION, "--compile-layers"]),
            (f"trainer {FUSION} --compile-layers", "bf16", 1, 4, [FUSION, "--compile-layers"]),
            ("trainer", "fp16", 8, 32, []))


def gpu_trainer_argv(model: Dict[str, int], precision: str, mb: int, gbs: int, iters: int,
                     extra: Sequence[str], dropout: float = 0.1) -> List[str]:
    return ["--hidden-dropout", str(dropout), "--attention-dropout", str(dropout), "--num-layers", str(model["layers"]), "--hidden-size", str(model["hidden"]),
            "--num-attention-heads", str(model["heads"]), "--seq-length", str(model["seq"]),
            "--max-position-embeddings", str(model["seq"]), "--vocab-size", str(model["vocab"]),
            "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", str(mb),
            "--global-batch-size", str(gbs), "--train-iters", str(iters), "--lr", "1.5e-4",
            "--clip-grad", "1.0", f"--{precision}", "--log-interval", "100000",
            "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0", *extra]


def _trainer_period(model: Dict[str, int], precision: str, mb: int, gbs: int, iters: int,
                    warmup: int, extra: Sequence[str], dropout: float = 0.1) -> float:
    """Median seconds per iteration of ``pretrain`` (first forward of batch k to k+1)."""
    import pretrain_gpt
    from megatron.training import pretrain

    argv = gpu_trainer_argv(model, precision, mb, gbs, iters, extra, dropout)
    stamps: List[float] = []
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 _timed(pretrain_gpt.forward_step, gbs // mb, stamps), argv=argv)
    return median([b - a for a, b in zip(stamps, stamps[1:])][warmup:])


def _plain_period(model: Dict[str, int], precision: str, mb: int, gbs: int, iters: int,
                  warmup: int, device: str, compile_model: bool, dropout: float = 0.1) -> float:
    """The same step written as a plain PyTorch loop around transformers' GPT-2: fp32
    weights under autocast, fused AdamW, gradient accumulation over gbs / mb
    microbatches, clipping at 1.0, one loss read per iteration (as the trainer's)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=model["layers"], n_embd=model["hidden"], n_head=model["heads"],
                     n_positions=model["seq"], vocab_size=model["vocab"], bos_token_id=0,
                     eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout)
    net = GPT2LMHeadModel(cfg).to(device)
    net.train()
    step_model = torch.compile(net) if compile_model else net
    opt = torch.optim.AdamW(net.parameters(), lr=1.5e-4, weight_decay=0.01,
                            **({"fused": True} if device == "cuda" else {}))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    m = gbs // mb
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model["vocab"], (mb, model["seq"]), generator=gen).to(device)
               for _ in range(m)]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for ids in batches:
            with torch.autocast(device_type=device, dtype=dtype):
                loss = step_model(input_ids=ids, labels=ids).loss
            (loss / m).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(total)
        times.append(time.perf_counter() - t0)
    del net, step_model, opt
    return median(times[warmup:])


def bench_cuda_345m(iters: int = 8, warmup: int = 2, dry_run: bool = False,
                    micro_batch_sizes: Sequence[int] = (8, 1), compile_layers: bool = True,
                    dropout: float = 0.1,
                    progress: Optional[Callable[[Dict[str, Any]], None]] = None
                    ) -> Dict[str, Any]:
    """GPT-345M on one GPU: the trainer (bf16, fp16, with and without --compile-layers)
    at micro batch 8 and 1, and a plain PyTorch GPT-2 of the same shape under
    torch.compile beside it (skipped without CUDA).

    ``dry_run``: the same code on the CPU with a 2-layer model, three iterations and no
    compilation of layers or of the plain model, to check on a machine without a GPU that
    the section runs.  ``progress``: called with the result so far after every row (and
    each row is printed as it is measured)."""
    import torch

    from bench.common import gpt_config
    from megatron.model.flops import gpt_flops_per_iteration

    if dry_run:
        model, device, name, iters, warmup = DRY_RUN_MODEL, "cpu", "CPU (dry run)", 3, 1
        plan = [r for r in GPU_ROWS if "--compile-layers" not in (r[4] or [])]
    elif not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA device on this machine"}
    else:
        model, device, name, plan = GPT_345M, "cuda", torch.cuda.get_device_name(0), GPU_ROWS
    plan = [r for r in plan if r[2] in micro_batch_sizes
            and (compile_layers or "--compile-layers" not in (r[4] or []))]
    peak = _peak_flops(name)
    rows: List[Dict[str, Any]] = []

    def period(label: str, mb: int) -> Optional[float]:
        hit = [r["seconds_per_iteration"] for r in rows
               if r["name"] == label and r["micro_batch_size"] == mb and r["precision"] == "bf16"]
        return hit[0] if hit else None

    def result(done: bool) -> Dict[str, Any]:
        plain1 = period("plain GPT-2, torch.compile", 1)
        ratios = {}
        for label in dict.fromkeys(r["name"] for r in rows if r["argv"] is not None):
            ours = period(label, 1)
            if ours is not None and plain1:
                ratios[label] = ours / plain1
        return {"status": ("dry run" if dry_run else "measured") if done else "partial",
                "device": name, "peak_flops": peak,
                "peak_note": "dense tensor-core peak assumed from the device name",
                "model": (f"GPT ({model['layers']} layers, hidden {model['hidden']}, "
                          f"{model['heads']} heads, seq {model['seq']}, vocab {model['vocab']}, "
                          f"dropout {dropout:g})"), "dropout": dropout,
                "rows": list(rows), "b1_trainer_over_plain_compiled": ratios,
                "goals": "bf16 b=8 MFU >= 0.40; b=1 trainer step <= 0.9x plain compiled step"}

    for label, precision, mb, gbs, extra in plan:
        cfg, _ = gpt_config(gpu_trainer_argv(model, precision, mb, gbs, iters, [], dropout))
        flops = gpt_flops_per_iteration(cfg.model, gbs, cfg.model.seq_length)
        t0 = time.perf_counter()
        if extra is None:
            period_s = _plain_period(model, precision, mb, gbs, iters, warmup, device,
                                     compile_model=not dry_run, dropout=dropout)
        else:
            period_s = _trainer_period(model, precision, mb, gbs, iters, warmup, extra, dropout)
        achieved = flops / period_s
        rows.append({"name": label, "precision": precision, "micro_batch_size": mb,
                     "global_batch_size": gbs, "seconds_per_iteration": period_s,
                     "tflops": achieved / 1e12, "mfu": achieved / peak if peak else None,
                     "row_seconds": time.perf_counter() - t0,
                     "argv": gpu_trainer_argv(model, precision, mb, gbs, iters, extra or [],
                                              dropout)
                     if extra is not None else None})
        mfu = f"{achieved / peak:.3f}" if peak else "-"
        print(f"  {label}, {precision}, b={mb}: {period_s:.4f} s/iteration, "
              f"{achieved / 1e12:.1f} TFLOP/s, MFU {mfu} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if progress is not None:
            progress(result(done=False))
    return result(done=True)


def cuda_only(args: argparse.Namespace, argv: Optional[List[str]], t0: float) -> Dict[str, Any]:
    """Section (c) alone (a GPU session's run): its own JSON, nothing else rewritten."""
    command = ("PYTHONPATH=. python bench/throughput.py "
               + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
               ).strip()

    def payload_of(cuda: Dict[str, Any]) -> Dict[str, Any]:
        return {"command": command, "cuda_gpt_345m": cuda, "git": git_revision(),
                "bench_seconds": time.perf_counter() - t0}

    cuda = bench_cuda_345m(dry_run=args.gpu_dry_run, micro_batch_sizes=args.cuda_micro_batch_sizes,
                           compile_layers=not args.cuda_skip_compile_layers,
                           dropout=args.dropout,
                           progress=lambda partial: write_results(
                               "throughput_cuda", payload_of(partial), args.out_dir))
    print_cuda(cuda)
    payload = payload_of(cuda)
    path = write_results("throughput_cuda", payload, args.out_dir)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


def print_cuda(cuda: Dict[str, Any]) -> None:
    if cuda["status"] not in ("measured", "dry run"):
        print(f"(c) GPT-345M single-GPU throughput: {cuda['status']} ({cuda['reason']})")
        return
    print(format_table(["run", "precision", "micro batch", "global batch", "s/iteration",
                        "TFLOP/s", "MFU"],
                       [[r["name"], r["precision"], r["micro_batch_size"],
                         r["global_batch_size"], r["seconds_per_iteration"], r["tflops"],
                         r["mfu"]] for r in cuda["rows"]],
                       title=f"(c) {cuda['model']} on {cuda['device']}, side by side"))
    for label, ratio in cuda["b1_trainer_over_plain_compiled"].items():
        print(f"    micro batch 1: {label} step / plain compiled step = {ratio:.3f} "
              f"(goal <= 0.9)")


def plot(synthetic: List[Dict[str, Any]], gpt: List[Dict[str, Any]], forward_s: float,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "tab:gray", "gpipe": "tab:green", "flush": "tab:blue", "2bw": "tab:red"}
    markers = {"none": "s", "gpipe": "^", "flush": "o", "2bw": "D"}
    panels = [(synthetic, f"(a) synthetic stages, d={SYNTHETIC_STAGES}, b=1, "
                          f"F={forward_s * 1e3:g} ms, B=2F")]
    if gpt:
        panels.append((gpt, f"(b) small GPT, d=2, b={gpt[0]['b']}, 2 CPU ranks"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.3), squeeze=False)
    for ax, (rows, title) in zip(axes[0], panels):
        for s in SCHEDULES:
            mine = sorted((r for r in rows if r["schedule"] == s),
                          key=lambda r: r["global_batch_size"])
            x = [r["global_batch_size"] for r in mine]
            # gpipe drawn wide underneath: on sleeping stages it coincides with flush
            wide = s == "gpipe"
            ax.plot(x, [r["samples_per_s"] for r in mine], color=colors[s], marker=markers[s],
                    lw=4.0 if wide else 1.6, ms=9 if wide else 6, alpha=0.55 if wide else 1.0,
                    zorder=1 if wide else 2, label=s)
            if "ideal_samples_per_s" in mine[0]:
                ax.plot(x, [r["ideal_samples_per_s"] for r in mine], color=colors[s], ls=":",
                        lw=1.0)
        ax.set_xscale("log", base=2)
        xs = sorted({r["global_batch_size"] for r in rows})
        ax.set_xticks(xs)
        ax.set_xticklabels([str(v) for v in xs])
        ax.set_xlabel("global batch size (samples)")
        ax.set_ylabel("throughput (samples/s)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(title="dotted: ideal" if "ideal_samples_per_s" in rows[0] else None,
                  fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(results_dir: Path, figure: Optional[str]) -> Dict[str, Any]:
    path = results_dir / "throughput.json"
    if not path.is_file():
        raise SystemExit(f"bench/throughput.py --replot: {path} not found; run the bench first")
    data = json.loads(path.read_text())
    out = Path(figure) if figure else REPO_ROOT / data["figures"][0]
    plot(data["synthetic"], data["gpt"], data["forward_s"], out)
    print(f"redrew {out} from {path}")
    return data


def print_rows(rows: List[Dict[str, Any]], title: str) -> None:
    table = [[r["schedule"], r["m"], r["global_batch_size"], r["samples_per_s"],
              r.get("ideal_samples_per_s"), r.get("measured_over_ideal"), r["over_flush"],
              r["over_gpipe"]] for r in rows]
    print(format_table(["schedule", "m", "global batch", "samples/s", "ideal", "meas/ideal",
                        "/flush", "/gpipe"], table, title=title))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes, shorter runs")
    p.add_argument("--smoke", action="store_true", help="with --quick: seconds (tests)")
    p.add_argument("--forward-ms", type=float, default=None,
                   help="synthetic forward time F in ms (default 20, quick 5, smoke 2); B = 2F")
    p.add_argument("--skip-gpt", action="store_true", help="synthetic stages only")
    p.add_argument("--skip-cuda", action="store_true", help="no GPT-345M GPU measurement")
    p.add_argument("--cuda-only", action="store_true",
                   help="only section (c), the GPT-345M GPU measurement; writes "
                        "throughput_cuda.json and leaves throughput.json and the figure alone")
    p.add_argument("--gpu-dry-run", action="store_true",
                   help="run section (c)'s code on the CPU with a 2-layer model (checks it "
                        "without a GPU; its numbers mean nothing)")
    p.add_argument("--cuda-micro-batch-sizes", type=int, nargs="+", default=[8, 1],
                   help="with --cuda-only: the micro batch sizes of section (c) (8 and 1)")
    p.add_argument("--cuda-skip-compile-layers", action="store_true",
                   help="with --cuda-only: leave out the --compile-layers rows")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="with --cuda-only: hidden and attention dropout of both models (0.1)")
    p.add_argument("--out-dir", default=None, help="where to write throughput.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figure from an existing throughput.json")
    args = p.parse_args(argv)
    if args.smoke and not args.quick:
        p.error("--smoke is a variant of --quick; pass both")
    if args.replot:
        return replot(Path(args.out_dir) if args.out_dir else RESULTS_DIR, args.figure)
    if args.cuda_only and args.skip_cuda:
        p.error("--cuda-only and --skip-cuda exclude each other")
    import torch

    t0 = time.perf_counter()
    if args.cuda_only:
        return cuda_only(args, argv, t0)
    torch.set_num_threads(1)
    if args.smoke:
        ms, gpt_ms, batches, fwd = [4], [2], 3, 2.0
        gpt_batches, rounds = 3, 1
    elif args.quick:
        ms, gpt_ms, batches, fwd = [4, 8, 16], [2, 8], 4, 5.0
        gpt_batches, rounds = 5, 1
    else:
        ms, gpt_ms, batches, fwd = [4, 8, 16, 32], [2, 4, 8, 16], 5, 20.0
        # real compute on shared cores is noisier than sleeping stages: best of 3 rounds
        gpt_batches, rounds = 6, 3
    forward_s = (args.forward_ms or fwd) / 1e3
    synthetic = bench_synthetic(ms, forward_s, batches, 1)
    print_rows(synthetic, f"(a) synthetic stages, d={SYNTHETIC_STAGES}, w=1, b=1, "
                          f"F={forward_s * 1e3:g} ms, B=2F")
    gpt: List[Dict[str, Any]] = []
    if not args.skip_gpt:
        gpt = bench_gpt(gpt_ms, 2, gpt_batches, rounds, args.smoke)
        ex = gpt_argv("2bw", gpt_ms[0], 2, batches, args.smoke)
        print_rows(gpt, f"(b) small GPT (4 layers, hidden {ex[ex.index('--hidden-size') + 1]}, "
                        f"seq {ex[ex.index('--seq-length') + 1]}), d=2, b=2")
    cuda = ({"status": "skipped", "reason": "--skip-cuda"} if args.skip_cuda
            else bench_cuda_345m(dry_run=args.gpu_dry_run))
    print_cuda(cuda)
    figure = Path(args.figure) if args.figure else FIGURE
    plot(synthetic, gpt, forward_s, figure)
    payload = {
        "command": ("PYTHONPATH=. python bench/throughput.py "
                   + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
                   ).strip(),
        "quick": args.quick, "smoke": args.smoke, "forward_s": forward_s,
        "backward_s": 2 * forward_s, "batches_per_run": batches,
        "gpt_batches_per_run": gpt_batches, "gpt_rounds": rounds,
        "synthetic": synthetic, "gpt": gpt, "gpt_argv_example": gpt_argv("2bw", gpt_ms[0], 2,
                                                                          gpt_batches, args.smoke),
        "cuda_gpt_345m": cuda,
        "figures": [figure_entry(figure)],
        "git": git_revision(), "bench_seconds": time.perf_counter() - t0}
    path = write_results("throughput", payload, args.out_dir)
    print(f"wrote {path} and {figure} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

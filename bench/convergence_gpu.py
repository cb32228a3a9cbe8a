"""GPU convergence: PipeDream-2BW and its mitigations against PipeDream-Flush on GPT 12 x 768.

The comparison issue 9 asks for whenever a GPU is at hand: a GPT of 12 layers, hidden 768,
12 heads, sequence 512, GPT-2 BPE, global batch 32, peak lr 6e-4 with cosine decay, at
least 1,000 iterations, on a corpus of at least 5M tokens, at d=1 on one GPU in bf16. The
loss curves are invariant to d (tests/distributed/test_pipeline_semantics.py and
test_mitigations.py prove it in float64), so one GPU shows what d stages would train.

Two steps, because the GPU machine cannot reach ../shared::

    # here: the corpus (Python standard-library source, tokenized with GPT-2 BPE)
    PYTHONPATH=. python bench/convergence_gpu.py --prepare-data .gpudata
    # on the GPU machine (the folder travels with the checkout)
    PYTHONPATH=. python bench/convergence_gpu.py --data-dir .gpudata --out-dir OUT

The corpus is the ``.py`` files of the running Python's standard library (site-packages
left out), in path order, cut into documents of whole files, shuffled with a fixed seed and
cut at ``--target-tokens``; its file count, token count and a hash of its file list are in
the JSON.  The run trains each variant in turn in this process, writes the JSON after each
one (a run cut short keeps what finished), times each variant's steady-state seconds per
iteration in a separate short run without evaluation, and draws loss against iterations
and against time.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import shlex
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO_ROOT, figure_entry, format_table, median,  # noqa: E402
                          run_tool, write_results)
from bench.convergence import (STYLES, VARIANTS, fixed_valid_datasets_provider,  # noqa: E402
                               git_revision, smooth, variant_summary)

SHARED_GPT2 = REPO_ROOT.parent / "shared" / "data" / "gpt2"
FIGURE = REPO_ROOT / "docs" / "figures" / "convergence_gpu_gpt.png"
MODEL = dict(layers=12, hidden=768, heads=12, seq=512, gbs=32)
SMOKE_MODEL = dict(layers=2, hidden=64, heads=4, seq=32, gbs=8)
"""--smoke (tests, and gpu_session.sh's dry run): the code on a CPU in seconds.  Its cost
is the output layer over GPT-2's 50,304 padded tokens; at seq 32 a micro batch's logits
(about 25 MiB in fp32) stay under the 32 MiB above which the tuned malloc maps fresh pages."""


# ---------------------------------------------------------------------------------------
# data (run here, where ../shared is)
# ---------------------------------------------------------------------------------------
def stdlib_source_files() -> List[Path]:
    """The standard library's ``.py`` files in path order, site-packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def prepare_data(out_dir: Path, target_tokens: int, vocab: Path, merges: Path,
                 workers: int) -> Dict[str, Any]:
    """Write corpus.jsonl, the GPT-2 vocabulary and the indexed dataset into ``out_dir``."""
    if not (vocab.is_file() and merges.is_file()):
        raise SystemExit(f"error: --vocab-file {vocab} / --merge-file {merges}: "
                         f"GPT-2 BPE files expected (../shared/data/gpt2)")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = stdlib_source_files()
    docs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= 200:
            docs.append((str(path.relative_to(path.parents[len(path.parents) - 1])), text))
    random.Random(1234).shuffle(docs)
    # GPT-2 BPE gives about 2 characters per token on Python source (indentation is one
    # token per space); cut at 2.1 and count exactly after tokenizing
    budget = int(target_tokens * 2.1)
    kept, chars = [], 0
    for name, text in docs:
        if chars >= budget:
            break
        kept.append((name, text))
        chars += len(text)
    corpus = out_dir / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for _, text in kept:
            f.write(json.dumps({"text": text}) + "\n")
    shutil.copyfile(vocab, out_dir / "gpt2-vocab.json")
    shutil.copyfile(merges, out_dir / "gpt2-merges.txt")
    run_tool(["tools/preprocess_data.py", "--input", str(corpus), "--json-keys", "text",
              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab),
              "--merge-file", str(merges), "--append-eod", "--workers", str(workers),
              "--output-prefix", str(out_dir / "pysrc")], "convergence_gpu")
    corpus.unlink()  # the indexed dataset is what travels
    from megatron.data.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(out_dir / "pysrc_text_document"))
    tokens = int(sum(int(n) for n in ds.sizes))
    listing = hashlib.sha256("\n".join(n for n, _ in kept).encode()).hexdigest()
    info = {"source": f"Python {sys.version.split()[0]} standard library .py files "
                      f"(site-packages left out), shuffled with seed 1234",
            "documents": len(kept), "characters": chars, "tokens": tokens,
            "file_list_sha256": listing, "tokenizer": "GPT-2 BPE (../shared/data/gpt2)"}
    (out_dir / "corpus_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"[convergence_gpu] {out_dir}: {len(kept)} files, {chars / 1e6:.1f}M characters, "
          f"{tokens / 1e6:.2f}M tokens")
    return info


# ---------------------------------------------------------------------------------------
# training (run on the GPU)
# ---------------------------------------------------------------------------------------
def trainer_argv(variant: str, m: Dict[str, int], data_dir: Path, iters: int, lr: float,
                 mbs: int, eval_interval: int, eval_iters: int, precision: str,
                 split: str = "98,2,0") -> List[str]:
    prefix = "--fp32" if precision == "fp32" else f"--{precision}"
    return ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
            "--max-position-embeddings", str(m["seq"]),
            "--micro-batch-size", str(mbs), "--global-batch-size", str(m["gbs"]),
            *VARIANTS[variant], "--train-iters", str(iters), "--lr", str(lr),
            "--min-lr", str(lr / 10), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(max(1, iters // 50)), "--weight-decay", "0.1",
            "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", "1234",
            *([] if precision == "fp32" else [prefix]),
            "--data-path", str(data_dir / "pysrc_text_document"), "--split", split,
            "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(data_dir / "gpt2-vocab.json"),
            "--merge-file", str(data_dir / "gpt2-merges.txt"),
            "--log-interval", "100000", "--eval-interval", str(eval_interval),
            "--eval-iters", str(eval_iters), "--num-workers", "0"]


def _set(argv: List[str], flag: str, value: str) -> List[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def train_variant(argv: List[str]) -> Dict[str, Any]:
    import pretrain_gpt
    from megatron.training import pretrain

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        res = pretrain(fixed_valid_datasets_provider, pretrain_gpt.model_provider,
                       pretrain_gpt.forward_step, argv=argv)
    return {"train": {it: v["lm loss"] for it, v in res.losses.items()},
            "valid": {it: v["lm loss"] for it, v in res.eval_losses.items()},
            "wall_seconds": time.perf_counter() - t0}


def time_variant(argv: List[str], iters: int, warmup: int) -> float:
    """Median seconds per iteration (first forward of batch k to that of k+1) of a short
    run without evaluation."""
    import pretrain_gpt
    from bench.throughput import _timed
    from megatron.training import pretrain

    argv = _set(_set(_set(argv, "--train-iters", str(iters)), "--eval-iters", "0"),
                "--lr-warmup-iters", "1")
    mbs = int(argv[argv.index("--micro-batch-size") + 1])
    gbs = int(argv[argv.index("--global-batch-size") + 1])
    stamps: List[float] = []
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 _timed(pretrain_gpt.forward_step, gbs // mbs, stamps), argv=argv)
    return median([b - a for a, b in zip(stamps, stamps[1:])][warmup:])


def summarize(runs: Dict[str, Dict[str, Any]], seconds: Dict[str, float],
              warmup_iters: int) -> Dict[str, Dict[str, Any]]:
    """convergence.py's per-variant summary, plus the gap to Flush at every evaluation."""
    if "flush" not in runs:
        return {}
    out = variant_summary(runs, seconds, warmup_iters)
    flush = runs["flush"]["valid"]
    for name, r in runs.items():
        out[name]["gap_at"] = {it: r["valid"][it] - flush[it]
                               for it in sorted(r["valid"]) if it in flush}
    return out


def plot(runs: Dict[str, Dict[str, Any]], seconds: Dict[str, float], title: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for name, r in runs.items():
        label, color, style = STYLES[name]
        its = sorted(r["train"])
        axes[0].plot(its, smooth([r["train"][i] for i in its], 25), color=color, ls=style,
                     label=label, lw=1.2)
        v = sorted(r["valid"])
        axes[1].plot(v, [r["valid"][i] for i in v], color=color, ls=style, marker=".",
                     label=label)
        if seconds.get(name):
            axes[2].plot([i * seconds[name] for i in v], [r["valid"][i] for i in v],
                         color=color, ls=style, marker=".", label=label)
    axes[0].set(xlabel="iteration", ylabel="training loss (moving mean of 25)",
                title="training loss")
    axes[1].set(xlabel="iteration", ylabel="validation loss", title="validation loss")
    axes[2].set(xlabel="seconds (iterations x measured s/iteration)",
                ylabel="validation loss", title="validation loss against time")
    for ax in axes:
        ax.grid(alpha=0.3)
        finals = [r["valid"][max(r["valid"])] for r in runs.values() if r["valid"]]
        if ax is not axes[0] and finals:
            ax.set_ylim(min(finals) - 0.1, min(finals) + 2.0)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare-data", metavar="DIR", default=None,
                   help="build the corpus and indexed dataset into DIR and stop")
    p.add_argument("--target-tokens", type=int, default=8_000_000,
                   help="corpus size in GPT-2 tokens, about (default 8M)")
    p.add_argument("--vocab-file", default=str(SHARED_GPT2 / "encoder.json"))
    p.add_argument("--merge-file", default=str(SHARED_GPT2 / "vocab.bpe"))
    p.add_argument("--workers", type=int, default=2, help="tokenizer processes")
    p.add_argument("--data-dir", default=None, help="a folder --prepare-data wrote")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=["flush", "2bw", "2bw+predict", "2bw+dc", "2bw+warmup"],
                   help="in this order (flush first: the others are measured against it)")
    p.add_argument("--iters", type=int, default=1200)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--time-iters", type=int, default=40,
                   help="iterations of each variant's timing run (median after 10)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="start no variant that would end past this many seconds, from the "
                        "time of the variants already run")
    p.add_argument("--smoke", action="store_true",
                   help="a 2-layer model for a few iterations (checks the code on a CPU)")
    p.add_argument("--out-dir", default=None, help="where to write convergence_gpu.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    args = p.parse_args(argv)
    if args.prepare_data:
        prepare_data(Path(args.prepare_data), args.target_tokens, Path(args.vocab_file),
                     Path(args.merge_file), args.workers)
        return {}
    if not args.data_dir:
        p.error("--data-dir is required (or --prepare-data DIR)")
    data_dir = Path(args.data_dir)
    info_path = data_dir / "corpus_info.json"
    if not info_path.is_file():
        p.error(f"--data-dir {data_dir}: no corpus_info.json (run --prepare-data first)")
    info = json.loads(info_path.read_text())
    if args.variants[0] != "flush":
        p.error("--variants must start with flush (the others are measured against it)")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    model = SMOKE_MODEL if args.smoke else MODEL
    if args.smoke:
        args.iters, args.eval_interval, args.eval_iters, args.time_iters = 6, 3, 1, 4
        args.micro_batch_size = 4
    split = "80,20,0" if args.smoke else "98,2,0"  # a smoke corpus has a few dozen files
    warmup_iters = args.iters // 2  # the trainer's default --2bw-flush-warmup-iters
    t0 = time.perf_counter()
    runs: Dict[str, Dict[str, Any]] = {}
    seconds: Dict[str, float] = {}
    argvs = {v: trainer_argv(v, model, data_dir, args.iters, args.lr, args.micro_batch_size,
                             args.eval_interval, args.eval_iters, args.precision, split)
             for v in args.variants}
    out_dir = Path(args.out_dir) if args.out_dir else None
    figure = Path(args.figure) if args.figure else FIGURE
    title = (f"GPT {model['layers']} x {model['hidden']}, seq {model['seq']}, batch "
             f"{model['gbs']}, lr {args.lr:g} cosine, {args.precision}, d=1 on {device}; "
             f"{info['tokens'] / 1e6:.1f}M tokens of Python source")
    payload: Dict[str, Any] = {}
    for name in args.variants:
        spent = time.perf_counter() - t0
        if args.budget_seconds and runs:
            per = spent / len(runs)
            if spent + per > args.budget_seconds:
                print(f"[convergence_gpu] {name}: skipped (--budget-seconds "
                      f"{args.budget_seconds:g}; {spent:.0f} s spent, ~{per:.0f} s each)")
                continue
        t1 = time.perf_counter()
        runs[name] = train_variant(argvs[name])
        if name != "2bw+warmup":
            seconds[name] = time_variant(argvs[name], args.time_iters, 10 if not args.smoke
                                         else 2)
        v = runs[name]["valid"]
        if not v:
            raise SystemExit(f"error: --data-dir {data_dir}: no validation loss (the "
                             f"validation split of {split} holds no full sample; prepare "
                             f"a larger corpus with --target-tokens)")
        print(f"[convergence_gpu] {name}: validation loss {v[max(v)]:.4f} at iteration "
              f"{max(v)}, {seconds.get(name, float('nan')) * 1e3:.1f} ms/iteration, "
              f"{time.perf_counter() - t1:.0f} s", flush=True)
        summary = summarize(runs, seconds, warmup_iters)
        payload = {
            "command": ("PYTHONPATH=. python bench/convergence_gpu.py " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))).strip(),
            "device": device, "torch": torch.__version__, "model": model,
            "iters": args.iters, "lr": args.lr, "micro_batch_size": args.micro_batch_size,
            "precision": args.precision, "corpus": info, "warmup_iters": warmup_iters,
            "argv": argvs, "runs": runs, "seconds_per_iteration": seconds,
            "summary": summary, "git": git_revision(),
            "figures": [figure_entry(figure)],
            "bench_seconds": time.perf_counter() - t0}
        write_results("convergence_gpu", payload, out_dir)
    summary = payload.get("summary", {})
    rows = [[name, s["final_valid"], s["relative_to_flush"], s["reaches_flush_final_at"],
             s["seconds_per_iteration"], s["seconds_to_flush_final"]]
            for name, s in summary.items()]
    print(format_table(["variant", "final valid loss", "vs Flush", "iters to Flush's final",
                        "s/iteration", "s to Flush's final"], rows, title=title))
    plot(runs, seconds, title, figure)
    print(f"wrote convergence_gpu.json and {figure} ({time.perf_counter() - t0:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

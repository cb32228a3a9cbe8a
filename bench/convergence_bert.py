"""Convergence, BERT half: 2BW against Flush in pretraining, then MNLI finetuning.

    PYTHONPATH=. python bench/convergence_bert.py            # ~8 min on 2 CPU cores
    PYTHONPATH=. python bench/convergence_bert.py --quick    # ~1.5 min, smaller model
    PYTHONPATH=. python bench/convergence_bert.py --smoke    # seconds (tests)

The same small BERT (uncased WordPiece vocabulary of ``../shared/data/bert/vocab.txt``)
is pretrained twice on 2 gloo CPU ranks (d=2 pipeline stages), once with
``--pipeline-schedule flush`` (vanilla Adam) and once with ``--pipeline-schedule 2bw``
(1-stale Adam, paper section 3.1), with identical data order, hyperparameters and seeds,
on a sentence-level dataset built by ``tools/preprocess_data.py --split-sentences`` from
tinyshakespeare + the WikiText-2 test split (the stdlib documentation-string corpus of
tools/make_demo_corpus.py when ``../shared/data`` is absent).  Training curves of the
masked-LM and sentence-order losses and the validation losses on fixed held-out samples
go to docs/figures/convergence_bert.png.

Each pretrained checkpoint is then finetuned on the MNLI sample (train.tsv) with the
same settings, once per finetuning schedule (flush, 2bw), and scored on dev_matched,
dev_mismatched and the 16-column sample (the paper's Table 1 layout).  These files hold
a handful of examples: the accuracies show the pipeline runs end to end, they are not
evidence about the schedules.  Results: bench/results/convergence_bert.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO_ROOT, figure_entry, format_table,  # noqa: E402
                          run_tool, write_corpus, write_results)
from bench.convergence import (DEFAULT_VARIANTS, SHARED_DATA, STYLES, VARIANTS,  # noqa: E402
                               _set_flag, add_warmup_iters_flag, elapsed, first_reach,
                               fixed_valid_datasets, flush_warmup_iters, git_revision,
                               real_text_documents, run_groups, smooth, variant_summary)

FIGURE = REPO_ROOT / "docs" / "figures" / "convergence_bert.png"
SCHEDULES = ("flush", "2bw")
VOCAB = SHARED_DATA / "bert" / "vocab.txt"
MNLI = SHARED_DATA / "glue" / "MNLI"
MNLI_VALID = ("dev_matched.tsv", "dev_mismatched.tsv", "sample_dev_matched_16col.tsv")
CAVEAT = ("The MNLI files in ../shared/data are samples of a handful of examples (train 6, "
          "dev_matched 5, dev_mismatched 5, 16-column sample 11): these accuracies show that "
          "pretraining -> finetuning -> evaluation runs end to end under both schedules; "
          "differences between them are noise, not evidence for or against 2BW.")


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def prepare_data(work_dir: Path, max_chars: Optional[int]) -> Dict[str, str]:
    """Sentence-level BERT dataset of the pretraining text (cached in ``work_dir``)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tag = f"c{max_chars or 'all'}"
    corpus = work_dir / f"bert_corpus_{tag}.jsonl"
    prefix = work_dir / f"bert_corpus_{tag}"
    source = write_corpus(corpus, *real_text_documents(max_chars), "convergence_bert")
    if not Path(str(prefix) + "_text_sentence.idx").is_file():
        run_tool(["tools/preprocess_data.py", "--input", str(corpus), "--json-keys", "text",
                   "--split-sentences", "--tokenizer-type", "BertWordPieceLowerCase",
                   "--vocab-file", str(VOCAB), "--workers", "1", "--output-prefix", str(prefix)],
                 "convergence_bert")
    return {"data_path": str(prefix) + "_text_sentence", "source": source}


# ---------------------------------------------------------------------------------------
# settings and command lines
# ---------------------------------------------------------------------------------------
def model_settings(quick: bool, smoke: bool) -> Dict[str, Any]:
    """Model, pretraining and finetuning sizes of the three modes."""
    if smoke:
        return dict(layers=2, hidden=32, heads=2, seq=32, mbs=2, m=2, iters=6, eval_interval=3,
                    eval_iters=1, lr=1e-3, max_chars=40_000, ft_epochs=1, ft_lr=5e-4)
    if quick:
        return dict(layers=2, hidden=64, heads=4, seq=64, mbs=4, m=2, iters=60,
                    eval_interval=10, eval_iters=2, lr=1e-3, max_chars=300_000, ft_epochs=2,
                    ft_lr=5e-4)
    return dict(layers=2, hidden=128, heads=4, seq=128, mbs=2, m=4, iters=250,
                eval_interval=25, eval_iters=8, lr=1e-3, max_chars=0, ft_epochs=5, ft_lr=5e-4)


def common_argv(s: Dict[str, Any], depth: int = 2) -> List[str]:
    return ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]),
            "--max-position-embeddings", str(s["seq"]),
            "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(VOCAB),
            "--pipeline-model-parallel-size", str(depth), "--distributed-backend", "gloo",
            "--seed", "1234", "--num-workers", "0", "--log-interval", "100000",
            "--distributed-timeout-minutes", "30"]


def pretrain_argv(variant: str, s: Dict[str, Any], data_path: str, save: Optional[Path],
                  depth: int = 2) -> List[str]:
    """Pretraining flags of one variant (flush, 2bw or 2bw+<mitigation>)."""
    return common_argv(s, depth) + [
        *VARIANTS[variant], "--micro-batch-size", str(s["mbs"]),
        "--global-batch-size", str(s["mbs"] * s["m"]), "--train-iters", str(s["iters"]),
        "--lr", str(s["lr"]), "--min-lr", str(s["lr"] / 10), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, s["iters"] // 20)), "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--mask-prob", "0.15", "--short-seq-prob", "0.1",
        "--data-path", data_path, "--split", "90,10,0",
        "--eval-interval", str(s["eval_interval"]), "--eval-iters", str(s["eval_iters"]),
        *(["--save", str(save), "--save-interval", str(s["iters"])] if save else [])]


def finetune_argv(schedule: str, s: Dict[str, Any], pretrained: Path) -> List[str]:
    # b=1, m=2: the smallest batch 2BW allows at d=2 (m >= d), 3 steps per epoch of 6 rows
    return common_argv(s) + [
        "--task", "MNLI", "--pipeline-schedule", schedule, "--micro-batch-size", "1",
        "--global-batch-size", "2", "--epochs", str(s["ft_epochs"]), "--lr", str(s["ft_lr"]),
        "--lr-decay-style", "linear", "--lr-warmup-fraction", "0.1", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--train-data", str(MNLI / "train.tsv"),
        "--valid-data", *[str(MNLI / f) for f in MNLI_VALID],
        "--pretrained-checkpoint", str(pretrained)]


# ---------------------------------------------------------------------------------------
# the work on each rank
# ---------------------------------------------------------------------------------------
def fixed_valid_datasets_provider(cfg: Any, tokenizer: Any, num_samples: Tuple[int, int, int],
                                  train_samples: Optional[int] = None):
    """pretrain_bert's datasets, as bench/convergence.py's ``fixed_valid_datasets``."""
    import pretrain_bert

    return fixed_valid_datasets(pretrain_bert.datasets_provider, cfg, tokenizer, num_samples,
                                train_samples)


def _worker(rank: int, world: int, pre: List[Tuple[str, List[str]]],
            fine: List[Tuple[str, List[str]]] = (),
            train_samples: Optional[int] = None) -> Dict[str, Any]:
    import functools

    import torch

    import pretrain_bert
    from megatron.training import pretrain
    from tasks.main import main as task_main

    torch.set_num_threads(1)
    out: Dict[str, Any] = {"pretrain": {}, "finetune": {}}
    for name, argv in pre:
        t0 = time.perf_counter()
        pretrain_bert.TASK.masking = pretrain_bert.masking_from_args(argv)
        with contextlib.redirect_stdout(io.StringIO()):
            res = pretrain(functools.partial(fixed_valid_datasets_provider,
                                             train_samples=train_samples),
                           pretrain_bert.model_provider,
                           pretrain_bert.forward_step,
                           extra_args_provider=pretrain_bert.add_bert_args, argv=argv)
        out["pretrain"][name] = {"train": res.losses, "valid": res.eval_losses,
                                 "seconds_per_iteration": res.seconds_per_iteration,
                                 "wall_seconds": time.perf_counter() - t0}
    for name, argv in fine:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            res = task_main(list(argv))
        out["finetune"][name] = {
            "accuracy": {ep: {Path(p).name: a for p, a in accs.items()}
                         for ep, accs in res.accuracy.items()},
            "examples": {Path(k).name: r.samples for k, r in res.reports.items()},
            "train_loss": {it: v["loss"] for it, v in res.training.losses.items()},
            "iterations": res.iteration, "wall_seconds": time.perf_counter() - t0}
    return out


# ---------------------------------------------------------------------------------------
# analysis, figure
# ---------------------------------------------------------------------------------------
def curve(losses: Dict[int, Dict[str, float]], key: str) -> Dict[int, float]:
    return {int(it): float(v[key]) for it, v in sorted(losses.items()) if key in v}


def summarize(pre: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Final validation losses, their relative difference, and 2BW's extra iterations."""
    out: Dict[str, Any] = {}
    for key in ("lm loss", "sop loss"):
        v = {name: curve(pre[name]["valid"], key) for name in SCHEDULES}
        if not all(v.values()):
            continue
        f, t = v["flush"], v["2bw"]
        ff, tf = f[max(f)], t[max(t)]
        rf, rt = first_reach(f, ff), first_reach(t, ff)
        tag = key.split()[0]
        out[f"final_valid_{tag}_flush"] = ff
        out[f"final_valid_{tag}_2bw"] = tf
        out[f"relative_difference_{tag}"] = (tf - ff) / ff
        if tag == "lm":
            out["final_iteration"] = max(f)
            out["first_valid_lm_flush"] = f[min(f)]
            out["first_valid_lm_2bw"] = t[min(t)]
            out["extra_iterations_2bw"] = None if rt is None or rf is None else rt - rf
    tr = {name: curve(pre[name]["train"], "lm loss") for name in SCHEDULES}
    out["train_lm_first_flush"] = tr["flush"][min(tr["flush"])]
    out["train_lm_first_2bw"] = tr["2bw"][min(tr["2bw"])]
    return out


def mnli_table(fine: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (pretraining schedule, finetuning schedule): last-epoch accuracies."""
    rows = []
    for name, r in fine.items():
        pre, ft = name.split("->")
        last = r["accuracy"][max(r["accuracy"])]
        row = {"pretraining_schedule": pre, "finetuning_schedule": ft}
        for f in MNLI_VALID:
            row[Path(f).stem] = last.get(f)
        row["epochs"] = max(r["accuracy"])
        rows.append(row)
    return rows


def plot(pre: Dict[str, Dict[str, Any]], title: str, path: Path,
         seconds: Optional[Dict[str, Optional[float]]] = None, warmup_iters: int = 0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train", "lm loss", "training masked-LM loss"),
              ("valid", "lm loss", "validation masked-LM loss (fixed held-out samples)"),
              ("train", "sop loss", "training sentence-order loss"),
              ("valid", "sop loss", "validation sentence-order loss")]
    if seconds:
        panels += [("time", "lm loss", "validation masked-LM loss against time"),
                   ("time", "sop loss", "validation sentence-order loss against time")]
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(12, 3.8 * len(panels) // 2))
    for ax, (part, key, what) in zip(axes.flat, panels):
        for name in pre:
            label, color, ls = STYLES.get(name, (name, None, "-"))
            c = curve(pre[name]["valid" if part == "time" else part], key)
            if not c:
                continue
            its, vals = zip(*c.items())
            if part == "time":
                times = [elapsed(name, it, seconds, warmup_iters) for it in its]
                if all(t is not None for t in times):
                    ax.plot(times, vals, color=color, ls=ls, marker="o", ms=2.5, lw=1.4,
                            label=label)
            elif part == "train":
                window = max(1, len(vals) // 25)
                ax.plot(its, smooth(vals, window), color=color, ls=ls, lw=1.4,
                        label=f"{label}, moving avg {window}")
            else:
                ax.plot(its, vals, color=color, ls=ls, marker="o", ms=2.5, lw=1.4,
                        label=f"{label}: {vals[-1]:.3f}")
        ax.set_xlabel("seconds (iterations x measured s/iteration)" if part == "time"
                      else "iteration")
        ax.set_ylabel(f"{key} (nats)")
        ax.set_title(what, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure_title(s: Dict[str, Any], source: str) -> str:
    return (f"BERT {s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, uncased "
            f"WordPiece vocab; d=2, w=1, m={s['m']}, b={s['mbs']}, global batch "
            f"{s['mbs'] * s['m']}, peak lr {s['lr']:g}\n{source}")


def report(s: Dict[str, Any], summary: Dict[str, Any], pre: Dict[str, Any],
           table: List[Dict[str, Any]]) -> None:
    rows = [[n, summary.get(f"final_valid_lm_{n}"), summary.get(f"final_valid_sop_{n}"),
             pre[n]["seconds_per_iteration"]] for n in SCHEDULES]
    print(format_table(["schedule", "final valid lm loss", "final valid sop loss",
                        "s/iteration"], rows,
                       title=f"BERT pretraining, {s['iters']} iterations"))
    print(f"relative difference of final validation lm loss (2bw vs flush): "
          f"{summary['relative_difference_lm'] * 100:+.2f}%")
    heads = ["pretraining", "finetuning", *[Path(f).stem for f in MNLI_VALID]]
    print(format_table(heads, [[r["pretraining_schedule"], r["finetuning_schedule"],
                                *[r[Path(f).stem] for f in MNLI_VALID]] for r in table],
                       title=f"MNLI dev accuracy after {s['ft_epochs']} finetuning epoch(s)"))
    print(CAVEAT)


def resummarize(path: Path) -> Dict[str, Any]:
    """The masked-LM per-variant summary recomputed from the stored curves (its fields
    grew after the run), written back."""
    data = json.loads(path.read_text())
    lm = {n: {"valid": curve(c["valid"], "lm loss")} for n, c in data["curves"].items()}
    seconds = (data.get("timing") or {}).get("seconds_per_iteration") or {}
    data["variants"] = variant_summary(lm, seconds, data.get("warmup_iters", 0))
    data["resummarized"] = ("per-variant summary recomputed from the stored curves and "
                            "timing by bench/convergence_bert.py --resummarize")
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"recomputed the summary of {path}")
    return data


# ---------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model, 60 iterations (~1.5 min)")
    p.add_argument("--smoke", action="store_true", help="a few iterations, for tests (seconds)")
    p.add_argument("--iters", type=int, default=None, help="override pretraining iterations")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help="pretraining variants compared (flush and 2bw always; only those "
                        "two are finetuned; default: all, smoke: 2bw+predict)")
    p.add_argument("--time-repeats", type=int, default=None,
                   help="interleaved timing rounds; the fastest of each variant is kept "
                        "(default 3; smoke 1)")
    p.add_argument("--time-iters", type=int, default=None,
                   help="iterations of each per-iteration timing run (default 30; smoke 2)")
    add_warmup_iters_flag(p)
    p.add_argument("--no-finetune-schedules", action="store_true",
                   help="finetune with each pretraining run's own schedule only")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "megatron-bench"
                                             / "convergence_bert"),
                   help="where the corpus and the sentence-level dataset are cached")
    p.add_argument("--out-dir", default=None, help="where to write convergence_bert.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    p.add_argument("--resummarize", metavar="JSON", default=None,
                   help="recompute the per-variant summary of a convergence_bert.json from "
                        "its stored curves and timing, and write it back")
    args = p.parse_args(argv)
    if args.resummarize:
        return resummarize(Path(args.resummarize))
    if not (VOCAB.is_file() and MNLI.is_dir()):
        raise SystemExit(f"bench/convergence_bert.py: needs {VOCAB} and {MNLI} (the BERT "
                         f"vocabulary and the MNLI sample); not found")
    s = model_settings(args.quick, args.smoke)
    if args.iters:
        s["iters"] = args.iters
    if args.variants is None:
        args.variants = ["2bw+predict"] if args.smoke else list(DEFAULT_VARIANTS)
    if args.time_repeats is None:
        args.time_repeats = 1 if args.smoke else 3
    variants = ["flush", "2bw"] + [v for v in args.variants if v not in SCHEDULES]
    warmup_iters = flush_warmup_iters(p, args.warmup_iters, s["iters"])
    time_iters = args.time_iters or (2 if args.smoke else 30)
    t0 = time.perf_counter()
    data = prepare_data(Path(args.work_dir), s["max_chars"] or None)
    prep_s = time.perf_counter() - t0
    ckpt_root = Path(tempfile.mkdtemp(prefix="convergence_bert_ckpt_"))
    try:
        pre = [(n, pretrain_argv(n, s, data["data_path"], ckpt_root / n)) for n in SCHEDULES]
        fine = [(f"{pn}->{fn}", finetune_argv(fn, s, ckpt_root / pn)) for pn in SCHEDULES
                for fn in SCHEDULES if fn == pn or not args.no_finetune_schedules]
        # the mitigations pretrain in a second pair of ranks, at the same time
        extra = [(n, pretrain_argv(n, s, data["data_path"], None)) for n in variants
                 if n not in SCHEDULES]
        timed = [v for v in variants if v != "2bw+warmup"]
        # interleaved rounds (fastest kept): load spikes on a shared machine hit every variant
        timing = [(f"time{r}:{n}", _set_flag(_set_flag(_set_flag(_set_flag(
            pretrain_argv(n, s, data["data_path"], None), "--train-iters", str(time_iters)),
            "--eval-interval", str(10 * time_iters)), "--eval-iters", "1"),
            "--lr-warmup-iters", "1"))
            for r in range(args.time_repeats) for n in timed]
        print(f"[convergence_bert] data ready in {prep_s:.0f} s ({data['source']}); "
              f"pretraining {', '.join(variants)} for {s['iters']} iterations, then "
              f"{len(fine)} MNLI finetunings, on 2 ranks per group ...", flush=True)
        groups = [(pre, fine)] + ([(extra, [])] if extra else [])
        results = run_groups(groups, 2, len(groups), worker=_worker)
        print(f"[convergence_bert] timing {', '.join(timed)} for {time_iters} iterations at "
              f"d=2 (the bench's BERT has 2 layers: d=4 is not possible) ...", flush=True)
        times = run_groups([(timing, [])], 2, 1, worker=_worker)
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    pre_res, fine_res = results["pretrain"], results["finetune"]
    pre_res = {n: pre_res[n] for n in variants}
    seconds = {n: min(times["pretrain"][f"time{r}:{n}"]["seconds_per_iteration"]
                      for r in range(args.time_repeats)) for n in timed}
    figure = Path(args.figure) if args.figure else FIGURE
    plot(pre_res, figure_title(s, data["source"]), figure, seconds, warmup_iters)
    summary = summarize(pre_res)
    table = mnli_table(fine_res)
    report(s, summary, pre_res, table)
    lm = {n: {"valid": curve(pre_res[n]["valid"], "lm loss")} for n in variants}
    vsum = variant_summary(lm, seconds, warmup_iters)
    print(format_table(["variant", "final valid lm loss", "vs flush", "reaches flush final at",
                        "s/iteration (d=2)", "s to flush final"],
                       [[n, v["final_valid"], f"{v['relative_to_flush'] * 100:+.2f}%",
                         v["reaches_flush_final_at"], v["seconds_per_iteration"],
                         v["seconds_to_flush_final"]] for n, v in vsum.items()],
                       title="2BW mitigations, masked-LM validation loss"))
    payload = {
        "command": ("PYTHONPATH=. python bench/convergence_bert.py "
                    + " ".join(shlex.quote(a) for a in
                               (argv if argv is not None else sys.argv[1:]))).strip(),
        "quick": args.quick, "smoke": args.smoke, "settings": s, "depth": 2, "width": 1,
        "global_batch_size": s["mbs"] * s["m"], "data_source": data["source"],
        "summary": summary, "mnli_table": table, "mnli_caveat": CAVEAT,
        "variants": vsum, "warmup_iters": warmup_iters,
        "timing": {"depth": 2, "iterations": time_iters, "rounds": args.time_repeats,
                   "seconds_per_iteration": seconds},
        "pretraining": [{"schedule": n, "final_valid_lm_loss": summary.get(f"final_valid_lm_{n}"),
                         "final_valid_sop_loss": summary.get(f"final_valid_sop_{n}"),
                         "seconds_per_iteration": pre_res[n]["seconds_per_iteration"]}
                        for n in SCHEDULES],
        "curves": {n: {"train": pre_res[n]["train"], "valid": pre_res[n]["valid"]}
                   for n in variants},
        "finetuning": fine_res,
        "argv": {"pretrain": dict(pre + extra), "finetune": dict(fine)},
        "figures": [figure_entry(figure)],
        "git": git_revision(), "bench_seconds": time.perf_counter() - t0}
    path = write_results("convergence_bert", payload, args.out_dir)
    print(f"wrote {path} and {figure} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

"""Convergence: PipeDream-2BW against PipeDream-Flush (vanilla Adam) on real text.

    PYTHONPATH=. python bench/convergence.py            # ~20 min on 2 CPU cores
    PYTHONPATH=. python bench/convergence.py --quick    # a few minutes, smaller model
    PYTHONPATH=. python bench/convergence.py --quick --smoke   # seconds (tests)

The same small GPT is pretrained once per variant -- ``--pipeline-schedule flush``
(vanilla optimizer semantics), ``2bw`` (1-stale updates, paper section 3.1) and 2BW with
each ``--2bw-mitigation`` (predict, dc, warmup) -- with identical data order,
hyperparameters and seeds.  The loss curves run at d=1 by default (``--depth``): the
update rules are proven invariant to d (tests/distributed/test_pipeline_semantics.py,
test_mitigations.py), and one rank is much cheaper on a small CPU machine.  The time
per iteration of each variant is measured separately, side by side, in short runs at
d=4 (``--time-depth``; at most the number of layers), and "time to Flush's final loss"
is iterations-to-reach x that time.  The corpus is tinyshakespeare plus the
WikiText-2 test split from ``../shared/data`` (cut into ~2,000-character documents and
interleaved in a fixed order), tokenized with a SentencePiece model trained by
tools/train_tokenizer.py and written by tools/preprocess_data.py; without
``../shared/data`` the documentation-string corpus of tools/make_demo_corpus.py is used.

Validation uses the same fixed held-out samples at every evaluation (so the curve is
not noisier than the model).  Printed: final validation losses, their relative
difference, and how many more iterations 2BW needs to reach the validation loss
PipeDream-Flush ends with.  Figure (paper Figure 4 style):
docs/figures/convergence_gpt.png.  Results: bench/results/convergence.json.

The BERT pretraining + MNLI finetuning part of the paper's Table 1 is recorded as a
TODO in the JSON until pretrain_bert.py and tasks/main.py exist in this repository.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO_ROOT, figure_entry, RESULTS_DIR,  # noqa: E402
                          first_reach, format_table, run_tool, write_corpus, write_results)

SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
FIGURE = REPO_ROOT / "docs" / "figures" / "convergence_gpt.png"
SCHEDULES = ("flush", "2bw")
# Every variant compared: the two schedules, then 2BW with each --2bw-mitigation.
VARIANTS: Dict[str, List[str]] = {
    "flush": ["--pipeline-schedule", "flush"],
    "2bw": ["--pipeline-schedule", "2bw"],
    "2bw+predict": ["--pipeline-schedule", "2bw", "--2bw-mitigation", "predict"],
    "2bw+dc": ["--pipeline-schedule", "2bw", "--2bw-mitigation", "dc"],
    "2bw+warmup": ["--pipeline-schedule", "2bw", "--2bw-mitigation", "warmup"],
    # a momentum correction for the delay (bench/delay_stability.py: prediction's stable
    # step grows with beta1, 2.5 -> 3.8 from 0.9 to 0.95); asked for by name only
    "2bw+predict+beta1": ["--pipeline-schedule", "2bw", "--2bw-mitigation", "predict",
                          "--adam-beta1", "0.95"],
}
# what a run compares when --variants is not given
DEFAULT_VARIANTS = ("flush", "2bw", "2bw+predict", "2bw+dc", "2bw+warmup")
STYLES = {"flush": ("PipeDream-Flush (vanilla Adam)", "tab:blue", "-"),
          "2bw": ("PipeDream-2BW (1-stale Adam)", "tab:red", "--"),
          "2bw+predict": ("2BW + weight prediction", "tab:green", "-"),
          "2bw+dc": ("2BW + delay compensation", "tab:purple", ":"),
          "2bw+warmup": ("2BW + flush warm-up", "tab:orange", "-."),
          "2bw+predict+beta1": ("2BW + prediction, beta1 0.95", "tab:olive", ":")}


def git_revision() -> Dict[str, Any]:
    """The commit the numbers were measured on, and whether the tree had local changes."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    return {"commit": commit or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None}


# ---------------------------------------------------------------------------------------
# corpus -> tokenizer -> indexed dataset
# ---------------------------------------------------------------------------------------
def _chunks(paragraphs: Sequence[str], target_chars: int) -> List[str]:
    """Group consecutive paragraphs into documents of about ``target_chars``."""
    docs, cur, size = [], [], 0
    for p in paragraphs:
        if not p.strip():
            continue
        cur.append(p)
        size += len(p)
        if size >= target_chars:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        docs.append("\n\n".join(cur))
    return docs


def real_text_documents(max_chars: Optional[int], doc_chars: int = 2000) -> Tuple[List[str], str]:
    """(documents, description) from ../shared/data, or ([], reason) when it is absent."""
    shakespeare = SHARED_DATA / "corpus" / "tinyshakespeare.txt"
    wiki = SHARED_DATA / "wikitext" / "wikitext-2-raw" / "wiki.test.raw"
    if not (shakespeare.is_file() and wiki.is_file()):
        return [], f"{shakespeare} or {wiki} not found"
    docs: List[str] = []
    for path, sep in ((shakespeare, "\n\n"), (wiki, "\n \n")):
        text = path.read_text(encoding="utf-8")
        if max_chars:
            text = text[:max_chars // 2]
        docs += _chunks(text.split(sep), doc_chars)
    # one fixed interleaving, so train and validation both hold both sources
    random.Random(1234).shuffle(docs)
    return docs, f"tinyshakespeare.txt + wikitext-2-raw/wiki.test.raw ({len(docs)} documents)"


def prepare_data(work_dir: Path, vocab_size: int, max_chars: Optional[int]) -> Dict[str, str]:
    """Build corpus.jsonl, a SentencePiece model and the indexed dataset (cached)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tag = f"v{vocab_size}_c{max_chars or 'all'}"
    corpus = work_dir / f"corpus_{tag}.jsonl"
    tok_prefix = work_dir / f"tokenizer_{tag}"
    data_prefix = work_dir / f"corpus_{tag}"
    log = io.StringIO()
    source = write_corpus(corpus, *real_text_documents(max_chars), "convergence", log)
    if not Path(str(tok_prefix) + ".model").is_file():
        run_tool(["tools/train_tokenizer.py", "--input", str(corpus), "--json-keys", "text",
                   "--vocab-size", str(vocab_size), "--model-type", "bpe",
                   "--output-prefix", str(tok_prefix)], "convergence", log)
    if not Path(str(data_prefix) + "_text_document.idx").is_file():
        run_tool(["tools/preprocess_data.py", "--input", str(corpus), "--json-keys", "text",
                   "--tokenizer-type", "SentencePieceTokenizer",
                   "--tokenizer-model", str(tok_prefix) + ".model", "--append-eod",
                   "--workers", "1", "--output-prefix", str(data_prefix)], "convergence", log)
    return {"data_path": str(data_prefix) + "_text_document",
            "tokenizer_model": str(tok_prefix) + ".model", "source": source}


# ---------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------
def model_settings(quick: bool, smoke: bool) -> Dict[str, int]:
    if smoke:
        return dict(layers=2, hidden=32, heads=2, seq=32, mbs=2, m=2, iters=8, eval_interval=4,
                    eval_iters=2, vocab=512, max_chars=60_000)
    if quick:
        return dict(layers=2, hidden=64, heads=4, seq=64, mbs=4, m=4, iters=150,
                    eval_interval=25, eval_iters=4, vocab=1024, max_chars=400_000)
    return dict(layers=4, hidden=128, heads=4, seq=128, mbs=4, m=4, iters=600, eval_interval=25,
                eval_iters=8, vocab=2048, max_chars=0)


def gpt_argv(variant: str, s: Dict[str, int], data: Dict[str, str], depth: int,
             width: int, lr: float) -> List[str]:
    """Trainer flags of one variant (a schedule name, or 2bw+<mitigation>)."""
    gbs = s["mbs"] * s["m"] * width
    return ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]),
            "--max-position-embeddings", str(s["seq"]),
            "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(gbs),
            "--pipeline-model-parallel-size", str(depth), *VARIANTS[variant],
            "--distributed-backend", "gloo",
            "--train-iters", str(s["iters"]), "--lr", str(lr), "--min-lr", str(lr / 10),
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, s["iters"] // 20)),
            "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
            "--data-path", data["data_path"], "--split", "95,5,0",
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", data["tokenizer_model"],
            "--log-interval", "100000", "--eval-interval", str(s["eval_interval"]),
            "--eval-iters", str(s["eval_iters"]), "--num-workers", "0",
            "--distributed-timeout-minutes", "30"]


class _FirstSamples:
    """The first ``n`` samples of a dataset: every evaluation sees the same samples."""

    def __init__(self, ds: Any, n: int) -> None:
        self.ds, self.n = ds, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]


def fixed_valid_datasets(datasets_provider: Any, cfg: Any, tokenizer: Any,
                         num_samples: Tuple[int, int, int], train_samples: Optional[int] = None):
    """``datasets_provider``'s datasets with every evaluation on the same first samples.
    ``train_samples``: build the training set for that many samples whatever the run's
    length, so runs of different lengths see the same sample order (the index mapping's
    shuffle depends on the number of samples).  Shared by the GPT and BERT benches."""
    eval_samples = cfg.training.eval_iters * cfg.training.global_batch_size
    n_train, _, n_test = num_samples
    n_train = max(n_train, train_samples or 0)
    train, valid, test = datasets_provider(cfg, tokenizer, (n_train, eval_samples, n_test))
    return train, (_FirstSamples(valid, eval_samples) if valid is not None else None), test


def fixed_valid_datasets_provider(cfg: Any, tokenizer: Any, num_samples: Tuple[int, int, int],
                                  train_samples: Optional[int] = None):
    """pretrain_gpt's datasets, as ``fixed_valid_datasets``."""
    import pretrain_gpt

    return fixed_valid_datasets(pretrain_gpt.datasets_provider, cfg, tokenizer, num_samples,
                                train_samples)


def _worker(rank: int, world: int, runs: List[Tuple[str, List[str]]],
            train_samples: Optional[int] = None) -> Dict[str, Any]:
    import functools

    import torch

    import pretrain_gpt
    from megatron.training import pretrain

    torch.set_num_threads(1)
    provider = functools.partial(fixed_valid_datasets_provider, train_samples=train_samples)
    out = {}
    for name, argv in runs:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            res = pretrain(provider, pretrain_gpt.model_provider,
                           pretrain_gpt.forward_step, argv=argv)
        out[name] = {"train": {it: v["lm loss"] for it, v in res.losses.items()},
                     "valid": {it: v["lm loss"] for it, v in res.eval_losses.items()},
                     "seconds_per_iteration": res.seconds_per_iteration,
                     "wall_seconds": time.perf_counter() - t0}
    return out


# ---------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------
def analyze(runs: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    flush, tbw = runs["flush"]["valid"], runs["2bw"]["valid"]
    last = max(flush)
    f_final, t_final = flush[last], tbw[max(tbw)]
    target = f_final
    reach_flush = first_reach(flush, target)
    reach_2bw = first_reach(tbw, target)
    return {"final_iteration": last, "final_valid_flush": f_final, "final_valid_2bw": t_final,
            "relative_difference": (t_final - f_final) / f_final,
            "final_valid_ppl_flush": math.exp(min(f_final, 50.0)),
            "final_valid_ppl_2bw": math.exp(min(t_final, 50.0)),
            "target": target, "flush_reaches_target_at": reach_flush,
            "2bw_reaches_target_at": reach_2bw,
            # the other way round: when vanilla semantics got as far as 2BW ends
            "flush_reaches_2bw_final_at": first_reach(flush, t_final),
            "extra_iterations_2bw": (None if reach_2bw is None or reach_flush is None
                                     else reach_2bw - reach_flush)}


def elapsed(variant: str, iteration: float, seconds: Dict[str, Optional[float]],
            warmup_iters: int) -> Optional[float]:
    """Seconds a variant needs for ``iteration`` iterations at the measured per-iteration
    times; the flush warm-up runs its first ``warmup_iters`` at Flush's time, then 2BW's."""
    if variant == "2bw+warmup":
        if seconds.get("flush") is None or seconds.get("2bw") is None:
            return None
        head = min(iteration, warmup_iters)
        return head * seconds["flush"] + (iteration - head) * seconds["2bw"]
    sec = seconds.get(variant)
    return None if sec is None else iteration * sec


def variant_summary(runs: Dict[str, Dict[str, Any]], seconds: Dict[str, Optional[float]],
                    warmup_iters: int) -> Dict[str, Dict[str, Any]]:
    """Per variant: validation loss at Flush's last iteration, its gap to Flush, the
    iteration where it first reaches Flush's final loss and the time that takes.

    And time to a loss both reach: the higher of the variant's and Flush's final losses
    (``common_target``); the seconds each needs to first reach it (iterations x measured
    seconds/iteration) and Flush's time over the variant's (``speedup_at_common_target``,
    above 1: the variant gets there sooner)."""
    flush = runs["flush"]["valid"]
    last = max(flush)
    target = flush[last]
    out = {}
    for name, r in runs.items():
        valid = r["valid"]
        reach = first_reach(valid, target)
        common = max(valid[last], target)
        reach_v, reach_f = first_reach(valid, common), first_reach(flush, common)
        t_v = None if reach_v is None else elapsed(name, reach_v, seconds, warmup_iters)
        t_f = None if reach_f is None else elapsed("flush", reach_f, seconds, warmup_iters)
        out[name] = {"final_valid": valid[last],
                     "relative_to_flush": (valid[last] - target) / target,
                     "reaches_flush_final_at": reach,
                     "seconds_per_iteration": seconds.get(name),
                     "seconds_to_flush_final": (None if reach is None else
                                                elapsed(name, reach, seconds, warmup_iters)),
                     "common_target": common, "seconds_to_common_target": t_v,
                     "flush_seconds_to_common_target": t_f,
                     "speedup_at_common_target": (t_f / t_v if t_v and t_f else None)}
    return out


def smooth(values: Sequence[float], window: int) -> List[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(by_lr: Dict[float, Dict[str, Dict[str, Any]]], title: str, path: Path,
         seconds: Optional[Dict[str, Optional[float]]] = None, warmup_iters: int = 0) -> None:
    """One row per learning rate: training loss, validation loss against iterations,
    and (when per-iteration times are known) validation loss against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 3 if seconds else 2
    fig, axes = plt.subplots(len(by_lr), ncols, figsize=(5.5 * ncols, 0.6 + 3.8 * len(by_lr)),
                             squeeze=False)
    for row, (lr, runs) in zip(axes, by_lr.items()):
        ax_t, ax_v = row[0], row[1]
        for name in runs:
            label, color, ls = STYLES.get(name, (name, None, "-"))
            its, vals = zip(*sorted(runs[name]["train"].items()))
            window = max(1, len(vals) // 40)
            ax_t.plot(its, smooth(vals, window), color=color, ls=ls, lw=1.4,
                      label=f"{label}, moving avg {window}")
            its, vals = zip(*sorted(runs[name]["valid"].items()))
            ax_v.plot(its, vals, color=color, ls=ls, marker="o", ms=2.5, lw=1.4,
                      label=f"{label}: {vals[-1]:.3f}")
            if seconds:
                times = [elapsed(name, it, seconds, warmup_iters) for it in its]
                if all(t is not None for t in times):
                    row[2].plot(times, vals, color=color, ls=ls, marker="o", ms=2.5, lw=1.4,
                                label=label)
        for ax, what in ((ax_t, "training loss"),
                         (ax_v, "validation loss (fixed held-out set)")):
            ax.set_xlabel("iteration")
            ax.set_ylabel("lm loss (nats/token)")
            ax.set_title(f"{what}, peak lr {lr:g}", fontsize=10)
        if seconds:
            row[2].set_xlabel("seconds (iterations x measured s/iteration at the timing depth)")
            row[2].set_ylabel("lm loss (nats/token)")
            row[2].set_title(f"validation loss against time, peak lr {lr:g}", fontsize=10)
        for ax in row:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bert_status() -> Dict[str, Any]:
    """The BERT/MNLI part (paper Table 1) lives in its own bench."""
    return {"status": "separate bench",
            "command": "PYTHONPATH=. python bench/convergence_bert.py",
            "results": "bench/results/convergence_bert.json"}


def figure_title(s: Dict[str, int], depth: int, width: int, source: str,
                 time_depth: Optional[int] = None) -> str:
    timing = (f"; loss curves at d={depth} (semantics do not depend on d), s/iteration "
              f"measured at d={time_depth}" if time_depth else "")
    return (f"GPT {s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, vocab "
            f"{s['vocab']}; d={depth}, w={width}, m={s['m']}, b={s['mbs']}, global batch "
            f"{s['mbs'] * s['m'] * width}{timing}\n{source}")


def replot(results_dir: Path, figure: Optional[str]) -> Dict[str, Any]:
    """Redraw the figure from convergence.json (JSON keys are strings: back to ints)."""
    path = results_dir / "convergence.json"
    if not path.is_file():
        raise SystemExit(f"bench/convergence.py --replot: {path} not found; run the bench first")
    data = json.loads(path.read_text())
    by_lr = {r["lr"]: {name: {part: {int(k): v for k, v in c[part].items()}
                              for part in ("train", "valid")}
                       for name, c in r["curves"].items()} for r in data["runs"]}
    out = Path(figure) if figure else REPO_ROOT / data["figures"][0]
    timing = data.get("timing") or {}
    plot(by_lr, figure_title(data["settings"], data["depth"], data["width"],
                             data["data_source"], timing.get("depth")), out,
         timing.get("seconds_per_iteration"), data.get("warmup_iters", 0))
    print(f"redrew {out} from {path}")
    return data


def resummarize(path: Path) -> Dict[str, Any]:
    """Recompute each learning rate's per-variant summary of a convergence.json from its
    stored curves and timing (the summary's fields grew after the run), write it back."""
    data = json.loads(path.read_text())
    seconds = (data.get("timing") or {}).get("seconds_per_iteration") or {}
    for run in data["runs"]:
        curves = {name: {part: {int(k): v for k, v in c[part].items()}
                         for part in ("train", "valid")} for name, c in run["curves"].items()}
        run["variants"] = variant_summary(curves, seconds, data.get("warmup_iters", 0))
    data["resummarized"] = ("per-variant summaries recomputed from the stored curves and "
                            "timing by bench/convergence.py --resummarize")
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"recomputed the summaries of {path}")
    return data


def report(lr: float, runs: Dict[str, Dict[str, Any]], seconds: Dict[str, Optional[float]],
           warmup_iters: int) -> Dict[str, Any]:
    """Print one learning rate's comparison; return its JSON record."""
    summary = analyze(runs)
    variants = variant_summary(runs, seconds, warmup_iters)
    rows = [[name, v["final_valid"], f"{v['relative_to_flush'] * 100:+.2f}%",
             v["reaches_flush_final_at"], v["seconds_per_iteration"],
             v["seconds_to_flush_final"], v["speedup_at_common_target"]]
            for name, v in variants.items()]
    print(format_table(["variant", "final valid loss", "vs flush", "reaches flush final at",
                        "s/iteration (timing run)", "s to flush final",
                        "flush s / variant s to the loss both reach"], rows,
                       title=f"peak lr {lr:g}: after {summary['final_iteration']} iterations"))
    return {"lr": lr, "summary": summary, "variants": variants,
            "table": [{"schedule": name, "final_valid_loss": v["final_valid"],
                       "seconds_per_iteration": runs[name]["seconds_per_iteration"]}
                      for name, v in variants.items()],
            "curves": {name: {"train": runs[name]["train"], "valid": runs[name]["valid"]}
                       for name in runs}}


def _set_flag(argv: List[str], flag: str, value: str) -> List[str]:
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def run_groups(groups: List[Any], world: int, jobs: int, worker: Any = None) -> Dict[str, Any]:
    """Run each group (the worker's arguments) in its own set of ``world`` ranks, ``jobs``
    groups at a time; the results of the last rank (which computes the losses), merged
    (nested dicts one level deep)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.dist_utils import run_distributed

    fn = worker or _worker

    def one(group: Any) -> Dict[str, Any]:
        args = group if isinstance(group, tuple) else (group,)
        return run_distributed(fn, world, args=args, timeout=6 * 3600)[-1]

    merged: Dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for res in pool.map(one, groups):
            for k, v in res.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k].update(v)
                else:
                    merged[k] = v
    return merged


def add_warmup_iters_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup-iters", type=int, default=None,
                   help="--2bw-flush-warmup-iters of the 2bw+warmup variant (default: the "
                        "trainer's, half of the run)")


def flush_warmup_iters(p: argparse.ArgumentParser, requested: Optional[int], iters: int) -> int:
    """The 2bw+warmup variant's warm-up length: ``requested`` (--warmup-iters), else the
    trainer's default of half the run; a requested length is put on its command line."""
    warmup = iters // 2 if requested is None else requested
    if not 0 <= warmup <= iters:
        p.error(f"--warmup-iters {warmup}: expected 0..{iters} (the run's length)")
    if requested is not None:
        VARIANTS["2bw+warmup"] = VARIANTS["2bw+warmup"] + ["--2bw-flush-warmup-iters",
                                                           str(warmup)]
    return warmup


# ---------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model, 150 iterations")
    p.add_argument("--smoke", action="store_true", help="with --quick: seconds, for tests")
    p.add_argument("--iters", type=int, default=None, help="override --train-iters")
    p.add_argument("--depth", type=int, default=1,
                   help="pipeline stages d of the loss-curve runs (default 1: the semantics "
                        "are proven invariant to d, and d=1 is cheapest)")
    p.add_argument("--width", type=int, default=1, help="parallel pipelines w (default 1)")
    p.add_argument("--time-depth", type=int, default=None,
                   help="d of the separate per-iteration timing runs (default 4, at most the "
                        "number of layers: --quick times at d=2; smoke 2)")
    p.add_argument("--time-iters", type=int, default=None,
                   help="iterations of each timing run (default 30; quick 12; smoke 2)")
    p.add_argument("--time-repeats", type=int, default=None,
                   help="interleaved timing rounds; the fastest of each variant is kept "
                        "(default 3; smoke 1)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help="what to compare (flush and 2bw are always included; default: "
                        "all, smoke: 2bw+predict)")
    p.add_argument("--dc-lambda", type=float, default=None,
                   help="--2bw-dc-lambda of the 2bw+dc variant (default: the trainer's, 1)")
    add_warmup_iters_flag(p)
    p.add_argument("--jobs", type=int, default=1,
                   help="learning rates trained at the same time (separate processes)")
    p.add_argument("--lr", type=float, nargs="+", default=None,
                   help="peak learning rates, one set of runs each (default 1e-3 3e-4; "
                        "quick: 1e-3)")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "megatron-bench"
                                             / "convergence"),
                   help="where the corpus, tokenizer and indexed dataset are cached")
    p.add_argument("--out-dir", default=None, help="where to write convergence.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    p.add_argument("--resummarize", metavar="JSON", default=None,
                   help="recompute the per-variant summaries of a convergence.json from its "
                        "stored curves and timing, and write it back")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figure from an existing convergence.json")
    args = p.parse_args(argv)
    if args.smoke and not args.quick:
        p.error("--smoke is a variant of --quick; pass both")
    if args.resummarize:
        return resummarize(Path(args.resummarize))
    if args.replot:
        return replot(Path(args.out_dir) if args.out_dir else RESULTS_DIR, args.figure)

    s = model_settings(args.quick, args.smoke)
    if args.iters:
        s["iters"] = args.iters
    if args.variants is None:
        args.variants = ["2bw+predict"] if args.smoke else list(DEFAULT_VARIANTS)
    if args.time_repeats is None:
        args.time_repeats = 1 if args.smoke else 3
    variants = ["flush", "2bw"] + [v for v in args.variants if v not in ("flush", "2bw")]
    warmup_iters = flush_warmup_iters(p, args.warmup_iters, s["iters"])
    # d=4 as asked; a model with fewer layers (--quick: 2) is timed at d = its layers
    time_depth = args.time_depth or min(2 if args.smoke else 4, s["layers"])
    time_iters = args.time_iters or (2 if args.smoke else 12 if args.quick else 30)
    t0 = time.perf_counter()
    data = prepare_data(Path(args.work_dir), s["vocab"], s["max_chars"] or None)
    prep_s = time.perf_counter() - t0
    lrs = args.lr or ([1e-3] if args.quick else [1e-3, 3e-4])
    if args.dc_lambda is not None:
        VARIANTS["2bw+dc"] = VARIANTS["2bw+dc"] + ["--2bw-dc-lambda", str(args.dc_lambda)]
    groups = [[(f"{name}@{lr:g}", gpt_argv(name, s, data, args.depth, args.width, lr))
               for name in variants] for lr in lrs]
    world = args.depth * args.width
    print(f"[convergence] data ready in {prep_s:.0f} s ({data['source']}); training "
          f"{', '.join(variants)} at lr {', '.join(f'{lr:g}' for lr in lrs)} for "
          f"{s['iters']} iterations on {world} rank(s) ...", flush=True)
    results = run_groups(groups, world, args.jobs)
    # per-iteration time of each variant, side by side in one short run at time_depth
    timed = [v for v in variants if v != "2bw+warmup"]
    timing_runs = []
    for r in range(args.time_repeats):  # interleaved rounds: load spikes hit all variants
        for name in timed:
            a = gpt_argv(name, s, data, time_depth, 1, lrs[0])
            a = _set_flag(_set_flag(_set_flag(a, "--train-iters", str(time_iters)),
                                    "--eval-interval", str(10 * time_iters)), "--eval-iters", "1")
            a = _set_flag(a, "--lr-warmup-iters", "1")  # must stay below the short run
            timing_runs.append((f"time{r}:{name}", a))
    print(f"[convergence] timing {', '.join(timed)} for {time_iters} iterations at "
          f"d={time_depth}, {args.time_repeats} interleaved rounds (fastest kept) ...", flush=True)
    timing = run_groups([timing_runs], time_depth, 1)
    seconds = {name: min(timing[f"time{r}:{name}"]["seconds_per_iteration"]
                         for r in range(args.time_repeats)) for name in timed}
    by_lr = {lr: {name: results[f"{name}@{lr:g}"] for name in variants} for lr in lrs}
    figure = Path(args.figure) if args.figure else FIGURE
    plot(by_lr, figure_title(s, args.depth, args.width, data["source"], time_depth), figure,
         seconds, warmup_iters)
    print(f"loss curves at d={args.depth} (2BW and its mitigations are proven invariant to "
          f"d); seconds/iteration measured side by side at d={time_depth} over {time_iters} "
          f"iterations (one pipeline fill and drain included); the flush warm-up's time is "
          f"{warmup_iters} iterations at Flush's time, then 2BW's")
    out_runs = [report(lr, r, seconds, warmup_iters) for lr, r in by_lr.items()]
    payload = {
        "command": ("PYTHONPATH=. python bench/convergence.py "
                   + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
                   ).strip(),
        "quick": args.quick, "smoke": args.smoke, "settings": s, "depth": args.depth,
        "width": args.width, "global_batch_size": s["mbs"] * s["m"] * args.width, "lrs": lrs,
        "variants": variants, "warmup_iters": warmup_iters,
        "timing": {"depth": time_depth, "iterations": time_iters, "rounds": args.time_repeats,
                   "seconds_per_iteration": seconds},
        "data_source": data["source"], "argv": {name: a for group in groups for name, a in group},
        "runs": out_runs,
        "figures": [figure_entry(figure)],
        "bert_mnli": bert_status(), "git": git_revision(),
        "bench_seconds": time.perf_counter() - t0}
    path = write_results("convergence", payload, args.out_dir)
    print(f"wrote {path} and {figure} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

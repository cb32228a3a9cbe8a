"""How much does the trainer cost on top of a plain PyTorch loop?  (CPU, one process)

    PYTHONPATH=. python bench/trainer_overhead.py [--quick] [--rounds 3] [--profile]

Both sides train the same ``megatron.model.GPTModel`` (same seed, so the same initial
weights) on the same mock-data microbatches, fp32, dropout 0:

* A, this trainer: ``megatron.training.pretrain`` with ``--pipeline-schedule flush`` and
  one stage (d=1), i.e. the pipeline engine, the Megatron optimizer (global norm
  clipping, AdamW), the LR scheduler and the logger;
* B, a plain loop: microbatches from a DataLoader, ``(loss / m).backward()`` for each,
  ``clip_grad_norm_``, ``torch.optim.AdamW`` with the same decay groups (matrices decay,
  biases and LayerNorm weights do not).

The two alternate step by step (A B A B ...) so both see the same machine load: the
trainer's training set is wrapped so that reading the first sample of each batch runs
one plain-loop step first (outside any trainer context; see ``_BatchStartHook``).  A
trainer step is the time from the end of one plain step to the start of the next, so
it includes everything the trainer does per batch (data, forward, backward, gradient
statistics, optimizer, scheduler, logging).  Each run's first steps are warm-up and
dropped; medians of the rest are compared.  Losses of A and B must agree step by step
(checked), which shows that both really do the same work.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (REPO_ROOT, bench_command, format_table, gpt_config,  # noqa: E402
                          median, write_results)

# The model of the task: 4 layers, hidden 256, 8 heads, seq 128, vocab 8192.
FULL_MODEL = {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 8192}
QUICK_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 1024}


def trainer_argv(model: Dict[str, int], iters: int, micro_batch: int = 4,
                 global_batch: int = 16) -> List[str]:
    """pretrain_gpt.py flags of the benchmarked configuration."""
    return ["--num-layers", str(model["layers"]), "--hidden-size", str(model["hidden"]),
            "--num-attention-heads", str(model["heads"]), "--seq-length", str(model["seq"]),
            "--max-position-embeddings", str(model["seq"]),
            "--vocab-size", str(model["vocab"]), "--tokenizer-type", "NullTokenizer",
            "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
            "--train-iters", str(iters), "--pipeline-schedule", "flush",
            "--distributed-backend", "gloo",  # a CPU benchmark even where CUDA exists
            "--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "100000",
            "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0"]


def batch_periods(stamps: List[float]) -> List[float]:
    """Differences of consecutive batch-start times."""
    return [b - a for a, b in zip(stamps, stamps[1:])]


def run_trainer(argv: List[str], num_microbatches: int,
                cpu_stamps: Optional[List[float]] = None) -> Tuple[List[float], List[float]]:
    """(step times, losses) of ``pretrain`` on ``argv``; the last batch only ends the
    last period, so ``iters`` batches give ``iters - 1`` step times.  ``cpu_stamps``, when
    given, receives the process CPU time at each batch start."""
    import pretrain_gpt
    from megatron.training import pretrain

    starts: List[float] = []
    calls = [0]

    def timed_forward_step(data_iterator, model):
        if calls[0] % num_microbatches == 0:
            starts.append(time.perf_counter())
            if cpu_stamps is not None:
                cpu_stamps.append(time.process_time())
        calls[0] += 1
        return pretrain_gpt.forward_step(data_iterator, model)

    result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                      timed_forward_step, argv=argv)
    losses = [result.losses[k]["lm loss"] for k in sorted(result.losses)]
    return batch_periods(starts), losses


class PlainLoop:
    """The same training as the trainer's, written as a minimal PyTorch loop; one
    ``step()`` per batch."""

    def __init__(self, cfg: Any, tokenizer: Any, iters: int) -> None:
        from megatron.data.gpt_dataset import MockGPTDataset
        from megatron.model import GPTModel
        from megatron.tensor_parallel import TPInfo

        tr, oc = cfg.training, cfg.optimizer
        self.m = tr.global_batch_size // tr.micro_batch_size
        self.clip = oc.clip_grad
        self.model = GPTModel(cfg.model, TPInfo.single(), seed=tr.seed)
        self.model.train()
        self.params = list(self.model.parameters())
        groups = [{"params": [p for p in self.params if p.ndim >= 2],
                   "weight_decay": oc.weight_decay},
                  {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2),
                                     eps=oc.adam_eps)
        ds = MockGPTDataset(iters * tr.global_batch_size, cfg.model.seq_length,
                            tokenizer.vocab_size, tr.seed)
        self.loader = iter(torch.utils.data.DataLoader(ds, batch_size=tr.micro_batch_size,
                                                       shuffle=False, num_workers=0))
        self.positions = torch.arange(cfg.model.seq_length).unsqueeze(0)
        self.times: List[float] = []
        self.losses: List[float] = []

    def step(self) -> None:
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(self.m):
            text = next(self.loader)["text"]
            tokens, labels = text[:, :-1], text[:, 1:]
            loss = self.model(tokens, self.positions.expand_as(tokens), None,
                              labels=labels).mean()
            (loss / self.m).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(total / self.m)
        self.times.append(time.perf_counter() - t0)


class _BatchStartHook(torch.utils.data.Dataset):
    """Wraps the trainer's training set; reading the first sample of each batch calls
    ``hook()`` first.  The engine reads data before it enters any autograd or memory
    tracking context, so whatever the hook runs is not charged to the trainer."""

    def __init__(self, dataset, global_batch: int, hook) -> None:
        self.dataset, self.global_batch, self.hook = dataset, global_batch, hook

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int):
        if idx % self.global_batch == 0:
            self.hook()
        return self.dataset[idx]


def run_interleaved(argv: List[str], cfg: Any, tokenizer: Any, iters: int
                    ) -> Dict[str, List[float]]:
    """One trainer run with a plain-loop step slotted in before each of its batches
    (A B A B ... at step granularity).  Returns step times and losses of both."""
    import pretrain_gpt
    from megatron.training import pretrain

    plain = PlainLoop(cfg, tokenizer, iters)
    marks: List[Tuple[float, float]] = []  # (before the plain step, after it)

    def between_batches() -> None:
        before = time.perf_counter()
        if len(plain.times) < iters:
            plain.step()
        marks.append((before, time.perf_counter()))

    def datasets_provider(c, tok, num_samples):
        train, valid, test = pretrain_gpt.datasets_provider(c, tok, num_samples)
        return _BatchStartHook(train, c.training.global_batch_size, between_batches), valid, test

    result = pretrain(datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                      argv=argv)
    # trainer step k runs from the end of plain step k to the start of plain step k+1
    trainer_times = [nxt[0] - cur[1] for cur, nxt in zip(marks, marks[1:])]
    return {"trainer": trainer_times, "plain": plain.times[:len(trainer_times)],
            "trainer_losses": [result.losses[k]["lm loss"] for k in sorted(result.losses)],
            "plain_losses": plain.losses}


def check_same_training(trainer_losses: List[float], plain_losses: List[float],
                        rtol: float = 1e-4) -> float:
    """Largest relative loss difference; raises if the two runs trained differently."""
    n = min(len(trainer_losses), len(plain_losses))
    worst = max(abs(a - b) / max(abs(b), 1e-12)
                for a, b in zip(trainer_losses[:n], plain_losses[:n]))
    if worst > rtol:
        raise RuntimeError(f"trainer and plain loop losses differ (max rel {worst:.2e}):\n"
                           f"trainer {trainer_losses[:n]}\nplain   {plain_losses[:n]}")
    return worst


# Python code of the trainer itself (not the model, not torch): its own time under the
# profiler is the overhead a plain loop would not have.
TRAINER_CODE = ("megatron/pipeline/", "megatron/optimizer/", "megatron/training",
                "megatron/data/", "pretrain_gpt.py")


def profile_trainer(argv: List[str], m: int, top: int = 25) -> Tuple[str, Dict[str, float]]:
    """cProfile of one trainer run: the top functions by own time, and the share of the
    run spent in the trainer's own Python code (``TRAINER_CODE``)."""
    prof = cProfile.Profile()
    prof.enable()
    run_trainer(argv, m)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    total = stats.total_tt
    own = {}
    for (filename, _, func), (_, _, tottime, _, _) in stats.stats.items():
        name = filename.replace("\\", "/")
        if any(part in name for part in TRAINER_CODE):
            key = f"{name.split(str(REPO_ROOT) + '/')[-1]}:{func}"
            own[key] = own.get(key, 0.0) + tottime
    trainer_s = sum(own.values())
    summary = {"profiled_seconds": total, "trainer_python_seconds": trainer_s,
               "trainer_python_fraction": trainer_s / total,
               "top_trainer_functions": dict(sorted(own.items(), key=lambda kv: -kv[1])[:8])}
    return buf.getvalue(), summary


def results_name(compile_layers: bool) -> str:
    """The JSON a run writes: a --compile-layers run compares another trainer, so it
    must not replace the eager run's trainer_overhead.json."""
    return "trainer_overhead_compile_layers" if compile_layers else "trainer_overhead"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, 2 short rounds (tests)")
    p.add_argument("--rounds", type=int, default=None,
                   help="trainer runs, each with its plain twin (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per run after warm-up (default 8, quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped per run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--profile", action="store_true", help="also print a cProfile of A")
    p.add_argument("--compile-layers", action="store_true",
                   help="train A with --compile-layers (B stays eager): does compiling the "
                        "transformer layers pay on this CPU?  Compilation happens in the "
                        "warm-up steps (raise --warmup if it spills over)")
    p.add_argument("--out-dir", default=None,
                   help="where to write trainer_overhead.json (with --compile-layers: "
                        "trainer_overhead_compile_layers.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 3)
    steps = args.steps or (3 if args.quick else 8)
    model = QUICK_MODEL if args.quick else FULL_MODEL
    iters = args.warmup + steps + 1  # +1: the last batch only closes the last period
    targv = trainer_argv(model, iters) + (["--compile-layers"] if args.compile_layers else [])
    cfg, tokenizer = gpt_config(targv)
    m = cfg.training.global_batch_size // cfg.training.micro_batch_size

    times: Dict[str, List[float]] = {"trainer": [], "plain": []}
    paired: List[float] = []
    per_round = []
    worst = 0.0
    for r in range(rounds):
        run = run_interleaved(targv, cfg, tokenizer, iters)
        worst = max(worst, check_same_training(run["trainer_losses"], run["plain_losses"]))
        a, b = run["trainer"][args.warmup:], run["plain"][args.warmup:]
        times["trainer"] += a
        times["plain"] += b
        paired += [x / y for x, y in zip(a, b)]
        per_round.append({"round": r, "trainer_ms": 1e3 * median(a), "plain_ms": 1e3 * median(b),
                          "ratio": median(a) / median(b)})
    ms_a, ms_b = 1e3 * median(times["trainer"]), 1e3 * median(times["plain"])
    ratio = ms_a / ms_b
    rows = [[r["round"], r["trainer_ms"], r["plain_ms"], r["ratio"]] for r in per_round]
    rows.append(["all", ms_a, ms_b, ratio])
    print(format_table(["round", "trainer ms/step", "plain ms/step", "ratio"], rows,
                       title=f"trainer (flush, d=1{', --compile-layers' if args.compile_layers else ''}"
                             f") vs plain PyTorch loop, steps interleaved: "
                             f"{model}, micro batch {cfg.training.micro_batch_size}, global "
                             f"batch {cfg.training.global_batch_size} (m={m}), fp32, "
                             f"{args.threads} thread(s), medians"))
    print(f"losses agree step by step (max relative difference {worst:.1e}); ratio of medians "
          f"{ratio:.3f}, median of paired step ratios {median(paired):.3f} (goal <= 1.03)")
    payload = {"command": bench_command("bench/trainer_overhead.py", argv),
               "quick": args.quick, "compile_layers": args.compile_layers, "model": model,
               "micro_batch_size": cfg.training.micro_batch_size,
               "global_batch_size": cfg.training.global_batch_size, "num_microbatches": m,
               "rounds": rounds, "timed_steps_per_run": steps, "warmup_steps": args.warmup,
               "threads": args.threads, "trainer_ms_per_step": ms_a, "plain_ms_per_step": ms_b,
               "ratio": ratio, "median_paired_ratio": median(paired), "goal_ratio": 1.03,
               "max_rel_loss_diff": worst, "per_round": per_round, "step_times_s": times}
    if args.profile:
        report, summary = profile_trainer(targv, m)
        print(report)
        print(f"the trainer's own Python code (engine, optimizer wrapper, training loop, data) "
              f"took {summary['trainer_python_seconds']:.3f} s of "
              f"{summary['profiled_seconds']:.1f} s profiled "
              f"({100 * summary['trainer_python_fraction']:.2f} %); top: "
              f"{ {k: round(v, 4) for k, v in summary['top_trainer_functions'].items()} }")
        payload["profile"] = summary
    path = write_results(results_name(args.compile_layers), payload, args.out_dir)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()

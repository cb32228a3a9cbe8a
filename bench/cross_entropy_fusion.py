"""What ``--cross-entropy-loss-fusion`` buys on a GPU, side by side in one process.

    PYTHONPATH=. python bench/cross_entropy_fusion.py [--out-dir DIR]   # ~3 min on an H100
    PYTHONPATH=. python bench/cross_entropy_fusion.py --dry-run         # tiny, on the CPU

(a) The loss alone at GPT-345M's head shape (seq 1024, padded vocabulary 50304, bf16
logits, micro batch 1 and 8): forward + backward of ``vocab_parallel_cross_entropy``,
the chunked eager code (the default) against the fused ``torch.compile`` path, the two
alternating, median over rounds; plus the allocator's peak above the logits during the
pair (the fused backward writes a new gradient instead of overwriting the logits).
(b) The trainer (``pretrain``, GPT-345M, bf16, dropout 0.1, m = 4) with and without the
flag, alternating, for micro batch 8 and 1: seconds per iteration and model-FLOPs
utilisation.

Without a GPU it says so and stops; ``--dry-run`` runs the same code on the CPU with a
2-layer model (tests).  Results: bench/results/gpu/cross_entropy_fusion.json.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, format_table, write_results  # noqa: E402
from bench.convergence import git_revision  # noqa: E402
from bench.throughput import (DRY_RUN_MODEL, GPT_345M, _peak_flops, _trainer_period,  # noqa: E402
                              gpu_trainer_argv)

FLAG = "--cross-entropy-loss-fusion"


def loss_alone(device: str, seq: int, vocab: int, micro_batches: List[int], rounds: int,
               iters: int) -> List[Dict[str, Any]]:
    import torch

    from megatron.tensor_parallel import vocab_parallel_cross_entropy

    cuda = device == "cuda"
    rows = []
    for b in micro_batches:
        gen = torch.Generator().manual_seed(b)
        logits0 = (torch.randn(seq, b, vocab, generator=gen) * 3).to(torch.bfloat16).to(device)
        target = torch.randint(0, vocab, (seq, b), generator=gen).to(device)
        times: Dict[bool, List[float]] = {False: [], True: []}
        peaks: Dict[bool, int] = {}
        losses: Dict[bool, float] = {}

        def once(fused: bool) -> torch.Tensor:
            x = logits0.clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(x, target, inplace_backward=True, fused=fused)
            loss.sum().backward()
            return loss.detach()

        for fused in (False, True):  # warm-up (and the compilation), the peak, the loss
            for _ in range(2):
                once(fused)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                losses[fused] = float(once(fused).mean())
                torch.cuda.synchronize()
                peaks[fused] = torch.cuda.max_memory_allocated() - base
            else:
                losses[fused] = float(once(fused).mean())
        for _ in range(rounds):
            for fused in (False, True):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    once(fused)
                if cuda:
                    torch.cuda.synchronize()
                times[fused].append((time.perf_counter() - t0) / iters)
        chunked, fused_s = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"micro_batch_size": b, "tokens": seq * b, "vocab": vocab,
                     "chunked_ms": 1e3 * chunked, "fused_ms": 1e3 * fused_s,
                     "speedup": chunked / fused_s,
                     "chunked_samples_ms": [1e3 * t for t in times[False]],
                     "fused_samples_ms": [1e3 * t for t in times[True]],
                     "chunked_peak_bytes": peaks.get(False), "fused_peak_bytes": peaks.get(True),
                     "logits_bytes": logits0.numel() * logits0.element_size(),
                     "mean_loss_chunked": losses[False], "mean_loss_fused": losses[True]})
        del logits0
        if cuda:
            torch.cuda.empty_cache()
    return rows


def trainer_ab(model: Dict[str, int], micro_batches: List[int], m: int, rounds: int,
               iters: int, warmup: int, peak: Optional[float]) -> List[Dict[str, Any]]:
    import torch

    from bench.common import gpt_config
    from megatron.model.flops import gpt_flops_per_iteration

    rows = []
    for b in micro_batches:
        gbs = b * m
        cfg, _ = gpt_config(gpu_trainer_argv(model, "bf16", b, gbs, iters, []))
        flops = gpt_flops_per_iteration(cfg.model, gbs, cfg.model.seq_length)
        samples: Dict[str, List[float]] = {"default": [], FLAG: []}
        for _ in range(rounds):
            for key, extra in (("default", []), (FLAG, [FLAG])):
                samples[key].append(_trainer_period(model, "bf16", b, gbs, iters, warmup,
                                                    extra))
                print(f"  b={b} {key}: {samples[key][-1]:.4f} s/iteration", flush=True)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        base, fused = (statistics.median(samples[k]) for k in ("default", FLAG))
        rows.append({"micro_batch_size": b, "global_batch_size": gbs,
                     "default_s": base, "fused_s": fused, "speedup": base / fused,
                     "default_samples_s": samples["default"], "fused_samples_s": samples[FLAG],
                     "default_mfu": flops / base / peak if peak else None,
                     "fused_mfu": flops / fused / peak if peak else None})
    return rows


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per way (2)")
    p.add_argument("--dry-run", action="store_true", help="a 2-layer model on the CPU")
    p.add_argument("--out-dir", default=None,
                   help=f"where the JSON goes (default {RESULTS_DIR / 'gpu'})")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("cross_entropy_fusion: skipped (no CUDA device; --dry-run checks the code on "
              "the CPU)")
        return {"status": "skipped"}
    t0 = time.perf_counter()
    if args.dry_run:
        device, model, name, iters = "cpu", DRY_RUN_MODEL, "CPU (dry run)", 2
        seq, vocab = 64, 512
    else:
        device, model, name, iters = "cuda", GPT_345M, torch.cuda.get_device_name(0), 10
        seq, vocab = GPT_345M["seq"], 50304  # the trainer pads 50257 to a multiple of 128
    peak = None if args.dry_run else _peak_flops(name)
    alone = loss_alone(device, seq, vocab, [1, 8], args.rounds, iters)
    print(format_table(
        ["micro batch", "tokens", "chunked ms", "fused ms", "speedup", "peak MiB chunked",
         "peak MiB fused"],
        [[r["micro_batch_size"], r["tokens"], r["chunked_ms"], r["fused_ms"], r["speedup"],
          None if r["chunked_peak_bytes"] is None else r["chunked_peak_bytes"] / 2 ** 20,
          None if r["fused_peak_bytes"] is None else r["fused_peak_bytes"] / 2 ** 20]
         for r in alone],
        title=f"(a) cross-entropy forward + backward alone, vocab {vocab}, bf16 logits, {name}"))
    trainer = trainer_ab(model, [8, 1], 4, args.rounds, 3 if args.dry_run else 8,
                         1 if args.dry_run else 2, peak)
    print(format_table(
        ["micro batch", "global batch", "default s/it", f"{FLAG} s/it", "speedup",
         "MFU default", "MFU fused"],
        [[r["micro_batch_size"], r["global_batch_size"], r["default_s"], r["fused_s"],
          r["speedup"], r["default_mfu"], r["fused_mfu"]] for r in trainer],
        title=f"(b) the trainer, GPT {model}, bf16, dropout 0.1, {name}"))
    command = "PYTHONPATH=. python bench/cross_entropy_fusion.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    payload = {"command": command.strip(),
               "status": "dry run" if args.dry_run else "measured", "device": name,
               "torch": torch.__version__, "model": model, "peak_flops": peak,
               "loss_alone": alone, "trainer": trainer, "rounds": args.rounds,
               "git": git_revision(), "bench_seconds": time.perf_counter() - t0}
    out = Path(args.out_dir) if args.out_dir else RESULTS_DIR / "gpu"
    path = write_results("cross_entropy_fusion", payload, out)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

"""What accumulating bf16 gradients in float32 buys and costs, side by side.

--bf16 turns --accumulate-allreduce-grads-in-fp32 on (as Megatron-LM does); this bench
measures both sides of that choice in one process.

    PYTHONPATH=. python bench/grad_accumulation.py            # ~2 min on 2 CPU cores
    PYTHONPATH=. python bench/grad_accumulation.py --quick    # ~40 s
    PYTHONPATH=. python bench/grad_accumulation.py --cuda     # GPT-345M step times on a GPU

(a) Error.  A bf16 GPT (4 layers, hidden 256, seq 128, vocab 8192, micro batch 2),
m microbatches, m = 4, 16, 64: the batch gradient accumulated by autograd in bf16 (the
weights' dtype) and in float32, each against the exact sum (float64) of the same
per-microbatch gradients; relative L2 error over all parameters.
(b) Cost.  The trainer (``pretrain``, bf16, d = 1, m = 8) with float32 and with bf16
accumulation, alternating rounds: seconds per iteration and their ratio.  The bf16
runs are what a torch without ``Tensor.grad_dtype`` does (the bench switches the
support off for them).  With ``--cuda``: GPT-345M at micro batch 8 and 1 on the GPU.

(c) Fusion probe.  What Megatron-LM's gradient-accumulation fusion would save: for each
weight of a GPT-345M layer (qkv, proj, fc1, fc2) and the tokens of one microbatch, the
weight-gradient GEMM in bf16 followed by the float32 accumulation (the cast and the add
that autograd runs for ``grad_dtype``) against one GEMM that adds into the float32
gradient itself, ``torch.addmm(main_grad, dy^T, x, out_dtype=torch.float32,
out=main_grad)``.  It reports whether this torch has that kernel for the device (this
CPU build has none), the fused result's error against the unfused one, and both times
per layer and microbatch.  Only ``--cuda`` times it; on the CPU it only probes.

Results: bench/results/grad_accumulation.json (--cuda: bench/results/gpu/).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS_DIR, format_table, write_results  # noqa: E402
from bench.convergence import git_revision  # noqa: E402
from bench.throughput import GPT_345M, _trainer_period  # noqa: E402

MODEL = {"layers": 4, "hidden": 256, "heads": 8, "seq": 128, "vocab": 8192}
"""The GPT of (a), and of (b) on the CPU."""
QUICK_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 1024}
"""--quick (tests): bf16 matrix products are emulated on a CPU without AVX-512 BF16, where
MODEL's trainer step took 25 s (0.3 s with it)."""


def accumulation_error(ms: List[int], micro_batch: int = 2, seed: int = 3,
                       model: Optional[Dict[str, int]] = None) -> List[Dict[str, Any]]:
    import torch

    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    from megatron.pipeline.weights import WeightBuffers
    from megatron.tensor_parallel import TPInfo

    m_ = model or MODEL
    cfg = ModelConfig(num_layers=m_["layers"], hidden_size=m_["hidden"],
                      num_attention_heads=m_["heads"], seq_length=m_["seq"],
                      padded_vocab_size=m_["vocab"], hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.bfloat16)

    def build(widen: bool) -> GPTModel:
        model = GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                         layer_numbers=range(cfg.num_layers), seed=seed)
        if widen:
            WeightBuffers(model, 1).set_grad_dtype(torch.float32)
        return model

    def backward(model: GPTModel, text: torch.Tensor) -> None:
        model(text[:, :-1], None, None, labels=text[:, 1:]).float().mean().backward()

    rows = []
    gen = torch.Generator().manual_seed(seed)
    for m in ms:
        texts = [torch.randint(0, cfg.padded_vocab_size, (micro_batch, cfg.seq_length + 1),
                               generator=gen) for _ in range(m)]
        # exact: float64 sum of each microbatch's gradient (the tied embedding's two
        # contributions added in float32, as the widened path adds them)
        ref = build(True)
        exact = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
        for text in texts:
            ref.zero_grad(set_to_none=True)
            backward(ref, text)
            for e, p in zip(exact, ref.parameters()):
                e += p.grad.double()
        row: Dict[str, Any] = {"microbatches": m}
        for widen, key in ((False, "bf16"), (True, "fp32")):
            model = build(widen)
            t0 = time.perf_counter()
            for text in texts:
                backward(model, text)
            num = sum((p.grad.double() - e).square().sum().item()
                      for p, e in zip(model.parameters(), exact))
            den = sum(e.square().sum().item() for e in exact)
            row[f"{key}_rel_error"] = (num / den) ** 0.5
            row[f"{key}_seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(f"  m={m}: bf16 {row['bf16_rel_error']:.2e}, fp32 {row['fp32_rel_error']:.2e}",
              flush=True)
    return rows


@contextlib.contextmanager
def _bf16_accumulation(on: bool):
    """Inside (on=True): --bf16 accumulates in bf16, as on a torch without grad_dtype."""
    import megatron.argument_checks.optimizer as arguments

    saved = arguments.GRAD_DTYPE_SUPPORTED
    if on:
        arguments.GRAD_DTYPE_SUPPORTED = False
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its warning, expected here
            yield
    finally:
        arguments.GRAD_DTYPE_SUPPORTED = saved


def step_cost(model: Dict[str, int], micro_batches: List[int], m: int, rounds: int,
              iters: int, warmup: int) -> List[Dict[str, Any]]:
    rows = []
    for b in micro_batches:
        samples: Dict[str, List[float]] = {"fp32": [], "bf16": []}
        for _ in range(rounds):
            for key in ("fp32", "bf16"):
                with _bf16_accumulation(key == "bf16"):
                    samples[key].append(_trainer_period(model, "bf16", b, b * m, iters,
                                                        warmup, [], dropout=0.0))
                print(f"  b={b} {key} accumulation: {samples[key][-1]:.4f} s/iteration",
                      flush=True)
        fp32, bf16 = (statistics.median(samples[k]) for k in ("fp32", "bf16"))
        rows.append({"micro_batch_size": b, "global_batch_size": b * m,
                     "fp32_s": fp32, "bf16_s": bf16, "fp32_over_bf16": fp32 / bf16,
                     "fp32_samples_s": samples["fp32"], "bf16_samples_s": samples["bf16"]})
    return rows


LAYER_WEIGHTS = {"qkv": (3, 1), "proj": (1, 1), "fc1": (4, 1), "fc2": (1, 4)}
"""(out, in) of each weight of a transformer layer, in units of the hidden size."""


def fusion_probe(device: str, hidden: int, tokens: List[int], reps: int = 20
                 ) -> Dict[str, Any]:
    """(c): is there an ``addmm`` into a float32 output from bf16 inputs on ``device``,
    and what it saves per layer and microbatch at each token count (``reps`` > 0)."""
    import torch

    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    dy, x = rand(8, 16), rand(8, 32)
    main = torch.randn(16, 32, generator=gen).to(dev)
    want = main + (dy.t().float() @ x.float())
    got = main.clone()
    try:  # in place, as the fusion would use it
        torch.addmm(got, dy.t(), x, out_dtype=torch.float32, out=got)
    except (NotImplementedError, RuntimeError, TypeError) as exc:
        return {"device": device, "supported": False,
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    out: Dict[str, Any] = {"device": device, "supported": True,
                           "max_abs_error_small": float((got - want).abs().max()), "rows": []}
    if reps <= 0:
        return out
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        return (time.perf_counter() - t0) / reps

    for n in tokens:
        unfused_s = fused_s = 0.0
        errors = []
        for o, i in LAYER_WEIGHTS.values():
            dy, x = rand(n, o * hidden), rand(n, i * hidden)
            acc = torch.zeros(o * hidden, i * hidden, device=dev)
            fused = acc.clone()
            unfused_s += timed(lambda: acc.add_((dy.t() @ x).to(torch.float32)))
            fused_s += timed(lambda: torch.addmm(fused, dy.t(), x, out_dtype=torch.float32,
                                                 out=fused))
            scale = float(acc.abs().max()) or 1.0
            errors.append(float((fused - acc).abs().max()) / scale)
        out["rows"].append({"tokens": n, "unfused_ms": 1e3 * unfused_s,
                            "fused_ms": 1e3 * fused_s, "fused_over_unfused": fused_s / unfused_s,
                            "max_rel_difference": max(errors)})
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer microbatch counts and rounds")
    p.add_argument("--cuda", action="store_true", help="(b) with GPT-345M on the GPU")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds per way (default 3, quick 1)")
    p.add_argument("--out-dir", default=None, help="where the JSON goes")
    args = p.parse_args(argv)
    import torch

    from megatron.config import GRAD_DTYPE_SUPPORTED

    if not GRAD_DTYPE_SUPPORTED:
        print(f"grad_accumulation: skipped (torch {torch.__version__} has no Tensor.grad_dtype)")
        return {"status": "skipped"}
    if args.cuda and not torch.cuda.is_available():
        print("grad_accumulation: skipped (--cuda without a CUDA device)")
        return {"status": "skipped"}
    t0 = time.perf_counter()
    rounds = args.rounds or (1 if args.quick else 3)
    ms = [4, 16] if args.quick else [4, 16, 64]
    error_model = QUICK_MODEL if args.quick else MODEL
    errors = accumulation_error(ms, model=error_model)
    print(format_table(
        ["microbatches", "bf16 accumulation", "fp32 accumulation"],
        [[r["microbatches"], f"{r['bf16_rel_error']:.2e}", f"{r['fp32_rel_error']:.2e}"]
         for r in errors],
        title=f"(a) batch gradient's relative L2 error against the exact sum, bf16 GPT "
              f"{error_model}"))
    if args.cuda:
        model, name, bs, iters, warmup = GPT_345M, torch.cuda.get_device_name(0), [8, 1], 8, 2
    else:
        model, name, bs, iters, warmup = error_model, "CPU", [2], 6, 2
    cost = step_cost(model, bs, 8 if not args.cuda else 4, rounds, iters, warmup)
    print(format_table(
        ["micro batch", "global batch", "fp32 acc. s/it", "bf16 acc. s/it", "fp32 / bf16"],
        [[r["micro_batch_size"], r["global_batch_size"], r["fp32_s"], r["bf16_s"],
          r["fp32_over_bf16"]] for r in cost],
        title=f"(b) the trainer, bf16 GPT {model}, d=1, {name}, median of {rounds} "
              f"alternating rounds"))
    probe = fusion_probe("cuda" if args.cuda else "cpu", GPT_345M["hidden"],
                         [b * GPT_345M["seq"] for b in (8, 1)], reps=20 if args.cuda else 0)
    if not probe["supported"]:
        print(f"(c) fusion probe on {probe['device']}: no float32-output addmm "
              f"({probe['reason']})")
    elif probe["rows"]:
        print(format_table(
            ["tokens", "GEMM + fp32 add ms", "addmm into fp32 ms", "fused / unfused",
             "max rel. difference"],
            [[r["tokens"], r["unfused_ms"], r["fused_ms"], r["fused_over_unfused"],
              f"{r['max_rel_difference']:.1e}"] for r in probe["rows"]],
            title=f"(c) weight gradients of one GPT-345M layer per microbatch, {name}"))
    else:
        print(f"(c) fusion probe on {probe['device']}: supported (not timed here)")
    command = "PYTHONPATH=. python bench/grad_accumulation.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    payload = {"command": command.strip(), "quick": args.quick, "device": name,
               "torch": torch.__version__, "error_model": error_model, "errors": errors,
               "cost_model": model, "step_cost": cost, "rounds": rounds,
               "fusion_probe": probe,
               "git": git_revision(), "bench_seconds": time.perf_counter() - t0}
    out = Path(args.out_dir) if args.out_dir else (RESULTS_DIR / "gpu" if args.cuda
                                                   else RESULTS_DIR)
    path = write_results("grad_accumulation", payload, out)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

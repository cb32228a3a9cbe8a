"""What does --fp16 / --bf16 cost on a CPU?  (one process, the issue's tiny GPT)

    PYTHONPATH=. python bench/cpu_precision.py [--quick]

Times one training step (forward + backward over the micro-batches of one batch) of a
4-layer, hidden-64 GPT (seq 128, vocab 8192, micro batch 4, m=4) with the weights in
float32, bfloat16 and float16.  The three dtypes alternate step by step so that they see
the same machine load; medians are compared.  The answer depends on the CPU: torch's
CPU capability (recorded in the JSON) says whether bf16/fp16 matrix products run on
native instructions (AVX512-BF16, AMX) or on AVX2 emulation.  The trainer's own warning
(``megatron.initialize.precision_warning``) times a matmul on the machine it runs on.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (bench_command, format_table, gpt_config, median,  # noqa: E402
                          write_results)

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "8192",
         "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "4",
         "--global-batch-size", "16", "--train-iters", "1", "--lr", "1e-4",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model_and_batches(dtype: torch.dtype, microbatches: int):
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo

    cfg, _ = gpt_config(MODEL)
    cfg.model.params_dtype = dtype
    model = GPTModel(cfg.model, TPInfo.single(), seed=1234)
    gen = torch.Generator().manual_seed(0)
    s, b, v = cfg.model.seq_length, cfg.training.micro_batch_size, cfg.model.padded_vocab_size
    batches = [torch.randint(0, v, (b, s + 1), generator=gen) for _ in range(microbatches)]
    return model, batches


def _step(model: torch.nn.Module, batches: List[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for text in batches:
        tokens, labels = text[:, :-1], text[:, 1:]
        loss = model(tokens, None, None, labels=labels).float().mean()
        (loss / len(batches)).backward()
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - t0


def measure(steps: int, fp16_steps: int, microbatches: int = 4) -> Dict[str, Any]:
    built = {name: _model_and_batches(dt, microbatches) for name, dt in DTYPES.items()}
    times: Dict[str, List[float]] = {name: [] for name in DTYPES}
    for name, (model, batches) in built.items():  # warm-up
        _step(model, batches[:1])
    for i in range(steps):
        for name, (model, batches) in built.items():
            if name == "fp16" and i >= fp16_steps:
                continue  # fp16 is so slow that a few steps say enough
            times[name].append(_step(model, batches))
    ms = {name: 1e3 * median(t) for name, t in times.items()}
    return {"ms_per_step": ms, "ratio_to_fp32": {k: v / ms["fp32"] for k, v in ms.items()},
            "step_times_s": times}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 steps, 1 of them fp16")
    p.add_argument("--steps", type=int, default=None, help="steps per dtype (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out-dir", default=None, help="where to write cpu_precision.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = args.steps or (2 if args.quick else 5)
    res = measure(steps, fp16_steps=1 if args.quick else min(steps, 2))
    rows = [[k, res["ms_per_step"][k], res["ratio_to_fp32"][k]] for k in DTYPES]
    print(format_table(["weights", "ms/step", "x fp32"], rows,
                       title=f"CPU training step of a 4-layer hidden-64 GPT (seq 128, micro "
                             f"batch 4, m=4), {args.threads} thread(s), medians"))
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"torch CPU capability: {capability}")
    path = write_results("cpu_precision", {"command": bench_command("bench/cpu_precision.py",
                                                                    argv),
                                           "quick": args.quick, "threads": args.threads,
                                           "steps": steps, "cpu_capability": capability,
                                           **res}, args.out_dir)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()

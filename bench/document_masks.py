"""What --reset-attention-mask (attention inside each document) costs, side by side.

    PYTHONPATH=. python bench/document_masks.py            # ~2 min on 2 CPU cores
    PYTHONPATH=. python bench/document_masks.py --quick    # ~20 s

One gloo rank trains a small GPT with the trainer (``pretrain``), alternating rounds
with the plain causal attention and with ``--reset-position-ids --reset-attention-mask``,
float32, dropout off, for each attention backend: ``auto`` (torch's fused
scaled_dot_product_attention: causal kernel, or an additive float mask) and ``local``
(the explicit softmax: a shared causal mask, or a bool mask per microbatch).  Per run:
the activation bytes the executor's saved-tensor counter saw at its peak (the trainer's
own measure), seconds per iteration (median over rounds) and the planner's mask bytes
(``ModelSpec.stage_mask_bytes``, which counts the fused path's additive mask at 2 bytes
per entry, fp16: doubled here for these fp32 runs).  The measured difference is also
checked to the byte against what it should be: the planner's mask, plus the position ids
the embedding keeps, now a [b, s] int64 tensor instead of a broadcast view of one row
(8 s (b - 1)), less, for the explicit softmax, the shared [s, s] causal mask it no
longer keeps.  The data are random tokens: the cost of the mask does not depend on
where the documents end.

Results: bench/results/document_masks.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import format_table, mock_gpt_argv, write_results  # noqa: E402

MODEL = dict(layers=4, hidden=256, heads=8, seq=256, vocab=4096, micro_batch=4)
QUICK_MODEL = dict(layers=2, hidden=64, heads=4, seq=64, vocab=512, micro_batch=2)
BACKENDS = ("auto", "local")
FLAGS = ["--reset-position-ids", "--reset-attention-mask"]


def _argv(m: Dict[str, int], iters: int, backend: str, masked: bool) -> List[str]:
    return (mock_gpt_argv(m, iters) + ["--attention-backend", backend]
            + (FLAGS if masked else []))


def _worker(rank: int, world: int, model: Dict[str, int], iters: int,
            rounds: int) -> Dict[str, Any]:
    import pretrain_gpt
    import torch
    from megatron.training import pretrain

    out: Dict[str, Any] = {}
    for _ in range(rounds):
        for backend in BACKENDS:
            for masked in (False, True):
                torch.manual_seed(0)
                with contextlib.redirect_stdout(io.StringIO()):
                    result = pretrain(pretrain_gpt.datasets_provider,
                                      pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                                      argv=_argv(model, iters, backend, masked))
                mine = result.memory["per_rank"][0]
                out.setdefault(f"{backend}/{'mask' if masked else 'causal'}", []).append(
                    {"seconds_per_iteration": result.seconds_per_iteration,
                     "stashed_bytes": mine["peak_stashed_activation_bytes"]})
    return out


def _planner_mask_bytes(m: Dict[str, int], backend: str) -> float:
    """The planner's per-microbatch mask, in the bytes of these fp32 runs: the additive
    mask of the fused path has 4 bytes per entry here, not fp16's 2; bools stay 1."""
    from megatron.pipeline.planner.model_spec import ModelSpec

    spec = ModelSpec(kind="gpt", num_layers=m["layers"], hidden_size=m["hidden"],
                     num_attention_heads=m["heads"], seq_length=m["seq"],
                     vocab_size=m["vocab"], attention_backend=backend,
                     reset_attention_mask=True)
    fp32 = 1.0 if spec.keeps_scores else 2.0
    return fp32 * spec.stage_mask_bytes(m["micro_batch"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one round")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    from tests.dist_utils import run_distributed

    model, iters, rounds = (QUICK_MODEL, 3, 1) if args.quick else (MODEL, 4, 3)
    res = run_distributed(_worker, 1, args=(model, iters, rounds), timeout=1200)[0]
    rows, table = [], []
    for backend in BACKENDS:
        causal, masked = res[f"{backend}/causal"], res[f"{backend}/mask"]
        t_causal = statistics.median(r["seconds_per_iteration"] for r in causal)
        t_mask = statistics.median(r["seconds_per_iteration"] for r in masked)
        b_causal, b_mask = causal[0]["stashed_bytes"], masked[0]["stashed_bytes"]
        planned = _planner_mask_bytes(model, backend)
        s, b = model["seq"], model["micro_batch"]
        expected = planned + 8 * s * (b - 1) - (s * s if backend == "local" else 0)
        row = {"attention_backend": backend, "stashed_bytes_causal": b_causal,
               "stashed_bytes_mask": b_mask, "extra_bytes": b_mask - b_causal,
               "planner_extra_bytes": planned, "expected_extra_bytes": expected,
               "s_per_iter_causal": t_causal,
               "s_per_iter_mask": t_mask, "time_ratio": t_mask / t_causal}
        rows.append(row)
        table.append([backend, f"{b_causal / 2**20:.2f}", f"{b_mask / 2**20:.2f}",
                      f"{row['extra_bytes'] / 2**20:.3f}", f"{planned / 2**20:.3f}",
                      "yes" if row["extra_bytes"] == expected else "NO",
                      f"{t_causal * 1e3:.1f}", f"{t_mask * 1e3:.1f}",
                      f"{row['time_ratio']:.3f}"])
    print(format_table(["backend", "stash MiB causal", "stash MiB mask", "extra MiB",
                        "planner extra MiB", "exact", "ms/iter causal", "ms/iter mask", "time ratio"],
                       table))
    path = write_results("document_masks",
                         {"quick": args.quick, "command": "PYTHONPATH=. python "
                          "bench/document_masks.py" + (" --quick" if args.quick else ""),
                          "model": model, "train_iters": iters, "rounds": rounds,
                          "world": 1, "flags": FLAGS, "rows": rows},
                         Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path}")
    ok = all(r["extra_bytes"] == r["expected_extra_bytes"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

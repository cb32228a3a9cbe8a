"""What --sequence-parallel saves and costs, side by side in one run.

    PYTHONPATH=. python bench/sequence_parallel.py            # ~2 min on 2 CPU cores
    PYTHONPATH=. python bench/sequence_parallel.py --quick    # ~20 s

Two tensor-parallel gloo ranks (t = 2, one pipeline stage) train a small GPT with the
trainer (``pretrain``), alternating rounds with and without the flag, in float32 with
dropout off so the two runs compute the same function.  Per rank: the activation bytes
the executor's saved-tensor counter saw kept for the backward pass at its peak (the
trainer's own measure, ``--measure-memory-interval``), seconds per iteration (the
trainer's timer, median over rounds) and the largest difference between the two runs'
losses (sequence parallelism changes only the order of some sums).  The planner's
prediction of the same ratio (``ModelSpec.layer_activation_bytes`` and the head) is
printed beside it.  The ranks share two CPU cores: the time ratio says what the extra
collectives (an all-gather and a reduce-scatter in place of each all-reduce, and the
per-step sum of the norms' gradients) cost on one machine, not on a cluster.

Results: bench/results/sequence_parallel.json.
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

MODEL = dict(layers=4, hidden=256, heads=8, seq=256, vocab=8192, micro_batch=4)
QUICK_MODEL = dict(layers=2, hidden=64, heads=4, seq=32, vocab=1024, micro_batch=2)


def _argv(m: Dict[str, int], iters: int, sp: bool) -> List[str]:
    return (mock_gpt_argv(m, iters) + ["--tensor-model-parallel-size", "2"]
            + (["--sequence-parallel"] if sp else []))


def _worker(rank: int, world: int, model: Dict[str, int], iters: int,
            rounds: int) -> Dict[str, Any]:
    import pretrain_gpt
    import torch
    from megatron.training import pretrain

    out: Dict[str, Any] = {"plain": [], "sp": []}
    for _ in range(rounds):
        for name in ("plain", "sp"):
            torch.manual_seed(0)
            with contextlib.redirect_stdout(io.StringIO()):
                result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                  pretrain_gpt.forward_step,
                                  argv=_argv(model, iters, name == "sp"))
            mine = next(r for r in result.memory["per_rank"] if r["rank"] == rank)
            out[name].append({"seconds_per_iteration": result.seconds_per_iteration,
                              "stashed_bytes": mine["peak_stashed_activation_bytes"],
                              "losses": {k: v["lm loss"] for k, v in result.losses.items()}})
    return out


def _predicted_ratio(m: Dict[str, int]) -> float:
    """The planner's activation bytes of the one stage (all layers and the head, one
    microbatch in flight at d = 1), with over without sequence parallelism, less the
    two residual dropout masks per layer the formula counts (s b h bytes each, s/t
    positions with the flag): these runs have no dropout."""
    from megatron.pipeline.planner.model_spec import ModelSpec

    def stage(sp: bool) -> float:
        spec = ModelSpec(kind="gpt", num_layers=m["layers"], hidden_size=m["hidden"],
                         num_attention_heads=m["heads"], seq_length=m["seq"],
                         vocab_size=m["vocab"], sequence_parallel=sp)
        b = m["micro_batch"]
        masks = 2.0 * m["seq"] * b * m["hidden"] / spec.sequence_shards(2)
        return (m["layers"] * (spec.layer_activation_bytes(b, 2) - masks)
                + spec.head_activation_bytes(b, 2))
    return stage(True) / stage(False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one round")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    from tests.dist_utils import run_distributed

    model, iters, rounds = (QUICK_MODEL, 3, 1) if args.quick else (MODEL, 6, 3)
    per_rank = run_distributed(_worker, 2, args=(model, iters, rounds), timeout=1200)
    predicted = _predicted_ratio(model)
    rows, table = [], []
    for rank, res in enumerate(per_rank):
        t_plain = statistics.median(r["seconds_per_iteration"] for r in res["plain"])
        t_sp = statistics.median(r["seconds_per_iteration"] for r in res["sp"])
        diff = max(abs(a["losses"][k] - b["losses"][k])
                   for a, b in zip(res["plain"], res["sp"]) for k in a["losses"])
        plain_bytes, sp_bytes = res["plain"][0]["stashed_bytes"], res["sp"][0]["stashed_bytes"]
        row = {"rank": rank, "stashed_bytes_plain": plain_bytes, "stashed_bytes_sp": sp_bytes,
               "memory_ratio": sp_bytes / plain_bytes, "planner_memory_ratio": predicted,
               "s_per_iter_plain": t_plain, "s_per_iter_sp": t_sp, "time_ratio": t_sp / t_plain,
               "max_loss_difference": diff}
        rows.append(row)
        table.append([rank, f"{plain_bytes / 2**20:.2f}", f"{sp_bytes / 2**20:.2f}",
                      f"{row['memory_ratio']:.3f}", f"{predicted:.3f}",
                      f"{t_plain * 1e3:.1f}", f"{t_sp * 1e3:.1f}", f"{row['time_ratio']:.3f}",
                      f"{diff:.1e}"])
    print(format_table(["rank", "stash MiB plain", "stash MiB SP", "ratio", "planner ratio",
                        "ms/iter plain", "ms/iter SP", "time ratio", "max |loss diff|"], table))
    path = write_results("sequence_parallel",
                         {"quick": args.quick, "command": "PYTHONPATH=. python "
                          "bench/sequence_parallel.py" + (" --quick" if args.quick else ""),
                          "model": model, "train_iters": iters, "rounds": rounds,
                          "world": 2, "tensor_parallel": 2, "schedule": "none",
                          "rows": rows},
                         Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path}")
    ok = all(r["memory_ratio"] < 1.0 and r["max_loss_difference"] < 1e-3 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

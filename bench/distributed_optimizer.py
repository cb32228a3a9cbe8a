"""What --use-distributed-optimizer saves and costs, side by side in one run.

    PYTHONPATH=. python bench/distributed_optimizer.py            # ~2 min on 2 CPU cores
    PYTHONPATH=. python bench/distributed_optimizer.py --quick    # ~30 s

Two data-parallel gloo ranks (w = 2, d = 1) train a small GPT with the trainer
(``pretrain``) under PipeDream-2BW, alternating rounds with and without the flag.  Per
rank: the optimizer state it holds after training (Adam moments, plus fp32 master weights
under --bf16), counted from the optimizer's own tensors; seconds per iteration (the
trainer's own timer, median over rounds); and whether the losses of the two runs are the
same bits.  On a CPU the ranks share two cores, so the time ratio says what the
reduce to the owners and their weight broadcast change in a step here, not on a cluster.

Results: bench/results/distributed_optimizer.json.
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

from bench.common import format_table, write_results  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "8192"]
QUICK_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "1024"]


def _argv(model: List[str], iters: int, sharded: bool) -> List[str]:
    return model + [
        "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--micro-batch-size", "4", "--global-batch-size", "32",
        "--train-iters", str(iters), "--lr", "1e-3", "--lr-decay-style", "constant",
        "--pipeline-schedule", "2bw", "--seed", "5", "--log-interval", "1000",
        "--eval-interval", "100000", "--eval-iters", "1", "--num-workers", "0",
        ] + (["--use-distributed-optimizer"] if sharded else [])


def _worker(rank: int, world: int, model: List[str], iters: int, rounds: int) -> Dict[str, Any]:
    import pretrain_gpt
    import torch
    from megatron.optimizer import optimizer as mod
    from megatron.training import pretrain

    held: List[int] = []
    original = mod.MegatronOptimizer._share_weights

    def spy(self, write_to):
        state = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                    for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        masters = (sum(m.numel() * m.element_size() for m in self.main_params if m is not None)
                   if self.use_masters else 0)
        held.append(state + masters)
        return original(self, write_to)

    mod.MegatronOptimizer._share_weights = spy
    out: Dict[str, Any] = {"plain": [], "sharded": []}
    for _ in range(rounds):
        for name in ("plain", "sharded"):
            held.clear()
            torch.manual_seed(0)
            with contextlib.redirect_stdout(io.StringIO()):
                result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                  pretrain_gpt.forward_step,
                                  argv=_argv(model, iters, name == "sharded"))
            out[name].append({"seconds_per_iteration": result.seconds_per_iteration,
                              "state_bytes": held[-1],
                              "losses": {k: v["lm loss"] for k, v in result.losses.items()}})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one round")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    from tests.dist_utils import run_distributed

    model, iters, rounds = (QUICK_MODEL, 4, 1) if args.quick else (MODEL, 8, 3)
    per_rank = run_distributed(_worker, 2, args=(model, iters, rounds), timeout=1200)
    rows, table = [], []
    for rank, res in enumerate(per_rank):
        t_plain = statistics.median(r["seconds_per_iteration"] for r in res["plain"])
        t_shard = statistics.median(r["seconds_per_iteration"] for r in res["sharded"])
        same = all(a["losses"] == b["losses"] for a, b in zip(res["plain"], res["sharded"]))
        row = {"rank": rank, "state_bytes_plain": res["plain"][0]["state_bytes"],
               "state_bytes_sharded": res["sharded"][0]["state_bytes"],
               "state_ratio": res["sharded"][0]["state_bytes"] / res["plain"][0]["state_bytes"],
               "s_per_iter_plain": t_plain, "s_per_iter_sharded": t_shard,
               "time_ratio": t_shard / t_plain, "same_losses": same}
        rows.append(row)
        table.append([rank, f"{row['state_bytes_plain'] / 2**20:.2f}",
                      f"{row['state_bytes_sharded'] / 2**20:.2f}", f"{row['state_ratio']:.3f}",
                      f"{t_plain * 1e3:.1f}", f"{t_shard * 1e3:.1f}", f"{row['time_ratio']:.3f}",
                      "yes" if same else "NO"])
    print(format_table(["rank", "state MiB plain", "state MiB sharded", "ratio",
                        "ms/iter plain", "ms/iter sharded", "time ratio", "same losses"], table))
    path = write_results("distributed_optimizer",
                         {"quick": args.quick, "command": "PYTHONPATH=. python "
                          "bench/distributed_optimizer.py" + (" --quick" if args.quick else ""),
                          "model": model, "train_iters": iters, "rounds": rounds,
                          "world": 2, "schedule": "2bw", "rows": rows},
                         Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path}")
    return 0 if all(r["same_losses"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

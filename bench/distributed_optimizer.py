"""What --use-distributed-optimizer saves and costs, side by side in one run.

    PYTHONPATH=. python bench/distributed_optimizer.py            # ~4 min on 2 CPU cores
    PYTHONPATH=. python bench/distributed_optimizer.py --quick    # ~1 min

Two data-parallel gloo ranks (w = 2, d = 1) train a small GPT with the trainer
(``pretrain``) under PipeDream-2BW, alternating rounds with and without the flag.  Per
rank: the optimizer state it holds after training (Adam moments, plus fp32 master weights
under --bf16), counted from the optimizer's own tensors; seconds per iteration (the
trainer's own timer, median over rounds); and how far the losses of the two runs are
apart (the same bits but for the gradient clipping factor, which follows a norm the
sharded optimizer sums per piece: the same to rounding).  Over the ranks: the largest
and smallest share of the state, beside what a split by whole parameters (largest first
to the least-loaded rank, the previous design) would give for the same parameters.  On
a CPU the ranks share two cores, so the time ratio says what the reduce-scatter of the
gradients and the all-gather of the weights change in a step here, not on a cluster.

--overlap-param-gather is measured beside the same sharded run with the same smaller
buckets (``--ddp-bucket-size``, so a layer spans a few buckets and the next forward's
layers can wait for theirs one by one): "buckets" waits for the all-gathers at the step,
"overlap" leaves them in flight into the next forward pass.  Their losses must be the
same bits.

Results: bench/results/distributed_optimizer.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
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


MODES = {"plain": [], "sharded": ["--use-distributed-optimizer"],
         "buckets": ["--use-distributed-optimizer", "--ddp-bucket-size", "300000"],
         "overlap": ["--use-distributed-optimizer", "--ddp-bucket-size", "300000",
                     "--overlap-param-gather"]}


def _argv(model: List[str], iters: int, mode: str) -> List[str]:
    return model + [
        "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--micro-batch-size", "4", "--global-batch-size", "32",
        "--train-iters", str(iters), "--lr", "1e-3", "--lr-decay-style", "constant",
        "--pipeline-schedule", "2bw", "--seed", "5", "--log-interval", "1000",
        "--eval-interval", "100000", "--eval-iters", "1", "--num-workers", "0",
        ] + MODES[mode]


def _worker(rank: int, world: int, model: List[str], iters: int, rounds: int) -> Dict[str, Any]:
    import pretrain_gpt
    import torch
    from megatron.optimizer import optimizer as mod
    from megatron.training import pretrain

    held: List[int] = []
    numels: List[int] = []
    original = mod.MegatronOptimizer.finish_step

    def spy(self, *args, **kwargs):
        info = original(self, *args, **kwargs)
        state = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                    for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        masters = (sum(m.numel() * m.element_size() for m in self.main_params)
                   if self.use_masters else 0)
        held.append(state + masters)
        numels[:] = [math.prod(s) for s in self._shapes]
        return info

    mod.MegatronOptimizer.finish_step = spy
    out: Dict[str, Any] = {name: [] for name in MODES}
    for _ in range(rounds):
        for name in MODES:
            held.clear()
            torch.manual_seed(0)
            with contextlib.redirect_stdout(io.StringIO()):
                result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                                  pretrain_gpt.forward_step,
                                  argv=_argv(model, iters, name))
            out[name].append({"seconds_per_iteration": result.seconds_per_iteration,
                              "state_bytes": held[-1], "numels": list(numels),
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
        apart = max(abs(b["losses"][t] - loss) / abs(loss)
                    for a, b in zip(res["plain"], res["sharded"])
                    for t, loss in a["losses"].items())
        row = {"rank": rank, "state_bytes_plain": res["plain"][0]["state_bytes"],
               "state_bytes_sharded": res["sharded"][0]["state_bytes"],
               "state_ratio": res["sharded"][0]["state_bytes"] / res["plain"][0]["state_bytes"],
               "s_per_iter_plain": t_plain, "s_per_iter_sharded": t_shard,
               "time_ratio": t_shard / t_plain, "same_losses": same,
               "loss_max_rel_diff": apart}
        t_buckets = statistics.median(r["seconds_per_iteration"] for r in res["buckets"])
        t_overlap = statistics.median(r["seconds_per_iteration"] for r in res["overlap"])
        row.update(s_per_iter_buckets=t_buckets, s_per_iter_overlap=t_overlap,
                   overlap_time_ratio=t_overlap / t_buckets,
                   overlap_same_losses=all(a["losses"] == b["losses"] for a, b in
                                           zip(res["buckets"], res["overlap"])))
        rows.append(row)
        table.append([rank, f"{row['state_bytes_plain'] / 2**20:.2f}",
                      f"{row['state_bytes_sharded'] / 2**20:.2f}", f"{row['state_ratio']:.3f}",
                      f"{t_plain * 1e3:.1f}", f"{t_shard * 1e3:.1f}", f"{row['time_ratio']:.3f}",
                      "same bits" if same else f"{apart:.1e}"])
    print(format_table(["rank", "state MiB plain", "state MiB sharded", "ratio",
                        "ms/iter plain", "ms/iter sharded", "time ratio", "losses apart"],
                       table))
    print(format_table(
        ["rank", "ms/iter sharded, 300k-param buckets", "ms/iter + --overlap-param-gather",
         "time ratio", "losses"],
        [[r["rank"], f"{r['s_per_iter_buckets'] * 1e3:.1f}",
          f"{r['s_per_iter_overlap'] * 1e3:.1f}", f"{r['overlap_time_ratio']:.3f}",
          "same bits" if r["overlap_same_losses"] else "DIFFER"] for r in rows]))
    sharded = [r["state_bytes_sharded"] for r in rows]
    numels = per_rank[0]["plain"][0]["numels"]
    per_element = rows[0]["state_bytes_plain"] / sum(numels)
    whole = [load * per_element for load in whole_parameter_loads(numels, len(per_rank))]
    spread = {"state_bytes_sharded_max": max(sharded), "state_bytes_sharded_min": min(sharded),
              "whole_parameter_split_max": max(whole), "whole_parameter_split_min": min(whole),
              "largest_parameter_fraction": max(numels) / sum(numels)}
    print(f"state per rank, sharded: max {max(sharded) / 2**20:.2f} MiB, min "
          f"{min(sharded) / 2**20:.2f} MiB; split by whole parameters: max "
          f"{max(whole) / 2**20:.2f} MiB, min {min(whole) / 2**20:.2f} MiB (largest "
          f"parameter {spread['largest_parameter_fraction']:.1%} of the stage)")
    path = write_results("distributed_optimizer",
                         {"quick": args.quick, "command": "PYTHONPATH=. python "
                          "bench/distributed_optimizer.py" + (" --quick" if args.quick else ""),
                          "model": model, "train_iters": iters, "rounds": rounds,
                          "world": 2, "schedule": "2bw", "rows": rows, **spread},
                         Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path}")
    return 0 if all(r["loss_max_rel_diff"] < 1e-6 and r["overlap_same_losses"]
                    for r in rows) else 1


def whole_parameter_loads(numels: List[int], world: int) -> List[int]:
    """Elements per rank under the previous split by whole parameters: largest first,
    each to the rank with the fewest elements so far."""
    load = [0] * world
    for n in sorted(numels, reverse=True):
        load[load.index(min(load))] += n
    return load


if __name__ == "__main__":
    sys.exit(main())

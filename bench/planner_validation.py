"""Planner predictions against real runs: samples/s and stashed bytes (CPU, gloo ranks).

    PYTHONPATH=. python bench/planner_validation.py [--quick] [--out-dir DIR]

1. Profile (``tools/profile_model.py``) the small GPT below in this process, one
   thread, at the microbatch size the runs use: forward/backward time of a block, the
   embedding and the head, their counted saved-activation bytes, optimizer step times.
2. Train the same GPT with ``megatron.training.pretrain`` on d gloo ranks (w = 1) for
   each (d, schedule, m), one thread per rank as the trainer's tests do.  Measured:
   samples/s = global batch / median batch period on stage 0 (time between the first
   forwards of consecutive batches, warm-up batches dropped), and every stage's peak
   stashed activation bytes and weight bytes from the executor's counters.  Before
   training, ranks 0 and 1 time a gloo send/recv of one [s, b, h] activation; that
   bandwidth prices the inter-stage transfers.
3. Predict each configuration from the profile alone: the event simulator over the
   schedule's real action lists (``planner.simulate.simulated_batch_time``) and the
   closed-form schedule formulas of ``CostModel.estimate``, both with profile-based
   costs; predicted stash per stage = peak in-flight microbatches of the simulated
   schedule x profiled per-microbatch stash of that stage (embedding on the first,
   head on the last).  Bytes must agree exactly; times within 15 %.

CPU contention, said plainly: this machine has ``os.cpu_count()`` cores (2 here),
shared with other users.  With d ranks on c cores, d > c ranks that compute at the same
time share cores, so for those rows the profiled times are multiplied by d / c (the
steady state of 1F1B keeps every stage busy; fill and drain, when fewer ranks compute,
then run faster than predicted).  The 15 % goal is judged on the uncontended rows
(d <= c); contended rows are printed and stored, marked.  The load average before and
after is stored too, since other users' processes slow the runs down and the profile
cannot know about them.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import format_table, gpt_config, median, write_results  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "500"]
MICRO_BATCH = 4
TIME_GOAL = 0.15
WARMUP_BATCHES = 2
_STAMPS: List[Tuple[float, bool]] = []


def run_argv(d: int, schedule: str, m: int, iters: int, recompute: bool = False) -> List[str]:
    """pretrain_gpt.py flags of one validated configuration (w = 1)."""
    argv = MODEL + ["--tokenizer-type", "NullTokenizer", "--mock-data",
                    "--micro-batch-size", str(MICRO_BATCH),
                    "--global-batch-size", str(MICRO_BATCH * m),
                    "--pipeline-model-parallel-size", str(d), "--pipeline-schedule", schedule,
                    "--distributed-backend", "gloo", "--train-iters", str(iters),
                    "--lr", "1e-4", "--lr-decay-style", "constant", "--seed", "1234",
                    "--log-interval", "100000", "--eval-interval", "100000",
                    "--eval-iters", "0", "--num-workers", "0"]
    if recompute:
        argv.append("--recompute-activations")
    return argv


def configurations(quick: bool) -> List[Dict[str, Any]]:
    """(d, schedule, m, recompute) to validate."""
    if quick:
        grid = [(1, "flush", 4, False), (2, "gpipe", 4, False), (2, "flush", 4, False),
                (2, "2bw", 4, False)]
    else:
        grid = [(1, "flush", 4, False), (1, "flush", 8, False)]
        grid += [(2, s, m, False) for s in ("gpipe", "flush", "2bw") for m in (4, 8)]
        grid += [(2, "none", 4, False), (2, "2bw", 8, True)]
        grid += [(4, s, 8, False) for s in ("gpipe", "flush", "2bw")]
    return [{"d": d, "schedule": s, "m": m, "recompute": rc,
             "name": f"d={d} {s} m={m}{' +rc' if rc else ''}"} for d, s, m, rc in grid]


# ---------------------------------------------------------------------------------------
# inside the spawned ranks
# ---------------------------------------------------------------------------------------
def _timed_forward_step(data_iterator, model):
    # recomputation calls forward_step again inside the backward, with grad enabled
    _STAMPS.append((time.perf_counter(), torch.is_grad_enabled()))
    import pretrain_gpt
    return pretrain_gpt.forward_step(data_iterator, model)


def _p2p_seconds(rank: int, nbytes: int, rounds: int = 20) -> Optional[float]:
    """One-way time of a gloo send/recv of ``nbytes`` between ranks 0 and 1."""
    import torch.distributed as dist
    if rank > 1:
        return None
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = []
    for i in range(rounds + 3):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return median(times)


def _worker(rank: int, world: int, runs: Sequence[Tuple[str, List[str], int]],
            act_bytes: int) -> Dict[str, Any]:
    import pretrain_gpt
    from megatron.training import pretrain
    out: Dict[str, Any] = {"p2p_s": _p2p_seconds(rank, act_bytes) if world > 1 else None}
    for name, argv, m in runs:
        _STAMPS.clear()
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()):
            result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                              _timed_forward_step, argv=list(argv))
        recompute = "--recompute-activations" in argv
        # the first forward of each microbatch: under recompute it runs without grad
        starts = [t for t, grad in _STAMPS if grad != recompute][::m]
        out[name] = {"periods": [b - a for a, b in zip(starts, starts[1:])],
                     "memory": result.memory["per_rank"] if rank == 0 else None}
    return out


# ---------------------------------------------------------------------------------------
# predictions
# ---------------------------------------------------------------------------------------
def predict(cfg: Dict[str, Any], profile, bandwidth: float, cores: int) -> Dict[str, Any]:
    """Profile-based samples/s (simulator and closed form) and per-stage stash bytes."""
    from megatron.pipeline.planner import Config, CostModel, CostOptions, get_hardware
    from megatron.pipeline.planner.simulate import simulate_config, simulated_batch_time

    d, m = cfg["d"], cfg["m"]
    factor = max(1.0, d / cores)
    prof = profile.scaled(factor) if factor > 1 else profile
    model = prof.model_spec()
    hw = get_hardware("cpu").with_overrides(intra_server_bandwidth=bandwidth)
    # Our executor all-reduces the tied embedding inside STEP, synchronously: no overlap.
    options = CostOptions(grad_bytes_per_param=float(prof.model["dtype_bytes"]),
                          overlap_grad_reduce_2bw=False)
    config = Config(w=1, d=d, b=MICRO_BATCH, m=m, recompute=cfg["recompute"],
                    schedule=cfg["schedule"])
    est = CostModel(model, hw, options, prof).estimate(config)
    batch_sim = simulated_batch_time(config, model, hw, options=options, profile=prof)
    sim = simulate_config(config, model, hw, num_batches=3, options=options, profile=prof)
    layers = model.num_layers // d
    per_mb = [prof.stage_stash_bytes(layers, s == 0, s == d - 1, MICRO_BATCH, cfg["recompute"])
              for s in range(d)]
    w = prof.weights
    weight_bytes = [layers * w["block_bytes"] + (w["embedding_bytes"] if s == 0 else 0)
                    + ((w["head_bytes"] + (w["tied_embedding_bytes"] if d > 1 else 0))
                       if s == d - 1 else 0) for s in range(d)]
    return {"time_factor": factor, "samples_per_s_sim": MICRO_BATCH * m / batch_sim,
            "samples_per_s_closed_form": est.samples_per_s,
            "in_flight": list(sim.peak_in_flight), "stash_per_microbatch": per_mb,
            "stash_bytes": [n * b for n, b in zip(sim.peak_in_flight, per_mb)],
            "weight_bytes_per_version": weight_bytes}


def measure(cfgs: List[Dict[str, Any]], iters: int, act_bytes: int,
            timeout: float) -> Tuple[Dict[str, Any], Optional[float]]:
    """Run every configuration, one spawn per pipeline depth."""
    from tests.dist_utils import run_distributed
    out: Dict[str, Any] = {}
    p2p = None
    for d in sorted({c["d"] for c in cfgs}):
        runs = [(c["name"], run_argv(d, c["schedule"], c["m"], iters, c["recompute"]), c["m"])
                for c in cfgs if c["d"] == d]
        per_rank = run_distributed(_worker, d, args=(runs, act_bytes), timeout=timeout)
        out.update({name: per_rank[0][name] for name, _, _ in runs})
        if per_rank[0]["p2p_s"] is not None and p2p is None:
            p2p = per_rank[0]["p2p_s"]
    return out, p2p


def compare(cfgs, measured, profile, bandwidth: float, cores: int) -> List[Dict[str, Any]]:
    rows = []
    for c in cfgs:
        got = measured[c["name"]]
        pred = predict(c, profile, bandwidth, cores)
        mem = {r["stage"]: r for r in got["memory"]}
        d = c["d"]
        meas_tput = MICRO_BATCH * c["m"] / median(got["periods"][WARMUP_BATCHES:])
        stash = [mem[s]["peak_stashed_activation_bytes"] for s in range(d)]
        weights = [mem[s]["weight_bytes_per_version"] for s in range(d)]
        rows.append({**c, "contended": d > cores, "periods_s": got["periods"],
                     "measured_samples_per_s": meas_tput,
                     "ratio_sim": pred["samples_per_s_sim"] / meas_tput,
                     "ratio_closed_form": pred["samples_per_s_closed_form"] / meas_tput,
                     "measured_in_flight": [mem[s]["peak_in_flight"] for s in range(d)],
                     "measured_stash_bytes": stash, "measured_weight_bytes_per_version": weights,
                     "stash_exact": stash == pred["stash_bytes"],
                     "weights_exact": weights == pred["weight_bytes_per_version"],
                     **{f"predicted_{k}": v for k, v in pred.items()}})
    return rows


def print_tables(rows: List[Dict[str, Any]]) -> None:
    print(format_table(
        ["configuration", "pred sim", "pred closed", "measured", "sim/meas", "closed/meas",
         "note"],
        [[r["name"], r["predicted_samples_per_s_sim"],
          r["predicted_samples_per_s_closed_form"], r["measured_samples_per_s"],
          r["ratio_sim"], r["ratio_closed_form"],
          f"contended: compute x{r['predicted_time_factor']:g}" if r["contended"] else ""]
         for r in rows],
        title=f"samples/s, b={MICRO_BATCH}, w=1: predicted from the profile vs measured"))
    print()
    table = []
    for r in rows:
        for s in range(r["d"]):
            table.append([r["name"], s, r["predicted_in_flight"][s], r["measured_in_flight"][s],
                          r["predicted_stash_bytes"][s], r["measured_stash_bytes"][s],
                          "yes" if r["predicted_stash_bytes"][s] == r["measured_stash_bytes"][s]
                          else "NO",
                          "yes" if r["predicted_weight_bytes_per_version"][s]
                          == r["measured_weight_bytes_per_version"][s] else "NO"])
    print(format_table(["configuration", "stage", "in-flight pred", "meas", "stash bytes pred",
                        "measured", "exact", "weights exact"], table,
                       title="peak stashed activation bytes per stage (executor counters)"))


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    from megatron.pipeline.planner.profile import Profile
    from tools.profile_model import profile_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="d in {1, 2}, m=4, short runs")
    p.add_argument("--iters", type=int, default=None, help="batches per run (6 quick, 10)")
    p.add_argument("--out-dir", default=None, help="where to write planner_validation.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    load_before = list(os.getloadavg())
    torch.set_num_threads(1)  # as each spawned rank (tests/dist_utils.py)
    cfg, _ = gpt_config(run_argv(1, "flush", 4, 1))
    raw = profile_model(cfg.model, [MICRO_BATCH], warmup=3, repeat=7 if args.quick else 15)
    profile = Profile(raw, "in-process profile")
    act_bytes = profile.stage_input_bytes(MICRO_BATCH)
    cfgs = configurations(args.quick)
    iters = args.iters or (6 if args.quick else 10)
    measured, p2p = measure(cfgs, iters, act_bytes, timeout=600)
    bandwidth = act_bytes / p2p if p2p else 5e9
    rows = compare(cfgs, measured, profile, bandwidth, cores)
    print_tables(rows)
    judged = [r for r in rows if not r["contended"]]
    within = sum(abs(r["ratio_sim"] - 1) <= TIME_GOAL for r in judged)
    exact = all(r["stash_exact"] and r["weights_exact"] for r in rows)
    print(f"\ntime: {within} of {len(judged)} uncontended configurations within "
          f"{100 * TIME_GOAL:.0f}% (simulator); bytes: "
          f"{'all exact' if exact else 'MISMATCH'}; gloo p2p {bandwidth / 1e9:.2f} GB/s; "
          f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {cores} cores")
    payload = {"quick": args.quick, "model_argv": MODEL, "micro_batch_size": MICRO_BATCH,
               "iters": iters, "warmup_batches": WARMUP_BATCHES, "cores": cores,
               "time_goal": TIME_GOAL, "within_goal": within, "judged": len(judged),
               "bytes_exact": exact, "p2p_seconds": p2p, "p2p_bandwidth": bandwidth,
               "load_average_before": load_before, "load_average_after": list(os.getloadavg()),
               "contention_rule": "compute times x d / cores when d > cores",
               "profile": raw, "rows": rows, "bench_seconds": time.perf_counter() - t0}
    path = write_results("planner_validation", payload, args.out_dir)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

"""Pipeline schedules measured through the real trainer (CPU, gloo ranks).

    PYTHONPATH=. python bench/pipeline_schedules.py [--quick] [--forward-ms 30]
    PYTHONPATH=. python bench/pipeline_schedules.py --timelines   # docs/figures/timeline_real_*

Part (a), synthetic stages: 4 ranks, d=4, w=1.  Each stage is a module whose forward
sleeps F and whose backward sleeps 2F (``time.sleep`` frees the CPU, so two cores can
host four "busy" stages) around one tiny parameter, run by ``megatron.training.pretrain``
and the pipeline engine exactly like a real model.  For none/gpipe/flush/2bw and
m in {4, 8, 16} the time of one training segment (first forward on any stage to last
backward on any stage, after a warm-up run) is compared with the schedule's ideal:

    none: nb*d*m*(F+B)    gpipe, flush: nb*(m+d-1)*(F+B)    2bw: (nb*m+d-1)*(F+B)

(the pipeline fills once per 2BW segment and never drains between its nb batches).

Part (b), a real GPT with d=2: this project's flush and 2bw against
``torch.distributed.pipelining``'s Schedule1F1B and ScheduleGPipe on the same stages
(``GPTModel`` halves wrapped as tokens -> hidden and hidden -> logits), same weights,
same microbatches, same update (tied-embedding gradient sum, global-norm clipping,
AdamW).  Both sides read their data inside the timed loop from the same mock dataset:
our trainer one microbatch at a time, the torch side one DataLoader batch per step (as
a user of torch.distributed.pipelining would; until 2026-11-22 its batches were built
before the loop, which left its data loading out of the comparison).  The first-step
losses of all variants are printed and must agree.  Ours also runs with each receive
posted when its action runs instead of ahead of it (``..., receives on demand``: the
ablation of ``P2PCommunicator.prepost_receives``), and Flush with its two end-of-batch
sums made by all_reduce (``flush, sums by all_reduce``: the ablation of
``megatron.exchange``).  Throughput is the batch period on
stage 0 (first forward of batch k to that of batch k+1), median over the batches after
warm-up.  Each round runs every variant back to back (the order reversed every other round);
"per round" is the ratio to torch's 1F1B within each round, its median and range over
the rounds: the spread that tells a real difference from the machine's noise.  Beside
it, the CPU time per batch of each rank's process (gloo's threads included): on a
machine shared with other work the wall-clock ratio follows how many cores each run
happened to get, the CPU time per batch does not.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import REPO_ROOT, format_table, median, write_results  # noqa: E402

SCHEDULES = ("none", "gpipe", "flush", "2bw")
STAGES = 4
WIDTH = 8  # elements per activation of the synthetic stages

# ---------------------------------------------------------------------------------------
# (a) synthetic stages of fixed cost
# ---------------------------------------------------------------------------------------
# (start, end) of every synthetic forward and backward of this process
_STAMPS: Dict[str, List[tuple]] = {"F": [], "B": []}


class _Sleep(torch.autograd.Function):
    """Identity whose forward takes ``fwd_s`` and backward ``bwd_s`` seconds."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):  # type: ignore[override]
        start = time.perf_counter()
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        _STAMPS["F"].append((start, time.perf_counter()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        start = time.perf_counter()
        time.sleep(ctx.bwd_s)
        _STAMPS["B"].append((start, time.perf_counter()))
        return grad, None, None


class SleepStage(nn.Module):
    """A pipeline stage of fixed cost with the seams the engine needs.

    First and last stage mark their parameter as the tied embedding (as GPT does), so
    the engine's embedding all-reduce runs as it would for a real model."""

    def __init__(self, forward_s: float, pre_process: bool, post_process: bool,
                 num_stages: int) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.pre_process = pre_process
        self.weight = nn.Parameter(torch.ones(WIDTH))
        if num_stages > 1 and (pre_process or post_process):
            self.weight.shared_embedding = True
            self.weight.shared = post_process
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def stage_input_shape(self, micro_batch_size: int) -> tuple:
        return (micro_batch_size, WIDTH)

    def forward(self, x: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.pre_process:
            x = self.input_tensor
        return _Sleep.apply(x * self.weight, self.forward_s, 2 * self.forward_s)


def sleep_model_provider(cfg, groups, pre_process: bool, post_process: bool, *,
                         forward_s: float) -> nn.Module:
    return SleepStage(forward_s, pre_process, post_process, groups.pp_size)


def _mean_loss(output: torch.Tensor):
    loss = output.mean()
    return loss, {"loss": loss.detach()}


def sleep_forward_step(data_iterator, model: SleepStage):
    data = next(data_iterator)
    x = data["text"][:, :WIDTH].to(torch.float32) if model.pre_process else None
    return model(x), _mean_loss


def synthetic_argv(schedule: str, m: int, batches: int) -> List[str]:
    return ["--num-layers", str(STAGES), "--hidden-size", "8", "--num-attention-heads", "1",
            "--seq-length", str(WIDTH), "--max-position-embeddings", str(WIDTH),
            "--vocab-size", "16", "--tokenizer-type", "NullTokenizer", "--mock-data",
            "--micro-batch-size", "1", "--global-batch-size", str(m),
            "--train-iters", str(batches), "--pipeline-model-parallel-size", str(STAGES),
            "--pipeline-schedule", schedule, "--distributed-backend", "gloo",
            "--lr", "1e-3", "--log-interval", "100000", "--eval-interval", "100000",
            "--eval-iters", "0", "--num-workers", "0"]


def _synthetic_worker(rank: int, world: int, runs: List[Dict[str, Any]],
                      trace_dir: str) -> List[Dict[str, float]]:
    import pretrain_gpt
    from megatron.pipeline.trace import load_trace
    from megatron.training import pretrain

    out = []
    for i, run in enumerate(runs):
        _STAMPS["F"].clear()
        _STAMPS["B"].clear()
        provider = partial(sleep_model_provider, forward_s=run["forward_s"])
        trace = f"{trace_dir}/run{i}.json"
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(pretrain_gpt.datasets_provider, provider, sleep_forward_step,
                     argv=synthetic_argv(run["schedule"], run["m"], run["batches"])
                     + ["--timeline-file", trace])
        f, b = _STAMPS["F"], _STAMPS["B"]
        events, _ = load_trace(f"{trace_dir}/run{i}_rank{rank}.json")
        out.append({"first": min(s for s, _ in f), "last": max(e for _, e in b),
                    "f_sum": sum(e - s for s, e in f), "f_n": len(f),
                    "b_sum": sum(e - s for s, e in b), "b_n": len(b),
                    # STEP agrees on the global norm with every stage: time in it is
                    # mostly waiting for the slowest stage
                    "step_sum": sum(e.duration for e in events if e.op in ("S@", "STEP"))})
    return out


def ideal_segment_units(schedule: str, d: int, m: int, batches: int) -> int:
    """Ideal segment time in units of (F+B)."""
    if schedule == "none":
        return batches * d * m
    if schedule in ("gpipe", "flush"):
        return batches * (m + d - 1)
    return batches * m + d - 1


def simulated_segment_seconds(schedule: str, d: int, m: int, batches: int,
                              forward_s: float) -> float:
    """Makespan of the project's own schedule under the project's simulator (F, B=2F, free
    communication, STEP as a barrier across stages as the engine runs it)."""
    from megatron.pipeline.schedules import build_schedule
    from megatron.pipeline.simulator import simulate, unit_cost

    result = simulate(build_schedule(schedule, d, m, batches), unit_cost(1.0, 2.0),
                      step_barrier=True)
    return result.makespan * forward_s


def bench_synthetic(ms: List[int], batches: Dict[str, int], forward_s: float,
                    timeout: float) -> List[Dict[str, Any]]:
    from tests.dist_utils import run_distributed

    runs = [{"schedule": "flush", "m": 4, "batches": 1, "forward_s": forward_s, "warmup": True}]
    runs += [{"schedule": s, "m": m, "batches": batches[s], "forward_s": forward_s}
             for m in ms for s in SCHEDULES]
    with tempfile.TemporaryDirectory() as trace_dir:
        per_rank = run_distributed(_synthetic_worker, STAGES, args=(runs, trace_dir),
                                   timeout=timeout)
    rows = []
    for i, run in enumerate(runs):
        if run.get("warmup"):
            continue
        mine = [r[i] for r in per_rank]
        seconds = max(r["last"] for r in mine) - min(r["first"] for r in mine)
        s, m, nb = run["schedule"], run["m"], run["batches"]
        units = ideal_segment_units(s, STAGES, m, nb)
        ideal = units * 3 * forward_s
        # the sleeps themselves overshoot on a busy machine; with their measured mean
        # durations the ideal isolates what the engine, gloo and the schedule cost
        f_real = sum(r["f_sum"] for r in mine) / sum(r["f_n"] for r in mine)
        b_real = sum(r["b_sum"] for r in mine) / sum(r["b_n"] for r in mine)
        ideal_real = units * (f_real + b_real)
        sim = simulated_segment_seconds(s, STAGES, m, nb, forward_s)
        rows.append({"schedule": s, "m": m, "batches": nb, "seconds": seconds,
                     "ideal_seconds": ideal, "samples_per_s": m * nb / seconds,
                     "ideal_samples_per_s": m * nb / ideal, "measured_over_ideal": ideal / seconds,
                     "measured_forward_s": f_real, "measured_backward_s": b_real,
                     "measured_over_ideal_at_measured_costs": ideal_real / seconds,
                     "step_seconds_per_batch": sum(r["step_sum"] for r in mine) / len(mine) / nb,
                     "simulated_seconds": sim, "simulated_over_ideal": ideal / sim,
                     "measured_over_simulated": sim / seconds})
    by = {(r["schedule"], r["m"]): r for r in rows}
    for r in rows:
        if r["schedule"] == "2bw":
            m = r["m"]
            r["speedup_over_flush"] = r["samples_per_s"] / by[("flush", m)]["samples_per_s"]
            r["speedup_over_gpipe"] = r["samples_per_s"] / by[("gpipe", m)]["samples_per_s"]
            r["theoretical_speedup_steady"] = (m + STAGES - 1) / m
            r["theoretical_speedup_segment"] = (by[("flush", m)]["ideal_seconds"]
                                                / by[("flush", m)]["batches"] * r["batches"]
                                                / r["ideal_seconds"])
    return rows


def print_synthetic(rows: List[Dict[str, Any]], forward_s: float) -> None:
    table = [[r["schedule"], r["m"], r["batches"], r["samples_per_s"], r["ideal_samples_per_s"],
              r["measured_over_ideal"], r["simulated_over_ideal"], r["measured_over_simulated"],
              f"{r['measured_forward_s'] * 1e3:.1f}/{r['measured_backward_s'] * 1e3:.1f}",
              r["step_seconds_per_batch"] * 1e3, r.get("speedup_over_flush"),
              r.get("speedup_over_gpipe"), r.get("theoretical_speedup_segment"),
              r.get("theoretical_speedup_steady")]
             for r in rows]
    print(format_table(
        ["schedule", "m", "nb", "samples/s", "ideal", "meas/ideal", "sim/ideal", "meas/sim",
         "F/B ms", "STEP ms/b", "2bw/flush", "2bw/gpipe", "theory nb", "(m+d-1)/m"], table,
        title=f"(a) synthetic stages, d={STAGES}, w=1, F={forward_s * 1e3:g} ms, B=2F "
              f"(goal meas/ideal >= 0.95); sim = this project's simulator, STEP a barrier\n"
              f"F/B ms: measured sleep times; STEP ms/b: time per batch a stage spends in STEP "
              f"(waiting for the other stages)"))


# ---------------------------------------------------------------------------------------
# (b) a small GPT, d=2: this project vs torch.distributed.pipelining
# ---------------------------------------------------------------------------------------
class TokensToHidden(nn.Module):
    """First GPT stage with a plain ``forward(tokens)`` for torch's PipelineStage."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.gpt(tokens, positions, None)


class HiddenToLogits(nn.Module):
    """Last GPT stage: [s, b, h] hidden states -> [b, s, V] logits."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.gpt.set_input_tensor(hidden)
        return self.gpt(None, None, None)


def vocab_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss with the project's cross-entropy kernel, the one GPTModel uses on
    our side, so the comparison measures the pipelines and not two loss kernels."""
    from megatron.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, labels).mean()


def gpt_argv(schedule: str, quick: bool, iters: int) -> List[str]:
    hidden, seq, mbs, m = (64, 32, 2, 4) if quick else (128, 64, 2, 8)
    return ["--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--mock-data",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs * m),
            "--train-iters", str(iters), "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", schedule, "--distributed-backend", "gloo",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--clip-grad", "1.0", "--seed", "1234", "--log-interval", "100000",
            "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0"]


def run_torch_pipelining(schedule_cls: type, argv: List[str], rank: int):
    """(batch periods on this rank, per-batch mean losses on the last rank)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from bench.common import gpt_config
    from megatron.data.gpt_dataset import MockGPTDataset
    from bench.trainer_overhead import batch_periods
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo

    cfg, tokenizer = gpt_config(argv)
    tr, oc = cfg.training, cfg.optimizer
    m, iters, last = tr.global_batch_size // tr.micro_batch_size, tr.train_iters, rank == 1
    gpt = GPTModel(cfg.model, TPInfo.single(), pre_process=rank == 0, post_process=last,
                   layer_numbers=cfg.parallel.stage_layers(cfg.model.num_layers, rank), seed=tr.seed)
    stage = PipelineStage(HiddenToLogits(gpt) if last else TokensToHidden(gpt), rank, 2,
                          torch.device("cpu"))
    schedule = schedule_cls(stage, n_microbatches=m, loss_fn=vocab_cross_entropy)
    params = list(gpt.parameters())
    shared = gpt.shared_embedding_weight()
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": oc.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=oc.lr, betas=(oc.adam_beta1, oc.adam_beta2), eps=oc.adam_eps)
    # The batches are read inside the timed loop, as our trainer reads its microbatches:
    # one DataLoader batch of the whole global batch per step (what a user of
    # torch.distributed.pipelining writes; schedule.step splits it into microbatches).
    # Same dataset class, seed and order as our side's, so the same samples.
    loader = iter(torch.utils.data.DataLoader(
        MockGPTDataset(iters * tr.global_batch_size, cfg.model.seq_length,
                       tokenizer.vocab_size, tr.seed),
        batch_size=tr.global_batch_size, shuffle=False, num_workers=0))
    starts, losses = [], []
    cpu = _CPU_STAMPS
    cpu.clear()
    for step in range(iters):
        starts.append(time.perf_counter())
        cpu.append(time.process_time())
        text = next(loader)["text"]
        if last:
            mb_losses: List[torch.Tensor] = []
            schedule.step(target=text[:, 1:].contiguous(), losses=mb_losses, return_outputs=False)
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        else:
            schedule.step(text[:, :-1].contiguous())
        # the update our trainer makes: tied embedding gradient summed over the two
        # stages, one global norm (counting the tied weight once), clip, AdamW
        dist.all_reduce(shared.grad)
        counted = [p.grad for p in params if p.grad is not None and not (last and p is shared)]
        total = torch.stack(torch._foreach_norm(counted)).double().square().sum().reshape(1)
        dist.all_reduce(total)
        coef = oc.clip_grad / (float(total.sqrt()) + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return batch_periods(starts), losses


GPT_VARIANTS = ("flush", "2bw", "flush, sums by all_reduce", "flush, receives on demand",
                "2bw, receives on demand",
                "torch Schedule1F1B", "torch ScheduleGPipe")
"""``..., receives on demand``: ours with each receive posted when its action runs (as
on NCCL, and as torch.distributed.pipelining posts them), not ahead of it: the
side-by-side ablation of ``P2PCommunicator.prepost_receives``, which two ranks on this
bench's machine get by default (``megatron.pipeline.p2p.prepost_pays``).
``flush, sums by all_reduce``: ours with the tied-embedding sum and the optimizer's
agreement made by gloo's all_reduce instead of by direct exchange (the ablation of
``megatron.exchange``, 2026-11-23)."""
# process CPU time (all threads, gloo's included) at each batch start of the current run:
# CPU work per batch does not depend on how much of the machine other processes take
_CPU_STAMPS: List[float] = []


def run_ours(argv: List[str], num_microbatches: int):
    """(batch periods, losses) of this project's trainer; CPU stamps in _CPU_STAMPS."""
    from bench.trainer_overhead import run_trainer

    _CPU_STAMPS.clear()
    return run_trainer(argv, num_microbatches, cpu_stamps=_CPU_STAMPS)


@contextlib.contextmanager
def sums_by_all_reduce(on: bool):
    """``megatron.exchange.ExchangeSum`` off (all_reduce on gloo too) while inside."""
    from megatron.exchange import ExchangeSum

    ExchangeSum.enabled = not on
    try:
        yield
    finally:
        ExchangeSum.enabled = True


@contextlib.contextmanager
def receives_on_demand(on: bool):
    """The engine's communicator with ``prepost_receives=False`` while inside."""
    from megatron.pipeline import engine as engine_mod

    original = engine_mod.P2PCommunicator
    if on:
        engine_mod.P2PCommunicator = lambda *a, **k: original(*a, **{**k, "prepost_receives": False})
    try:
        yield
    finally:
        engine_mod.P2PCommunicator = original


def _gpt_worker(rank: int, world: int, quick: bool, rounds: int, warmup: int,
                steps: int) -> Dict[str, Dict[str, Any]]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    iters = warmup + steps + 1
    out: Dict[str, Dict[str, Any]] = {v: {"periods": [], "round_medians": [], "losses": None,
                                          "cpu_periods": []}
                                      for v in GPT_VARIANTS}
    for r in range(rounds):
        # reversed order every other round, so a drift in machine load hits all alike
        for variant in (GPT_VARIANTS if r % 2 == 0 else GPT_VARIANTS[::-1]):
            if not variant.startswith("torch"):
                argv = gpt_argv(variant.split(",")[0], quick, iters)
                with contextlib.redirect_stdout(io.StringIO()), \
                        receives_on_demand(variant.endswith("on demand")), \
                        sums_by_all_reduce(variant.endswith("all_reduce")):
                    periods, losses = run_ours(argv, _microbatches(argv))
            else:
                cls = Schedule1F1B if variant.endswith("1F1B") else ScheduleGPipe
                periods, losses = run_torch_pipelining(cls, gpt_argv("flush", quick, iters), rank)
            out[variant]["periods"] += periods[warmup:]
            cpu = [b - a for a, b in zip(_CPU_STAMPS, _CPU_STAMPS[1:])]
            out[variant]["cpu_periods"] += cpu[warmup:]
            out[variant]["round_medians"].append(median(periods[warmup:]))
            if out[variant]["losses"] is None:
                out[variant]["losses"] = losses
    return out


def _microbatches(argv: List[str]) -> int:
    gbs = int(argv[argv.index("--global-batch-size") + 1])
    return gbs // int(argv[argv.index("--micro-batch-size") + 1])


def bench_gpt(quick: bool, rounds: int, warmup: int, steps: int, timeout: float
              ) -> Dict[str, Any]:
    from tests.dist_utils import run_distributed

    per_rank = run_distributed(_gpt_worker, 2, args=(quick, rounds, warmup, steps),
                               timeout=timeout)
    argv = gpt_argv("flush", quick, 1)
    gbs = int(argv[argv.index("--global-batch-size") + 1])
    first = {v: per_rank[1][v]["losses"][0] for v in GPT_VARIANTS}
    ref = first["flush"]
    worst = max(abs(v - ref) / abs(ref) for v in first.values())
    if worst > 1e-4:
        raise RuntimeError(f"first-step losses differ (max rel {worst:.1e}): {first}; the "
                           "comparison would not be apples to apples")
    rows = []
    for v in GPT_VARIANTS:
        period = median(per_rank[0][v]["periods"])
        spread = per_rank[0][v]["round_medians"]
        cpu = [median(per_rank[r][v]["cpu_periods"]) for r in range(2)]
        rows.append({"variant": v, "first_step_loss": first[v], "seconds_per_batch": period,
                     "cpu_seconds_per_batch_per_rank": cpu,
                     "samples_per_s": gbs / period, "round_medians_s": spread,
                     "round_min_samples_per_s": gbs / max(spread),
                     "round_max_samples_per_s": gbs / min(spread)})
    base = {r["variant"]: r["samples_per_s"] for r in rows}
    torch_rounds = per_rank[0]["torch Schedule1F1B"]["round_medians"]
    torch_cpu = sum(median(per_rank[k]["torch Schedule1F1B"]["cpu_periods"]) for k in range(2))
    for r in rows:
        r["over_torch_1f1b"] = r["samples_per_s"] / base["torch Schedule1F1B"]
        r["over_torch_gpipe"] = r["samples_per_s"] / base["torch ScheduleGPipe"]
        # round by round (each round runs every variant back to back): the ratio with
        # the load of the moment shared, and its spread over the rounds
        paired = [t / ours for t, ours in zip(torch_rounds, r["round_medians_s"])]
        r["paired_over_torch_1f1b"] = paired
        r["paired_over_torch_1f1b_median"] = median(paired)
        r["cpu_over_torch_1f1b"] = torch_cpu / sum(r["cpu_seconds_per_batch_per_rank"])
    return {"argv": argv, "global_batch_size": gbs, "num_microbatches": _microbatches(argv),
            "rounds": rounds, "timed_batches_per_run": steps, "max_rel_first_loss_diff": worst,
            "rows": rows}


def print_gpt(res: Dict[str, Any]) -> None:
    table = [[r["variant"], f"{r['first_step_loss']:.6f}", r["seconds_per_batch"] * 1e3,
              "/".join(f"{c * 1e3:.1f}" for c in r["cpu_seconds_per_batch_per_rank"]),
              r["samples_per_s"], f"{r['round_min_samples_per_s']:.1f}-"
              f"{r['round_max_samples_per_s']:.1f}", r["over_torch_1f1b"],
              f"{r['paired_over_torch_1f1b_median']:.3f} ({min(r['paired_over_torch_1f1b']):.3f}"
              f"-{max(r['paired_over_torch_1f1b']):.3f})", r["cpu_over_torch_1f1b"],
              r["over_torch_gpipe"]]
             for r in res["rows"]]
    print(format_table(["schedule", "first-step loss", "ms/batch", "CPU ms/batch (rank 0/1)",
                        "samples/s", "rounds' range", "/torch 1F1B",
                        "/torch 1F1B per round: median (range)", "/torch 1F1B by CPU",
                        "/torch GPipe"], table,
                       title=f"(b) GPT, d=2, m={res['num_microbatches']}, global batch "
                             f"{res['global_batch_size']}: this project vs "
                             f"torch.distributed.pipelining"))
    print(f"first-step losses agree to {res['max_rel_first_loss_diff']:.1e} (relative)")


# ---------------------------------------------------------------------------------------
# traced timelines of a real GPT run for the docs
# ---------------------------------------------------------------------------------------
def timeline_argv(schedule: str, batches: int, trace_file: str) -> List[str]:
    # big enough that a microbatch's compute (~10-30 ms per stage) outweighs Python,
    # gloo and the scheduling noise of a shared CPU, small enough to run in seconds
    return ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024",
            "--tokenizer-type", "NullTokenizer", "--mock-data", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--train-iters", str(batches), "--pipeline-model-parallel-size", "4",
            "--pipeline-schedule", schedule, "--distributed-backend", "gloo", "--lr", "1e-4",
            "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
            "--num-workers", "0", "--timeline-file", trace_file]


def draw_real_timelines(out_dir: Path, trace_dir: Path) -> List[str]:
    """Train a small GPT on 4 CPU ranks (d=4, m=8) under gpipe, flush and 2bw with
    tracing on, and draw each run with tools/draw_timeline.py."""
    written = []
    for schedule, batches in (("gpipe", 2), ("flush", 2), ("2bw", 3)):
        trace = trace_dir / f"{schedule}.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(STAGES), str(REPO_ROOT / "pretrain_gpt.py"),
                        *timeline_argv(schedule, batches, str(trace))],
                       check=True, cwd=REPO_ROOT)
        png = out_dir / f"timeline_real_{schedule}_d4_m8.png"
        subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "draw_timeline.py"),
                        "--trace", str(trace_dir / f"{schedule}_rank*.json"),
                        "--title", f"traced run: {schedule}, GPT on 4 CPU ranks (gloo), d=4, "
                                   f"m=8, {batches} batches",
                        "--output", str(png)], check=True, cwd=REPO_ROOT)
        written.append(str(png))
    return written


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="m=4 only, short runs (tests)")
    p.add_argument("--forward-ms", type=float, default=None,
                   help="synthetic forward time F in ms (default 60, quick 10); B = 2F")
    p.add_argument("--batches", type=int, default=None,
                   help="batches per measured segment (default 3, quick 2; none: one less)")
    p.add_argument("--gpt-rounds", type=int, default=None, help="(b) rounds (default 4, quick 1)")
    p.add_argument("--gpt-steps", type=int, default=None,
                   help="(b) timed batches per run, after 2 warm-up ones (default 4, quick 2)")
    p.add_argument("--skip-synthetic", action="store_true")
    p.add_argument("--skip-gpt", action="store_true")
    p.add_argument("--timelines", action="store_true",
                   help="only draw docs/figures/timeline_real_{gpipe,flush,2bw}_d4_m8.png")
    p.add_argument("--out-dir", default=None, help="where to write pipeline_schedules.json")
    args = p.parse_args(argv)
    if args.timelines:
        with tempfile.TemporaryDirectory() as tmp:
            for path in draw_real_timelines(REPO_ROOT / "docs" / "figures", Path(tmp)):
                print(f"wrote {path}")
        return {}
    torch.set_num_threads(1)
    forward_s = (args.forward_ms or (10.0 if args.quick else 60.0)) / 1e3
    nb = args.batches or (2 if args.quick else 3)
    ms = [4] if args.quick else [4, 8, 16]
    payload: Dict[str, Any] = {
        "command": "PYTHONPATH=. python bench/pipeline_schedules.py " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:])),
        "quick": args.quick}
    t0 = time.perf_counter()
    if not args.skip_synthetic:
        batches = {s: max(1, nb - 1) if s == "none" else nb for s in SCHEDULES}
        rows = bench_synthetic(ms, batches, forward_s, timeout=600)
        print_synthetic(rows, forward_s)
        payload["synthetic"] = {"stages": STAGES, "data_parallel": 1, "forward_s": forward_s,
                                "backward_s": 2 * forward_s, "goal_measured_over_ideal": 0.95,
                                "rows": rows}
    if not args.skip_gpt:
        rounds = args.gpt_rounds or (1 if args.quick else 4)
        res = bench_gpt(args.quick, rounds, warmup=2,
                        steps=args.gpt_steps or (2 if args.quick else 4),
                        timeout=600)
        print_gpt(res)
        payload["gpt"] = res
    payload["bench_seconds"] = time.perf_counter() - t0
    path = write_results("pipeline_schedules", payload, args.out_dir)
    print(f"wrote {path} ({payload['bench_seconds']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()

"""Algorithm 1 (search), best_plan and command_line."""
from __future__ import annotations

import argparse
import itertools
import shlex
import time

import pytest

from megatron.pipeline.planner import (SCHEDULES, Config, CostModel, HardwareSpec, ModelSpec,
                                       PlanningError, best_plan, command_line, get_hardware,
                                       get_model, search)
from megatron.pipeline.planner.search import divisors

P3 = get_hardware("p3.16xlarge")


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1024) == [2 ** i for i in range(11)]


def _brute_force(model, hw, n, batch, tensor_parallel, max_b=64):
    """Best throughput over every (t, w, d, schedule, recompute, b, m), m = 1..B/(w b)."""
    cm = CostModel(model, hw)
    best = 0.0
    ts = [t for t in range(1, n + 1) if n % t == 0] if tensor_parallel else [1]
    for t in ts:
        for d in range(1, n // t + 1):
            if (n // t) % d or model.num_layers % d or model.num_attention_heads % t:
                continue
            w = n // (t * d)
            for sched, rc, b in itertools.product(SCHEDULES, (False, True),
                                                  [2 ** i for i in range(7)]):
                if b > max_b:
                    continue
                for m in range(1, batch // (w * b) + 1):
                    if sched == "2bw" and m < d:
                        continue
                    est = cm.estimate(Config(w=w, d=d, t=t, b=b, m=m, recompute=rc,
                                             schedule=sched), keep_stages=False)
                    if cm.fits(est):
                        best = max(best, est.samples_per_s)
    return best


@pytest.mark.parametrize("name,n,batch,tp", [("gpt-1.3b", 4, 16, True), ("gpt-2.2b", 8, 32, False),
                                             ("gpt-1.3b", 8, 24, True)])
def test_search_matches_brute_force(name, n, batch, tp):
    model = get_model(name)
    rows = search(model, P3, n, batch, tensor_parallel=tp)
    assert rows[0].fits
    assert rows[0].predicted_samples_per_s == pytest.approx(
        _brute_force(model, P3, n, batch, tp), rel=1e-12)
    # ranked: fitting rows by throughput, then rejected rows, each with a reason
    fitting = [r for r in rows if r.fits]
    assert [r.predicted_samples_per_s for r in fitting] == sorted(
        (r.predicted_samples_per_s for r in fitting), reverse=True)
    assert all(r.reason_rejected for r in rows if not r.fits)
    assert all(r.config.global_batch <= batch for r in fitting)
    assert all(r.config.m >= r.config.d for r in fitting if r.config.schedule == "2bw")
    assert all(r.memory_per_gpu_bytes <= P3.usable_memory_bytes for r in fitting)


def test_memory_limits_what_fits():
    model = get_model("gpt-2.2b")
    rows = search(model, P3, 8, 64)
    by = {(r.config.w, r.config.d, r.config.schedule, r.config.recompute): r for r in rows}
    # 2.2B parameters x 16 bytes do not fit on one 16 GB GPU (pure data parallelism)...
    assert not by[(8, 1, "none", False)].fits
    assert "out of memory" in by[(8, 1, "none", False)].reason_rejected
    # ...and 8 stages do; recomputation lets a larger microbatch fit.
    assert by[(1, 8, "2bw", True)].fits
    assert by[(1, 8, "2bw", True)].config.b >= by[(1, 8, "2bw", False)].config.b


def test_runtime_1024_gpus_under_one_second():
    model = get_model("gpt-3.8b")
    search(model, P3, 64, 512, tensor_parallel=True)     # warm imports and caches
    start = time.perf_counter()
    rows = search(model, P3, 1024, 2048, tensor_parallel=True)
    assert time.perf_counter() - start < 1.0
    assert rows[0].fits


def test_planner_picks_the_papers_depth_for_3_8b():
    """Section 5.2: the planner recommends 16-deep configurations for GPT 3.8B on 64 GPUs."""
    best = best_plan(get_model("gpt-3.8b"), P3, 64, 512, schedules=["2bw"])
    assert best.config.d == 16, best


def test_no_fit_is_one_clear_error():
    with pytest.raises(PlanningError, match="smallest footprint .* needs .* GiB per GPU"):
        best_plan(get_model("gpt-3.8b"), P3, 2, 512)
    with pytest.raises(PlanningError, match="--schedules"):
        search(get_model("gpt-1.3b"), P3, 8, 64, schedules=["1f1b"])
    with pytest.raises(PlanningError, match="--max-batch-size"):
        search(get_model("gpt-1.3b"), P3, 8, 0)


def _megatron_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--seq-length", "--max-position-embeddings", "--micro-batch-size",
                 "--global-batch-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--pipeline-schedule", choices=SCHEDULES, required=True)
    p.add_argument("--recompute-activations", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--2bw-mitigation", dest="tbw_mitigation", default="none")
    return p


def _torchrun_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--nnodes", type=int)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--node-rank")
    p.add_argument("--master-addr")
    p.add_argument("--master-port")
    p.add_argument("script")
    return p


@pytest.mark.parametrize("cfg,kind", [
    (Config(w=4, d=16, t=1, b=2, m=64, recompute=True, schedule="2bw"), "gpt"),
    (Config(w=1, d=2, t=4, b=8, m=3, recompute=False, schedule="flush"), "bert"),
])
def test_command_line_round_trip(cfg, kind):
    model = get_model("gpt-3.8b" if kind == "gpt" else "bert-355m")
    cmd = command_line(cfg, model, gpus_per_server=8)
    words = shlex.split(cmd)
    assert words[0] == "torchrun"
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    launch, _ = _torchrun_parser().parse_known_args(words[1:script + 1])
    assert launch.script == f"pretrain_{kind}.py"
    assert launch.nnodes * launch.nproc_per_node == cfg.num_gpus
    args = _megatron_parser().parse_args(words[script + 1:])
    # a planned 2BW run uses the staleness mitigation the benches recommend
    from megatron.optimizer.staleness import MITIGATIONS
    from megatron.pipeline.planner.search import RECOMMENDED_2BW_MITIGATION

    assert RECOMMENDED_2BW_MITIGATION in MITIGATIONS
    assert args.tbw_mitigation == (RECOMMENDED_2BW_MITIGATION if cfg.schedule == "2bw"
                                   else "none")
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length) == (
        model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length)
    assert (args.micro_batch_size, args.global_batch_size) == (cfg.b, cfg.global_batch)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (cfg.t, cfg.d)
    assert args.pipeline_schedule == cfg.schedule
    assert args.recompute_activations == cfg.recompute and args.fp16
    # data-parallel width is implied: world / (t d)
    assert cfg.num_gpus // (args.tensor_model_parallel_size *
                            args.pipeline_model_parallel_size) == cfg.w


def test_search_is_consistent_with_custom_hardware():
    """More memory admits data parallelism: an 80 GB GPU plans w=N for a 355M model."""
    big = HardwareSpec(name="big", gpus_per_server=8, gpu_memory_bytes=80 * 2 ** 30,
                       peak_flops=3e14, achieved_flops=1.5e14, intra_server_bandwidth=3e11,
                       inter_server_bandwidth=2e11)
    model = ModelSpec(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                      vocab_size=50304)
    best = best_plan(model, big, 8, 512)
    assert best.config.w == 8 and best.config.d == 1

"""The benches' --quick modes run end to end and write well-formed JSON.

Timings on a shared CI machine say nothing, so only the structure and the values that
do not depend on speed are asserted: the machine block, losses that must agree, and
the ideal-time formulas of the synthetic pipeline part.  (bench/grad_accumulation.py
--quick is bench/gpu_session.sh's dry run of it: tests/unit/test_gpu_benches.py checks
that run's JSON.)
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.dist_utils import forked_ranks  # noqa: E402  (after the path)


def _load(name: str, out_dir: Path) -> dict:
    with open(out_dir / f"{name}.json") as f:
        data = json.load(f)
    assert data["bench"] == name
    for key in ("platform", "cpu_count", "torch", "date"):
        assert data["machine"][key], key
    assert data["quick"] is True
    return data


def _run_bench(script: str, out_dir: Path, timeout: float) -> dict:
    """bench/<script> --quick in a process of its own (for the benches that train in it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--quick",
                           "--out-dir", str(out_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return _load(script.removesuffix(".py"), out_dir)


def _call_bench(name: str, argv: list) -> None:
    """bench/<name>.py ARGV, its ``main`` called in this process, for the benches that train
    only in gloo ranks (processes of their own either way): run here, their ranks fork
    (``forked_ranks``), and no process of the bench's imports torch again."""
    module = importlib.import_module(f"bench.{name}")
    threads = torch.get_num_threads()
    try:
        with forked_ranks():
            status = module.main(argv)
    finally:
        torch.set_num_threads(threads)  # some pin it to 1, as their ranks run
    # the exit status of the benches whose __main__ is sys.exit(main())
    assert not isinstance(status, int) or status == 0, f"bench/{name}.py: exit status {status}"


def _quick(name: str, out_dir: Path) -> dict:
    _call_bench(name, ["--quick", "--out-dir", str(out_dir)])
    return _load(name, out_dir)


def test_trainer_overhead_quick(tmp_path: Path) -> None:
    data = _run_bench("trainer_overhead.py", tmp_path, timeout=120)
    # same model, same data, same update: the losses must agree (fp32, same op order)
    assert data["max_rel_loss_diff"] < 1e-4
    assert data["trainer_ms_per_step"] > 0 and data["plain_ms_per_step"] > 0
    assert data["ratio"] == pytest.approx(data["trainer_ms_per_step"] / data["plain_ms_per_step"])
    assert len(data["per_round"]) == data["rounds"] == 2
    assert len(data["step_times_s"]["trainer"]) == data["rounds"] * data["timed_steps_per_run"]


def test_pipeline_schedules_quick(tmp_path: Path) -> None:
    data = _quick("pipeline_schedules", tmp_path)
    syn = data["synthetic"]
    f_plus_b = syn["forward_s"] + syn["backward_s"]
    rows = {r["schedule"]: r for r in syn["rows"]}
    assert set(rows) == {"none", "gpipe", "flush", "2bw"}
    d = syn["stages"]
    for s, r in rows.items():
        m, nb = r["m"], r["batches"]
        units = {"none": nb * d * m, "gpipe": nb * (m + d - 1), "flush": nb * (m + d - 1),
                 "2bw": nb * m + d - 1}[s]
        assert r["ideal_seconds"] == pytest.approx(units * f_plus_b)
        # sleeping stages can only be slower than the ideal, never much faster
        assert r["seconds"] >= 0.97 * r["ideal_seconds"], (s, r)
    assert rows["2bw"]["theoretical_speedup_steady"] == pytest.approx((4 + d - 1) / 4)
    gpt = {r["variant"]: r for r in data["gpt"]["rows"]}
    assert set(gpt) == {"flush", "2bw", "flush, sums by all_reduce", "flush, receives on demand",
                        "2bw, receives on demand",
                        "torch Schedule1F1B", "torch ScheduleGPipe"}
    assert data["gpt"]["max_rel_first_loss_diff"] < 1e-4
    losses = [r["first_step_loss"] for r in gpt.values()]
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0])
    assert all(r["samples_per_s"] > 0 for r in gpt.values())


def test_step_chain_quick(tmp_path: Path) -> None:
    data = _quick("step_chain", tmp_path)
    rows = {r["way"]: r for r in data["rows"]}
    assert set(rows) == {"exchange", "all_reduce"}
    for r in rows.values():
        # 2 runs x (8 batches - the first 3 - the last, which has no successor)
        assert r["batches"] == 2 * 4
        # each batch's chain holds its R@ and its S@, so the medians keep the order (the
        # sum of two medians can exceed the median of the sums: no check on that)
        assert r["chain_ms"] >= r["step_wall_ms"] > 0
        assert r["chain_ms"] >= r["reduce_wall_ms"] > 0
    assert rows["all_reduce"]["chain_saved_ms"] == 0.0


def test_step_chain_samples_from_a_trace() -> None:
    from bench.step_chain import chain_samples
    from megatron.pipeline.trace import TraceEvent

    def ev(batch, op, start, end, cpu=0.0):
        return TraceEvent(rank=0, stage=0, action=op, op=op, microbatch=None, batch=batch,
                          start=start, end=end, cpu=cpu)

    events = []
    for t in range(3):
        base = 10.0 * t
        events += [ev(t, "F", base, base + 1), ev(t, "F", base + 1, base + 2),
                   ev(t, "B", base + 2, base + 6), ev(t, "R@", base + 6, base + 6.5, 0.25),
                   ev(t, "S@", base + 6.5, base + 8, 1.0)]
    out = chain_samples(events, first_batch=1)
    # batch 1 only: batch 0 is before first_batch, batch 2 has no successor
    assert out == {"chain": [4.0], "reduce_wall": [0.5], "reduce_cpu": [0.25],
                   "step_wall": [1.5], "step_cpu": [1.0], "period": [10.0]}


def test_equal_time_projection_smoke(tmp_path: Path, capsys) -> None:
    """bench/equal_time.py --time-source simulated: the timing runs' traces give stage
    costs, the simulator's periods size the runs (a mitigation's with its own optimizer
    work), and the JSON says that the times are projected."""
    _call_bench("equal_time", ["--smoke", "--model", "gpt", "--time-source", "simulated",
                               "--work-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path),
                               "--figure", str(tmp_path / "f.png"),
                               "--variants", "2bw+warmup", "2bw+predict"])
    data = json.loads((tmp_path / "equal_time.json").read_text())
    assert data["time_source"] == "simulated"
    run = data["runs"][0]
    assert set(run["seconds_per_iteration"]) == {"flush", "2bw", "2bw+predict"}
    assert set(run["measured_seconds_per_iteration"]) == {"flush", "2bw", "2bw+predict"}
    # every timing round is kept, not only the fastest
    assert {k: len(v) for k, v in run["measured_rounds"].items()} == {
        "flush": 1, "2bw": 1, "2bw+predict": 1}
    assert len(run["mitigation_stage_costs"]["2bw+predict"]) == run["time_depth"]
    assert all(v > 0 for v in run["seconds_per_iteration"].values())
    assert len(run["stage_costs"]) == run["time_depth"]
    # a processor per stage: 2BW's projected period is no longer than Flush's
    assert run["seconds_per_iteration"]["2bw"] <= run["seconds_per_iteration"]["flush"]
    assert "PROJECTED" in capsys.readouterr().out and (tmp_path / "f.png").exists()


def test_host_malloc_quick(tmp_path: Path) -> None:
    """Both variants of every configuration ran in their own processes; the tuned row
    carries the speedup over the default row.  (The allocator's behaviour itself is
    tested without timing in tests/unit/test_device_selection.py.)"""
    data = _quick("host_malloc", tmp_path)
    rows = data["rows"]
    assert [(r["configuration"], r["variant"]) for r in rows] == [
        (c, v) for c in ("d=1 flush", "d=2 flush", "d=2 2bw") for v in ("tuned", "glibc default")]
    for tuned, default in zip(rows[::2], rows[1::2]):
        d = 1 if tuned["configuration"].startswith("d=1") else 2
        assert len(tuned["minor_faults_per_batch"]) == len(default["sys_ms_per_batch"]) == d
        assert tuned["speedup"] == pytest.approx(default["seconds_per_batch"]
                                                 / tuned["seconds_per_batch"])
        assert "speedup" not in default


def test_p2p_prepost_quick(tmp_path: Path) -> None:
    data = _quick("p2p_prepost", tmp_path)
    assert [r["mode"] for r in data["latency"]] == ["posted when needed", "posted ahead",
                                                    "posted ahead, after the wait"]
    assert all(r["mean_wait_s"] >= 0 and len(r["mean_wait_s_per_run"]) == 1
               for r in data["latency"])
    (row,) = data["gpt"]
    assert (row["schedule"], row["d"]) == ("2bw", 2)
    assert row["speedup_ahead"] == pytest.approx(row["period_s_when_needed"] / row["period_s_ahead"])
    assert row["speedup_ahead_after_wait"] == pytest.approx(
        row["period_s_when_needed"] / row["period_s_ahead_after_wait"])
    assert min(row["period_s_ahead"], row["period_s_when_needed"],
               row["period_s_ahead_after_wait"]) > 0


def test_grad_accumulation_fusion_probe(monkeypatch) -> None:
    """(c) of bench/grad_accumulation.py: where torch has no float32-output addmm it says
    so; where it has one (emulated here, as CUDA's) it times both ways per weight and
    checks that the fused sum is the unfused one."""
    import torch

    from bench.grad_accumulation import LAYER_WEIGHTS, fusion_probe

    probe = fusion_probe("cpu", 8, [4], reps=1)
    if not probe["supported"]:  # this CPU build: the reason, and nothing timed
        assert probe == {"device": "cpu", "supported": False, "reason": probe["reason"]}
        assert "addmm" in probe["reason"]

    def emulated(inp, a, b, out_dtype=None, *, out=None):
        res = inp + a.to(out_dtype) @ b.to(out_dtype)
        return out.copy_(res) if out is not None else res

    monkeypatch.setattr(torch, "addmm", emulated)
    probe = fusion_probe("cpu", 8, [4, 16], reps=2)
    assert probe["supported"] and probe["max_abs_error_small"] < 1e-5
    assert [r["tokens"] for r in probe["rows"]] == [4, 16] and len(LAYER_WEIGHTS) == 4
    for r in probe["rows"]:
        assert r["unfused_ms"] > 0 and r["fused_ms"] > 0
        assert r["fused_over_unfused"] == pytest.approx(r["fused_ms"] / r["unfused_ms"])
        # both sums ran reps + 1 times over the same bf16 inputs: only rounding differs
        assert r["max_rel_difference"] < 1e-2


def test_eval_memory_quick(tmp_path: Path) -> None:
    """Every configuration's every rank reported the forwards of one evaluation segment.
    (Growth itself is asserted without RSS in
    tests/distributed/test_eval_weights.py::test_evaluation_holds_no_tensor_per_microbatch.)"""
    data = _quick("eval_memory", tmp_path)
    assert [r["configuration"] for r in data["rows"]] == ["t=2 (2 ranks)", "d=2 (2 ranks)",
                                                          "w=2 (2 ranks)"]
    for row in data["rows"]:
        assert len(row["ranks"]) == 2 and row["eval_iters"] == 20
        # one segment of 20 batches: 4 microbatches each (w=2: 2 per pipeline)
        per_batch = 2 if row["configuration"].startswith("w=2") else 4
        assert all(r["forwards"] == 20 * per_batch for r in row["ranks"]), row
        assert row["rss_peak_mb"] >= max(row["rss_start_mb"], row["rss_end_mb"])


def test_distributed_optimizer_quick(tmp_path: Path) -> None:
    data = _quick("distributed_optimizer", tmp_path)
    rows = data["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    # the same bits but for the clipping factor, whose norm agrees to rounding
    assert all(r["loss_max_rel_diff"] < 1e-6 for r in rows)
    # the two ranks' shares are the whole state, split evenly (each bucket padded to a
    # multiple of 2: a few elements apart at most)
    assert sum(r["state_bytes_sharded"] for r in rows) == rows[0]["state_bytes_plain"]
    assert all(0 < r["state_ratio"] < 1 for r in rows)
    assert data["state_bytes_sharded_max"] - data["state_bytes_sharded_min"] <= 64
    # --overlap-param-gather: the same bits as waiting for the gathers at the step
    assert all(r["overlap_same_losses"] for r in rows)


def test_sequence_parallel_quick(tmp_path: Path) -> None:
    data = _quick("sequence_parallel", tmp_path)
    rows = data["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 < r["memory_ratio"] < 1 and 0 < r["planner_memory_ratio"] < 1
        assert r["max_loss_difference"] < 1e-4


def test_document_masks_quick(tmp_path: Path) -> None:
    data = _quick("document_masks", tmp_path)
    rows = {r["attention_backend"]: r for r in data["rows"]}
    assert sorted(rows) == ["auto", "local"]
    for r in rows.values():  # the counter saw exactly the mask the planner charges
        assert r["extra_bytes"] == r["expected_extra_bytes"] > 0
        assert r["s_per_iter_causal"] > 0 and r["s_per_iter_mask"] > 0


def test_segment_setup_quick(tmp_path: Path) -> None:
    data = _quick("segment_setup", tmp_path)
    rows = data["rows"]
    assert [(r["schedule"], r["d"], r["m"], r["batches"], r["forward_only"]) for r in rows] == [
        ("flush", 2, 4, 10, False), ("2bw", 2, 4, 20, False), ("2bw", 4, 8, 10, True)]
    for r in rows:
        assert r["build_seconds"] > 0 and r["cached_seconds"] > 0
        assert r["build_seconds_per_batch"] == pytest.approx(r["build_seconds"] / r["batches"])
        # one stage's list is kept, not every stage's
        assert 0 < r["stage_bytes"] < r["all_stages_bytes"]

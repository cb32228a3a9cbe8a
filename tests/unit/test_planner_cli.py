"""tools/plan.py smoke tests through a real subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_preset_model_and_cluster_prints_table_command_and_json(tmp_path):
    out = tmp_path / "plan.json"
    res = _plan("--model", "gpt-2.2b", "--cluster", "p3.16xlarge", "--num-gpus", "16",
                "--max-batch-size", "128", "--schedules", "2bw,flush", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "samples/s" in res.stdout and "mem GiB" in res.stdout
    assert "torchrun --nnodes=2 --nproc-per-node=8" in res.stdout
    data = json.loads(out.read_text())
    assert data["best"]["fits"] and data["best"]["config"]["schedule"] in ("2bw", "flush")
    assert data["command"] in res.stdout
    assert {r["config"]["schedule"] for r in data["rows"]} == {"2bw", "flush"}
    fastest = data["fastest_steady_state"]
    assert fastest["predicted_samples_per_s"] == max(r["predicted_samples_per_s"]
                                                     for r in data["rows"])
    # the command's configuration: the most samples/s over the run it starts (a 2BW row
    # at its rate with the Flush warm-up the command adds)
    run = (data["warmup"]["run_samples_per_s"] if data["warmup"]
           else data["best"]["predicted_samples_per_s"])
    assert all(run >= r["predicted_samples_per_s"] for r in data["rows"]
               if r["fits"] and r["config"]["schedule"] != "2bw")


def test_megatron_flags_and_custom_cluster_with_tensor_parallel():
    res = _plan("--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                "--seq-length", "128", "--vocab-size", "30592", "--model-type", "bert",
                "--num-gpus", "4", "--gpus-per-server", "4", "--gpu-memory-gb", "8",
                "--intra-server-bandwidth", "20", "--inter-server-bandwidth", "1.25",
                "--max-batch-size", "32", "--tensor-parallel", "--top", "0")
    assert res.returncode == 0, res.stderr
    assert "pretrain_bert.py" in res.stdout
    assert " 4 " in res.stdout  # t = 4 rows are listed


def test_errors_are_one_clear_line():
    res = _plan("--model", "gpt-1.3b", "--num-gpus", "12", "--max-batch-size", "64")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "--num-gpus 12" in res.stderr and "--gpus-per-server 8" in res.stderr
    res = _plan("--model", "gpt-3.8b", "--num-gpus", "2", "--max-batch-size", "64")
    assert res.returncode == 2 and "no configuration" in res.stderr
    res = _plan("--num-layers", "4", "--num-gpus", "2", "--max-batch-size", "64")
    assert res.returncode == 2 and "--hidden-size" in res.stderr


def test_layer_level_recompute_is_planned_with_megatron_flags():
    res = _plan("--model", "gpt-355m", "--cluster", "dgx-a100", "--num-gpus", "1",
                "--max-batch-size", "64", "--recompute", "layer", "--schedules", "flush")
    assert res.returncode == 0, res.stderr
    assert ("--recompute-granularity full --recompute-method uniform "
            "--recompute-num-layers 1") in res.stdout
    assert "uni1" in res.stdout



def test_a_2bw_plan_reports_the_warm_up_half_of_its_run(tmp_path):
    """The command of a 2BW plan runs the recommended Flush warm-up for half the run: the
    planner prints that half's rate (the same configuration under Flush) and the rate
    over the whole run, samples over time, and stores them in the JSON."""
    from megatron.pipeline.planner import CostModel, CostOptions, get_hardware, get_model
    from megatron.pipeline.planner.cost_model import Config

    out = tmp_path / "plan.json"
    res = _plan("--model", "gpt-2.2b", "--cluster", "p3.16xlarge", "--num-gpus", "64",
                "--max-batch-size", "512", "--schedules", "2bw,flush", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    cfg, warm = data["best"]["config"], data["warmup"]
    assert cfg["schedule"] == "2bw" and "--2bw-mitigation warmup" in data["command"]
    flush = CostModel(get_model("gpt-2.2b"), get_hardware("p3.16xlarge"), CostOptions()
                      ).estimate(Config(**dict(cfg, schedule="flush"))).samples_per_s
    assert warm["flush_samples_per_s"] == flush
    tbw = data["best"]["predicted_samples_per_s"]
    assert warm["run_samples_per_s"] == 1 / (0.5 / flush + 0.5 / tbw)
    assert flush < warm["run_samples_per_s"] < tbw
    assert f"{warm['run_samples_per_s']:.2f} samples/s over the whole run" in res.stdout
    # search() ranks by steady rate; the fastest 2BW steady state (w=16 d=4 here) has a
    # slow Flush half (its data-parallel all-reduce is no longer hidden), so the command
    # runs another configuration, and says why
    fastest = data["fastest_steady_state"]
    assert fastest["config"] != cfg and fastest["predicted_samples_per_s"] > tbw
    fast_flush = CostModel(get_model("gpt-2.2b"), get_hardware("p3.16xlarge"), CostOptions()
                           ).estimate(Config(**dict(fastest["config"], schedule="flush")))
    fast_run = 1 / (0.5 / fast_flush.samples_per_s + 0.5 / fastest["predicted_samples_per_s"])
    assert warm["run_samples_per_s"] > fast_run
    assert "chosen for the whole run's rate" in res.stdout


def test_no_note_when_the_fastest_steady_state_is_also_best_over_the_run():
    res = _plan("--model", "gpt-3.8b", "--cluster", "p3.16xlarge", "--num-gpus", "64",
                "--max-batch-size", "512", "--schedules", "2bw,flush")
    assert res.returncode == 0, res.stderr
    assert "samples/s over the whole run" in res.stdout
    assert "chosen for the whole run's rate" not in res.stdout


def test_cpu_plans_run_in_fp32_and_2bw_must_pay_for_its_staleness(tmp_path):
    """On a CPU cluster the command has no --fp16 (emulated half precision is ~400x
    slower there); at d = 1, where 2BW removes no bubble, a 0.3% faster 2BW plan is
    passed over, with a note saying so, for a schedule without stale weights."""
    out = tmp_path / "plan.json"
    res = _plan("--num-gpus", "2", "--cluster", "cpu", "--max-batch-size", "16",
                "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                "--seq-length", "64", "--vocab-size", "512", "--json", str(out))
    assert res.returncode == 0, res.stderr
    cmd = res.stdout.strip().splitlines()[-2]
    assert cmd.startswith("torchrun") and "--fp16" not in cmd and "--bf16" not in cmd
    data = json.loads(out.read_text())
    assert data["best"]["config"]["schedule"] != "2bw"
    passed = data["passed_over_2bw"]
    assert passed is not None and passed["config"]["schedule"] == "2bw"
    assert "but 2BW must gain more than 2%" in res.stdout
    # the paper's GPU cluster keeps fp16
    gpu = _plan("--model", "gpt-2.2b", "--cluster", "p3.16xlarge", "--num-gpus", "16",
                "--max-batch-size", "128")
    assert gpu.returncode == 0 and "--fp16" in gpu.stdout.strip().splitlines()[-1]
    # an H100 computes bf16 at its half-precision rate: no loss scale to tune
    h100 = _plan("--model", "gpt-1.3b", "--cluster", "h100-sxm", "--num-gpus", "8",
                 "--max-batch-size", "64")
    cmd = h100.stdout.strip().splitlines()[-1]
    assert h100.returncode == 0 and "--bf16" in cmd and "--fp16" not in cmd, h100.stdout

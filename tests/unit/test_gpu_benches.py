"""The GPU-session benches run on the CPU in their check modes, and the stability model
behind docs/pipeline.md's explanation of 2BW's gap holds its closed forms.

* bench/delay_stability.py: Flush's stable step eta*lambda is 2(1+beta1)/(1-beta1),
  the 1-stale rule's is 1 for every beta1, prediction lies between;
* bench/gpu_session.sh part 1 runs every GPU bench's dry run (throughput, the fused loss,
  the planner's CUDA mode, the profile, gradient accumulation) and each writes its JSON; bench/convergence_gpu.py builds its corpus and trains Flush and 2BW in
  --smoke mode; tools/make_results.py renders all of it without falling back.

The script runs its benches one process at a time, for about a minute, which leaves one
of a 2-core machine's cores idle: the fixture runs the file's other commands on it
meanwhile, and each test checks its own command's result.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
GPT2 = REPO.parent / "shared" / "data" / "gpt2"


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 0.95])
def test_delay_stability_closed_forms(beta):
    from bench.delay_stability import matrix_trajectory, simulate, threshold

    flush, stale, pred = (threshold(r, beta) for r in ("flush", "2bw", "2bw+predict"))
    assert flush == pytest.approx(2 * (1 + beta) / (1 - beta), rel=1e-6)
    assert stale == pytest.approx(1.0, rel=1e-6)
    assert stale - 1e-6 <= pred < flush
    if beta == 0.9:
        assert pred == pytest.approx(2.53, abs=0.01)
    for rule in ("flush", "2bw", "2bw+predict"):
        a = 0.7 * threshold(rule, beta)
        assert simulate(rule, beta, a, 40) == pytest.approx(
            matrix_trajectory(rule, beta, a, 40))
        assert abs(simulate(rule, beta, a, 3000)[-1]) < 1e-3  # inside the bound: decays
        outside = simulate(rule, beta, 1.5 * threshold(rule, beta), 600)[-1]
        assert not abs(outside) < 1e3  # outside: grows (inf or nan once it overflows)


ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
SESSION = ["bash", str(REPO / "bench" / "gpu_session.sh")]
SESSION_ENV = dict(os.environ, GPU_SESSION_DRY="1", OMP_NUM_THREADS="1")


def _run(args, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _session(*args: str, env: Dict[str, str] = SESSION_ENV) -> subprocess.CompletedProcess:
    return subprocess.run([*SESSION, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


@dataclass
class Results:
    root: Path  # holds gpu/ (the script's OUT, the layout the page reads) and the rest
    runs: Dict[str, subprocess.CompletedProcess]  # what ran beside the script, by name


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> Results:
    """bench/gpu_session.sh part 1 on the CPU (GPU_SESSION_DRY=1: every GPU bench's dry run)
    into results/gpu/, and beside it, one after another: the delay-stability bench (its
    JSON into results/gpu/ too), bench/convergence_gpu.py's corpus and smoke run (where
    ../shared/data/gpt2 is), and the script's one-step and bad-argument runs.  One run
    serves every test of the file."""
    root = tmp_path_factory.mktemp("results")
    out = root / "gpu"
    with open(root / "session.stdout", "w") as log, open(root / "session.stderr", "w") as err:
        session = subprocess.Popen([*SESSION, "1", str(out)], cwd=REPO, env=SESSION_ENV,
                                   stdout=log, stderr=err, start_new_session=True)
        try:
            runs = {"stability": _run(["bench/delay_stability.py", "--out-dir", str(out),
                                       "--figure", str(root / "stability.png")])}
            if (GPT2 / "encoder.json").is_file():
                runs["corpus"] = _run(["bench/convergence_gpu.py", "--prepare-data",
                                       str(root / "data"), "--target-tokens", "40000"])
                if runs["corpus"].returncode == 0:
                    # fp32 on a CPU: without AVX-512 BF16 the bf16 matrix products are
                    # emulated (7x slower)
                    precision = "bf16" if torch.cuda.is_available() else "fp32"
                    runs["smoke"] = _run(
                        ["bench/convergence_gpu.py", "--data-dir", str(root / "data"),
                         "--smoke", "--variants", "flush", "2bw", "--precision", precision,
                         "--out-dir", str(out), "--figure", str(root / "c.png")])
            runs["one"] = _session("1", str(root / "one"),
                                   env=dict(SESSION_ENV, GPU_SESSION_STEPS="planner_validation"))
            runs["bad"] = _session("3", str(root / "x"))
            runs["nodata"] = _session("2", str(root / "y"))
            session.wait(timeout=600)
        finally:
            if session.poll() is None:  # a timeout above: stop the script and its bench
                os.killpg(session.pid, signal.SIGKILL)
                session.wait()
    assert session.returncode == 0, ((root / "session.stdout").read_text()[-2000:]
                                     + (root / "session.stderr").read_text()[-2000:])
    _ok(runs["stability"])
    return Results(root, runs)


def test_cross_entropy_fusion_dry_run(gpu_results: Results):
    """Both ways of the loss give the same loss; the trainer ran both ways at b=8 and 1."""
    out = gpu_results.root / "gpu"
    data = json.loads((out / "cross_entropy_fusion.json").read_text())
    assert data["status"] == "dry run" and data["command"].endswith("--out-dir " + str(out))
    assert [r["micro_batch_size"] for r in data["loss_alone"]] == [1, 8]
    for r in data["loss_alone"]:
        assert r["mean_loss_fused"] == pytest.approx(r["mean_loss_chunked"], rel=1e-5)
        assert r["chunked_ms"] > 0 and r["fused_ms"] > 0
    assert [r["micro_batch_size"] for r in data["trainer"]] == [8, 1]
    assert all(r["default_s"] > 0 and r["fused_s"] > 0 for r in data["trainer"])


def test_throughput_cuda_only_dry_run(gpu_results: Results):
    data = json.loads((gpu_results.root / "gpu" / "throughput_cuda.json").read_text())
    cuda = data["cuda_gpt_345m"]
    assert cuda["status"] == "dry run" and cuda["dropout"] == 0.1
    assert {r["micro_batch_size"] for r in cuda["rows"]} == {8, 1}
    fused = "trainer --cross-entropy-loss-fusion"
    assert {r["name"] for r in cuda["rows"]} == {"trainer", fused, "plain GPT-2, torch.compile"}
    assert set(cuda["b1_trainer_over_plain_compiled"]) == {"trainer", fused}
    assert all(r["seconds_per_iteration"] > 0 for r in cuda["rows"])


def test_gpu_profile_dry_run(gpu_results: Results):
    data = json.loads((gpu_results.root / "gpu" / "gpu_profile.json").read_text())
    assert [run["micro_batch_size"] for run in data["runs"]] == [8, 1]
    for run in data["runs"]:
        assert run["active_iterations"] >= 1
        names = {x["name"] for x in run["top_cpu"]}
        assert any(n.startswith("aten::") for n in names), names
        # the dry run's trainer takes the GPU where there is one: kernels are counted there
        assert (run["device_ms_total"] is None) == (not torch.cuda.is_available())


def test_grad_accumulation_quick(gpu_results: Results):
    """The script's dry run of bench/grad_accumulation.py is its --quick mode."""
    from megatron.config import GRAD_DTYPE_SUPPORTED
    if not GRAD_DTYPE_SUPPORTED:
        pytest.skip("Tensor.grad_dtype needs torch >= 2.10")
    data = json.loads((gpu_results.root / "gpu" / "grad_accumulation.json").read_text())
    assert data["bench"] == "grad_accumulation" and data["quick"] is True
    for key in ("platform", "cpu_count", "torch", "date"):
        assert data["machine"][key], key
    assert [r["microbatches"] for r in data["errors"]] == [4, 16]
    for r in data["errors"]:
        # float32 sums of bf16 gradients: rounding far below bf16's 2^-8
        assert r["fp32_rel_error"] < 1e-6 < 1e-4 < r["bf16_rel_error"]
    assert data["step_cost"][0]["fp32_s"] > 0 and data["step_cost"][0]["bf16_s"] > 0
    probe = data["fusion_probe"]
    assert probe["device"] == "cpu" and "supported" in probe


@pytest.mark.skipif(not (GPT2 / "encoder.json").is_file(), reason="needs ../shared/data/gpt2")
def test_convergence_gpu_smoke_and_page(gpu_results: Results, tmp_path: Path):
    root = gpu_results.root
    _ok(gpu_results.runs["corpus"])
    info = json.loads((root / "data" / "corpus_info.json").read_text())
    assert info["tokens"] >= 20000 and info["documents"] > 0  # "about" the target
    assert not (root / "data" / "corpus.jsonl").exists()  # only the indexed dataset travels
    _ok(gpu_results.runs["smoke"])
    data = json.loads((root / "gpu" / "convergence_gpu.json").read_text())
    assert set(data["summary"]) == {"flush", "2bw"}
    flush = data["summary"]["flush"]
    assert flush["relative_to_flush"] == 0 and flush["reaches_flush_final_at"] is not None
    first = {n: data["runs"][n]["train"]["1"] for n in ("flush", "2bw")}
    assert first["flush"] == pytest.approx(first["2bw"], rel=1e-5)  # batch 1 on W(0) in both
    assert (root / "c.png").read_bytes()[:4] == b"\x89PNG"

    from tools.make_results import build_page

    page = build_page(root, tmp_path / "RESULTS.md")
    for section in ("gpu_convergence_gpu", "gpu_throughput_cuda", "gpu_gpu_profile",
                    "gpu_cross_entropy_fusion"):
        assert f"## {section}" in page, section
    assert "does not have the fields" not in page


def test_gpu_session_script_dry_run_and_bad_arguments(gpu_results: Results):
    """bench/gpu_session.sh: part 1 on a CPU (GPU_SESSION_DRY=1) runs the GPU benches'
    dry runs into OUT, at most 8 files (what the device tool returns); GPU_SESSION_STEPS
    picks steps; bad arguments stop with one line and exit 2."""
    root = gpu_results.root
    files = sorted(p.name for p in (root / "gpu").iterdir()
                   if p.name != "convergence_gpu.json")  # the convergence smoke run's
    assert files == ["cross_entropy_fusion.json", "delay_stability.json", "gpu_profile.json",
                     "grad_accumulation.json", "planner_validation_cuda.json", "session.log",
                     "throughput_cuda.json"]  # delay_stability.json: the fixture's own
    assert (root / "session.stdout").read_text().count(": exit 0 after") == 5

    one = gpu_results.runs["one"]  # GPU_SESSION_STEPS=planner_validation: one step alone
    assert one.returncode == 0 and one.stdout.count(": exit 0 after") == 1, one.stdout
    assert sorted(p.name for p in (root / "one").iterdir()) == [
        "planner_validation_cuda.json", "session.log"]
    bad = gpu_results.runs["bad"]
    assert bad.returncode == 2 and "part must be 1 or 2, got '3'" in bad.stderr
    nodata = gpu_results.runs["nodata"]
    assert nodata.returncode == 2 and "--prepare-data wrote" in nodata.stderr

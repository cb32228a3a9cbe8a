"""The GPU-session benches run on the CPU in their check modes, and the stability model
behind docs/pipeline.md's explanation of 2BW's gap holds its closed forms.

* bench/delay_stability.py: Flush's stable step eta*lambda is 2(1+beta1)/(1-beta1),
  the 1-stale rule's is 1 for every beta1, prediction lies between;
* bench/gpu_session.sh part 1 runs every GPU bench's dry run (throughput, the fused loss,
  the planner's CUDA mode, the profile, gradient accumulation) and each writes its JSON; bench/convergence_gpu.py builds its corpus and trains Flush and 2BW in
  --smoke mode; tools/make_results.py renders all of it without falling back.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def _run(args, tmp_path: Path, timeout: int = 240) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> Path:
    """bench/gpu_session.sh part 1 on the CPU (GPU_SESSION_DRY=1: every GPU bench's dry run)
    into results/gpu/, the layout the page reads, and the delay-stability bench beside it.
    One run serves the script's test and each bench's."""
    root = tmp_path_factory.mktemp("results")
    out = root / "gpu"
    env = dict(os.environ, GPU_SESSION_DRY="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh"), "1", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (root / "session.stdout").write_text(proc.stdout)
    _run(["bench/delay_stability.py", "--out-dir", str(out), "--figure",
          str(root / "stability.png")], root)
    return root


def test_cross_entropy_fusion_dry_run(gpu_results: Path):
    """Both ways of the loss give the same loss; the trainer ran both ways at b=8 and 1."""
    data = json.loads((gpu_results / "gpu" / "cross_entropy_fusion.json").read_text())
    assert data["status"] == "dry run" and data["command"].endswith("--out-dir " + str(
        gpu_results / "gpu"))
    assert [r["micro_batch_size"] for r in data["loss_alone"]] == [1, 8]
    for r in data["loss_alone"]:
        assert r["mean_loss_fused"] == pytest.approx(r["mean_loss_chunked"], rel=1e-5)
        assert r["chunked_ms"] > 0 and r["fused_ms"] > 0
    assert [r["micro_batch_size"] for r in data["trainer"]] == [8, 1]
    assert all(r["default_s"] > 0 and r["fused_s"] > 0 for r in data["trainer"])


def test_throughput_cuda_only_dry_run(gpu_results: Path):
    data = json.loads((gpu_results / "gpu" / "throughput_cuda.json").read_text())
    cuda = data["cuda_gpt_345m"]
    assert cuda["status"] == "dry run" and cuda["dropout"] == 0.1
    assert {r["micro_batch_size"] for r in cuda["rows"]} == {8, 1}
    fused = "trainer --cross-entropy-loss-fusion"
    assert {r["name"] for r in cuda["rows"]} == {"trainer", fused, "plain GPT-2, torch.compile"}
    assert set(cuda["b1_trainer_over_plain_compiled"]) == {"trainer", fused}
    assert all(r["seconds_per_iteration"] > 0 for r in cuda["rows"])


def test_gpu_profile_dry_run(gpu_results: Path):
    data = json.loads((gpu_results / "gpu" / "gpu_profile.json").read_text())
    assert [run["micro_batch_size"] for run in data["runs"]] == [8, 1]
    for run in data["runs"]:
        assert run["active_iterations"] >= 1
        names = {x["name"] for x in run["top_cpu"]}
        assert any(n.startswith("aten::") for n in names), names
        # the dry run's trainer takes the GPU where there is one: kernels are counted there
        assert (run["device_ms_total"] is None) == (not torch.cuda.is_available())


@pytest.mark.skipif(not (GPT2 / "encoder.json").is_file(), reason="needs ../shared/data/gpt2")
def test_convergence_gpu_smoke_and_page(gpu_results: Path, tmp_path: Path):
    data_dir = tmp_path / "data"
    _run(["bench/convergence_gpu.py", "--prepare-data", str(data_dir), "--target-tokens",
          "40000"], tmp_path)
    info = json.loads((data_dir / "corpus_info.json").read_text())
    assert info["tokens"] >= 20000 and info["documents"] > 0  # "about" the target
    assert not (data_dir / "corpus.jsonl").exists()  # only the indexed dataset travels
    out = gpu_results / "gpu"
    # fp32 on a CPU: without AVX-512 BF16 the bf16 matrix products are emulated (7x slower)
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    _run(["bench/convergence_gpu.py", "--data-dir", str(data_dir), "--smoke", "--variants",
          "flush", "2bw", "--precision", precision, "--out-dir", str(out), "--figure",
          str(tmp_path / "c.png")], tmp_path)
    data = json.loads((out / "convergence_gpu.json").read_text())
    assert set(data["summary"]) == {"flush", "2bw"}
    flush = data["summary"]["flush"]
    assert flush["relative_to_flush"] == 0 and flush["reaches_flush_final_at"] is not None
    first = {n: data["runs"][n]["train"]["1"] for n in ("flush", "2bw")}
    assert first["flush"] == pytest.approx(first["2bw"], rel=1e-5)  # batch 1 on W(0) in both
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"

    from tools.make_results import build_page

    page = build_page(gpu_results, tmp_path / "RESULTS.md")
    for section in ("gpu_convergence_gpu", "gpu_throughput_cuda", "gpu_gpu_profile",
                    "gpu_cross_entropy_fusion"):
        assert f"## {section}" in page, section
    assert "does not have the fields" not in page


def test_gpu_session_script_dry_run_and_bad_arguments(gpu_results: Path, tmp_path: Path):
    """bench/gpu_session.sh: part 1 on a CPU (GPU_SESSION_DRY=1) runs the GPU benches'
    dry runs into OUT, at most 8 files (what the device tool returns); GPU_SESSION_STEPS
    picks steps; bad arguments stop with one line and exit 2."""
    files = sorted(p.name for p in (gpu_results / "gpu").iterdir()
                   if p.name != "convergence_gpu.json")  # written by the convergence test
    assert files == ["cross_entropy_fusion.json", "delay_stability.json", "gpu_profile.json",
                     "grad_accumulation.json", "planner_validation_cuda.json", "session.log",
                     "throughput_cuda.json"]  # delay_stability.json: the fixture's own
    assert (gpu_results / "session.stdout").read_text().count(": exit 0 after") == 5

    env = dict(os.environ, GPU_SESSION_DRY="1", OMP_NUM_THREADS="1")
    run = lambda *a: subprocess.run(["bash", str(REPO / "bench" / "gpu_session.sh"), *a],  # noqa: E731
                                    cwd=REPO, env=env, capture_output=True, text=True,
                                    timeout=600)
    env["GPU_SESSION_STEPS"] = "planner_validation"  # one step alone
    one = run("1", str(tmp_path / "one"))
    assert one.returncode == 0 and one.stdout.count(": exit 0 after") == 1, one.stdout
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "planner_validation_cuda.json", "session.log"]
    bad = run("3", str(tmp_path / "x"))
    assert bad.returncode == 2 and "part must be 1 or 2, got '3'" in bad.stderr
    nodata = run("2", str(tmp_path / "y"))
    assert nodata.returncode == 2 and "--prepare-data wrote" in nodata.stderr

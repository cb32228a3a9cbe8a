"""QA pass 57 on the benches: what they write, where, and how the results page names it.

Pure logic: the measurements are replaced by fakes, so every test runs in seconds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


# -- write_results must never leave a broken file in place of good results ---------------
def test_write_results_failure_keeps_the_previous_results(tmp_path: Path) -> None:
    from bench.common import write_results

    good = write_results("x", {"rows": [1, 2, 3]}, tmp_path)
    before = good.read_text()
    with pytest.raises(TypeError):
        # a value JSON cannot hold, after some rows were already serialised
        write_results("x", {"rows": [4, 5], "oops": object()}, tmp_path)
    assert good.read_text() == before  # not a truncated half of the new results
    assert _read(good)["rows"] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]  # no temp file left


def test_bench_command_quotes_its_arguments() -> None:
    from bench.common import bench_command

    assert (bench_command("bench/memory.py", ["--out-dir", "/tmp/a b"])
            == "PYTHONPATH=. python bench/memory.py --out-dir '/tmp/a b'")


# -- trainer_overhead: --compile-layers must not overwrite the eager run's JSON ----------
def test_trainer_overhead_compile_layers_has_its_own_json(tmp_path: Path, monkeypatch) -> None:
    import bench.trainer_overhead as to

    def fake_run(argv, cfg, tokenizer, iters):
        return {"trainer": [0.2] * (iters - 1), "plain": [0.1] * (iters - 1),
                "trainer_losses": [5.0] * iters, "plain_losses": [5.0] * iters}

    monkeypatch.setattr(to, "run_interleaved", fake_run)
    (tmp_path / "trainer_overhead.json").write_text('{"eager": true}\n')
    argv = ["--quick", "--compile-layers", "--out-dir", str(tmp_path)]
    to.main(argv)
    assert _read(tmp_path / "trainer_overhead.json") == {"eager": True}  # untouched
    data = _read(tmp_path / "trainer_overhead_compile_layers.json")
    assert data["compile_layers"] is True and data["ratio"] == pytest.approx(2.0)
    assert data["command"] == "PYTHONPATH=. python bench/trainer_overhead.py " + " ".join(argv)


# -- planner_validation: the command is recorded in both modes ---------------------------
def test_planner_validation_cuda_records_its_command(tmp_path: Path, monkeypatch) -> None:
    import bench.planner_validation as pv

    monkeypatch.setattr(pv, "cuda_validation",
                        lambda **kw: {"status": "skipped", "reason": "skipped: no GPU"})
    pv.main(["--cuda", "--out-dir", str(tmp_path)])
    data = _read(tmp_path / "planner_validation_cuda.json")
    assert data["command"] == ("PYTHONPATH=. python bench/planner_validation.py --cuda "
                               f"--out-dir {tmp_path}")


# -- memory --layer-recompute --smoke is labelled as such ---------------------------------
def test_memory_layer_recompute_smoke_is_labelled(tmp_path: Path, monkeypatch) -> None:
    import bench.memory as mem
    from tools.make_results import Entry, section

    row = {"stash_bytes": 10, "microbatch_stash_bytes": 5, "peak_rss_bytes": 100,
           "rss_after_setup_bytes": 50, "variant": "none", "flags": [],
           "training_peak_bytes": 50}
    monkeypatch.setattr(mem, "measure_layer_recompute", lambda smoke: [dict(row)])
    mem.main(["--layer-recompute", "--smoke", "--out-dir", str(tmp_path)])
    data = _read(tmp_path / "memory_recompute.json")
    assert data["smoke"] is True and "--smoke" in data["command"]
    assert str(tmp_path) in data["command"]
    page = section(Entry("memory_recompute", "memory_recompute", data), REPO,
                   tmp_path / "RESULTS.md")
    assert "**Quick mode**" in page


# -- gpu_profile --dry-run says so -------------------------------------------------------
def test_gpu_profile_dry_run_is_labelled(tmp_path: Path, monkeypatch) -> None:
    import bench.gpu_profile as gp
    from tools.make_results import Entry, section

    monkeypatch.setattr(gp, "profile_trainer", lambda *a, **k: {"micro_batch_size": a[1]})
    monkeypatch.setattr(gp, "show", lambda r: None)
    gp.main(["--dry-run", "--micro-batch-size", "1", "--out-dir", str(tmp_path)])
    data = _read(tmp_path / "gpu_profile.json")
    assert data["status"] == "dry run" and data["dry_run"] is True
    assert data["command"].startswith("PYTHONPATH=. python bench/gpu_profile.py --dry-run")
    page = section(Entry("gpu_profile", "gpu_profile", {**data, "runs": []}), REPO,
                   tmp_path / "RESULTS.md")
    assert "**Dry run**" in page


# -- the other benches record their command too ------------------------------------------
def test_checkpoint_cpu_precision_host_malloc_record_their_command(tmp_path: Path,
                                                                    monkeypatch) -> None:
    import bench.checkpoint_io as ck
    import bench.cpu_precision as cp
    import bench.host_malloc as hm

    monkeypatch.setattr(ck, "run", lambda model, rounds: {
        "model": model, "parameters": 1, "rounds": rounds, "bytes": {"pickle": 1, "safe": 1},
        "seconds": {k: 1.0 for k in ("pickle_save", "pickle_load", "safe_save", "safe_hash",
                                     "safe_load")},
        "all_seconds": {}, "save_ratio": 2.0, "load_ratio": 1.0})
    monkeypatch.setattr(cp, "measure", lambda steps, fp16_steps: {
        "ms_per_step": {k: 1.0 for k in cp.DTYPES}, "ratio_to_fp32": {k: 1.0 for k in cp.DTYPES},
        "step_times_s": {}})
    monkeypatch.setattr(hm, "measure", lambda *a, **k: [])
    monkeypatch.setattr(hm, "print_rows", lambda rows: None)
    for mod, name in ((ck, "checkpoint_io"), (cp, "cpu_precision"), (hm, "host_malloc")):
        argv = ["--quick", "--out-dir", str(tmp_path)]
        mod.main(argv)
        data = _read(tmp_path / f"{name}.json")
        assert data["command"] == f"PYTHONPATH=. python bench/{name}.py " + " ".join(argv)


# -- planner_runtime and paper_reproduction can write somewhere else ---------------------
def test_planner_runtime_writes_where_asked(tmp_path: Path, monkeypatch) -> None:
    import bench.planner_runtime as pr

    monkeypatch.setattr(pr, "SIZES", (8,))
    monkeypatch.setattr(pr, "REPEATS", 1)
    pr.main(["--out-dir", str(tmp_path)])
    data = _read(tmp_path / "planner_runtime.json")
    assert data["command"].endswith(f"bench/planner_runtime.py --out-dir {tmp_path}")
    assert data["machine"]["cpu_count"] and [r["num_gpus"] for r in data["results"]] == [8, 8]


def test_paper_reproduction_writes_where_asked(tmp_path: Path, monkeypatch) -> None:
    import bench.paper_reproduction as pp

    for fn in ("throughput_experiment", "planner_depths", "planning_sweep", "max_model_size",
               "memory_ordering"):
        monkeypatch.setattr(pp, fn, lambda *a, **k: [])
    monkeypatch.setattr(pp, "claim_table", lambda rows: [])
    for fn in ("print_report", "plot_throughput", "plot_memory", "plot_planning"):
        monkeypatch.setattr(pp, fn, lambda *a, **k: None)
    pp.main(["--no-sim", "--out-dir", str(tmp_path / "r"), "--figure-dir", str(tmp_path / "f")])
    data = _read(tmp_path / "r" / "paper_reproduction.json")
    assert data["command"].startswith("PYTHONPATH=. python bench/paper_reproduction.py --no-sim")
    assert data["figures"] == [str(tmp_path / "f" / f"paper_{k}.png")
                               for k in ("throughput", "memory", "planning")]


# -- make_results: a JSON without a command names a script that exists ------------------
@pytest.mark.parametrize("name,data,want", [
    ("planner_validation_cuda", {"status": "measured"}, "bench/planner_validation.py --cuda"),
    ("trainer_overhead_compile_layers", {"compile_layers": True, "quick": False},
     "bench/trainer_overhead.py --compile-layers`"),
    ("memory_recompute", {"smoke": True}, "bench/memory.py --layer-recompute --smoke`"),
    ("trainer_overhead", {"quick": True}, "bench/trainer_overhead.py --quick`"),
])
def test_command_of_names_an_existing_script(name: str, data: dict, want: str) -> None:
    from tools.make_results import SCRIPT_OF, command_of

    text = command_of(name, data)
    assert want in text, text
    script = text.split("python ")[1].split()[0].rstrip("`")
    assert (REPO / script).is_file(), script
    assert all((REPO / "bench" / f"{s}.py").is_file() for s, _ in SCRIPT_OF.values())

"""The evidence benches (convergence, memory, throughput) run end to end in their
``--quick --smoke`` mode, and docs/RESULTS.md regenerates from the JSON they write.

Timings on a shared machine say little, so the assertions are about values that do
not depend on speed: identical first-batch losses of Flush and 2BW (same data order and
seeds), weight-version and in-flight counts, the paper's memory formula, and the page.
"""
from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.dist_utils import forked_ranks  # noqa: E402  (after the path)


BENCHES = {"convergence": ["--work-dir", "work"], "memory": [], "throughput": ["--skip-cuda"]}


def _check(name: str, out_dir: Path) -> None:
    with open(out_dir / f"{name}.json") as f:
        data = json.load(f)
    assert data["bench"] == name and data["quick"] and data["smoke"]
    assert data["command"].startswith(f"PYTHONPATH=. python bench/{name}.py --quick --smoke")
    for key in ("platform", "cpu_count", "torch", "date"):
        assert data["machine"][key], key
    png = out_dir / f"{name}.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One smoke run of each bench into one results folder, each bench's ``main`` called
    here, one after another: its ranks fork (``forked_ranks``), and no process of the
    bench's imports torch again."""
    out = tmp_path_factory.mktemp("results")
    threads = torch.get_num_threads()
    for name, extra in BENCHES.items():
        extra = [str(out / a) if a == "work" else a for a in extra]
        try:
            with forked_ranks():
                importlib.import_module(f"bench.{name}").main(
                    ["--quick", "--smoke", "--out-dir", str(out), "--figure",
                     str(out / f"{name}.png"), *extra])
        finally:
            torch.set_num_threads(threads)  # bench/throughput.py pins it to 1
        _check(name, out)
    return out


def _load(results: Path, name: str) -> Dict:
    with open(results / f"{name}.json") as f:
        return json.load(f)


def test_convergence_smoke(results: Path) -> None:
    data = _load(results, "convergence")
    (run,) = data["runs"]
    curves = run["curves"]
    iters = data["settings"]["iters"]
    for name in ("flush", "2bw"):
        train = {int(k): v for k, v in curves[name]["train"].items()}
        assert sorted(train) == list(range(1, iters + 1))
        assert all(math.isfinite(v) and 0 < v < 10 for v in train.values())
        assert curves[name]["valid"], name
    # batch 0 runs on the initial weights under both schedules: same data, same seeds,
    # so the first training loss must agree; 2BW's batch 1 still uses version 0, so
    # from iteration 2 on the curves may differ
    assert curves["2bw"]["train"]["1"] == pytest.approx(curves["flush"]["train"]["1"], rel=1e-5)
    s = run["summary"]
    last = str(s["final_iteration"])
    assert s["final_valid_flush"] == curves["flush"]["valid"][last]
    assert s["final_valid_2bw"] == curves["2bw"]["valid"][last]
    assert s["relative_difference"] == pytest.approx(
        (s["final_valid_2bw"] - s["final_valid_flush"]) / s["final_valid_flush"])
    assert data["bert_mnli"]["results"] == "bench/results/convergence_bert.json"


def test_first_reach_interpolates() -> None:
    from bench.convergence import first_reach

    curve = {10: 5.0, 20: 4.0, 30: 3.0}
    assert first_reach(curve, 3.5) == pytest.approx(25.0)
    assert first_reach(curve, 6.0) == 10.0
    assert first_reach(curve, 2.0) is None


def test_memory_smoke(results: Path) -> None:
    data = _load(results, "memory")
    rows = data["rows"]
    assert data["formula_mismatches"] == []
    by = {(r["schedule"], r["recompute"], r["stage"]): r for r in rows}
    (cfg,) = data["configs"]
    d, m = cfg["d"], cfg["m"]
    assert {k[0] for k in by} == {"none", "gpipe", "flush", "2bw"}
    for (s, rc, stage), r in by.items():
        assert r["weight_versions"] == (2 if s == "2bw" else 1), (s, rc, stage)
        expected = {"none": 1, "gpipe": m, "flush": min(d - stage, m),
                    "2bw": min(d - stage, m)}[s]
        assert r["peak_in_flight"] == expected, (s, rc, stage)
        # fp32 AdamW: two moments per parameter, no master copy
        assert r["master_bytes"] == 0
        assert r["optimizer_state_bytes"] == pytest.approx(
            2 * r["weight_bytes_per_version"], rel=0.01)
        if not rc:
            assert by[(s, True, stage)]["stash_bytes"] < r["stash_bytes"] / 5, (s, stage)
    # the last stage stashes the same per microbatch under every schedule
    last = {r["microbatch_stash_bytes"] for r in rows if r["stage"] == d - 1 and not r["recompute"]}
    assert len(last) == 1


def test_throughput_smoke(results: Path) -> None:
    data = _load(results, "throughput")
    syn = {r["schedule"]: r for r in data["synthetic"]}
    assert set(syn) == {"none", "gpipe", "flush", "2bw"}
    f_plus_b = data["forward_s"] + data["backward_s"]
    for s, r in syn.items():
        units = {"none": r["d"] * r["m"], "gpipe": r["m"] + r["d"] - 1,
                 "flush": r["m"] + r["d"] - 1, "2bw": r["m"]}[s]
        assert r["ideal_seconds_per_batch"] == pytest.approx(units * f_plus_b)
        # sleeping stages can be slower than ideal, never faster
        assert r["seconds_per_batch"] >= 0.95 * r["ideal_seconds_per_batch"], s
    # without pipelining the d stages take turns: clearly the slowest
    assert syn["none"]["samples_per_s"] < syn["2bw"]["samples_per_s"]
    assert {r["schedule"] for r in data["gpt"]} == {"none", "gpipe", "flush", "2bw"}
    assert data["cuda_gpt_345m"]["status"] == "skipped"


def test_results_page_regenerates(results: Path) -> None:
    from tools.make_results import build_page, main

    page_path = results / "RESULTS.md"  # beside the figures: links are plain file names
    assert main(["--results", str(results), "--output", str(page_path)]) == 0
    page = page_path.read_text()
    # regenerating from the same JSON gives the same bytes, and --check agrees
    assert build_page(results, page_path) == page
    assert main(["--results", str(results), "--output", str(page_path), "--check"]) == 0
    for name in ("convergence", "memory", "throughput"):
        data = _load(results, name)
        assert f"## {name}" in page
        assert data["command"] in page
        assert data["machine"]["date"] in page
        assert f"]({name}.png)" in page  # figure linked relative to the page
    conv = _load(results, "convergence")["runs"][0]["summary"]
    assert f"{conv['final_valid_flush']:.4f}" in page
    assert "does not have the fields" not in page  # every bench has its own renderer
    assert "## Headline numbers" in page
    assert "Not run yet" in page  # benches of others absent from this folder
    page_path.write_text(page + "edited by hand\n")
    assert main(["--results", str(results), "--output", str(page_path), "--check"]) == 1


def test_committed_results_page_is_current() -> None:
    """docs/RESULTS.md is what tools/make_results.py makes of bench/results/*.json."""
    from tools.make_results import DEFAULT_OUTPUT, DEFAULT_RESULTS, build_page

    if not DEFAULT_OUTPUT.is_file():
        pytest.skip("docs/RESULTS.md not generated yet")
    page = build_page(DEFAULT_RESULTS, DEFAULT_OUTPUT)
    assert DEFAULT_OUTPUT.read_text() == page, (
        "docs/RESULTS.md is stale: run `python tools/make_results.py`")
    # the two-schedule and the per-variant convergence JSON both render as intended
    assert "does not have the fields" not in page
    # every figure a committed result names is in the repository, so the page links it
    # the same way from any checkout (a /tmp path once made CI's page differ from ours)
    assert "outside the repository" not in page
    assert "is missing)" not in page


def test_a_figure_outside_the_repository_is_not_linked(tmp_path: Path) -> None:
    from tools.make_results import build_page

    results = tmp_path / "repo" / "bench" / "results"
    results.mkdir(parents=True)
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(b"png")
    (results / "x.json").write_text(json.dumps({"figures": [str(outside)], "value": 1}))
    page = build_page(results, tmp_path / "repo" / "docs" / "RESULTS.md")
    assert f"(figure `{outside}` is outside the repository: not linked)" in page
    assert "](" not in page.split("## x", 1)[1]


def _variant(final: float, rel: float, reach, spi, seconds) -> Dict:
    return {"final_valid": final, "relative_to_flush": rel, "reaches_flush_final_at": reach,
            "seconds_per_iteration": spi, "seconds_to_flush_final": seconds}


def _variant_payload() -> Dict:
    """A tiny convergence JSON in the per-variant format bench/convergence.py writes."""
    variants = {"flush": _variant(5.0, 0.0, 100.0, 0.5, 50.0),
                "2bw": _variant(5.1, 0.02, None, 0.45, None),
                "2bw+warmup": _variant(4.95, -0.01, 90.0, None, 44.0)}
    return {"bench": "convergence", "command": "PYTHONPATH=. python bench/convergence.py -x",
            "quick": True, "smoke": False,
            "settings": {"layers": 2, "hidden": 8, "heads": 2, "seq": 8, "mbs": 1, "m": 2,
                         "iters": 100, "vocab": 64},
            "depth": 1, "width": 1, "global_batch_size": 2, "lrs": [1e-3],
            "variants": list(variants), "warmup_iters": 10,
            "timing": {"depth": 4, "iterations": 3, "rounds": 1,
                       "seconds_per_iteration": {"flush": 0.5, "2bw": 0.45}},
            "data_source": "synthetic", "figures": ["docs/figures/none.png"],
            "runs": [{"lr": 1e-3, "summary": {"final_iteration": 100}, "variants": variants}],
            "bert_mnli": {"status": "TODO", "reason": "not part of this test"}}


def test_variant_format_renders_from_a_subfolder(tmp_path: Path) -> None:
    """bench/results/<group>/*.json become sections with the per-variant table."""
    from tools.make_results import build_page

    (tmp_path / "mitigations").mkdir()
    with open(tmp_path / "mitigations" / "convergence_x.json", "w") as f:
        json.dump(_variant_payload(), f)
    page = build_page(tmp_path, tmp_path / "RESULTS.md")
    assert "## mitigations_convergence_x" in page and "does not have the fields" not in page
    assert "mitigations/convergence_x.json`" in page
    assert "| 2bw | 5.1000 | +2.00% | not reached | 0.45 | not reached |" in page
    assert "| 2bw+warmup | 4.9500 | -1.00% | 90 | not timed (flush's, then 2bw's) | 44.0 |" \
        in page
    assert "seconds/iteration at d=4" in page
    head = [line for line in page.splitlines() if line.startswith("- mitigations_convergence_x")]
    assert len(head) == 1 and "2bw +2.00%; 2bw+warmup -1.00%" in head[0]
    assert "2bw+warmup at lr 0.001 by iteration 90 (44.0 s vs 50.0 s for Flush)" in head[0]


def test_variant_summary_time_to_the_loss_both_reach() -> None:
    """Flush ends lower; 2BW is faster per iteration but reaches its own final loss (the
    loss both reach) later in time than Flush does."""
    from bench.convergence import variant_summary

    runs = {"flush": {"valid": {100: 5.0, 200: 4.0, 300: 3.0}},
            "2bw": {"valid": {100: 5.5, 200: 4.5, 300: 4.0}}}
    out = variant_summary(runs, {"flush": 1.0, "2bw": 0.8}, warmup_iters=0)
    assert out["flush"]["speedup_at_common_target"] == pytest.approx(1.0)
    tbw = out["2bw"]
    assert tbw["reaches_flush_final_at"] is None and tbw["common_target"] == 4.0
    assert tbw["seconds_to_common_target"] == pytest.approx(300 * 0.8)
    assert tbw["flush_seconds_to_common_target"] == pytest.approx(200 * 1.0)
    assert tbw["speedup_at_common_target"] == pytest.approx(200 / 240)


def test_equal_time_budget_and_summary() -> None:
    """bench/equal_time.py: a run's iterations fill Flush's time; the warm-up variant's
    first fraction runs at Flush's speed; the summary finds when Flush's loss is reached."""
    from bench.equal_time import budget_iterations, modelled_seconds, summarize

    sec = {"flush": 0.2, "2bw": 0.16}
    assert budget_iterations("flush", 600, sec, 0.5) == (600, 0)
    assert budget_iterations("2bw", 600, sec, 0.5) == (750, 0)
    iters, warm = budget_iterations("2bw+warmup", 600, sec, 0.5)
    assert (iters, warm) == (666, 333)  # 120 s / 0.18 s, half of it under Flush
    assert modelled_seconds("2bw+warmup", iters, sec, warm) <= 600 * 0.2
    assert modelled_seconds("2bw+warmup", 100, sec, warm) == pytest.approx(100 * 0.2)
    with pytest.raises(ValueError, match="no measured time"):
        budget_iterations("2bw+dc", 600, sec, 0.5)
    curves = {"flush": {0: 6.0, 300: 5.0, 600: 4.0},
              "2bw": {0: 6.0, 300: 5.2, 600: 4.2, 750: 3.8}}
    plan = {"flush": {"train_iters": 600, "warmup_iters": 0},
            "2bw": {"train_iters": 750, "warmup_iters": 0}}
    out = summarize(curves, plan, sec)
    assert out["2bw"]["final_valid"] == 3.8
    assert out["2bw"]["reaches_flush_final_at"] == pytest.approx(600 + 150 * 0.2 / 0.4)
    assert out["2bw"]["speedup_to_flush_final"] == pytest.approx(
        600 * 0.2 / (out["2bw"]["reaches_flush_final_at"] * 0.16))
    assert out["flush"]["speedup_to_flush_final"] == 1.0
    # 2BW needs 675 iterations for Flush's 600: sooner only while 2BW is > 1.125x faster
    assert out["2bw"]["break_even_speed_ratio"] == pytest.approx(675 / 600)
    rounds = {"flush": [0.2, 0.2], "2bw": [0.16, 0.18]}
    per_round = summarize(curves, plan, sec, rounds)["2bw"]["speedup_to_flush_final_per_round"]
    assert per_round == pytest.approx([600 * 0.2 / (675 * 0.16), 600 * 0.2 / (675 * 0.18)])
    # Flush's noisy validation loss touched its final value before the end: both sides
    # are timed to their first reach, so Flush is 1.0 and 2BW is measured against 285.7
    dip = dict(curves, flush={0: 6.0, 300: 3.9, 600: 4.0})
    out = summarize(dip, plan, sec)
    flush_reach = 300 * 2.0 / 2.1
    assert out["flush"]["speedup_to_flush_final"] == pytest.approx(1.0)
    assert out["2bw"]["speedup_to_flush_final"] == pytest.approx(
        flush_reach * 0.2 / (out["2bw"]["reaches_flush_final_at"] * 0.16))
    assert out["2bw"]["break_even_speed_ratio"] == pytest.approx(
        out["2bw"]["reaches_flush_final_at"] / flush_reach)


def test_equal_time_break_even_of_the_warm_up() -> None:
    """The flush warm-up's first W iterations cost Flush's time whatever 2BW's speed: it
    is sooner iff (R - W) s_2bw < (N - W) s_flush; inside the warm-up the ratio is moot."""
    from bench.equal_time import break_even_ratio, modelled_seconds

    n, w, r = 600, 315, 612.6
    ratio = break_even_ratio("2bw+warmup", r, n, w)
    assert ratio == pytest.approx((r - w) / (n - w))
    s_flush = 0.2
    at_break_even = {"flush": s_flush, "2bw": s_flush / ratio}
    assert modelled_seconds("2bw+warmup", r, at_break_even, w) == pytest.approx(n * s_flush)
    assert break_even_ratio("2bw+warmup", 300, n, w) is None
    assert break_even_ratio("2bw+warmup", None, n, w) is None
    assert break_even_ratio("flush", 600, n, 0) is None

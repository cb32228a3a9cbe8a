"""bench/convergence_bert.py --smoke runs end to end: BERT pretraining with Flush and 2BW
on 2 gloo ranks, MNLI finetuning of each checkpoint, JSON, figure and results page.

Speed on a shared machine says little, so the assertions are on values: the first
training step of Flush and 2BW sees the same weights and data (identical losses), the
second differs (2BW's first update is delayed), accuracies are k / n of the sample
files, and the page renders the Table 1 rows from the JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO))
from tests.dist_utils import forked_ranks  # noqa: E402  (after the path)

pytestmark = pytest.mark.skipif(
    not ((DATA / "bert" / "vocab.txt").is_file() and (DATA / "glue" / "MNLI").is_dir()),
    reason="../shared/data (BERT vocab, MNLI sample) absent")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """bench/convergence_bert.py --smoke, its ``main`` called here: its ranks fork
    (``forked_ranks``), and no process of the bench's imports torch again."""
    from bench.convergence_bert import main

    out = tmp_path_factory.mktemp("bert_results")
    with forked_ranks():
        main(["--smoke", "--out-dir", str(out), "--figure", str(out / "convergence_bert.png"),
              "--work-dir", str(out / "work")])
    return out


def _load(out: Path) -> dict:
    with open(out / "convergence_bert.json") as f:
        return json.load(f)


def test_json_records_command_machine_and_figure(smoke: Path) -> None:
    data = _load(smoke)
    assert data["bench"] == "convergence_bert" and data["smoke"]
    assert data["command"].startswith("PYTHONPATH=. python bench/convergence_bert.py --smoke")
    for key in ("platform", "cpu_count", "torch", "date"):
        assert data["machine"][key], key
    assert (smoke / "convergence_bert.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "handful" in data["mnli_caveat"]


def test_flush_and_2bw_start_identically_then_differ(smoke: Path) -> None:
    curves = _load(smoke)["curves"]
    iters = curves["flush"]["train"]
    assert sorted(int(i) for i in iters) == list(range(1, data_iters(smoke) + 1))
    f1, t1 = curves["flush"]["train"]["1"], curves["2bw"]["train"]["1"]
    # same seeds, data order and initial weights: batch 1 is the same computation
    assert f1["lm loss"] == pytest.approx(t1["lm loss"], rel=1e-6)
    assert f1["sop loss"] == pytest.approx(t1["sop loss"], rel=1e-6)
    # later batches: 2BW runs one weight version behind (version max(t-2, 0)), so the
    # curves must part (the very first step may have lr 0 from the warm-up)
    later = [it for it in iters if int(it) > 1]
    assert any(curves["flush"]["train"][it]["lm loss"]
               != pytest.approx(curves["2bw"]["train"][it]["lm loss"], rel=1e-9)
               for it in later)
    summary = _load(smoke)["summary"]
    assert summary["final_valid_lm_flush"] > 0 and summary["final_valid_lm_2bw"] > 0
    rel = (summary["final_valid_lm_2bw"] - summary["final_valid_lm_flush"]) \
        / summary["final_valid_lm_flush"]
    assert summary["relative_difference_lm"] == pytest.approx(rel)


def data_iters(out: Path) -> int:
    return _load(out)["settings"]["iters"]


def test_mnli_table_has_every_schedule_pair_and_valid_accuracies(smoke: Path) -> None:
    data = _load(smoke)
    rows = data["mnli_table"]
    pairs = {(r["pretraining_schedule"], r["finetuning_schedule"]) for r in rows}
    assert pairs == {(p, f) for p in ("flush", "2bw") for f in ("flush", "2bw")}
    sizes = {"dev_matched": 5, "dev_mismatched": 5, "sample_dev_matched_16col": 11}
    for r in rows:
        for name, n in sizes.items():
            assert 0.0 <= r[name] <= 1.0 and abs(r[name] * n - round(r[name] * n)) < 1e-9
    for run in data["finetuning"].values():
        assert run["examples"]["train"] == 6
        assert run["iterations"] == data["settings"]["ft_epochs"] * 3  # 6 rows / batch 2


def test_results_page_shows_the_bert_table(smoke: Path) -> None:
    from tools.make_results import build_page

    page = build_page(smoke, smoke / "RESULTS.md")
    assert "## convergence_bert" in page
    assert "](convergence_bert.png)" in page
    summary = _load(smoke)["summary"]
    assert f"{summary['final_valid_lm_flush']:.4f}" in page
    assert "handful" in page

"""Memory accounting read from the executor's counters (d=4, m=8, float64 tiny GPT).

Paper §3.1: with 1F1B (flush, 2bw) stage s holds at most d - s in-flight microbatches,
GPipe holds all m; 2BW keeps two weight versions, the others one; with recomputation
only the stage input (and the microbatch's token ids) is stashed.
"""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

D, M = 4, 8
INPUT_BYTES = 16 * 2 * 32 * 8      # [seq, micro batch, hidden] float64
DATA_BYTES = 2 * 17 * 8            # token ids of one microbatch: [micro batch, seq + 1] int64


def _argv(schedule: str, *extra: str):
    return TINY + ["--pipeline-model-parallel-size", str(D), "--pipeline-schedule", schedule,
                   "--global-batch-size", str(2 * M), "--train-iters", "3", *extra]


@pytest.fixture(scope="module")
def runs():
    configs = [(s, _argv(s), None) for s in ("none", "gpipe", "flush", "2bw")]
    configs += [(f"{s}_recompute", _argv(s, "--recompute-activations"), None)
                for s in ("gpipe", "flush", "2bw")]
    results = run_distributed(train_configs, D, args=(configs,), timeout=600)
    return {name: {r["stage"]: r for r in results[-1][name]["memory"]["per_rank"]}
            for name, _, _ in configs}


def test_in_flight_microbatches_match_paper(runs):
    for s in range(D):
        assert runs["flush"][s]["peak_in_flight"] == D - s
        assert runs["2bw"][s]["peak_in_flight"] == D - s
        assert runs["gpipe"][s]["peak_in_flight"] == M
        assert runs["none"][s]["peak_in_flight"] == 1


def test_weight_versions(runs):
    for s in range(D):
        assert runs["2bw"][s]["peak_weight_versions"] == 2
        for name in ("none", "gpipe", "flush"):
            assert runs[name][s]["peak_weight_versions"] == 1
        assert runs["2bw"][s]["peak_weight_bytes"] == 2 * runs["flush"][s]["peak_weight_bytes"]


def test_stashed_bytes_scale_with_in_flight_count(runs):
    for s in range(D):
        flush, gpipe = runs["flush"][s], runs["gpipe"][s]
        assert flush["peak_stashed_activation_bytes"] > 0
        # every microbatch stashes the same bytes, so the peaks are in ratio (d - s) : m
        assert flush["peak_stashed_activation_bytes"] * M == gpipe["peak_stashed_activation_bytes"] * (D - s)
        assert runs["2bw"][s]["peak_stashed_activation_bytes"] == flush["peak_stashed_activation_bytes"]


def test_recompute_stashes_only_stage_inputs(runs):
    for name, in_flight in (("flush", lambda s: D - s), ("2bw", lambda s: D - s),
                            ("gpipe", lambda s: M)):
        for s in range(D):
            per_mb = DATA_BYTES + (INPUT_BYTES if s > 0 else 0)
            got = runs[f"{name}_recompute"][s]
            assert got["peak_in_flight"] == in_flight(s)
            assert got["peak_stashed_activation_bytes"] == in_flight(s) * per_mb, (name, s)
            assert got["peak_stashed_activation_bytes"] < runs[name][s]["peak_stashed_activation_bytes"]

"""--overlap-param-gather on spawned gloo ranks: the distributed optimizer's weight
all-gathers stay in flight after the step and each transformer layer of the next forward
pass waits for its own buckets; training gives the same bits as waiting at the step
(flush, 2BW, bf16 masters, layer recomputation with evaluation, an untied output layer,
two pipelines of two stages with the tied word embedding), and the gathers really are
waited for piecewise inside the forward pass.

A layer that read a bucket without waiting would read, outside this rank's own pieces,
the weights from before the step (the gathered values are written only when waited
for), so a missed wait changes the losses rather than racing."""
from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

# small buckets: a layer of the tiny GPT (about 12.6k parameters) spans several
SMALL = ["--ddp-bucket-size", "4000"]
DIST = ["--use-distributed-optimizer", *SMALL]
OVERLAP = [*DIST, "--overlap-param-gather"]


def _argv(schedule: str, *extra: str):
    # no clipping: the update is elementwise (test_distributed_optimizer.py explains)
    return TINY + ["--pipeline-schedule", schedule, "--clip-grad", "0", *extra]


def _bf16(argv):
    return [a for a in argv if a != "--fp64"] + ["--bf16"]


def _counting_worker(rank: int, world: int, configs):
    """``train_configs``, counting per configuration the waits that found buckets in
    flight: by a layer's hook (a bucket list) or for everything at once (None)."""
    from megatron.optimizer import sharding

    original = sharding.WeightGather.wait
    counts = {"piecewise": 0, "all": 0}

    def counting(self, buckets=None):
        before = len(self._pending)
        original(self, buckets)
        if len(self._pending) < before:
            counts["all" if buckets is None else "piecewise"] += 1

    sharding.WeightGather.wait = counting
    out = {}
    try:
        for config in configs:
            counts.update(piecewise=0, all=0)
            out.update(train_configs(rank, world, [config]))
            out[config[0]]["waits"] = dict(counts)
    finally:
        sharding.WeightGather.wait = original
    return out


@pytest.fixture(scope="module")
def runs():
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "2", "--eval-interval", "2",
                 "--untie-embeddings-and-output-weights"]
    configs = [
        ("flush", _argv("flush", *DIST), None),
        ("flush_overlap", _argv("flush", *OVERLAP), None),
        ("2bw", _argv("2bw", *DIST), None),
        ("2bw_overlap", _argv("2bw", *OVERLAP), None),
        ("bf16", _bf16(_argv("flush", *DIST)), None),
        ("bf16_overlap", _bf16(_argv("flush", *OVERLAP)), None),
        ("recompute", _argv("flush", *DIST, *recompute), None),
        ("recompute_overlap", _argv("flush", *OVERLAP, *recompute), None),
    ]
    return run_distributed(_counting_worker, 2, args=(configs,), timeout=600)


@pytest.mark.parametrize("name", ["flush", "2bw", "bf16", "recompute"])
def test_overlapped_gathers_train_to_the_same_bits(runs, name):
    for rank in (0, 1):
        a, b = runs[rank][name], runs[rank][f"{name}_overlap"]
        assert sorted(a["losses"]) == [1, 2, 3, 4]
        assert a["losses"] == b["losses"]
        assert a["grad_norms"] == b["grad_norms"]
        assert a["eval"] == b["eval"]
        assert not any(a["skipped"]) and not any(b["skipped"])


@pytest.mark.parametrize("name", ["flush", "2bw", "bf16", "recompute"])
def test_layers_wait_for_their_own_buckets_inside_the_forward(runs, name):
    for rank in (0, 1):
        waited = runs[rank][f"{name}_overlap"]["waits"]
        # every step but the last leaves gathers for the next forward's layers (the last
        # one's are waited for at the end of training); several per step
        assert waited["piecewise"] >= 2 * 3, waited
        # without the flag every gather is waited for at the step, all at once
        assert runs[rank][name]["waits"]["piecewise"] == 0, runs[rank][name]["waits"]


def test_two_pipelines_of_two_stages_with_the_tied_embedding():
    """d=2, w=2 (4 ranks): the last stage reads its copy of the tied word embedding
    outside any layer (the head's matrix), so its bucket is waited for before the
    forward pass starts."""
    configs = [(name, _argv("2bw", "--pipeline-model-parallel-size", "2", *extra), None)
               for name, extra in (("dist", DIST), ("overlap", OVERLAP))]
    res = run_distributed(_counting_worker, 4, args=(configs,), timeout=600)
    for rank in range(4):
        assert res[rank]["dist"]["losses"] == res[rank]["overlap"]["losses"]
        assert res[rank]["dist"]["grad_norms"] == res[rank]["overlap"]["grad_norms"]
        assert res[rank]["overlap"]["waits"]["piecewise"] >= 3
    assert sorted(res[-1]["overlap"]["losses"]) == [1, 2, 3, 4]


def test_the_flag_needs_the_distributed_optimizer(monkeypatch, capsys):
    from megatron.arguments import parse_and_validate
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        parse_and_validate(_argv("flush", "--overlap-param-gather"))
    err = capsys.readouterr().err
    assert "--overlap-param-gather" in err and "--use-distributed-optimizer" in err
    with pytest.raises(SystemExit):
        parse_and_validate(_argv("flush", "--ddp-bucket-size", "0"))
    assert "--ddp-bucket-size" in capsys.readouterr().err

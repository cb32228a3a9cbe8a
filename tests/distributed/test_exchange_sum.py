"""Sums by direct exchange (``megatron.exchange``) on gloo ranks: the same sum on every
member bit for bit, in group-rank order; rounds in sequence with receives posted ahead
and members arriving in any order; nothing left in flight; and trainings that use it
for the tied-embedding sum and the optimizer's agreement equal those that use
all_reduce."""
from __future__ import annotations

import time

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY


def _contribution(rank: int, rnd: int) -> torch.Tensor:
    # float32 values of very different magnitude: a different order of the additions
    # would change the rounded result
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return torch.randn(64, generator=g) * (10.0 ** (4 * rank))


def _rounds(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron.exchange import ExchangeSum

    group = dist.new_group(list(range(world)))
    ex = ExchangeSum(group, (64,), torch.float32, torch.device("cpu"))
    sums, waited = [], []
    ex.post_receives()  # round 0 posted ahead; the others when started
    for rnd in range(4):
        # a different member arrives last each round
        time.sleep(0.05 if rank == rnd % world else 0.0)
        t = _contribution(rank, rnd)
        pending = ex.start(t)
        t.fill_(float("nan"))  # the caller may reuse its tensor at once: a copy was sent
        start = time.perf_counter()
        pending.wait()
        waited.append(time.perf_counter() - start)
        sums.append(t.clone())
    ex.drain()
    return {"sums": sums, "posted": ex.num_posted, "waited": waited}


def test_every_member_gets_the_same_sum_in_rank_order() -> None:
    results = run_distributed(_rounds, 3, timeout=120)
    for rnd in range(4):
        expected = _contribution(0, rnd)
        for r in range(1, 3):
            expected = expected + _contribution(r, rnd)
        for res in results:
            assert torch.equal(res["sums"][rnd], expected), (rnd, res["sums"][rnd] - expected)
    assert [res["posted"] for res in results] == [0, 0, 0]
    # round 3: rank 0 arrived 50 ms after the others; they waited for its message, it
    # found theirs already there
    assert min(results[1]["waited"][3], results[2]["waited"][3]) > 0.03
    assert results[0]["waited"][3] < min(results[1]["waited"][3], results[2]["waited"][3])


def _shape_check(rank: int, world: int) -> str:
    import torch.distributed as dist

    from megatron.exchange import ExchangeSum

    ex = ExchangeSum(dist.new_group(list(range(world))), (4,), torch.float64,
                     torch.device("cpu"))
    with pytest.raises(ValueError, match=r"built for \(4,\) torch.float64"):
        ex.start(torch.zeros(4, dtype=torch.float32))
    return "ok"


def test_wrong_tensor_is_refused_before_anything_is_sent() -> None:
    assert run_distributed(_shape_check, 2, timeout=60) == ["ok", "ok"]


def _train_both_ways(rank: int, world: int, schedule: str) -> dict:
    import pretrain_gpt
    from megatron.exchange import ExchangeSum
    from megatron.training import pretrain

    out, starts = {}, []
    original = ExchangeSum.start

    def counting_start(self, tensor):
        starts.append(tuple(tensor.shape))
        return original(self, tensor)

    ExchangeSum.start = counting_start
    for enabled in (True, False):
        ExchangeSum.enabled = enabled
        try:
            result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                              pretrain_gpt.forward_step,
                              argv=TINY + ["--pipeline-model-parallel-size", "2",
                                           "--distributed-backend", "gloo",
                                           "--pipeline-schedule", schedule,
                                           "--train-iters", "5", "--eval-iters", "0"])
        finally:
            ExchangeSum.enabled = True
        out[enabled] = ([r.grad_norm for r in result.reports],
                        {k: v["lm loss"] for k, v in result.losses.items()})
        out[f"starts_{enabled}"], starts[:] = list(starts), []
    ExchangeSum.start = original
    return out


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_training_with_exchanges_equals_training_with_all_reduce(schedule: str) -> None:
    # two members: a + b either way, so the runs agree bit for bit
    for res in run_distributed(_train_both_ways, 2, args=(schedule,), timeout=180):
        assert res[True] == res[False]
        assert len(res[True][0]) == 5
        # exchanged: per batch the agreement (6 numbers: gradient sum of squares,
        # non-finite tensors, zeros, the loss flag, the weights' sum of squares, the
        # loss tokens) and the tied embedding (padded vocabulary 128 x hidden 32);
        # all_reduce otherwise
        assert sorted(res["starts_True"]) == [(6,)] * 5 + [(128, 32)] * 5
        assert res["starts_False"] == []

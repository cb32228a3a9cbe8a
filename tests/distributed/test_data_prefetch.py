"""Microbatches read ahead during waits reach the forward passes unchanged and in order.

The engine reads upcoming microbatches of a segment while a receive or a step's
all-reduce is in flight (``PipelineEngine._prefetch_during``).  Two gloo ranks, d=2,
mock data: every forward on every stage must get exactly microbatch k of the data
stream (samples k*b .. k*b+b-1), no sample may be read that the schedule does not use,
and the read-ahead must actually happen (stage 0 waits for gradients under 1F1B).
"""
from __future__ import annotations

import contextlib
import io
from typing import Dict, List

import pytest

from tests.dist_utils import run_distributed

MBS, M, ITERS = 2, 4, 3
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", str(MBS),
        "--global-batch-size", str(MBS * M), "--train-iters", str(ITERS), "--lr", "1e-3",
        "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "0",
        "--num-workers", "0", "--pipeline-model-parallel-size", "2",
        "--distributed-backend", "gloo", "--seed", "5"]


def _worker(rank: int, world: int, schedule: str) -> Dict[str, object]:
    import torch

    import pretrain_gpt
    from megatron.pipeline import engine as engine_mod
    from megatron.training import pretrain

    seen: List[torch.Tensor] = []
    read_ahead = [0]
    original = engine_mod.PipelineEngine._prefetch_during

    def counting(self, work):
        seg = self._seg
        before = len(seg.prefetched) if seg is not None else 0
        original(self, work)
        read_ahead[0] += (len(seg.prefetched) if seg is not None else 0) - before

    def recording_forward_step(data_iterator, model):
        data = next(data_iterator)
        seen.append(data["text"].clone())
        return pretrain_gpt.forward_step(iter([data]), model)

    engine_mod.PipelineEngine._prefetch_during = counting
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                     recording_forward_step,
                     argv=ARGV + ["--pipeline-schedule", schedule])
    finally:
        engine_mod.PipelineEngine._prefetch_during = original
    return {"seen": torch.stack(seen), "read_ahead": read_ahead[0]}


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_read_ahead_microbatches_arrive_in_order(schedule):
    import torch

    from megatron.data.gpt_dataset import MockGPTDataset

    results = run_distributed(_worker, 2, args=(schedule,), timeout=120)
    ds = MockGPTDataset(ITERS * MBS * M, 16, 129, 5)  # --vocab-size 128: 129 ids
    expected = torch.stack([
        torch.stack([torch.from_numpy(ds[k * MBS + i]["text"]) for i in range(MBS)])
        for k in range(ITERS * M)])
    for rank, res in enumerate(results):
        assert res["seen"].shape == expected.shape, f"rank {rank} read a different count"
        assert torch.equal(res["seen"], expected), f"rank {rank}: microbatches out of order"
    # stage 0 waits for each gradient under 1F1B and reads the next microbatches then
    assert results[0]["read_ahead"] > 0

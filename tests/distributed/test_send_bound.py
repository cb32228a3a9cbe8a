"""A long 2BW segment does not keep every tensor it sent: the engine bounds the sends in
flight (gloo reports a send complete only once it is waited on)."""
from __future__ import annotations

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY


def _peak_pending(rank: int, world: int) -> int:
    import pretrain_gpt
    from megatron.pipeline import p2p
    from megatron.training import pretrain

    peak = [0]
    original = p2p.P2PCommunicator._reap

    def reap(self) -> None:
        original(self)
        peak[0] = max(peak[0], self.num_pending)

    p2p.P2PCommunicator._reap = reap
    try:
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step,
                 argv=TINY + ["--pipeline-model-parallel-size", "2", "--distributed-backend",
                              "gloo", "--pipeline-schedule", "2bw", "--train-iters", "8",
                              "--eval-iters", "0"])
    finally:
        p2p.P2PCommunicator._reap = original
    return peak[0]


def test_sends_in_flight_stay_bounded_over_a_2bw_segment() -> None:
    # 8 batches x 4 microbatches in one segment: 32 sends per stage, all of them kept
    # until the segment's end before the bound
    assert run_distributed(_peak_pending, 2, timeout=120) == [4, 4]

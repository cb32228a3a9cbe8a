"""Receives posted ahead of their action get the same messages, in the same order.

``P2PCommunicator(prepost_receives=True)`` (the gloo default) posts each channel's
next receive as soon as the one before it completed, so a receive can be in flight
across several forward and backward passes.  Three gloo ranks walk the real action
lists of every schedule (d=3, m=4, two segments: the second checks a new segment starts
clean), sending tensors that name (segment, microbatch, kind, sender) and checking
what each receive gets, with receives posted ahead and posted when needed.
"""
from __future__ import annotations

from typing import Dict, List

import pytest

from tests.dist_utils import run_distributed

D, M, BATCHES = 3, 4, 2


def _walk(rank: int, world: int, schedule: str, prepost: bool) -> Dict[str, object]:
    import torch

    from megatron.pipeline.p2p import P2PCommunicator
    from megatron.pipeline.schedules import Op, build_schedule

    p2p = P2PCommunicator(rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None,
                          (2, 3), torch.float32, torch.device("cpu"), prepost_receives=prepost)
    posted_ahead = 0
    got: List[List[float]] = []
    for segment in range(2):
        mine = build_schedule(schedule, D, M, BATCHES)[rank]
        p2p.expect_receives(sum(a.op is Op.RECV_ACT for a in mine),
                            sum(a.op is Op.RECV_GRAD for a in mine))
        posted_ahead = max(posted_ahead, p2p.num_posted_receives)
        for a in mine:
            if a.op not in (Op.SEND_ACT, Op.SEND_GRAD, Op.RECV_ACT, Op.RECV_GRAD):
                continue
            key = float(segment * 1000 + a.batch * 100 + a.microbatch)
            if a.op is Op.SEND_ACT:
                p2p.send_forward(torch.tensor([key, 1.0, rank]).expand(2, 3))
            elif a.op is Op.SEND_GRAD:
                p2p.send_backward(torch.tensor([key, 2.0, rank]).expand(2, 3))
            elif a.op is Op.RECV_ACT:
                msg = p2p.recv_forward()[0].tolist()
                got.append(msg)
                assert msg == [key, 1.0, rank - 1], (a, msg)
            elif a.op is Op.RECV_GRAD:
                msg = p2p.recv_backward()[0].tolist()
                got.append(msg)
                assert msg == [key, 2.0, rank + 1], (a, msg)
        p2p.wait_all()
        assert p2p.num_posted_receives == 0
    return {"received": len(got), "posted_ahead": posted_ahead}


@pytest.mark.parametrize("prepost", [True, False], ids=["posted-ahead", "posted-when-needed"])
@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_receives_match_their_actions(schedule: str, prepost: bool) -> None:
    out = run_distributed(_walk, D, args=(schedule, prepost), timeout=60)
    # stage 0 receives gradients only, the last stage activations only, the middle both
    assert [o["received"] for o in out] == [2 * BATCHES * M, 4 * BATCHES * M, 2 * BATCHES * M]
    assert [o["posted_ahead"] for o in out] == ([1, 2, 1] if prepost else [0, 0, 0])


def _leftover(rank: int, world: int) -> str:
    import torch

    from megatron.pipeline.p2p import P2PCommunicator

    p2p = P2PCommunicator(None if rank == 0 else 0, 1 if rank == 0 else None, (2,),
                          torch.float32, torch.device("cpu"), prepost_receives=True)
    if rank == 0:
        p2p.expect_receives(0, 1)  # a segment that fails before its receive
        try:
            p2p.expect_receives(0, 1)
        except RuntimeError as exc:
            message = str(exc)
        else:
            message = "no error"
        p2p.send_forward(torch.zeros(2))  # let rank 1 finish
        p2p.wait_all()
        p2p.recv_backward()  # the receive posted by the "failed" segment
        return message
    p2p.expect_receives(1, 0)
    p2p.recv_forward()
    p2p.send_backward(torch.zeros(2))  # completes rank 0's outstanding receive
    p2p.wait_all()
    return "ok"


def test_a_new_segment_refuses_receives_left_by_a_failed_one() -> None:
    out = run_distributed(_leftover, 2, timeout=60)
    assert "still outstanding" in out[0], out[0]


def test_receives_are_posted_ahead_only_on_gloo_with_a_core_per_thread() -> None:
    from megatron.pipeline.p2p import prepost_pays

    assert prepost_pays("gloo", local_ranks=2, threads_per_rank=1, cores=2)
    assert prepost_pays("gloo", local_ranks=2, threads_per_rank=4, cores=16)
    assert not prepost_pays("gloo", local_ranks=4, threads_per_rank=1, cores=2)
    assert not prepost_pays("gloo", local_ranks=2, threads_per_rank=2, cores=2)
    assert not prepost_pays("nccl", local_ranks=1, threads_per_rank=1, cores=64)


ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
        "--num-workers", "0", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "2bw", "--distributed-backend", "gloo", "--seed", "5"]


def _banner(rank: int, world: int) -> str:
    import contextlib
    import io

    import torch

    import pretrain_gpt
    from megatron.training import pretrain

    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=ARGV)
    return out.getvalue()


def test_the_run_says_how_it_posts_receives() -> None:
    """Two single-threaded gloo ranks post ahead where the machine has two cores; the
    banner says which way the run went."""
    from megatron.pipeline.p2p import available_cores

    text = run_distributed(_banner, 2, timeout=120)[1]
    expected = "ahead" if available_cores() >= 2 else "when needed"
    assert f"receives posted {expected}" in text, text[-2000:]

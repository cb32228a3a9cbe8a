"""A process that trains several times (a sweep, a notebook, this test suite) does not
pile up process groups: each pretrain() gives its groups, threads and sockets back."""
from __future__ import annotations

import os
from typing import List

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="counts threads and file descriptors through /proc")


def _train_three_times(rank: int, world: int) -> List[tuple]:
    import pretrain_gpt
    from megatron.training import pretrain

    argv = TINY + ["--pipeline-model-parallel-size", "2", "--distributed-backend", "gloo",
                   "--train-iters", "1", "--eval-iters", "0"]
    counts = []
    for _ in range(3):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=argv)
        counts.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
    return counts


def test_pretrain_gives_its_process_groups_back() -> None:
    for counts in run_distributed(_train_three_times, 2, timeout=120):
        # before the fix each run left 15 threads and 23 descriptors behind (5 groups)
        assert counts[2] == counts[0], counts

"""--profile on two pipeline stages: each profiled rank writes its trace of the window
and the run ends cleanly (the profiler's results, left to the garbage collector until
after the process groups were destroyed, crashed a profiled rank with SIGSEGV)."""
from __future__ import annotations

import os

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY


def _profiled_run(rank: int, world: int, out: str):
    import pretrain_gpt
    from megatron.training import pretrain

    result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                      pretrain_gpt.forward_step,
                      argv=TINY + ["--pipeline-model-parallel-size", "2",
                                   "--distributed-backend", "gloo", "--pipeline-schedule",
                                   "2bw", "--train-iters", "5", "--eval-iters", "0",
                                   "--profile", "--use-pytorch-profiler",
                                   "--profile-step-start", "1", "--profile-step-end", "3",
                                   "--profile-ranks", "0", "1", "--profile-dir", out])
    return result.iteration


def test_both_stages_write_their_traces_and_exit_cleanly(tmp_path) -> None:
    out = str(tmp_path / "prof")
    assert run_distributed(_profiled_run, 2, args=(out,), timeout=120) == [5, 5]
    names = sorted(os.listdir(out))
    assert len(names) == 2 and all(n.endswith(".pt.trace.json") for n in names), names
    assert any("_rank0." in n for n in names) and any("_rank1." in n for n in names)

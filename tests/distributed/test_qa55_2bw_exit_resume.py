"""2BW stopped in the middle of training by --exit-duration-in-mins (the SIGTERM path:
agreed at a drain point, saved, 'stopped at iteration N'): the checkpoint holds both
weight versions, so the resumed run's losses equal the uninterrupted run's, bit for bit
(float32, dropout on).  test_resume.py covers the --exit-interval stop."""
from __future__ import annotations

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs


def _argv(*extra: str):
    base = [a for a in TINY if a != "--fp64"]
    for flag, value in (("--hidden-dropout", "0.1"), ("--attention-dropout", "0.1"),
                        ("--train-iters", "5"), ("--num-layers", "2")):
        base[base.index(flag) + 1] = value
    return base + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw", *extra]


def test_2bw_stopped_by_the_clock_resumes_bit_identical(tmp_path):
    ckpt = str(tmp_path / "ck")
    configs = [("full", _argv(), None),
               # the limit has passed at the first check: stops after the first segment
               ("first", _argv("--save", ckpt, "--exit-duration-in-mins", "0.00001"), None),
               ("second", _argv("--save", ckpt, "--load", ckpt), None)]
    res = run_distributed(train_configs, 2, args=(configs,), timeout=300)[-1]
    first, second, full = res["first"], res["second"], res["full"]
    stopped = first["iteration"]
    assert first["exited_early"] and 1 <= stopped < 5, first["iteration"]
    assert sorted(second["losses"]) == list(range(stopped + 1, 6))
    for t, loss in first["losses"].items():
        assert loss == full["losses"][t]
    for t, loss in second["losses"].items():
        assert loss == full["losses"][t], (t, loss, full["losses"][t])
    assert second["versions"] == full["versions"][stopped:]

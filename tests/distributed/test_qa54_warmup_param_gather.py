"""--2bw-mitigation warmup with --overlap-param-gather at w=2 (QA pass 54).

At the end of the flush warm-up the engine copies the newest weights W(N) into the
second buffer, where 2BW's batch N+1 reads them.  With the last warm-up step's weight
all-gathers still in flight, that copy took, outside this rank's own pieces, the weights
from before the step: the replicas then trained on different weights.  Overlapped or
not, the gathers must give the same run."""
from __future__ import annotations

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs


def _argv(*extra: str):
    return TINY + ["--pipeline-schedule", "2bw", "--clip-grad", "0", "--log-params-norm",
                   "--2bw-mitigation", "warmup", "--2bw-flush-warmup-iters", "1",
                   "--train-iters", "3", "--use-distributed-optimizer",
                   "--ddp-bucket-size", "3000", *extra]


def test_warmup_end_waits_for_the_weight_gathers():
    configs = [("waited", _argv(), None),
               ("overlap", _argv("--overlap-param-gather"), None)]
    res = run_distributed(train_configs, 2, args=(configs,), timeout=300)
    for r in res:
        assert r["overlap"]["losses"] == r["waited"]["losses"]
        assert r["overlap"]["params_norms"] == r["waited"]["params_norms"]
    # the replicas hold the same weights
    assert res[0]["overlap"]["params_norms"] == res[1]["overlap"]["params_norms"]

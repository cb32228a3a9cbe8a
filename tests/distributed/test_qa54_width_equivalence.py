"""Two parallel pipelines (w=2) train as one (w=1) at the same global batch, in float64
(QA pass 54): losses, gradient norms (clipping on) and the norms of the weights each
step used, under 2BW with layer recomputation and gradient buckets of a few thousand
parameters (the plain reducer's buckets: the word embedding, tied to the output layer
on the one stage, shares one), and with the distributed optimizer leaving its weight
gathers in flight.  Gradient accumulation: 2 microbatches per replica against 4."""
from __future__ import annotations

import math

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
              "--recompute-num-layers", "1"]


def _argv(*extra: str):
    return TINY + ["--pipeline-schedule", "2bw", "--log-params-norm", "--train-iters", "3",
                   "--ddp-bucket-size", "3000", *extra]


CONFIGS = [("recompute", _argv(*_RECOMPUTE), None),
           ("sharded", _argv("--use-distributed-optimizer", "--overlap-param-gather"), None)]


def _close(a, b):
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-12)
                                    for x, y in zip(a, b))


def test_two_replicas_equal_one():
    one = run_distributed(train_configs, 1, args=(CONFIGS,), timeout=300)[0]
    two = run_distributed(train_configs, 2, args=(CONFIGS,), timeout=300)
    for name, _, _ in CONFIGS:
        ref = one[name]
        assert sorted(ref["losses"]) == [1, 2, 3]
        for r in two:
            got = r[name]
            assert _close([got["losses"][t] for t in sorted(got["losses"])],
                          [ref["losses"][t] for t in sorted(ref["losses"])]), name
            assert _close(got["grad_norms"], ref["grad_norms"]), name
            assert _close(got["params_norms"], ref["params_norms"]), name

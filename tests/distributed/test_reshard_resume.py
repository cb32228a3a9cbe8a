"""Train at one (t, d, w) layout, save, reshard with tools/checkpoint_util.py, resume at
another: the resumed losses equal an uninterrupted run at the new layout (float64, no
dropout; the model's initial weights do not depend on the layout, so both start from the
same state).  This holds only if the optimizer moments, the LR schedule, the consumed
samples, the engine's iteration and -- under 2BW -- the shadow weight version all cross
the layout change."""
from __future__ import annotations

import os

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs
from tools.checkpoint_util import convert, read_checkpoint

# (schedule, source (t, d, w), target (t, d, w)); sources run on 2 ranks, targets on 4.
CASES = [("flush", (1, 2, 1), (2, 1, 2)),   # pp 2 -> 1 with a tp change and a dp change
         ("2bw", (1, 1, 2), (2, 2, 1))]     # pp 1 -> 2 with a tp change


def _argv(schedule, layout, *extra):
    t, d, _ = layout
    base = list(TINY)
    base[base.index("--train-iters") + 1] = "6"
    # a decaying LR: a scheduler that restarted would change the resumed losses
    base[base.index("--lr-decay-style") + 1] = "cosine"
    return base + ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
                   str(d), "--pipeline-schedule", schedule, "--min-lr", "1e-4", *extra]


def test_reshard_then_resume_matches_uninterrupted_run(tmp_path):
    first = [(f"{s}-first", _argv(s, src, "--save", str(tmp_path / f"{s}-src"),
                                  "--exit-interval", "3"), None)
             for s, src, _ in CASES]
    run_distributed(train_configs, 2, args=(first,), timeout=300)
    for s, _, (t, d, w) in CASES:
        out = convert(str(tmp_path / f"{s}-src"), str(tmp_path / f"{s}-dst"), tp=t, pp=d, dp=w)
        assert os.path.basename(out) == "iter_0000003"
        ckpt = read_checkpoint(str(tmp_path / f"{s}-dst"))
        assert (ckpt.tensor, ckpt.pipeline) == (t, d)
        payload = ckpt.payloads[(0, 0)]
        assert payload["consumed_train_samples"] == 24 and payload["optimizer"] is not None
        assert (payload["model_shadow"] is not None) == (s == "2bw")
    second = []
    for s, _, dst in CASES:
        second.append((f"{s}-full", _argv(s, dst), None))
        second.append((f"{s}-resumed", _argv(s, dst, "--load", str(tmp_path / f"{s}-dst")), None))
    res = run_distributed(train_configs, 4, args=(second,), timeout=300)[-1]
    for s, _, _ in CASES:
        full, resumed = res[f"{s}-full"]["losses"], res[f"{s}-resumed"]["losses"]
        assert sorted(resumed) == [4, 5, 6], (s, sorted(resumed))
        for it in (4, 5, 6):
            assert abs(resumed[it] - full[it]) < 1e-10, (s, it, resumed[it], full[it])

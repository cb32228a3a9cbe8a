"""A Llama-style GPT (RMSNorm, RoPE with Llama 3's scaling, SwiGLU, grouped-query
attention, query/key norms, no biases, untied output layer) trained on spawned gloo
ranks, float64: tensor parallelism (whole key/value groups per rank, SwiGLU's weight
split with stride 2, the query/key norm gradients summed over ranks), pipeline depth
and width all give the one-process losses; 2BW at d=2 equals 2BW on two parallel
pipelines; a 2BW run stopped and resumed (the untied output layer in the checkpoint)
is bit-identical."""
from __future__ import annotations

import contextlib
import io
import math

import pytest

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs

# hidden 32, 4 heads of 8: 2 key/value groups (one per rank at t=2), a SwiGLU width
# that is not 4h, and Llama 3's RoPE base
LLAMA = ["--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--position-embedding-type", "rope", "--rotary-base", "500000", "--swiglu",
         "--ffn-hidden-size", "40", "--group-query-attention", "--num-query-groups", "2",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         # Qwen3's query/key norms (their weight's gradient sums over tensor-parallel
         # ranks) and Llama 3.2's RoPE scaling
         "--qk-layernorm", "--use-rope-scaling", "--rope-scaling-factor", "32",
         # heads of 12: queries 48 wide in a hidden size of 32 (as Qwen3-0.6B's)
         "--kv-channels", "12"]


def _argv(*extra: str):
    return TINY + LLAMA + list(extra)


def _layout(schedule: str, t: int = 1, d: int = 1, *extra: str):
    return _argv("--pipeline-schedule", schedule, "--tensor-model-parallel-size", str(t),
                 "--pipeline-model-parallel-size", str(d), *extra)


def _close(a, b, tol=1e-11):
    return sorted(a) == sorted(b) and all(abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k]))
                                          for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt_llama"))
    configs = [("t2", _layout("flush", t=2), None),
               ("d2", _layout("flush", d=2), None),
               ("w2", _layout("flush"), None),
               ("d2_2bw", _layout("2bw", d=2), None),
               ("w2_2bw", _layout("2bw"), None),
               ("first", _layout("2bw", 1, 2, "--save", ckpt, "--exit-interval", "2"), None),
               ("second", _layout("2bw", 1, 2, "--save", ckpt, "--load", ckpt), None)]
    return run_distributed(train_configs, 2, args=(configs,), timeout=600)


@pytest.fixture(scope="module")
def one_process():
    import pretrain_gpt
    from megatron.training import pretrain

    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=_layout("flush"))
    return {k: v["lm loss"] for k, v in result.losses.items()}


def test_one_process_trains(one_process):
    assert sorted(one_process) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in one_process.values())
    assert len(set(one_process.values())) == 4  # the weights moved (mock data: no trend)


@pytest.mark.parametrize("layout", ["t2", "d2", "w2"])
def test_layouts_equal_one_process(runs, one_process, layout):
    assert _close(runs[-1][layout]["losses"], one_process), (runs[-1][layout]["losses"],
                                                             one_process)


def test_2bw_depth_two_equals_two_parallel_pipelines(runs):
    assert _close(runs[-1]["d2_2bw"]["losses"], runs[-1]["w2_2bw"]["losses"])
    assert not _close(runs[-1]["d2_2bw"]["losses"], runs[-1]["d2"]["losses"])  # stale: other


def test_2bw_resume_is_bit_identical(runs):
    res = runs[-1]
    first, second, full = res["first"], res["second"], res["d2_2bw"]["losses"]
    assert first["exited_early"] and first["iteration"] == 2
    assert sorted(second["losses"]) == [3, 4]
    for t in range(1, 5):
        got = first["losses"][t] if t <= 2 else second["losses"][t]
        assert got == full[t], (t, got, full[t])

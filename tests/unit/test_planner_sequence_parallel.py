"""The planner's --sequence-parallel (Korthikanti et al., 2022): with t > 1 the tensors
tensor parallelism replicates -- the norms' and the column-parallel linears' inputs, the
residual dropout masks, the stage inputs and outputs -- are split along the sequence.

Expected values are written out from the formulas of the activations module's docstring (and
Korthikanti's s b h (34 + 5 a s / h) / t), not by calling the module's helpers; one test
holds the formulas against what the trainer's own sequence-parallel layers and heads
keep on 2 gloo tensor ranks (the executor's saved-tensor counter)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.pipeline.planner import (Config, CostModel, HardwareSpec, ModelSpec,
                                       PlanningError, best_plan, command_line, get_hardware,
                                       get_model, search)
from megatron.pipeline.planner.profile import Profile

from tests.unit.test_planner_profile import make_profile

REPO = Path(__file__).resolve().parents[2]
GiB = 2.0 ** 30

# A toy GPT with the explicit softmax (--attention-backend local): Korthikanti's count.
L, H, A, S, V = 8, 64, 4, 32, 100
TOY = ModelSpec(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=V,
                attention_backend="local")
BERT = dataclasses.replace(TOY, kind="bert")
TOY_SP = dataclasses.replace(TOY, sequence_parallel=True)
BERT_SP = dataclasses.replace(BERT, sequence_parallel=True)
PER_LAYER = 12 * H * H + 13 * H          # QKV, proj, 2 MLP matrices + biases + 2 LayerNorms
# Plain hardware: no efficiency curve, no elementwise term, one server of 8.
PLAIN = HardwareSpec(name="plain", gpus_per_server=8, gpu_memory_bytes=16 * GiB, peak_flops=1e12,
                     achieved_flops=1e12, intra_server_bandwidth=1e11,
                     inter_server_bandwidth=1e9, reserved_memory_bytes=0.0)


def korthikanti_sp(b: int, t: int) -> float:
    """Korthikanti's per-layer bytes with tensor and sequence parallelism."""
    return S * b * H * (34 + 5 * A * S / H) / t


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "plan.py"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


# ------------------------------------------------------------------ the formulas
@pytest.mark.parametrize("t", [2, 4])
def test_layer_bytes_are_korthikantis_with_sequence_parallelism(t):
    b = 3
    assert TOY_SP.layer_activation_bytes(b, t) == pytest.approx(korthikanti_sp(b, t))
    # without it the 10 s b h stay replicated: s b h (10 + 24 / t + 5 a s / (h t))
    assert TOY.layer_activation_bytes(b, t) == pytest.approx(
        S * b * H * (10 + 24 / t + 5 * A * S / (H * t)))
    # the fused kernels' log-sum-exp (4 a s b) in place of the 5 a s^2 b
    fused = dataclasses.replace(TOY_SP, attention_backend="auto")
    assert fused.layer_activation_bytes(b, t) == \
        pytest.approx((34 * S * b * H + 4 * A * S * b) / t)
    # BERT's block is GPT-2's
    assert BERT_SP.layer_activation_bytes(b, t) == pytest.approx(korthikanti_sp(b, t))


def test_every_llama_term_is_split_with_sequence_parallelism():
    """With the replicated part split, the whole layer is the one-rank count / t."""
    llama = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                      ffn_hidden_size=96, seq_length=32, vocab_size=100,
                      normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                      qk_layernorm=True, add_bias_linear=False)
    split = dataclasses.replace(llama, sequence_parallel=True)
    for t in (2, 8):
        assert split.layer_activation_bytes(2, t) == \
            pytest.approx(llama.layer_activation_bytes(2) / t)
        assert split.layer_activation_bytes(2, t) < llama.layer_activation_bytes(2, t)


@pytest.mark.parametrize("t", [2, 4])
def test_stage_input_head_and_elementwise_bytes(t):
    b = 2
    assert TOY_SP.input_activation_bytes(b, t) == 2 * S * b * H / t
    assert TOY.input_activation_bytes(b, t) == 2 * S * b * H
    assert TOY_SP.layer_elementwise_bytes(b, t) == 24 * S * b * H / t
    assert TOY.layer_elementwise_bytes(b, t) == 24 * S * b * H
    # GPT: the final norm's and the output layer's inputs at s / t, the logits as before
    assert TOY_SP.head_activation_bytes(b, t) == \
        pytest.approx(4 * S * b * H / t + 2 * S * b * V / t)
    assert TOY.head_activation_bytes(b, t) == pytest.approx(4 * S * b * H + 2 * S * b * V / t)
    # BERT: only the final norm's input; its heads run on the gathered sequence
    assert BERT_SP.head_activation_bytes(b, t) == \
        pytest.approx(2 * S * b * H / t + 8 * S * b * H + 2 * S * b * V / t)
    assert BERT.head_activation_bytes(b, t) == pytest.approx(10 * S * b * H + 2 * S * b * V / t)
    fp32 = dataclasses.replace(BERT_SP, fp32_logits=True)
    assert fp32.head_activation_bytes(b, t) == \
        pytest.approx(2 * S * b * H / t + 8 * S * b * H + 4 * S * b * V / t)
    # the padding mask is per whole sequence
    assert BERT_SP.stage_mask_bytes(b) == BERT.stage_mask_bytes(b) == b * S * S


def test_one_tensor_rank_changes_nothing():
    b = 2
    for spec, split in ((TOY, TOY_SP), (BERT, BERT_SP)):
        assert split.layer_activation_bytes(b, 1) == spec.layer_activation_bytes(b)
        assert split.head_activation_bytes(b, 1) == spec.head_activation_bytes(b)
        assert split.input_activation_bytes(b, 1) == spec.input_activation_bytes(b)
        assert split.layer_elementwise_bytes(b, 1) == spec.layer_elementwise_bytes(b)
    hw = PLAIN.with_overrides(memory_bandwidth=1e11)
    cfg = Config(w=2, d=4, t=1, b=2, m=8, schedule="flush")
    one, other = CostModel(TOY, hw).estimate(cfg), CostModel(TOY_SP, hw).estimate(cfg)
    assert other.stages == one.stages and other.batch_time_s == one.batch_time_s
    assert other.memory_per_gpu_bytes == one.memory_per_gpu_bytes
    assert "--sequence-parallel" not in command_line(cfg, TOY_SP)
    assert "--sequence-parallel" in command_line(dataclasses.replace(cfg, t=2, w=1), TOY_SP)
    assert "--sequence-parallel" not in command_line(dataclasses.replace(cfg, t=2, w=1), TOY)


# ------------------------------------------------------------------ the cost model
def test_stage_memory_with_sequence_parallelism():
    """MEMORY(.) term by term, t = 2, flush: stage 1 of 4 holds d - 1 = 3 microbatches,
    the last stage one, each of them 1 / t of the t = 1 activations and stage input
    (a GPT has no padding mask, the one term that would stay whole)."""
    t, d, b, m = 2, 4, 2, 8
    cfg = Config(w=1, d=d, t=t, b=b, m=m, schedule="flush")
    stages = CostModel(TOY_SP, PLAIN).stage_costs(cfg)
    layers = L // d
    middle = layers * PER_LAYER / t
    assert stages[1].in_flight == 3
    # plus the explicit softmax's [s, s] bool causal mask: the whole sequence's, once
    assert stages[1].memory_bytes == pytest.approx(
        16 * middle + 3 * (layers * korthikanti_sp(b, t) + 2 * S * b * H / t) + S * S)
    last = (layers * PER_LAYER + 2 * H + V * H) / t    # final LayerNorm, tied embedding copy
    assert stages[-1].in_flight == 1
    assert stages[-1].memory_bytes == pytest.approx(
        16 * last + layers * korthikanti_sp(b, t) + 4 * S * b * H / t + 2 * S * b * V / t
        + 2 * S * b * H / t + S * S)
    # and with stage-level recomputation: one microbatch's activations, n stage inputs
    rc = CostModel(TOY_SP, PLAIN).stage_costs(dataclasses.replace(cfg, recompute=True))[1]
    assert rc.activation_bytes + rc.stash_bytes == pytest.approx(
        layers * korthikanti_sp(b, t) + 3 * 2 * S * b * H / t)


def test_point_to_point_shrinks_and_tensor_communication_does_not():
    """The p2p tensors are [s/t, b, h]; each all-reduce becomes an all-gather plus a
    reduce-scatter of the same bytes, so with no elementwise term the stages' forward
    and backward times are unchanged, and with one it falls by (1 - 1/t) of it."""
    t, d, b = 4, 2, 2
    cfg = Config(w=1, d=d, t=t, b=b, m=4, schedule="flush")
    off, on = CostModel(TOY, PLAIN).stage_costs(cfg), CostModel(TOY_SP, PLAIN).stage_costs(cfg)
    for a, s in zip(off, on):
        assert a.p2p_s > 0 and s.p2p_s == pytest.approx(a.p2p_s / t)
        assert s.forward_s == a.forward_s and s.backward_s == a.backward_s
        assert s.input_bytes == pytest.approx(2 * S * b * H / t) and a.input_bytes == 2 * S * b * H
    bw = 1e11
    hw = PLAIN.with_overrides(memory_bandwidth=bw)
    off, on = CostModel(TOY, hw).stage_costs(cfg), CostModel(TOY_SP, hw).stage_costs(cfg)
    saved = (L // d) * 24 * S * b * H * (1 - 1 / t) / bw
    for a, s in zip(off, on):
        assert a.forward_s - s.forward_s == pytest.approx(saved)
        assert a.backward_s - s.backward_s == pytest.approx(2 * saved)


def test_layer_level_recompute_keeps_sequence_parallel_chunk_inputs():
    t, b = 2, 2
    cfg = Config(w=1, d=1, t=t, b=b, m=4, schedule="flush", recompute_method="uniform",
                 recompute_num_layers=1)
    st = CostModel(TOY_SP, PLAIN).stage_costs(cfg)[0]
    head = 4 * S * b * H / t + 2 * S * b * V / t
    # one [s/t, b, h] hidden state per layer kept, one layer rebuilt at a time
    assert st.activation_per_microbatch_bytes == pytest.approx(L * 2 * S * b * H / t + head)
    assert st.transient_bytes == pytest.approx(korthikanti_sp(b, t))


def test_a_sequence_that_t_does_not_divide_is_refused():
    six = ModelSpec(num_layers=2, hidden_size=48, num_attention_heads=6, seq_length=32,
                    vocab_size=10)
    split = dataclasses.replace(six, sequence_parallel=True)
    CostModel(six, PLAIN).estimate(Config(w=1, d=1, t=3))    # without it: fine
    with pytest.raises(ValueError, match=r"--sequence-parallel .* --seq-length 32 must be "
                                         r"divisible by --tensor-model-parallel-size 3"):
        CostModel(split, PLAIN).estimate(Config(w=1, d=1, t=3))
    rows = search(split, PLAIN, 6, 12, tensor_parallel=True, schedules=("flush",))
    for r in rows:
        if r.config.t in (3, 6):
            assert not r.fits and r.reason_rejected == \
                f"t={r.config.t} does not divide --seq-length 32 (--sequence-parallel)"
    assert any(r.fits and r.config.t == 2 for r in rows)
    assert any(r.fits and r.config.t == 1 for r in rows)


def test_search_errors_where_sequence_parallelism_cannot_apply():
    with pytest.raises(PlanningError, match="--sequence-parallel needs --tensor-parallel"):
        search(TOY_SP, PLAIN, 8, 64)
    odd = dataclasses.replace(TOY_SP, seq_length=33)
    with pytest.raises(PlanningError, match=r"--seq-length 33 is divisible by none of the "
                                            r"tensor-parallel sizes t = 2, 4, 8"):
        search(odd, PLAIN, 8, 64, tensor_parallel=True)
    # one GPU: no t > 1 to try, as tensor_parallel alone plans t = 1 there
    assert search(odd, PLAIN, 1, 8, tensor_parallel=True)[0].fits


def test_the_search_plans_less_memory_where_memory_binds():
    """GPT-1.3B at 4k tokens on 8 V100s (flush, no recomputation): every tensor-parallel
    candidate needs less memory with sequence parallelism, and the best plan does too,
    at a higher predicted rate (less elementwise work and point-to-point traffic)."""
    model = dataclasses.replace(get_model("gpt-1.3b"), seq_length=4096)
    sp_model = dataclasses.replace(model, sequence_parallel=True)
    hw = get_hardware("p3.16xlarge")
    kw = dict(tensor_parallel=True, schedules=("flush",), recompute=(False,))
    cm = CostModel(sp_model, hw)
    rows = [r for r in search(model, hw, 8, 64, **kw) if r.fits and r.config.t > 1]
    assert rows
    for r in rows:
        est = cm.estimate(r.config)
        assert est.memory_per_gpu_bytes < r.memory_per_gpu_bytes
        assert est.samples_per_s > r.predicted_samples_per_s
    plain = best_plan(model, hw, 8, 64, **kw)
    split = best_plan(sp_model, hw, 8, 64, **kw)
    assert plain.config.t > 1 and split.config.t > 1
    assert split.memory_per_gpu_bytes < plain.memory_per_gpu_bytes
    assert split.predicted_samples_per_s > plain.predicted_samples_per_s
    assert "--sequence-parallel" in command_line(split, sp_model)
    assert "--sequence-parallel" not in command_line(plain, model)


def test_profiled_stages_divide_the_stage_input_too():
    """With a profile (taken at t = 1) the stage input is divided by t as well: the whole
    stash, and what recomputation keeps of the input (the token ids stay whole)."""
    prof = Profile(make_profile((2, 4)))
    s, h, b = prof.model["seq_length"], prof.model["hidden_size"], 2
    inp, data = s * b * h * 4, b * (s + 1) * 8           # make_profile's fp32 [s, b, h]
    blocks = 2 * 1000 * b                                 # two blocks of 1000 B per sample
    plain = prof.stage(2, False, False, b, d=4, t=2)
    split = prof.stage(2, False, False, b, d=4, t=2, sequence_parallel=True)
    assert plain.stash_bytes == inp + round((blocks - inp) / 2)
    assert split.stash_bytes == blocks // 2
    assert split.recompute_stash_bytes == inp // 2 + data
    assert prof.stage(2, False, False, b, t=1, sequence_parallel=True) == \
        prof.stage(2, False, False, b, t=1)
    fast = HardwareSpec(name="fast", gpus_per_server=8, gpu_memory_bytes=16e9,
                        peak_flops=1e12, achieved_flops=1e12, intra_server_bandwidth=1e9,
                        inter_server_bandwidth=1e9)
    cfg = Config(w=1, d=4, t=2, b=b, m=4, schedule="flush")
    spec = prof.model_spec()
    off = CostModel(spec, fast, profile=prof).stage_costs(cfg)[1]
    # a profile at t = 1 prices the model with sequence parallelism too
    on = CostModel(dataclasses.replace(spec, sequence_parallel=True), fast,
                   profile=prof).stage_costs(cfg)[1]
    assert off.p2p_s == pytest.approx(2 * 2 * inp / 1e9)
    assert on.p2p_s == pytest.approx(off.p2p_s / 2)


def test_the_simulator_sends_sequence_parallel_activations():
    pytest.importorskip("megatron.pipeline.simulator")
    from megatron.pipeline.planner.simulate import simulated_batch_time

    # 8 stages of 8 tensor ranks: every stage boundary crosses servers, p2p-bound
    model, hw = get_model("gpt-2.2b"), get_hardware("p3.16xlarge")
    split = dataclasses.replace(model, sequence_parallel=True)
    cfg = Config(w=1, d=8, t=8, b=2, m=64, schedule="flush", recompute=True)
    closed = CostModel(split, hw).estimate(cfg).batch_time_s
    assert simulated_batch_time(cfg, split, hw, batches=2) == pytest.approx(closed, rel=0.02)
    assert simulated_batch_time(cfg, model, hw, batches=2) > 1.05 * closed


# ------------------------------------------------------------------ the trainer
TS, TB, TH, TA, TV = 32, 2, 64, 4, 1024      # a small model for 2 gloo tensor ranks


def _trainer_stash(rank: int, world: int) -> dict:
    """Bytes the executor's counter charges a last stage of the trainer's GPT and BERT (no
    embedding: its input set by hand, [s/t, b, h] with sequence parallelism), of 1 and 2
    layers, float32, dropout off, t = 2 with and without sequence parallelism."""
    import torch

    from megatron.config import ModelConfig
    from megatron.model import BertModel, GPTModel
    from megatron.parallel_state import ParallelGroups, RankLayout
    from megatron.pipeline.memory import StashTracker
    from megatron.tensor_parallel import TPInfo

    tp = TPInfo.from_groups(ParallelGroups.build(RankLayout(world, tensor=world), rank))
    ids = torch.randint(0, TV, (TB, TS), generator=torch.Generator().manual_seed(1))
    out = {}
    for kind in ("gpt", "bert"):
        for sp in (False, True):
            for layers in (1, 2):
                # the last stage of a model one layer deeper: no embedding
                cfg = ModelConfig(num_layers=layers + 1, hidden_size=TH, num_attention_heads=TA,
                                  seq_length=TS, padded_vocab_size=TV, hidden_dropout=0.0,
                                  attention_dropout=0.0, params_dtype=torch.float32,
                                  sequence_parallel=sp)
                cls = GPTModel if kind == "gpt" else BertModel
                model = cls(cfg, tp, pre_process=False, post_process=True,
                            layer_numbers=range(1, layers + 1), seed=9)
                x = torch.randn(TS // world if sp else TS, TB, TH, requires_grad=True)
                model.set_input_tensor(x)
                tracker = StashTracker({p.untyped_storage().data_ptr()
                                        for p in model.parameters()})
                with tracker.counting(0):
                    if kind == "gpt":
                        model(None, None, None, labels=ids)
                    else:
                        model(None, torch.ones(TB, TS, dtype=torch.long), lm_labels=ids)
                out[kind, sp, layers] = tracker.in_flight[0]
    return out


def _as_trainer_keeps(fp16_bytes: float, spec: ModelSpec, t: int, per_token: int,
                      masks: float = 0.0, lse: float = 0.0) -> float:
    """The formula's fp16 bytes as the run above keeps them: 2-byte values doubled
    (float32), the float32 log-sum-exp ``lse`` as it is, no one-byte dropout ``masks``
    (dropout off), plus a mean and a 1/std per token for each of ``per_token`` norms
    (the formula leaves those out), on the s / t tokens a rank holds with sequence
    parallelism."""
    tokens = spec.seq_length * TB / spec.sequence_shards(t)
    return 2 * (fp16_bytes - masks - lse) + lse + per_token * 2 * 4 * tokens


def test_the_trainer_keeps_what_the_formulas_say():
    """The trainer's sequence-parallel layers and heads on 2 tensor ranks against the
    formulas: a layer (the increment from 1 to 2 layers) exactly, and the head's change
    with sequence parallelism (GPT: the final norm's and the output layer's inputs at
    s / t; BERT: the final norm's input only)."""
    from tests.dist_utils import run_distributed

    stash = run_distributed(_trainer_stash, 2, timeout=300)[0]
    t = 2
    for kind in ("gpt", "bert"):
        head = {}
        for sp in (False, True):
            spec = ModelSpec(num_layers=1, hidden_size=TH, num_attention_heads=TA,
                             seq_length=TS, vocab_size=TV, kind=kind, sequence_parallel=sp)
            split = t if sp else 1
            layer = _as_trainer_keeps(spec.layer_activation_bytes(TB, t), spec, t, per_token=2,
                                      masks=2 * TS * TB * TH / split, lse=4 * TA * TS * TB / t)
            measured = stash[kind, sp, 2] - stash[kind, sp, 1]
            assert measured == layer, (kind, sp)
            head[sp] = stash[kind, sp, 1] - measured
            predicted = _as_trainer_keeps(spec.head_activation_bytes(TB, t), spec, t,
                                          per_token=1)
            head[sp, "formula"] = predicted
        assert head[True] - head[False] == head[True, "formula"] - head[False, "formula"], kind
        assert head[True] < head[False]


# ------------------------------------------------------------------ tools/plan.py
def test_plan_cli_plans_sequence_parallelism(tmp_path):
    out = tmp_path / "plan.json"
    res = _plan("--model", "gpt-1.3b", "--seq-length", "4096", "--num-gpus", "8",
                "--max-batch-size", "64", "--schedules", "flush", "--recompute", "off",
                "--tensor-parallel", "--sequence-parallel", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    best = data["best"]["config"]
    assert data["model"]["sequence_parallel"] and best["t"] > 1
    assert "--sequence-parallel" in data["command"] and data["command"] in res.stdout
    assert f"--tensor-model-parallel-size {best['t']}" in data["command"]
    assert "sequence parallel" in res.stdout.splitlines()[0]     # the model: line
    plain = _plan("--model", "gpt-1.3b", "--seq-length", "4096", "--num-gpus", "8",
                  "--max-batch-size", "64", "--schedules", "flush", "--recompute", "off",
                  "--tensor-parallel")
    assert plain.returncode == 0, plain.stderr
    assert "--sequence-parallel" not in plain.stdout


def test_plan_cli_errors_name_the_flags():
    res = _plan("--model", "gpt-1.3b", "--num-gpus", "8", "--max-batch-size", "64",
                "--sequence-parallel")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "--sequence-parallel needs --tensor-parallel" in res.stderr
    res = _plan("--model", "gpt-1.3b", "--seq-length", "1001", "--num-gpus", "8",
                "--max-batch-size", "64", "--tensor-parallel", "--sequence-parallel")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "--sequence-parallel" in res.stderr and "--seq-length 1001" in res.stderr

"""The planner's --attention-backend: what the trainer's attention keeps for the backward
pass (fused kernels: a log-sum-exp per query; the explicit softmax: its s x s
probabilities), BERT's per-stage padding mask, and the long-context plans this opens."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel
from megatron.model.transformer import ATTENTION_BACKENDS as TRAINER_BACKENDS
from megatron.pipeline.planner import (Config, CostModel, ModelSpec, PlanningError, best_plan,
                                       command_line, get_hardware, get_model)
from megatron.pipeline.planner.model_spec import ATTENTION_BACKENDS
from megatron.pipeline.planner.profile import Profile
from megatron.tensor_parallel import TPInfo

from tests.unit.test_planner_llama import GPT_MODEL, PLAIN, _layer_stash, _profile_dict


def test_backends_are_the_trainers():
    assert ATTENTION_BACKENDS == TRAINER_BACKENDS
    with pytest.raises(ValueError, match="--attention-backend 'cudnn': expected one of"):
        ModelSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                  vocab_size=10, attention_backend="cudnn")


@pytest.mark.parametrize("options", [{}, {"hidden_size": 64}, {"kv_channels": 16},
                                     {"normalization": "RMSNorm", "swiglu": True,
                                      "position_embedding_type": "rope"}])
def test_explicit_softmax_keeps_what_the_formula_says(options):
    """The trainer's layer with --attention-backend local keeps, beyond what the fused
    kernel keeps, its probabilities instead of the log-sum-exp (no dropout here: the
    formula's mask (1) and dropout output (2) of the 5 bytes per score are absent; the
    probabilities are 2 fp16 bytes = 4 fp32 bytes).  The shared [s, s] causal mask (one
    per stage, no b factor) is the one thing the layer's formula leaves out: the cost
    model charges it once per stage (``ModelSpec.causal_mask_bytes``)."""
    s, b, a, f = 16, 2, 4, 40
    options = {"hidden_size": 32, **options}
    stash, formula = {}, {}
    for backend in ("auto", "local"):
        config = ModelConfig(num_layers=2, num_attention_heads=a, seq_length=s,
                             ffn_hidden_size=f, padded_vocab_size=64, hidden_dropout=0.0,
                             attention_dropout=0.0, attention_backend=backend, **options)
        spec = ModelSpec(num_layers=2, num_attention_heads=a, seq_length=s,
                         ffn_hidden_size=f, vocab_size=64, attention_backend=backend,
                         **options)
        stash[backend], formula[backend] = _layer_stash(config, b), spec.layer_activation_bytes(b)
    assert formula["local"] - formula["auto"] == 5 * a * s * s * b - 4 * a * s * b
    causal_mask = s * s
    assert spec.causal_mask_bytes() == causal_mask
    assert stash["local"] - stash["auto"] == 4 * a * s * s * b - 4 * a * s * b + causal_mask


@pytest.mark.parametrize("backend", ["auto", "local"])
def test_bert_padding_mask_is_counted_once_per_stage(backend):
    s, b = 16, 3
    config = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=s,
                         padded_vocab_size=64, num_tokentypes=2, hidden_dropout=0.0,
                         attention_dropout=0.0, attention_backend=backend)
    spec = ModelSpec(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=s,
                     vocab_size=64, kind="bert", attention_backend=backend)
    model = BertModel(config, TPInfo.single(), seed=1, add_binary_head=False).train()
    ids = torch.randint(4, 64, (b, s))
    pad = torch.ones(b, s, dtype=torch.long)
    pad[0, 9:] = 0
    masks = {}

    def pack(t):
        if t.dim() == 4 and tuple(t.shape[1:]) == (1, s, s):    # not the probabilities
            masks[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.encode(ids, pad)
    fp32 = 2 if backend == "auto" else 1   # an additive mask's values double in fp32
    assert sum(masks.values()) == fp32 * spec.stage_mask_bytes(b)
    gpt = dataclasses.replace(spec, kind="gpt")
    assert gpt.stage_mask_bytes(b) == 0.0
    # every stage keeps it, not every layer
    bert = dataclasses.replace(spec, num_layers=8)
    cm = CostModel(bert, PLAIN)
    st = cm.stage_costs(Config(w=1, d=2, b=b, m=2, schedule="flush"))[1]
    assert st.activation_per_microbatch_bytes == pytest.approx(
        4 * bert.layer_activation_bytes(b) + bert.stage_mask_bytes(b)
        + bert.head_activation_bytes(b))


def test_long_context_plans_fit_with_the_fused_kernel_only():
    """Qwen3-0.6B at 32k tokens on 8 H100s: the fused kernels' activations fit; keeping
    28 layers x 16 heads x 32k x 32k probabilities does not (the planner said so for
    every backend before it knew the difference)."""
    model = dataclasses.replace(get_model("qwen3-0.6b"), seq_length=32768)
    hw = get_hardware("h100-sxm")
    plan = best_plan(model, hw, 8, 64)
    assert plan.fits
    assert "--attention-backend" not in command_line(plan, model)
    local = dataclasses.replace(model, attention_backend="local")
    with pytest.raises(PlanningError, match="needs .* GiB per GPU"):
        best_plan(local, hw, 8, 64)
    # short sequences: the same plans either way, each command says its backend
    short = get_model("gpt-1.3b")
    row = best_plan(dataclasses.replace(short, attention_backend="unfused"), hw, 8, 64)
    assert "--attention-backend unfused" in command_line(row, row_model := dataclasses.replace(
        short, attention_backend="unfused"))
    assert row_model.keeps_scores and "unfused attention" in row_model.describe()


def test_a_profile_records_its_attention_backend():
    model = dict(GPT_MODEL)
    prof = Profile(_profile_dict(model))          # an older profile: the default, auto
    spec = prof.model_spec()
    assert spec.attention_backend == "auto"
    for same in ("flash", "fused"):               # the same kernels
        CostModel(dataclasses.replace(spec, attention_backend=same), PLAIN, profile=prof)
    with pytest.raises(ValueError, match=r"--attention-backend local \(profiled auto\)"):
        CostModel(dataclasses.replace(spec, attention_backend="local"), PLAIN, profile=prof)
    local = Profile(_profile_dict({**model, "attention_backend": "unfused"}))
    assert local.model_spec().keeps_scores
    CostModel(dataclasses.replace(spec, attention_backend="local"), PLAIN, profile=local)
    with pytest.raises(ValueError, match="model.attention_backend must be str"):
        Profile(_profile_dict({**model, "attention_backend": 1}))


def test_plan_cli_passes_the_backend_on():
    from tests.unit.test_planner_llama import _plan
    res = _plan("--model", "gpt-1.3b", "--attention-backend", "local", "--cluster", "dgx-a100",
                "--num-gpus", "8", "--max-batch-size", "64")
    assert res.returncode == 0, res.stderr
    assert "local attention" in res.stdout and "--attention-backend local" in res.stdout
    res = _plan("--model", "gpt-1.3b", "--attention-backend", "cudnn", "--num-gpus", "8",
                "--max-batch-size", "64")
    assert res.returncode == 2 and "--attention-backend: invalid choice: 'cudnn'" in res.stderr


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_head_formula_matches_the_bytes_the_executor_counts(kind):
    """The last stage beyond its layers keeps what ``head_activation_bytes`` says (fp32
    here: twice the formula's fp16 bytes; the logits are kept in the training dtype,
    not as a float32 copy) plus per-token values the formula leaves out: each
    LayerNorm's mean and 1/std, and the loss's target id, in-range flag and
    log-sum-exp."""
    from megatron.model import GPTModel
    from megatron.pipeline.memory import StashTracker

    s, b, h, v = 16, 2, 32, 256
    config = ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=4, seq_length=s,
                         padded_vocab_size=v, hidden_dropout=0.0, attention_dropout=0.0,
                         num_tokentypes=2 if kind == "bert" else 0)
    spec = ModelSpec(num_layers=2, hidden_size=h, num_attention_heads=4, seq_length=s,
                     vocab_size=v, kind=kind)
    labels = torch.randint(0, v, (b, s))
    if kind == "gpt":
        model = GPTModel(config, TPInfo.single(), pre_process=False, post_process=True,
                         layer_numbers=range(1, 2), seed=1)
        run = lambda: model(None, None, None, labels)  # noqa: E731
    else:
        model = BertModel(config, TPInfo.single(), pre_process=False, post_process=True,
                          layer_numbers=range(1, 2), seed=1, add_binary_head=False)
        pad = torch.ones(b, s, dtype=torch.long)
        run = lambda: model(None, pad, None, labels)[0]  # noqa: E731
    model.set_input_tensor(torch.randn(s, b, h, requires_grad=True))
    tracker = StashTracker({p.untyped_storage().data_ptr() for p in model.parameters()})
    with tracker.counting(0):
        loss = run()
    loss.sum().backward()
    layer = _layer_stash(config, b)
    mask = 2 * spec.stage_mask_bytes(b)                    # BERT's additive mask (fp32)
    norms = 2 if kind == "bert" else 1
    per_token = norms * 8 + 8 + 1 + 4
    assert tracker.in_flight[0] - layer - mask == \
        2 * spec.head_activation_bytes(b) + per_token * s * b
    assert dataclasses.replace(spec, fp32_logits=True).head_activation_bytes(b) == \
        spec.head_activation_bytes(b) + 2 * s * b * v


def test_plan_cli_plans_the_distributed_optimizer(tmp_path):
    import json

    from tests.unit.test_planner_llama import _plan
    mem = {}
    for extra in ((), ("--use-distributed-optimizer",)):
        out = tmp_path / f"plan{len(extra)}.json"
        res = _plan("--model", "gpt-1.3b", "--cluster", "dgx-a100", "--num-gpus", "16",
                    "--max-batch-size", "256", "--schedules", "flush", "--json", str(out),
                    *extra)
        assert res.returncode == 0, res.stderr
        assert ("--use-distributed-optimizer" in res.stdout) == bool(extra)
        rows = [r for r in json.loads(out.read_text())["rows"] if r["fits"]]
        assert rows and all(r["config"]["distributed_optimizer"] == bool(extra) for r in rows)
        mem[bool(extra)] = {json.dumps({k: v for k, v in r["config"].items()
                                        if k != "distributed_optimizer"}, sort_keys=True):
                            r["memory_per_gpu_bytes"] for r in rows}
    shared = [k for k in mem[False] if json.loads(k)["w"] > 1]
    assert shared and all(mem[True][k] < mem[False][k] for k in shared)


def test_planner_decides_on_the_distributed_optimizer():
    """Tried both ways, it wins where memory binds: GPT-1.3B on 16 GPUs of 8 GiB shards
    the state and runs w=4 d=4 instead of w=2 d=8; with one replica (w=1) a candidate is
    tried once, without it."""
    from megatron.pipeline.planner import search

    model, hw = get_model("gpt-1.3b"), get_hardware("p3.16xlarge").with_overrides(
        gpu_memory_bytes=8 * 2 ** 30)
    plain = best_plan(model, hw, 16, 256)
    auto = best_plan(model, hw, 16, 256, distributed_optimizer=(False, True))
    assert not plain.config.distributed_optimizer and auto.config.distributed_optimizer
    assert auto.predicted_samples_per_s > 1.2 * plain.predicted_samples_per_s
    assert (auto.config.w, auto.config.d) == (4, 4) and (plain.config.w, plain.config.d) == (2, 8)
    assert "--use-distributed-optimizer" in command_line(auto, model)
    assert "--use-distributed-optimizer" not in command_line(plain, model)
    rows = search(model, hw, 16, 256, distributed_optimizer=(False, True))
    assert not any(r.config.distributed_optimizer and r.config.w == 1 for r in rows)
    assert any(r.config.distributed_optimizer for r in rows if r.config.w > 1)


def test_profiler_measures_and_records_the_backend(tmp_path, capsys):
    """tools/profile_model.py --attention-backend local: the block's measured stash holds
    the probabilities (more than the fused kernel's), the JSON records the backend, and a
    plan from the profile passes it on; a plan that asks for the other kind of kernel is
    refused."""
    import json

    from tools.plan import run
    from tools.profile_model import main

    torch.set_num_threads(1)
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--vocab-size", "64", "--make-vocab-size-divisible-by",
             "32", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--micro-batch-sizes", "2", "--warmup", "0", "--repeat", "1", "--no-stages",
             "--device", "cpu"]
    stash = {}
    for backend in ("auto", "local"):
        out = tmp_path / f"{backend}.json"
        assert main([*flags, "--attention-backend", backend, "--output", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["model"]["attention_backend"] == backend
        stash[backend] = data["microbatches"][0]["block"]["stash_bytes"]
    s, b, a = 16, 2, 4
    # fp32 probabilities instead of the log-sum-exp; the causal mask, one per stage and
    # shared by its microbatches, is not charged to a block
    assert stash["local"] - stash["auto"] == 4 * a * s * s * b - 4 * a * s * b
    capsys.readouterr()
    local = str(tmp_path / "local.json")
    assert run(["--profile", local, "--cluster", "cpu", "--num-gpus", "2",
                "--max-batch-size", "8", "--top", "1"]) == 0
    assert "--attention-backend local" in capsys.readouterr().out
    assert run(["--profile", local, "--cluster", "cpu", "--num-gpus", "2",
                "--max-batch-size", "8", "--attention-backend", "auto"]) == 2
    assert "--attention-backend auto (profiled local)" in capsys.readouterr().err

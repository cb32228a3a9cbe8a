"""--ddp-bucket-size in the planner: the data-parallel buckets the cost model counts are
the ones the executor builds of the same stage (``GradientReduction``, and with
--use-distributed-optimizer ``plan_shard``'s, which the weight all-gathers of
--overlap-param-gather follow), and tools/plan.py takes the flag as the trainer does.

No process group: the reducers are built with a stand-in group (they only plan their
buckets before the first collective), and ``plan_shard`` is told the data-parallel
size through a patched ``get_world_size``.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import BertModel, GPTModel
from megatron.optimizer import sharding
from megatron.pipeline.grad_reduction import GradientReduction
from megatron.pipeline.planner import Config, CostModel, CostOptions, ModelSpec
from megatron.pipeline.weights import WeightBuffers
from megatron.tensor_parallel import TPInfo
from tests.unit.test_cost_model import PLAIN

H, A, S, V, W = 32, 4, 16, 64, 2
LLAMA = {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True,
         "qk_layernorm": True, "num_query_groups": 2, "add_bias_linear": False,
         "add_qkv_bias": True, "untie_embeddings_and_output_weights": True,
         "ffn_hidden_size": 40}
MODELS = {"gpt": ("gpt", {}), "llama": ("gpt", LLAMA), "head_dim": ("gpt", {"kv_channels": 16}),
          "bert": ("bert", {})}


def _stage(kind: str, options: dict, layers: int, d: int, stage: int, t: int,
           dtype: torch.dtype = torch.float16, hidden: int = H, vocab: int = V):
    """The trainer's module of pipeline stage ``stage`` of d (``layers`` per stage) on one
    of t tensor ranks, and the planner's ModelSpec of the same model."""
    common = dict(num_layers=layers * d, hidden_size=hidden, num_attention_heads=A,
                  seq_length=S, **options)
    config = ModelConfig(padded_vocab_size=vocab, params_dtype=dtype,
                         num_tokentypes=2 if kind == "bert" else 0, **common)
    tp = TPInfo(group=object(), size=t) if t > 1 else TPInfo.single()
    where = dict(pre_process=stage == 0, post_process=stage == d - 1,
                 layer_numbers=range(stage * layers, (stage + 1) * layers))
    model = (BertModel(config, tp, seed=1, **where) if kind == "bert"
             else GPTModel(config, tp, **where))
    return model, ModelSpec(vocab_size=vocab, kind=kind, **common)


def _executor_buckets(model, d: int, elements, bucket_bytes: float, distributed: bool,
                      monkeypatch) -> tuple:
    """(the reducer's buckets, the weight all-gather's: 0 without the distributed
    optimizer) as the engine builds them for this stage on W replicas: its first weight
    buffer, the tied word embedding left to its own sum on a cut pipeline."""
    params = WeightBuffers(model, 1).params(0)
    tied = tuple(p for p in params if d > 1 and getattr(p, "shared_embedding", False))
    shard = None
    if distributed:
        monkeypatch.setattr(sharding.dist, "get_world_size", lambda group: W)
        monkeypatch.setattr(sharding.dist, "get_rank", lambda group: 0)
        shard = sharding.plan_shard(params, object(), None, elements)
    reducer = GradientReduction(params, object(), W, 1, bucket_bytes=int(bucket_bytes),
                                overlap=False, exclude=tied, shard=shard,
                                bucket_elements=elements)
    return len(reducer._buckets), len(shard.buckets) if shard is not None else 0


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("t", [1, 2])
def test_stage_parameters_are_the_trainers(name, t):
    """``ModelSpec.stage_parameters``: the elements of each parameter of every kind of
    stage on a tensor rank, in the module's order, and which is the tied word
    embedding; at t = 1 they add up to the cost model's parameter count."""
    kind, options = MODELS[name]
    for d in (1, 3):
        for stage in range(d):
            model, spec = _stage(kind, options, 2, d, stage, t)
            first, last = stage == 0, stage == d - 1
            assert spec.stage_parameters(2, first, last, t) == tuple(
                (p.numel(), bool(getattr(p, "shared_embedding", False)))
                for p in model.parameters()), (d, stage)
            if t == 1:
                cm = CostModel(spec, PLAIN)
                assert sum(n for n, _ in spec.stage_parameters(2, first, last)) == \
                    cm.stage_params(stage, d, 2)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("distributed", [False, True])
def test_the_planner_counts_the_executors_buckets(name, distributed, monkeypatch):
    """For every kind of stage, tensor-parallel size and --ddp-bucket-size (from one
    parameter per bucket to one bucket per stage), the buckets the cost model counts
    are those the executor builds: the reducer's, and with the distributed optimizer
    the shard's, one all-gather each."""
    kind, options = MODELS[name]
    seen = set()
    for t in (1, 2):
        for d in (1, 3):
            for stage in range(d):
                model, spec = _stage(kind, options, 2, d, stage, t)
                for elements in (1, 100, 1000, 3000, 10 ** 9):
                    cfg = Config(w=W, d=d, t=t, b=1, m=d, schedule="flush",
                                 distributed_optimizer=distributed)
                    cm = CostModel(spec, PLAIN, CostOptions(grad_bucket_elements=elements))
                    planned = cm.bucket_counts(cfg, stage)
                    assert planned == _executor_buckets(model, d, elements, 0, distributed,
                                                        monkeypatch), (t, d, stage, elements)
                    st = cm.stage_costs(cfg)[stage]
                    assert (st.dp_buckets, st.gather_buckets) == planned
                    seen.add(planned)
    assert len(seen) > 4    # from one bucket to one per parameter


@pytest.mark.parametrize("bucket_bytes", [2000.0, 20000.0])
def test_bucket_bytes_without_the_flag_are_the_executors(bucket_bytes, monkeypatch):
    """Without --ddp-bucket-size the reducer closes a bucket by gradient bytes (fp16: 2 a
    parameter, ``CostOptions.grad_bytes_per_param``)."""
    for d in (1, 3):
        for stage in range(d):
            model, spec = _stage("gpt", {}, 2, d, stage, 1)
            cm = CostModel(spec, PLAIN, CostOptions(grad_bucket_bytes=bucket_bytes))
            cfg = Config(w=W, d=d, b=1, m=d, schedule="flush")
            assert cm.bucket_counts(cfg, stage) == _executor_buckets(
                model, d, None, bucket_bytes, False, monkeypatch)


def test_the_default_32_mib_buckets_of_a_larger_stage(monkeypatch):
    """The executor's default, 32 MiB of fp16 gradients, on layers of h = 1024 (a 4h x h
    matrix is 8 MiB) and a 50304-word embedding of 98 MiB: whole parameters per
    bucket, the embedding one bucket by itself, so fewer buckets than the stage's bytes
    / 32 MiB (which the planner assumed before)."""
    import math

    for distributed in (False, True):
        for d, stage in ((1, 0), (2, 0), (2, 1)):
            model, spec = _stage("gpt", {}, 2, d, stage, 1, hidden=1024, vocab=50304)
            cm = CostModel(spec, PLAIN)
            cfg = Config(w=W, d=d, b=1, m=d, schedule="flush", distributed_optimizer=distributed)
            planned = cm.bucket_counts(cfg, stage)
            executor = _executor_buckets(model, d, None, cm.options.grad_bucket_bytes,
                                         distributed, monkeypatch)
            if distributed:   # plan_shard's own constant is the planner's default
                assert cm.options.grad_bucket_bytes == sharding.BUCKET_BYTES
            assert planned == executor
            params = cm.stage_costs(cfg)[stage].params
            assert planned[0] < math.ceil(2 * params / cm.options.grad_bucket_bytes)


def test_the_flag_moves_the_exposed_reduce_and_gather():
    """A flush plan on a slow data-parallel link: the all-reduce left after the last
    backward is max(all-reduce / buckets, all-reduce - backward), the gather left to the
    next forward max(gather / buckets, gather - forward), with the buckets of the size
    given; one bucket hides nothing."""
    from megatron.pipeline.planner.hardware import ring_allreduce_time

    slow = dataclasses.replace(PLAIN, intra_server_bandwidth=1e6)
    spec = ModelSpec(num_layers=4, hidden_size=H, num_attention_heads=A, seq_length=S,
                     vocab_size=V, untie_embeddings_and_output_weights=True)
    cfg = Config(w=W, d=2, b=1, m=2, schedule="flush")
    for elements in (10 ** 9, 1000):
        cm = CostModel(spec, slow, CostOptions(grad_bucket_elements=elements))
        for st, dst in zip(cm.stage_costs(cfg),
                           cm.stage_costs(dataclasses.replace(cfg, distributed_optimizer=True))):
            n, g = st.dp_buckets, dst.gather_buckets
            gather = 0.5 * ring_allreduce_time(2 * dst.params, W, cm.estimate(cfg).links.data)
            if elements > 10 ** 6:   # one bucket a stage
                assert n == g == 1
                assert st.dp_exposed_s == pytest.approx(st.dp_allreduce_s)
                assert dst.step_s == pytest.approx(gather)
            else:
                assert n > 1 and g > 1
                assert st.dp_exposed_s < st.dp_allreduce_s and dst.step_s < gather
            assert st.dp_exposed_s == pytest.approx(
                max(st.dp_allreduce_s / n, st.dp_allreduce_s - st.backward_s))
            assert dst.step_s == pytest.approx(max(gather / g, gather - dst.forward_s))
    with pytest.raises(ValueError, match="--ddp-bucket-size must be a positive number of "
                                         "parameters, got 0"):
        CostOptions(grad_bucket_elements=0)


def test_plan_cli_takes_the_flag(tmp_path, capsys):
    """tools/plan.py --ddp-bucket-size N: validated as the trainer validates it, priced
    (a flush plan on data-parallel replicas gains from smaller buckets), passed on in
    the command and recorded in --json."""
    from megatron.arguments import ArgumentError, parse_args, validate_args
    from tools.plan import run

    base = ["--model", "gpt-355m", "--num-gpus", "8", "--max-batch-size", "64",
            "--schedules", "flush", "--recompute", "off", "--top", "1"]
    out = tmp_path / "plan.json"
    assert run(base + ["--json", str(out)]) == 0
    default = json.loads(out.read_text())
    assert "--ddp-bucket-size" not in capsys.readouterr().out and \
        default["ddp_bucket_size"] is None
    assert run(base + ["--ddp-bucket-size", "1000000", "--json", str(out)]) == 0
    cmd = capsys.readouterr().out.strip().splitlines()[-2]
    small = json.loads(out.read_text())
    assert cmd.startswith("torchrun") and cmd.endswith("--ddp-bucket-size 1000000")
    assert small["command"] == cmd and small["ddp_bucket_size"] == 1000000
    assert small["best"]["config"]["w"] > 1
    assert small["best"]["predicted_samples_per_s"] > default["best"]["predicted_samples_per_s"]
    assert run(base + ["--ddp-bucket-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "plan.py: error: --ddp-bucket-size must be a positive number of " \
                  "parameters, got 0"
    trainer = parse_args(["--num-layers", "2", "--hidden-size", "32",
                          "--num-attention-heads", "4", "--seq-length", "16",
                          "--max-position-embeddings", "16", "--micro-batch-size", "1",
                          "--global-batch-size", "1", "--mock-data", "--train-iters", "1",
                          "--lr", "1e-3", "--ddp-bucket-size", "0"])
    with pytest.raises(ArgumentError) as refused:
        validate_args(trainer, 1)
    assert str(refused.value) == err[len("plan.py: error: "):]     # the trainer's words

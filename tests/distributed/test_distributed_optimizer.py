"""--use-distributed-optimizer on spawned gloo ranks: data-parallel replicas that split
the optimizer state evenly (each owns one segment of every flat gradient bucket, so a
parameter may be cut between ranks) train to the same bits as plain data parallelism
without clipping (flush and 2BW, float64, bf16 with fp32 masters and fp16, 2BW's delay
compensation, per-token losses, tensor x sequence parallelism; the gradient norm agrees
to rounding, a cut parameter's squares being summed per piece, and so do clipped runs),
write the same checkpoint (model and the whole optimizer state, gathered), resume across
the flag and at another data-parallel size, and each keeps only its own share of the
state, within a bucket's padding of an even split even when one parameter (the word
embedding) outweighs all the others."""
from __future__ import annotations

import glob
import math
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs


def _argv(schedule: str, *extra: str):
    # no clipping: the update is then elementwise, the same bits whichever rank updates
    # which piece; the clipping factor follows the gradient norm, which the sharded
    # optimizer sums per piece (the same to rounding only):
    # test_clipped_runs_agree_to_rounding compares that
    return TINY + ["--pipeline-schedule", schedule, "--clip-grad", "0", *extra]


def _bf16(argv):
    return [a for a in argv if a != "--fp64"] + ["--bf16"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {name: str(tmp_path_factory.mktemp(name)) for name in
            ("plain", "dist", "plain_2bw", "dist_2bw", "cross")}


@pytest.fixture(scope="module")
def runs(ckpts):
    dist = ["--use-distributed-optimizer"]
    configs = [
        ("plain", _argv("flush", "--save", ckpts["plain"]), None),
        ("dist", _argv("flush", "--save", ckpts["dist"], *dist), None),
        ("plain_2bw", _argv("2bw", "--save", ckpts["plain_2bw"]), None),
        ("dist_2bw", _argv("2bw", "--save", ckpts["dist_2bw"], *dist), None),
        ("plain_clip", _argv("flush", "--clip-grad", "1.0"), None),
        ("dist_clip", _argv("flush", "--clip-grad", "1.0", *dist), None),
        ("plain_bf16", _bf16(_argv("flush")), None),
        ("dist_bf16", _bf16(_argv("flush", *dist)), None),
        # an overflow injected into iteration 2's gradients: skipped on every replica
        ("plain_inf", _argv("2bw"), "inject_overflow_stage0_iter2"),
        ("dist_inf", _argv("2bw", *dist), "inject_overflow_stage0_iter2"),
        # stop a distributed 2BW run at iteration 2, resume it without the flag
        ("first", _argv("2bw", "--save", ckpts["cross"], "--exit-interval", "2", *dist), None),
        ("second", _argv("2bw", "--save", ckpts["cross"], "--load", ckpts["cross"]), None),
    ]
    return run_distributed(train_configs, 2, args=(configs,), timeout=600)


@pytest.mark.parametrize("plain,sharded", [("plain", "dist"), ("plain_2bw", "dist_2bw"),
                                           ("plain_bf16", "dist_bf16"),
                                           ("plain_inf", "dist_inf")])
def test_sharded_state_trains_to_the_same_bits(runs, plain, sharded):
    for rank in (0, 1):
        a, b = runs[rank][plain], runs[rank][sharded]
        assert sorted(a["losses"]) == [1, 2, 3, 4]
        assert a["losses"] == b["losses"]
        # bf16 gradients accumulate in float32, whose norms are float32-rounded
        _same_norms(a["grad_norms"], b["grad_norms"], 1e-6 if "bf16" in plain else 1e-12)
        assert a["skipped"] == b["skipped"] == ([False, False, True, False]
                                                if plain == "plain_inf" else [False] * 4)


def test_clipped_runs_agree_to_rounding(runs):
    """With clipping, the factor follows the norm: the weights agree to rounding."""
    for rank in (0, 1):
        a, b = runs[rank]["plain_clip"], runs[rank]["dist_clip"]
        assert a["grad_norms"][0] > 1.0  # clipped
        assert sorted(a["losses"]) == sorted(b["losses"]) == [1, 2, 3, 4]
        for t, loss in a["losses"].items():
            assert b["losses"][t] == pytest.approx(loss, rel=1e-12)
        _same_norms(a["grad_norms"], b["grad_norms"])


def _same_norms(plain, sharded, rel=1e-12):
    """Gradient norms: equal to rounding (the sharded one sums a cut parameter's squares
    per piece); non-finite ones (skipped steps) alike."""
    assert len(plain) == len(sharded)
    for a, b in zip(plain, sharded):
        if math.isfinite(a):
            assert b == pytest.approx(a, rel=rel, abs=0.0), (plain, sharded)
        else:
            assert not math.isfinite(b), (plain, sharded)


def _payload(root: str):
    from megatron.checkpoint_files import load_payload
    stems = glob.glob(os.path.join(root, "iter_0000004", "*", "model_optim_rng.json"))
    assert len(stems) == 1, stems
    return load_payload(stems[0][:-len(".json")])


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


@pytest.mark.parametrize("plain,sharded", [("plain", "dist"), ("plain_2bw", "dist_2bw")])
def test_checkpoint_holds_the_whole_state_in_the_plain_format(runs, ckpts, plain, sharded):
    a, b = _payload(ckpts[plain]), _payload(ckpts[sharded])
    for part in ("model", "optimizer"):
        fa, fb = dict(_flat(a[part])), dict(_flat(b[part]))
        assert fa.keys() == fb.keys(), part
        for key, va in fa.items():
            vb = fb[key]
            if torch.is_tensor(va):
                assert torch.equal(va, vb), (part, key)
            else:
                assert va == vb, (part, key)
    state = a["optimizer"]["optimizer"]["state"]
    assert len(state) == len(a["optimizer"]["meta"]["shapes"])  # every parameter's moments


def test_resume_without_the_flag_continues_the_same_run(runs):
    for rank in (0, 1):
        first, second = runs[rank]["first"], runs[rank]["second"]
        full = runs[rank]["dist_2bw"]["losses"]
        assert first["exited_early"] and first["iteration"] == 2
        assert sorted(second["losses"]) == [3, 4]
        assert {**first["losses"], **second["losses"]} == full


def _shard_worker(rank: int, world: int):
    import torch.distributed as dist
    from torch import nn

    from megatron.config import OptimizerConfig, PrecisionConfig
    from megatron.optimizer import get_megatron_optimizer

    torch.manual_seed(0)
    shapes = [(8, 6), (6,), (5, 4), (4,), (3, 3), (2,)]
    base = [torch.randn(s, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
    out = {}
    for sharded in (False, True):
        params = [nn.Parameter(t.clone()) for t in base]
        opt = get_megatron_optimizer(
            OptimizerConfig(lr=0.1, weight_decay=0.1, use_distributed_optimizer=sharded),
            PrecisionConfig(), params, dp_group=dist.group.WORLD)
        for _ in range(2):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step(params, params, params, lr=0.1)
        held = sum(st["exp_avg"].numel() for st in opt.optimizer.state.values())
        out[sharded] = ([p.detach().clone() for p in params], held,
                        opt.state_dict()["optimizer"])
    return out


def test_each_rank_keeps_its_share_and_the_weights_agree():
    results = run_distributed(_shard_worker, 2, timeout=120)
    total = sum(torch.Size(s).numel() for s in [(8, 6), (6,), (5, 4), (4,), (3, 3), (2,)])
    held = [r[True][1] for r in results]
    assert sum(held) == total and all(0 < h < total for h in held)
    assert all(r[False][1] == total for r in results)
    for r in results:
        for a, b in zip(r[False][0], r[True][0]):
            assert torch.equal(a, b)
        plain, gathered = r[False][2], r[True][2]
        assert plain["param_groups"] == gathered["param_groups"]
        assert sorted(plain["state"]) == sorted(gathered["state"])
        for k, st in plain["state"].items():
            for name, v in st.items():
                assert torch.equal(v.cpu(), gathered["state"][k][name].cpu()), (k, name)


def _sharing_worker(rank: int, world: int, argv):
    """Train with ``argv``; return, per optimizer step, whether it ran sharded (the
    replicas all-gathering their new weights) and how many moment elements this rank
    held."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.optimizer import optimizer as mod
    from megatron.training import pretrain

    seen = []
    original = mod.MegatronOptimizer.finish_step

    def spy(self, *args, **kwargs):
        info = original(self, *args, **kwargs)
        seen.append((self.shard is not None,
                     sum(st["exp_avg"].numel() for st in self.optimizer.state.values())))
        return info

    mod.MegatronOptimizer.finish_step = spy
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=list(argv))
    return seen


def test_the_trainer_shards_over_its_data_parallel_replicas():
    plain, sharded = (run_distributed(_sharing_worker, 2, args=(_argv("2bw", *extra),),
                                      timeout=300)
                      for extra in ((), ("--use-distributed-optimizer",)))
    assert [s for s, _ in plain[0]] == [False] * 4
    assert [s for s, _ in sharded[0]] == [True] * 4
    whole = plain[0][-1][1]
    halves = [sharded[r][-1][1] for r in (0, 1)]
    assert sum(halves) == whole and all(h < whole for h in halves)


def test_prediction_cannot_be_sharded():
    from megatron.arguments import ArgumentError, parse_args, validate_args
    with pytest.raises(ArgumentError, match="--2bw-mitigation predict needs every"):
        validate_args(parse_args(_argv("2bw", "--use-distributed-optimizer",
                                       "--2bw-mitigation", "predict")), 2)


def test_two_pipelines_of_two_stages_train_to_the_same_bits():
    """d=2, w=2 (4 ranks): the tied word embedding's two copies, on the first and the
    last stage, are buckets of their own, averaged by the engine and split like any
    other."""
    configs = [(name, _argv("2bw", "--pipeline-model-parallel-size", "2", *extra), None)
               for name, extra in (("plain", ()), ("dist", ("--use-distributed-optimizer",)))]
    res = run_distributed(train_configs, 4, args=(configs,), timeout=600)
    for rank in range(4):
        assert res[rank]["plain"]["losses"] == res[rank]["dist"]["losses"]
        _same_norms(res[rank]["plain"]["grad_norms"], res[rank]["dist"]["grad_norms"])
    assert sorted(res[-1]["dist"]["losses"]) == [1, 2, 3, 4]


def _one_replica_loss_worker(rank: int, world: int, argv):
    """Train with ``argv``; only data-parallel rank 1 finds batch 2's loss non-finite
    (its gradients stay finite: what the last stage's loss check is for)."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.pipeline.update import Updater
    from megatron.training import pretrain

    original = Updater._loss_nonfinite

    def one_replica(self, seg, t):
        found = original(self, seg, t)
        return True if (t == 2 and self.groups.dp_rank == 1) else found

    Updater._loss_nonfinite = one_replica
    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=list(argv))
    return [r.skipped for r in result.reports], result.shared_embedding


@pytest.mark.parametrize("extra", [(), ("--use-distributed-optimizer",)],
                         ids=["plain", "distributed"])
def test_a_replica_that_skips_makes_all_skip(extra):
    """Both replicas skip batch 2 and keep the same weights (before, the other replica
    stepped and the two parted for good; with sharded state they would have waited for
    each other's all-gathers)."""
    res = run_distributed(_one_replica_loss_worker, 2, args=(_argv("2bw", *extra),),
                          timeout=300)
    assert res[0][0] == res[1][0] == [False, False, True, False]
    assert torch.equal(res[0][1], res[1][1])


_REDUCER_SHAPES = [(6, 4), (4,), (5, 3), (3,), (2, 2), (7,)]


def _reducer_shard(rank: int, world: int, group):
    from megatron.optimizer.sharding import OptimizerShard, plan_buckets

    numels = [torch.Size(s).numel() for s in _REDUCER_SHAPES]
    # 160 bytes = 20 float64 elements: several buckets, parameters cut by segments
    buckets = plan_buckets(numels, ["f64"] * len(numels), world, 160, [8] * len(numels))
    return OptimizerShard(rank=rank, size=world, buckets=buckets, numels=tuple(numels),
                          group=group)


def _reducer_worker(rank: int, world: int):
    """GradientReduction with the distributed optimizer's shard: each rank receives the
    average of its own segment of every bucket (written into the pieces of ``.grad``
    the segment covers), keeps its own gradient elsewhere, and only reduce-scatters."""
    import torch.distributed as dist
    from torch import nn

    from megatron.pipeline import grad_reduction as eng

    shard = _reducer_shard(rank, world, dist.group.WORLD)
    params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in _REDUCER_SHAPES]
    reducer = eng.GradientReduction(params, dist.group.WORLD, world, microbatches=1,
                                    overlap=True, shard=shard)
    for p in params:  # one microbatch: each hook sees the gradient final
        p.grad = None
    # element-distinct gradients, so a piece written at the wrong offset shows
    grads = [(rank + 1) * (torch.arange(torch.Size(s).numel(), dtype=torch.float64)
                           + 100 * i + 1).view(s) for i, s in enumerate(_REDUCER_SHAPES)]
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    calls = {"all_reduce": 0, "reduce_scatter": 0}
    originals = (dist.all_reduce, eng.reduce_scatter_flat)

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    dist.all_reduce = count("all_reduce", originals[0])
    eng.reduce_scatter_flat = count("reduce_scatter", originals[1])
    try:
        loss.backward()  # the hooks launch every bucket
        launched = reducer.launched_in_backward
        reducer.launch_remaining()
        reducer.finish()
    finally:
        dist.all_reduce, eng.reduce_scatter_flat = originals
    return {"launched": launched, "buckets": len(shard.buckets), "calls": calls,
            "grads": [p.grad.clone() for p in params], "own": grads,
            "pieces": [(pc.param, pc.start, pc.stop) for pc in shard.pieces()]}


def test_each_rank_receives_the_average_of_its_segment_only():
    world = 2
    results = run_distributed(_reducer_worker, world, timeout=120)
    shard = _reducer_shard(0, world, None)
    # the segments tile every bucket: each element of each parameter has one owner
    owner = [torch.full(s, -1) for s in _REDUCER_SHAPES]
    for rank, res in enumerate(results):
        assert res["calls"] == {"all_reduce": 0, "reduce_scatter": res["buckets"]}
        assert res["launched"] == res["buckets"] > 1
        for i, start, stop in res["pieces"]:
            flat = owner[i].view(-1)
            assert (flat[start:stop] == -1).all(), (rank, i, start, stop)
            flat[start:stop] = rank
    assert all((o >= 0).all() for o in owner)
    assert any(len(set(o.view(-1).tolist())) > 1 for o in owner)  # a parameter is cut
    assert all(b.padded % world == 0 and b.padded - b.numel < world for b in shard.buckets)
    for rank, res in enumerate(results):
        for i, (grad, own) in enumerate(zip(res["grads"], res["own"])):
            mean = sum(r["own"][i] for r in results) / world
            expected = torch.where(owner[i] == rank, mean, own)
            assert torch.equal(grad, expected), (rank, i)


def _stats_worker(rank: int, world: int):
    """``local_piece_stats``: each rank holds the true (averaged) gradient in its own
    pieces and garbage elsewhere, a non-finite element included; the statistics come
    from the pieces only, per parameter: the norm to rounding, the counts exactly."""
    import torch.distributed as dist

    from megatron.optimizer.clip_grads import local_grad_stats, local_piece_stats
    from megatron.optimizer.sharding import flat_view

    shard = _reducer_shard(rank, world, dist.group.WORLD)
    gen = torch.Generator().manual_seed(11)
    true = [torch.randn(s, generator=gen, dtype=torch.float64) for s in _REDUCER_SHAPES]
    true[1][2] = 0.0  # not counted (mask False)
    true[0][1, 1] = 0.0
    true[5][0] = 0.0
    mask = [True, False, True, True, False, True]
    held = [(t * 3 + rank).contiguous() for t in true]
    for h in held:
        h.view(-1)[-1] = float("inf")  # garbage outside this rank's pieces...
    pieces = shard.pieces()
    for pc in pieces:  # ...overwritten where it owns the elements
        flat_view(held[pc.param], pc).copy_(flat_view(true[pc.param], pc))
    views = [flat_view(held[pc.param], pc) for pc in pieces]
    owners = [pc.param for pc in pieces]
    sharded = local_piece_stats(views, owners, mask, torch.device("cpu"), True,
                                group=dist.group.WORLD)
    plain = local_grad_stats(true, mask, torch.device("cpu"), True)
    # a non-finite element in BOTH pieces of a cut parameter: one non-finite tensor
    cut = next(i for i in range(len(true)) if all(
        any(pc.param == i for pc in shard.pieces(r)) for r in range(world)))
    for pc, v in zip(pieces, views):
        if pc.param == cut:
            v[0] = float("nan")
    overflow = local_piece_stats(views, owners, mask, torch.device("cpu"), False,
                                 group=dist.group.WORLD)
    return sharded, plain, overflow


def test_sharded_gradient_statistics_come_from_the_pieces():
    for sharded, plain, overflow in run_distributed(_stats_worker, 2, timeout=60):
        assert plain[1] == 0 and plain[2] == 2  # finite; two zeros in the counted grads
        assert sharded[0].item() == pytest.approx(plain[0].item(), rel=1e-14)
        assert torch.equal(sharded[1:], plain[1:]), (sharded, plain)
        assert overflow[1] == 1 and not math.isfinite(overflow[0].item())


# a GPT whose word embedding (8192 x 16 = 131,072 elements) outweighs all its other
# parameters together (~14,000)
_BIG_VOCAB = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
              "--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "8192",
              "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
              "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
              "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "3",
              "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "1",
              "--num-workers", "0", "--pipeline-schedule", "flush", "--bf16",
              "--use-distributed-optimizer"]


def _balance_worker(rank: int, world: int):
    """Train one step; return the elements of optimizer state (moments and fp32
    masters) this rank holds, the stage's parameter sizes and the shard's padding."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.optimizer import optimizer as mod
    from megatron.training import pretrain

    seen = {}
    original = mod.MegatronOptimizer.finish_step

    def spy(self, *args, **kwargs):
        info = original(self, *args, **kwargs)
        moments = sum(t.numel() for st in self.optimizer.state.values()
                      for name, t in st.items() if name != "step")
        masters = sum(m.numel() for m in self.main_params)
        seen.update(moments=moments, masters=masters,
                    numels=list(self.shard.numels),
                    padding=sum(b.padded - b.numel for b in self.shard.buckets))
        return info

    mod.MegatronOptimizer.finish_step = spy
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step, argv=list(_BIG_VOCAB))
    return seen


@pytest.mark.parametrize("world", [2, 4])
def test_state_is_even_when_one_parameter_outweighs_the_rest(world):
    res = run_distributed(_balance_worker, world, timeout=300)
    numels = res[0]["numels"]
    total, largest = sum(numels), max(numels)
    assert largest > total - largest  # the embedding alone: a whole-parameter split fails
    padding = res[0]["padding"]
    for r in res:
        assert r["moments"] == 2 * r["masters"]  # exp_avg and exp_avg_sq per element held
        assert abs(r["masters"] - total / world) <= padding, (r["masters"], total / world)
    assert sum(r["masters"] for r in res) == total


def _fp16(argv):
    return [a for a in argv if a != "--fp64"] + ["--fp16"]


# (ranks, argv): what else a step involves, with and without the flag
_FEATURES = {
    "2bw_dc": (2, _argv("2bw", "--2bw-mitigation", "dc")),
    "per_token_loss": (2, _argv("flush", "--eod-mask-loss", "--calculate-per-token-loss")),
    # fp16 gradients, the dynamic loss scale skipping its first steps
    "fp16": (2, _fp16(_argv("2bw"))),
    # tensor-parallel replicas (counted once in the norm) and sequence-parallel weights
    # (summed over the tensor ranks after the data-parallel reduction)
    "sequence_parallel": (4, _argv("flush", "--tensor-model-parallel-size", "2",
                                   "--sequence-parallel")),
}


def _features_worker(rank: int, world: int, configs, via_main: bool):
    """``train_configs``; ``via_main``: through pretrain_gpt.py's entry (which allows
    per-token losses)."""
    import pretrain_gpt
    from tests.distributed.gpt_harness import summarize

    if not via_main:
        return train_configs(rank, world, configs)
    out = {}
    for name, argv, _ in configs:
        torch.manual_seed(0)
        out[name] = summarize(pretrain_gpt.main(list(argv)), rank)
    return out


@pytest.mark.parametrize("feature", sorted(_FEATURES))
def test_features_train_to_the_same_bits(feature):
    world, argv = _FEATURES[feature]
    configs = [("plain", argv, None), ("dist", argv + ["--use-distributed-optimizer"], None)]
    res = run_distributed(_features_worker, world,
                          args=(configs, feature == "per_token_loss"), timeout=600)
    for r in res:
        a, b = r["plain"], r["dist"]
        assert a["losses"] == b["losses"] and a["skipped"] == b["skipped"]
        assert a["loss_scales"] == b["loss_scales"]
        _same_norms(a["grad_norms"], b["grad_norms"], 1e-6 if feature == "fp16" else 1e-12)
    if feature == "fp16":
        assert res[0]["dist"]["skipped"][0]  # the initial loss scale overflows
    assert sorted(res[-1]["dist"]["losses"]) == [1, 2, 3, 4]


def test_resume_at_another_data_parallel_size(tmp_path):
    """Saved sharded over 2 replicas, resumed sharded over 4 (each now owning other
    pieces): the run goes on as the uninterrupted one, to rounding (4 replicas average
    the gradients in another order)."""
    ckpt = str(tmp_path / "ckpt")
    dist = ("--use-distributed-optimizer",)
    full, first = run_distributed(train_configs, 2, args=([
        ("full", _argv("flush", *dist), None),
        ("first", _argv("flush", "--save", ckpt, "--exit-interval", "2", *dist), None)],),
        timeout=600)[0].values()
    second = run_distributed(train_configs, 4, args=([
        ("second", _argv("flush", "--load", ckpt, *dist), None)],), timeout=600)[0]["second"]
    assert sorted(first["losses"]) == [1, 2] and sorted(second["losses"]) == [3, 4]
    for t, loss in {**first["losses"], **second["losses"]}.items():
        assert loss == pytest.approx(full["losses"][t], rel=1e-12)

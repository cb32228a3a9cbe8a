"""--use-distributed-optimizer on spawned gloo ranks: two data-parallel replicas that
split the optimizer state by parameter train to the same bits as plain data
parallelism (flush and 2BW, float64 and bf16 with fp32 masters), write the same
checkpoint (model and the whole optimizer state, gathered), resume across the flag,
and each keeps only its own share of the state."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs


def _argv(schedule: str, *extra: str):
    return TINY + ["--pipeline-schedule", schedule, *extra]


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
        assert a["grad_norms"] == b["grad_norms"]
        assert a["skipped"] == b["skipped"] == ([False, False, True, False]
                                                if plain == "plain_inf" else [False] * 4)


def _payload(root: str):
    from megatron.checkpointing import load_payload
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
    """Train with ``argv``; return, per optimizer step, whether it ran sharded (owners
    broadcasting their weights) and how many moment elements this rank held."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.optimizer import optimizer as mod
    from megatron.training import pretrain

    seen = []
    original = mod.MegatronOptimizer._share_weights

    def spy(self, write_to):
        seen.append((self.shard is not None,
                     sum(st["exp_avg"].numel() for st in self.optimizer.state.values())))
        return original(self, write_to)

    mod.MegatronOptimizer._share_weights = spy
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
    last stage, are owned and broadcast like any other parameter."""
    configs = [(name, _argv("2bw", "--pipeline-model-parallel-size", "2", *extra), None)
               for name, extra in (("plain", ()), ("dist", ("--use-distributed-optimizer",)))]
    res = run_distributed(train_configs, 4, args=(configs,), timeout=600)
    for rank in range(4):
        assert res[rank]["plain"]["losses"] == res[rank]["dist"]["losses"]
        assert res[rank]["plain"]["grad_norms"] == res[rank]["dist"]["grad_norms"]
    assert sorted(res[-1]["dist"]["losses"]) == [1, 2, 3, 4]


def _one_replica_loss_worker(rank: int, world: int, argv):
    """Train with ``argv``; only data-parallel rank 1 finds batch 2's loss non-finite
    (its gradients stay finite: what the last stage's loss check is for)."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.pipeline import engine as eng
    from megatron.training import pretrain

    original = eng.PipelineEngine._loss_nonfinite

    def one_replica(self, seg, t):
        found = original(self, seg, t)
        return True if (t == 2 and self.groups.dp_rank == 1) else found

    eng.PipelineEngine._loss_nonfinite = one_replica
    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=list(argv))
    return [r.skipped for r in result.reports], result.shared_embedding


@pytest.mark.parametrize("extra", [(), ("--use-distributed-optimizer",)],
                         ids=["plain", "distributed"])
def test_a_replica_that_skips_makes_all_skip(extra):
    """Both replicas skip batch 2 and keep the same weights (before, the other replica
    stepped and the two parted for good; with sharded state they would have waited for
    each other's broadcasts)."""
    res = run_distributed(_one_replica_loss_worker, 2, args=(_argv("2bw", *extra),),
                          timeout=300)
    assert res[0][0] == res[1][0] == [False, False, True, False]
    assert torch.equal(res[0][1], res[1][1])


def _reducer_worker(rank: int, world: int):
    """GradientReduction with the distributed optimizer's shard: the owner of each
    parameter gets the average, the other replica keeps its own gradient, and no
    all-reduce runs."""
    import torch.distributed as dist
    from torch import nn

    from megatron.optimizer.optimizer import OptimizerShard, shard_owners
    from megatron.pipeline.engine import GradientReduction

    shapes = [(6, 4), (4,), (5, 3), (3,), (2, 2)]
    params = [nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
    owners = tuple(shard_owners([p.numel() for p in params], world))
    shard = OptimizerShard(rank=rank, size=world, owners=owners, group=dist.group.WORLD)
    reducer = GradientReduction(params, dist.group.WORLD, world, microbatches=1,
                                bucket_bytes=64, overlap=True, shard=shard)
    buckets = [sorted({owners[i] for i in b}) for b in reducer._buckets]
    for p in params:  # one microbatch: each hook sees the gradient final
        p.grad = None
    grads = [torch.full(s, float(rank + 1), dtype=torch.float64) * (i + 1)
             for i, s in enumerate(shapes)]
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(a) or original(*a, **k)
    try:
        loss.backward()  # the hooks launch every bucket
        launched = reducer.launched_in_backward
        reducer.launch_remaining()
        reducer.finish()
    finally:
        dist.all_reduce = original
    got = [p.grad.clone() for p in params]
    return {"owners": owners, "buckets": buckets, "launched": launched,
            "all_reduces": len(calls), "grads": got}


def test_gradients_are_reduced_to_their_owners_only():
    results = run_distributed(_reducer_worker, 2, timeout=120)
    for rank, res in enumerate(results):
        assert all(len(b) == 1 for b in res["buckets"])  # one owner per bucket
        assert res["all_reduces"] == 0 and res["launched"] == len(res["buckets"])
        for i, (owner, grad) in enumerate(zip(res["owners"], res["grads"])):
            mean = (1 + 2) / 2 * (i + 1)
            own = (rank + 1) * (i + 1)
            expected = mean if owner == rank else own
            assert torch.equal(grad, torch.full_like(grad, expected)), (rank, i, owner)
    assert set(results[0]["owners"]) == {0, 1}


def _stats_worker(rank: int, world: int):
    """``local_grad_stats`` with ``owned``/``group``: each statistic comes from the
    owner's gradient (a non-owner's unreduced copy, even a non-finite one, counts for
    nothing) and equals, bit for bit, the unsharded statistic of the owners' values."""
    import torch.distributed as dist

    from megatron.optimizer.clip_grads import local_grad_stats

    gen = torch.Generator().manual_seed(11)
    true = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(7, 3), (5,), (4, 4)]]
    true[1][2] = 0.0  # not counted (mask False)
    true[0][1, 1] = 0.0
    mask = [True, False, True]
    owners = [0, 1, 1]
    mine = [o == rank for o in owners]
    garbage = [t * 3 + rank for t in true]
    garbage[0 if rank == 1 else 2] = torch.full_like(true[0 if rank == 1 else 2],
                                                    float("inf"))
    held = [t if m else g for t, g, m in zip(true, garbage, mine)]
    sharded = local_grad_stats(held, mask, torch.device("cpu"), True, owned=mine,
                               group=dist.group.WORLD)
    plain = local_grad_stats(true, mask, torch.device("cpu"), True)
    return sharded, plain


def test_sharded_gradient_statistics_are_the_owners():
    for sharded, plain in run_distributed(_stats_worker, 2, timeout=60):
        assert torch.equal(sharded, plain), (sharded, plain)
        assert plain[1] == 0 and plain[2] == 1  # finite; one zero in the counted grads

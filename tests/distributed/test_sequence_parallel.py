"""--sequence-parallel on 2 gloo tensor ranks.

Model level (float64, no dropout): GPT and BERT stages with sequence parallelism give
the single-process model's loss and, once the sequence-parallel weights' partial
gradients are summed over the tensor ranks (what the trainer does at each step), its
gradients -- for the learned-position and the RoPE embedding paths, tied and untied
output layers, a two-stage cut (stage boundaries carry [s/t, b, h]) and layer
recomputation.  The mapping functions are checked against their definitions.

Trainer level: ``pretrain`` with t = 2 and --sequence-parallel trains to the losses of
t = 2 without it (flush and 2BW, d = 1 and d = 2), keeps fewer activation bytes per
stage, and with dropout draws different residual-dropout masks on the two ranks while
keeping the norms' weights equal.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.config import ModelConfig
from megatron.model import BertModel, GPTModel, stage_layer_numbers
from megatron.tensor_parallel import (TPInfo, gather_from_sequence_parallel_region,
                                      reduce_scatter_to_sequence_parallel_region,
                                      scatter_to_sequence_parallel_region)
from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs
from tests.distributed.test_tensor_parallel import (_close, _full_name, _gather,
                                                     _gpt_forward, _run, _tp)

VOCAB, SEQ, BATCH = 32, 8, 2


def _gather_partitions(t: torch.Tensor, tp: TPInfo, dim: int, stride: int) -> torch.Tensor:
    """The whole tensor from the ranks' partitions; with stride k each rank holds its
    share of each of k consecutive blocks (SwiGLU's [gate_r; up_r])."""
    pieces = _gather(t, tp, dim).chunk(tp.size, dim=dim)
    blocks = [piece.chunk(stride, dim=dim) for piece in pieces]
    return torch.cat([blocks[r][i] for i in range(stride) for r in range(tp.size)], dim=dim)


def _mappings(tp: TPInfo) -> None:
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(6, 2, 3, generator=gen, dtype=torch.float64)  # same on both ranks
    upstream = torch.randn(6, 2, 3, generator=gen, dtype=torch.float64)
    rows = slice(3 * tp.rank, 3 * tp.rank + 3)

    x = full.clone().requires_grad_()
    out = scatter_to_sequence_parallel_region(x, tp)
    _close(out, full[rows], "scatter forward")
    out.backward(upstream[rows])
    # backward all-gathers: each rank's rows come from that rank's upstream slice
    _close(x.grad, upstream, "scatter backward")

    part = (full * (tp.rank + 1)).clone().requires_grad_()   # rank-dependent partials
    out = reduce_scatter_to_sequence_parallel_region(part, tp)
    _close(out, (full * 3)[rows], "reduce-scatter forward (1 + 2 = 3 times)")
    out.backward(upstream[rows])
    _close(part.grad, upstream, "reduce-scatter backward (all-gather)")

    local = full[rows].clone().requires_grad_()
    out = gather_from_sequence_parallel_region(local, tp)
    _close(out, full, "gather forward")
    out.backward(upstream * (tp.rank + 1))
    _close(local.grad, (upstream * 3)[rows], "gather backward (reduce-scatter)")
    local = full[rows].clone().requires_grad_()
    out = gather_from_sequence_parallel_region(local, tp, tensor_parallel_output_grad=False)
    out.backward(upstream)
    _close(local.grad, upstream[rows], "gather backward (own rows)")


def _compare(stages, full, tp: TPInfo, what: str) -> None:
    ref = dict(full.named_parameters())
    grads, marked = {}, set()
    for stage in stages:
        for name, p in stage.named_parameters():
            grad = p.grad
            if getattr(p, "sequence_parallel", False):
                marked.add(name)
                grad = grad.clone()
                dist.all_reduce(grad, group=tp.group)  # the trainer's per-step sum
            if p.tensor_model_parallel:
                grad = _gather_partitions(grad, tp, p.partition_dim, p.partition_stride)
            key = _full_name(stage, name)
            grads[key] = grads.get(key, 0) + grad
    assert set(grads) == set(ref)
    assert marked, f"{what}: no parameter is marked sequence_parallel"
    for key, grad in grads.items():
        _close(grad, ref[key].grad, f"{what}: grad {key}")


def _gpt_variant(tp: TPInfo, pp: int, what: str, tied: bool = True, **options) -> None:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=SEQ,
                      padded_vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                      params_dtype=torch.float64, **options)
    sp_cfg = ModelConfig(**{**cfg.__dict__, "sequence_parallel": True})
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    full = GPTModel(cfg, TPInfo.single(), seed=9, share_embeddings_and_output_weights=tied)
    loss_ref, _ = _run([full], _gpt_forward(ids, labels))
    stages = [GPTModel(sp_cfg, tp, pre_process=r == 0, post_process=r == pp - 1,
                       layer_numbers=stage_layer_numbers(cfg.num_layers, pp, r), seed=9,
                       share_embeddings_and_output_weights=tied) for r in range(pp)]
    if pp > 1:
        assert stages[1].stage_input_shape(BATCH) == (SEQ // 2, BATCH, 16)
    loss, outputs = _run(stages, _gpt_forward(ids, labels))
    _close(loss, loss_ref, f"{what}: loss")
    for out in outputs[:-1]:
        assert out.shape == (SEQ // 2, BATCH, 16), f"{what}: stage output {tuple(out.shape)}"
    _compare(stages, full, tp, what)
    if pp == 1:
        with torch.no_grad():
            _close(_gather(stages[0](ids, None, None), tp, -1), full(ids, None, None),
                   f"{what}: logits")


def _bert_variant(tp: TPInfo, pp: int) -> None:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=SEQ,
                      padded_vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                      params_dtype=torch.float64, num_tokentypes=2)
    sp_cfg = ModelConfig(**{**cfg.__dict__, "sequence_parallel": True})
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    types = torch.randint(0, 2, (BATCH, SEQ), generator=gen)
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[1, -3:] = 0

    def forward(model):
        out = model(ids, padding, types, lm_labels=labels if model.post_process else None)
        if not model.post_process:
            return out
        lm, binary = out
        return torch.cat([lm.reshape(-1), binary.reshape(-1)])
    full = BertModel(cfg, TPInfo.single(), seed=9)
    loss_ref, _ = _run([full], forward)
    stages = [BertModel(sp_cfg, tp, pre_process=r == 0, post_process=r == pp - 1,
                        layer_numbers=stage_layer_numbers(cfg.num_layers, pp, r), seed=9)
              for r in range(pp)]
    loss, _ = _run(stages, forward)
    _close(loss, loss_ref, f"BERT pp={pp}: loss")
    _compare(stages, full, tp, f"BERT pp={pp}")


def _model_worker(rank: int, world_size: int) -> bool:
    tp = _tp(rank, world_size)
    _mappings(tp)
    _gpt_variant(tp, 1, "GPT learned positions")
    _gpt_variant(tp, 2, "GPT two stages")
    _gpt_variant(tp, 1, "GPT RoPE, RMSNorm, SwiGLU, GQA, untied", tied=False,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                 num_query_groups=2, add_bias_linear=False, ffn_hidden_size=24)
    _gpt_variant(tp, 2, "GPT uniform recompute, no bias", recompute_granularity="full",
                 recompute_method="uniform", recompute_num_layers=1, add_bias_linear=False)
    _gpt_variant(tp, 1, "GPT selective recompute, local attention",
                 recompute_granularity="selective", attention_backend="local")
    _bert_variant(tp, 1)
    _bert_variant(tp, 2)
    return True


def test_sequence_parallel_model_matches_single_process():
    results = run_distributed(_model_worker, world_size=2, timeout=300)
    assert results == [True, True], results


def _bad_seq_worker(rank: int, world_size: int) -> str:
    tp = _tp(rank, world_size)
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=7,
                      padded_vocab_size=VOCAB, sequence_parallel=True)
    try:
        GPTModel(cfg, tp)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_sequence_length_must_divide():
    for message in run_distributed(_bad_seq_worker, world_size=2):
        assert "--seq-length 7" in message and "--sequence-parallel" in message, message


def _layer_stash(config: ModelConfig, tp: TPInfo, seq_rows: int, b: int) -> int:
    """Bytes the executor's counter charges one trainer layer on this rank."""
    from megatron.model.transformer import ParallelTransformerLayer
    from megatron.pipeline.memory import StashTracker

    layer = ParallelTransformerLayer(config, tp, 0, seed=1).train()
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(seq_rows, b, config.hidden_size, requires_grad=True)
    tracker = StashTracker(skip)
    with tracker.counting(0):
        out = layer(x, None, None)
    out.sum().backward()
    return tracker.in_flight[0]


def _count_worker(rank: int, world_size: int):
    """The planner's layer formula at t = 2 against the executor's count of a trainer
    layer, with and without sequence parallelism (float32: the formula's 2-byte values
    are 4 bytes; no dropout: no masks; sdpa: a float32 log-sum-exp per query head)."""
    from megatron.pipeline.planner.model_spec import ModelSpec

    tp = _tp(rank, world_size)
    s, b, h, a, f = 16, 2, 32, 4, 40
    out = {}
    for sp in (False, True):
        config = ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=a,
                             seq_length=s, ffn_hidden_size=f, padded_vocab_size=64,
                             hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sp)
        spec = ModelSpec(num_layers=2, hidden_size=h, num_attention_heads=a, seq_length=s,
                         ffn_hidden_size=f, vocab_size=64, sequence_parallel=sp)
        rows = s // 2 if sp else s
        lse = (a // 2) * b * s                      # this rank's heads, every query
        masks = 2 * rows * b * h                    # the two residual dropout masks
        fp16 = spec.layer_activation_bytes(b, 2) - masks - 4 * lse
        norms = 2 * 2 * rows * b                    # LayerNorm's mean and 1/std per token
        out[sp] = (_layer_stash(config, tp, rows, b), 4 * (fp16 / 2 + norms + lse))
    return out


def test_layer_formula_matches_the_executor_count():
    for per_rank in run_distributed(_count_worker, world_size=2):
        for sp, (counted, formula) in per_rank.items():
            assert counted == formula, (sp, counted, formula)
        assert per_rank[True][0] < per_rank[False][0]


# ---------------------------------------------------------------- trainer level
_T2 = ["--tensor-model-parallel-size", "2"]
_SP = ["--sequence-parallel"]


def _with_dropout(argv):
    out = list(argv)
    for flag in ("--hidden-dropout", "--attention-dropout"):
        out[out.index(flag) + 1] = "0.2"
    return out


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sp_dropout"))


@pytest.fixture(scope="module")
def trained(save_dir):
    configs = []
    for schedule in ("flush", "2bw"):
        base = TINY + _T2 + ["--pipeline-schedule", schedule, "--log-params-norm",
                             "--pipeline-model-parallel-size", "2"]
        configs += [(f"{schedule}", base, None), (f"{schedule}_sp", base + _SP, None)]
    configs.append(("dropout_sp", _with_dropout(TINY + _T2 + _SP + [
        "--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "2",
        "--save", save_dir]), None))
    return run_distributed(train_configs, 4, args=(configs,), timeout=600)


def test_trainer_sequence_parallel_trains_to_the_same_losses(trained):
    for rank in range(4):  # ranks 0, 1: stage 0; ranks 2, 3: stage 1 (reports losses)
        for schedule in ("flush", "2bw"):
            plain, sp = trained[rank][schedule], trained[rank][f"{schedule}_sp"]
            assert sorted(plain["losses"]) == ([1, 2, 3, 4] if rank >= 2 else [])
            assert len(plain["grad_norms"]) == len(sp["grad_norms"]) == 4
            for it, loss in plain["losses"].items():
                assert sp["losses"][it] == pytest.approx(loss, rel=0, abs=1e-12), (schedule, it)
            for a, b in zip(plain["grad_norms"] + plain["params_norms"],
                            sp["grad_norms"] + sp["params_norms"]):
                assert b == pytest.approx(a, rel=1e-12), schedule


def test_trainer_sequence_parallel_stashes_less(trained):
    for schedule in ("flush", "2bw"):
        plain = trained[0][schedule]["memory"]["per_rank"]
        sp = trained[0][f"{schedule}_sp"]["memory"]["per_rank"]
        for a, b in zip(plain, sp):
            assert a["rank"] == b["rank"]
            assert b["peak_stashed_activation_bytes"] < a["peak_stashed_activation_bytes"], \
                (schedule, a, b)


def test_dropout_keeps_replicated_weights_equal_across_tensor_ranks(trained, save_dir):
    """With dropout each rank draws its own residual-dropout masks (its own positions);
    the norms' weights and the row-parallel biases, whose gradients are summed over the
    tensor ranks every step, stay bit-identical on both ranks (a missing sum would let
    them drift apart at the first step)."""
    import glob
    import os

    from megatron.checkpoint_files import load_payload
    losses = trained[2]["dropout_sp"]["losses"]
    assert sorted(losses) == [1, 2, 3, 4] and all(v == v and v < 10 for v in losses.values())
    stems = sorted(glob.glob(os.path.join(save_dir, "iter_0000004", "*",
                                          "model_optim_rng.json")))
    assert len(stems) == 4, stems  # tensor 0/1 x stage 0/1
    by_stage = {}
    for stem in stems:
        by_stage.setdefault(os.path.basename(os.path.dirname(stem))[-3:], []).append(
            load_payload(stem[:-len(".json")])["model"])
    compared = 0
    for stage, (m0, m1) in by_stage.items():
        for key, value in m0.items():
            if "layernorm" in key or key.endswith("dense.bias") \
                    or key.endswith("dense_4h_to_h.bias"):
                assert torch.equal(value, m1[key]), (stage, key)
                compared += 1
            elif key.endswith("query_key_value.weight"):
                assert not torch.equal(value, m1[key]), (stage, key)  # partitions differ
    assert compared >= 12, compared

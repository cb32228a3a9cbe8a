"""Tensor parallelism on 2 gloo ranks equals the single-process computation (float64)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model import GPTModel, stage_layer_numbers
from megatron.parallel_state import ParallelGroups, RankLayout
from megatron.tensor_parallel import (ColumnParallelLinear, InitKey, RowParallelLinear, TPInfo,
                                      VocabParallelEmbedding, vocab_parallel_cross_entropy)
from tests.dist_utils import run_distributed

ATOL = 1e-10
VOCAB, SEQ, BATCH = 32, 8, 2


def _tp(rank: int, world_size: int) -> TPInfo:
    groups = ParallelGroups.build(RankLayout(world_size, tensor=world_size), rank)
    return TPInfo.from_groups(groups)


def _gather(t: torch.Tensor, tp: TPInfo, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(pieces, t.contiguous(), group=tp.group)
    return torch.cat(pieces, dim=dim)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _config(**kw) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=SEQ,
                       padded_vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                       params_dtype=torch.float64, **kw)


def _run(stages, forward):
    """Forward + backward through (possibly several) stages held by this process (the
    pipeline by hand); ``forward(stage)`` runs one.  Returns the loss and each stage's
    output."""
    inputs, outputs, x = [], [], None
    for stage in stages:
        if not stage.pre_process:
            x = x.detach().requires_grad_()
            stage.set_input_tensor(x)
        inputs.append(x)
        x = forward(stage)
        outputs.append(x)
    loss = outputs[-1].mean()
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    return loss.detach(), outputs


def _gpt_forward(ids, labels):
    return lambda stage: stage(ids, None, None,
                               labels=labels if stage.post_process else None)


def _full_name(stage, name: str) -> str:
    if name == "output_word_embeddings.weight":
        return "embedding.word_embeddings.weight"
    if name.startswith("encoder.layers."):
        local, rest = name[len("encoder.layers."):].split(".", 1)
        return f"encoder.layers.{stage.layer_numbers[int(local)]}.{rest}"
    return name


def _check_variant(tp: TPInfo, pp: int, tied: bool, recompute: dict) -> None:
    cfg = _config(**recompute)
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    full = GPTModel(cfg, TPInfo.single(), seed=9, share_embeddings_and_output_weights=tied)
    loss_ref, _ = _run([full], _gpt_forward(ids, labels))
    stages = [GPTModel(cfg, tp, pre_process=r == 0, post_process=r == pp - 1,
                       layer_numbers=stage_layer_numbers(cfg.num_layers, pp, r), seed=9,
                       share_embeddings_and_output_weights=tied) for r in range(pp)]
    loss, _ = _run(stages, _gpt_forward(ids, labels))
    _close(loss, loss_ref, f"loss pp={pp} tied={tied}")
    ref = dict(full.named_parameters())
    grads = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            if p.tensor_model_parallel:
                value, grad = _gather(p, tp, p.partition_dim), _gather(p.grad, tp, p.partition_dim)
            else:
                value, grad = p, p.grad
            key = _full_name(stage, name)
            _close(value, ref[key], f"initial {key}")
            grads[key] = grads.get(key, 0) + grad
    assert set(grads) == set(ref)
    for key, grad in grads.items():
        _close(grad, ref[key].grad, f"grad {key} pp={pp} tied={tied} {recompute}")
    if pp == 1:
        with torch.no_grad():
            _close(_gather(stages[0](ids, None, None), tp, -1), full(ids, None, None), "logits")


def _gpt_worker(rank: int, world_size: int) -> bool:
    tp = _tp(rank, world_size)
    assert tp.size == 2 and tp.rank == rank
    _check_variant(tp, pp=1, tied=True, recompute={})
    _check_variant(tp, pp=2, tied=True, recompute={})
    _check_variant(tp, pp=1, tied=False, recompute={"recompute_granularity": "selective"})
    return True


def test_gpt_tp2_matches_single_process():
    results = run_distributed(_gpt_worker, world_size=2)
    assert results == [True, True], results


def _layers_worker(rank: int, world_size: int) -> bool:
    tp = _tp(rank, world_size)
    gen = torch.Generator().manual_seed(1)
    dt = torch.float64

    # Cross-entropy: each rank holds a vocab slice of the same full logits.
    logits = torch.randn(4, 3, 10, generator=gen, dtype=dt) * 30
    target = torch.randint(0, 10, (4, 3), generator=gen)
    upstream = torch.rand(4, 3, generator=gen, dtype=dt)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, 10), target.view(-1), reduction="none").view(4, 3)
    (ref * upstream).sum().backward()
    for fused in (False, True):  # the chunked code and the torch.compile'd kernels
        part = logits.chunk(2, dim=-1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(part, target, tp, fused=fused)
        (loss * upstream).sum().backward()
        _close(loss, ref.detach(), f"cross-entropy loss (fused={fused})")
        _close(part.grad, full.grad.chunk(2, dim=-1)[rank], f"cross-entropy grad (fused={fused})")

    # Linear layers and embedding against their tp=1 twins (same init keys).
    x = torch.randn(5, 2, 8, generator=gen, dtype=dt)
    key = InitKey(2, 0, "layer")
    for cls, kw in ((ColumnParallelLinear, {"gather_output": True}),
                    (RowParallelLinear, {"input_is_parallel": False})):
        single = cls(8, 6, tp=TPInfo.single(), params_dtype=dt, init_key=key, **kw)
        par = cls(8, 6, tp=tp, params_dtype=dt, init_key=key, **kw)
        xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_s, out_p = single(xs)[0], par(xp)[0]
        _close(out_p, out_s, f"{cls.__name__} output")
        (out_s * out_s).sum().backward()
        (out_p * out_p).sum().backward()
        _close(xp.grad, xs.grad, f"{cls.__name__} input grad")
        _close(_gather(par.weight.grad, tp, par.weight.partition_dim), single.weight.grad,
               f"{cls.__name__} weight grad")
    ids = torch.tensor([[0, 5, 9, 4], [7, 2, 2, 3]])
    single = VocabParallelEmbedding(10, 4, tp=TPInfo.single(), params_dtype=dt, init_key=key)
    par = VocabParallelEmbedding(10, 4, tp=tp, params_dtype=dt, init_key=key)
    out_s, out_p = single(ids), par(ids)
    _close(out_p, out_s, "embedding output")
    (out_s ** 2).sum().backward()
    (out_p ** 2).sum().backward()
    _close(_gather(par.weight.grad, tp, 0), single.weight.grad, "embedding grad")
    return True


def test_layers_and_cross_entropy_tp2():
    results = run_distributed(_layers_worker, world_size=2)
    assert results == [True, True], results

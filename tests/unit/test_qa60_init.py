"""QA pass 60: a fresh model's initial weights, tensor by tensor, against Megatron-LM.

Megatron-LM (legacy ``megatron/model`` and Megatron Core alike) draws every weight
matrix from N(0, --init-method-std^2) -- word, position and token-type embeddings,
QKV, fc1, the untied output layer, BERT's LM-head dense, pooler and binary head, the
finetuning heads -- except the two output projections of each block (attention dense,
MLP fc2), which get std / sqrt(2 * --num-layers).  Biases start at 0, LayerNorm at
weight 1 / bias 0.  --init-method-xavier-uniform replaces both by Xavier's uniform.
Here the draws are measured on a mid-size model (4 layers, hidden 256) and compared
with those values; the full (gathered) tensor-parallel weights must equal the
single-rank ones (the layout-independent rule of megatron/tensor_parallel/param_init.py,
Megatron-LM's --use-cpu-initialization), and pipeline stages must hold their global
layers' weights, not a repeat of the first stage's.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel
from megatron.model.classification import Classification
from megatron.model.gpt_model import GPTModel
from megatron.model.multiple_choice import MultipleChoice
from megatron.tensor_parallel import TPInfo
from megatron.tensor_parallel.param_init import unshard

STD = 0.02
LAYERS = 4


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=LAYERS, hidden_size=256, num_attention_heads=8, seq_length=64,
                padded_vocab_size=2048, max_position_embeddings=256, init_method_std=STD)
    base.update(kw)
    return ModelConfig(**base)


def _expected(name: str, std: float = STD, layers: int = LAYERS):
    """(kind, value) Megatron-LM gives parameter ``name``: ('normal', std), ('const', c)."""
    if name.endswith("layernorm.weight"):
        return "const", 1.0
    if name.endswith(".bias") or name == "lm_head.bias":
        return "const", 0.0
    if name.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
        return "normal", std / math.sqrt(2.0 * layers)
    return "normal", std


def _check_distribution(model: torch.nn.Module, std: float = STD,
                        layers: int = LAYERS) -> list:
    seen = []
    for name, p in model.named_parameters():
        kind, value = _expected(name, std, layers)
        t = p.detach().double()
        if kind == "const":
            assert torch.all(t == value), f"{name}: expected all {value}"
            continue
        n = t.numel()
        # the sample std of n normal draws has relative error ~ 1/sqrt(2n): 6 of those
        tol = 6.0 / math.sqrt(2.0 * n) + 1e-3
        assert abs(t.std().item() / value - 1.0) < tol, \
            f"{name}: std {t.std().item():.5f}, Megatron-LM's {value:.5f}"
        assert abs(t.mean().item()) < 6.0 * value / math.sqrt(n), f"{name}: mean {t.mean()}"
        # a normal's 4th moment is 3 sigma^4 (a uniform's 1.8): the shape, not just the std
        if n >= 4096:
            kurt = ((t - t.mean()) ** 4).mean().item() / t.var().item() ** 2
            assert 2.7 < kurt < 3.3, f"{name}: kurtosis {kurt:.2f}, not a normal's 3"
        seen.append(name)
    return seen


def test_gpt_untied_every_tensor_has_megatrons_distribution():
    seen = _check_distribution(GPTModel(_cfg(untie_embeddings_and_output_weights=True),
                                        TPInfo()))
    assert {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
            "output_layer.weight"} <= set(seen)
    assert sum("dense_4h_to_h.weight" in n or "attention.dense.weight" in n
               for n in seen) == 2 * LAYERS


def test_bert_and_its_heads_have_megatrons_distribution():
    seen = _check_distribution(BertModel(_cfg(num_tokentypes=2), TPInfo()))
    assert {"embedding.tokentype_embeddings.weight", "pooler.dense.weight",
            "lm_head.dense.weight", "binary_head.weight"} <= set(seen)


@pytest.mark.parametrize("build", [
    lambda c: Classification(c, TPInfo(), num_classes=3),
    lambda c: MultipleChoice(c, TPInfo(), num_choices=4)])
def test_finetuning_heads_have_megatrons_distribution(build):
    seen = _check_distribution(build(_cfg(num_layers=1, num_tokentypes=2)), STD, 1)
    assert any(n.startswith(("classification_head", "multichoice_head")) for n in seen)


def test_other_std_and_layer_count_scale_the_output_projections():
    c = _cfg(num_layers=2, hidden_size=128, num_attention_heads=4, init_method_std=0.006)
    model = GPTModel(c, TPInfo())
    for name, p in model.named_parameters():
        kind, value = _expected(name, 0.006, 2)
        if kind == "normal":
            assert abs(p.detach().double().std().item() / value - 1) < 0.08, name


def test_xavier_uniform_bounds_are_the_full_matrices():
    model = BertModel(_cfg(num_layers=2, num_tokentypes=2, init_method_xavier_uniform=True),
                      TPInfo())
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        bound = math.sqrt(6.0 / (p.shape[0] + p.shape[1]))
        t = p.detach().double()
        assert t.abs().max().item() <= bound + 1e-7, name
        if t.numel() >= 4096:  # a uniform's std is bound / sqrt(3)
            assert abs(t.std().item() / (bound / math.sqrt(3)) - 1) < 0.05, name


@pytest.mark.parametrize("build,kw", [
    (GPTModel, dict(untie_embeddings_and_output_weights=True)),
    (GPTModel, dict(swiglu=True, num_query_groups=4, add_bias_linear=False)),
    (GPTModel, dict(init_method_xavier_uniform=True)),
    (BertModel, dict(num_tokentypes=2)),
])
def test_tensor_parallel_weights_gather_to_the_single_rank_ones(build, kw):
    """t = 2: each rank's slice is the slice of the t = 1 tensor, so the gathered weight
    has exactly the single-rank distribution (Megatron-LM's --use-cpu-initialization);
    replicated weights are equal on both ranks."""
    c = _cfg(num_layers=2, hidden_size=128, **kw)
    ref = dict(build(c, TPInfo()).named_parameters())
    ranks = [dict(build(c, TPInfo(group=object(), size=2, rank=r)).named_parameters())
             for r in range(2)]
    assert set(ranks[0]) == set(ref)
    split = 0
    for name, full in ref.items():
        p0 = ranks[0][name]
        if getattr(p0, "tensor_model_parallel", False):
            got = unshard([ranks[r][name].detach() for r in range(2)], p0.partition_dim,
                          p0.partition_stride)
            split += 1
            if p0.dim() == 2:  # not the same draw on both ranks
                assert not torch.equal(ranks[0][name], ranks[1][name]), name
        else:
            assert torch.equal(ranks[1][name], p0), name
            got = p0.detach()
        assert torch.equal(got, full.detach()), name
    assert split >= 5


@pytest.mark.parametrize("build,kw", [(GPTModel, {}), (BertModel, dict(num_tokentypes=2))])
def test_later_pipeline_stages_hold_their_own_layers(build, kw):
    c = _cfg(num_layers=4, hidden_size=64, num_attention_heads=4, **kw)
    ref = dict(build(c, TPInfo()).named_parameters())
    last = dict(build(c, TPInfo(), pre_process=False, post_process=True,
                      layer_numbers=range(2, 4)).named_parameters())
    for name, p in last.items():
        if name.startswith("encoder.layers."):
            i = int(name.split(".")[2])
            ref_name = name.replace(f"encoder.layers.{i}.", f"encoder.layers.{i + 2}.", 1)
            assert torch.equal(p, ref[ref_name]), name
        elif name == "output_word_embeddings.weight":  # the tied copy starts equal
            assert torch.equal(p, ref["embedding.word_embeddings.weight"])
        else:
            assert torch.equal(p, ref[name]), name
    # no two weight matrices of the model repeat or correlate
    mats = [(n, p.detach().flatten().double()) for n, p in ref.items()
            if p.dim() == 2 and p.numel() >= 4096]
    for i, (na, a) in enumerate(mats):
        for nb, b in mats[i + 1:]:
            k = min(a.numel(), b.numel())
            corr = torch.corrcoef(torch.stack([a[:k], b[:k]]))[0, 1].abs().item()
            assert corr < 6.0 / math.sqrt(k), (na, nb, corr)

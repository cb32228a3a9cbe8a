"""GPTModel: shapes, initialisation rule, causal masking and pipeline-stage splits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model import GPTModel, get_attention_mask, stage_layer_numbers
from megatron.model.transformer import CoreAttention
from megatron.model.utils import padding_attention_mask
from megatron.tensor_parallel import TPInfo, model_parallel_seed

VOCAB, SEQ, BATCH = 48, 12, 3


def make_config(**overrides) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=16, num_attention_heads=4, seq_length=SEQ,
                padded_vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=torch.float64)
    base.update(overrides)
    return ModelConfig(**base)


def make_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build_stages(config: ModelConfig, pp: int, seed: int = 7):
    stages = []
    for rank in range(pp):
        stages.append(GPTModel(config, TPInfo.single(), pre_process=rank == 0,
                               post_process=rank == pp - 1,
                               layer_numbers=stage_layer_numbers(config.num_layers, pp, rank),
                               seed=seed))
    return stages


def run_stages(stages, ids, labels, mask=None):
    """Forward/backward through the stages in one process, as a pipeline would."""
    inputs, outputs = [], []
    x = None
    for stage in stages:
        if not stage.pre_process:
            x = x.detach().requires_grad_()
            stage.set_input_tensor(x)
        inputs.append(x)
        x = stage(ids, None, mask, labels=labels if stage.post_process else None)
        outputs.append(x)
    loss = outputs[-1].mean()
    loss.backward()
    for i in range(len(stages) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    return loss.detach()


def global_name(stage: GPTModel, name: str) -> str:
    """Parameter name in the one-stage model (layer indices are local to a stage)."""
    if name == "output_word_embeddings.weight":
        return "embedding.word_embeddings.weight"
    if name.startswith("encoder.layers."):
        local, rest = name[len("encoder.layers."):].split(".", 1)
        return f"encoder.layers.{stage.layer_numbers[int(local)]}.{rest}"
    return name


def stage_grads(stages) -> dict:
    """Gradients by full-model parameter name; the two tied copies are summed."""
    grads = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            name = global_name(stage, name)
            grads[name] = grads.get(name, 0) + p.grad
    return grads


def test_shapes_and_outputs():
    cfg = make_config()
    ids, labels = make_batch()
    model = GPTModel(cfg, TPInfo.single(), seed=1)
    loss = model(ids, None, None, labels=labels)
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float64
    logits = model(ids, None, None)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                            reduction="none").view(BATCH, SEQ)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)

    first, last = build_stages(cfg, 2)
    hidden = first(ids, None, None)
    assert hidden.shape == first.stage_input_shape(BATCH) == (SEQ, BATCH, cfg.hidden_size)
    assert hidden.is_contiguous()
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        last(None, None, None, labels=labels)


def test_fp32_loss_for_half_params():
    cfg = make_config(params_dtype=torch.bfloat16)
    ids, labels = make_batch()
    loss = GPTModel(cfg, TPInfo.single(), seed=1)(ids, None, None, labels=labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()


def test_init_rule_same_seed_same_weights_other_seed_differs():
    cfg = make_config()
    a = dict(GPTModel(cfg, TPInfo.single(), seed=3).named_parameters())
    b = dict(GPTModel(cfg, TPInfo.single(), seed=3).named_parameters())
    c = dict(GPTModel(cfg, TPInfo.single(), seed=4).named_parameters())
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["encoder.layers.0.mlp.dense_h_to_4h.weight"],
                           c["encoder.layers.0.mlp.dense_h_to_4h.weight"])
    # Different layers and different matrices must not share draws.
    assert not torch.equal(a["encoder.layers.0.mlp.dense_h_to_4h.weight"],
                           a["encoder.layers.1.mlp.dense_h_to_4h.weight"])
    # Output projections use std / sqrt(2 L); inputs use std.
    big = GPTModel(make_config(hidden_size=64, num_attention_heads=4), TPInfo.single(), seed=0)
    std_in = big.encoder.layers[0].mlp.dense_h_to_4h.weight.std().item()
    std_out = big.encoder.layers[0].mlp.dense_4h_to_h.weight.std().item()
    assert abs(std_in - 0.02) < 0.002
    assert abs(std_out - 0.02 / (2 * 4) ** 0.5) < 0.001


@pytest.mark.parametrize("pp", [2, 4])
def test_stage_weights_match_full_model(pp):
    cfg = make_config()
    full = dict(GPTModel(cfg, TPInfo.single(), seed=7).named_parameters())
    stages = build_stages(cfg, pp)
    for stage in stages:
        for name, p in stage.named_parameters():
            assert torch.equal(p, full[global_name(stage, name)]), name
    last = stages[-1]
    assert last.output_word_embeddings.weight.shared is True
    assert last.output_word_embeddings.weight.shared_embedding is True
    assert stages[0].embedding.word_embeddings.weight.shared_embedding is True
    assert not hasattr(stages[0].embedding.word_embeddings.weight, "shared")
    assert last.shared_embedding_weight() is last.output_word_embeddings.weight
    assert stages[0].shared_embedding_weight() is stages[0].embedding.word_embeddings.weight
    if pp == 4:
        assert stages[1].shared_embedding_weight() is None
        assert stages[1].encoder.final_layernorm is None


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_stage_split_matches_single_stage_exactly(pp, dropout):
    torch.set_num_threads(1)
    cfg = make_config(hidden_dropout=dropout, attention_dropout=dropout)
    ids, labels = make_batch(1)
    model_parallel_seed(11)
    whole = build_stages(cfg, 1)
    loss_ref = run_stages(whole, ids, labels)
    model_parallel_seed(11)
    stages = build_stages(cfg, pp)
    loss = run_stages(stages, ids, labels)
    assert torch.equal(loss, loss_ref)
    ref, got = stage_grads(whole), stage_grads(stages)
    assert set(ref) == set(got)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_untied_output_layer():
    cfg = make_config()
    ids, labels = make_batch()
    model = GPTModel(cfg, TPInfo.single(), seed=1, share_embeddings_and_output_weights=False)
    assert model.shared_embedding_weight() is None
    assert model.output_layer.weight.shape == (VOCAB, cfg.hidden_size)
    assert not torch.equal(model.output_layer.weight, model.embedding.word_embeddings.weight)
    model(ids, None, None, labels=labels).mean().backward()
    assert model.output_layer.weight.grad.abs().sum() > 0


def test_causal_mask_blocks_future_tokens():
    cfg = make_config()
    ids, labels = make_batch()
    model = GPTModel(cfg, TPInfo.single(), seed=1)
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % VOCAB
    a = model(ids, None, None)
    b = model(changed, None, None)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    explicit = model(ids, None, get_attention_mask("causal", SEQ))
    torch.testing.assert_close(explicit, a, rtol=0, atol=1e-12)
    full = model(ids, None, get_attention_mask("none", SEQ))
    assert not torch.allclose(full[:, :7], a[:, :7])


def test_sdpa_backend_matches_manual():
    cfg = make_config()
    core_manual, core_sdpa = CoreAttention(cfg, TPInfo.single(), "manual"), \
        CoreAttention(cfg, TPInfo.single(), "sdpa")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SEQ, 2, 4, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(2, SEQ, dtype=torch.bool)
    pad[1, 9:] = False
    for mask in (None, padding_attention_mask(pad)):
        # Queries at padding positions see no key at all; their (ignored) outputs differ
        # by design (masked_fill vs additive mask), so compare real-token rows only.
        torch.testing.assert_close(core_sdpa(q, k, v, mask)[:9], core_manual(q, k, v, mask)[:9],
                                   rtol=0, atol=1e-12)


def test_utils_and_bad_input():
    assert stage_layer_numbers(8, 4, 2) == range(4, 6)
    assert stage_layer_numbers(3, 1, 0) == range(0, 3)
    with pytest.raises(ValueError, match=r"--num-layers \(6\) must be divisible"):
        stage_layer_numbers(6, 4, 0)
    mask = get_attention_mask("causal", 3)
    assert mask.shape == (1, 1, 3, 3)
    assert mask[0, 0].tolist() == [[False, True, True], [False, False, True],
                                   [False, False, False]]
    cfg = make_config()
    with pytest.raises(ValueError, match="pre_process=True"):
        GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                 layer_numbers=range(1, 4))
    with pytest.raises(ValueError, match="post_process=True"):
        GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                 layer_numbers=range(0, 2))
    with pytest.raises(ValueError, match="padded_vocab_size"):
        GPTModel(dataclasses.replace(cfg, padded_vocab_size=0), TPInfo.single())
    with pytest.raises(ValueError, match="bool"):
        GPTModel(cfg, TPInfo.single())(make_batch()[0], None, torch.zeros(1, 1, SEQ, SEQ))


def test_uneven_stage_split():
    """--decoder-first/last-pipeline-num-layers: fixed first/last stage, even middle."""
    from megatron.model.utils import stage_layer_counts

    assert stage_layer_counts(8, 4, first=1, last=1) == [1, 3, 3, 1]
    assert stage_layer_counts(4, 2, first=3) == [3, 1]
    assert stage_layer_counts(6, 3, last=2) == [2, 2, 2]
    assert stage_layer_counts(7, 4, first=1) == [1, 2, 2, 2]
    assert [stage_layer_numbers(8, 4, r, first=1, last=1) for r in range(4)] == [
        range(0, 1), range(1, 4), range(4, 7), range(7, 8)]
    for bad in (dict(first=0), dict(first=8), dict(first=2, last=3)):
        with pytest.raises(ValueError, match="decoder"):
            stage_layer_counts(8, 2, **bad)
    with pytest.raises(ValueError, match="split evenly"):
        stage_layer_counts(8, 4, first=3)


"""QA pass 60: the forward pass's less common options and dropout, against Megatron-LM.

A functional GPT/BERT written from Megatron-LM's description (legacy
``megatron/model/{language_model,transformer,bert_model}.py``):

* embeddings: word + position (+ token type), then dropout with --hidden-dropout;
* each layer: LN1 -> QKV -> softmax(QK^T / sqrt(d) + mask) -> dropout with
  --attention-dropout -> dense (+ bias) -> dropout with --hidden-dropout -> + residual;
  LN2 -> fc1 (+ bias) -> GeLU / tanh-GeLU (--openai-gelu) / relu^2 (--squared-relu) ->
  fc2 (+ bias) -> dropout -> + residual; the residual is the LN's output with
  --apply-residual-connection-post-layernorm, its input otherwise;
* a final LayerNorm (GPT and BERT), then GPT's logits against the word embedding, or
  BERT's LM head (dense -> GeLU -> LN -> logits + bias) and its binary head on the
  pooled position 0 (tanh(dense(h[0]))), no dropout in the heads;
* finetuning heads: dropout (--hidden-dropout) on the pooled output, then the linear.

With dropout on, the reference draws its masks in Megatron-LM's order from the same
seeded generator, so equal outputs mean the same dropout sites, probabilities and order.
--apply-query-key-layer-scaling is accepted and ignored here: in Megatron-LM it divides
the scores by the layer number and the fp32 softmax multiplies them back, the same
softmax up to rounding (checked below).
"""
from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel
from megatron.model.classification import Classification
from megatron.model.gpt_model import GPTModel
from megatron.tensor_parallel import TPInfo

S, B, V = 12, 3, 96


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S,
                padded_vocab_size=V, hidden_dropout=0.1, attention_dropout=0.3,
                attention_backend="unfused", params_dtype=torch.float64)
    base.update(kw)
    return ModelConfig(**base)


def _reference(m, cfg: ModelConfig, ids, mask, types=None, train=True):
    """Megatron-LM's forward from its description; returns the final-LN output [s, b, h]."""
    P = dict(m.named_parameters())
    h = cfg.hidden_size
    drop = lambda x, p: F.dropout(x, p=p, training=train)  # noqa: E731
    ln = lambda x, pre: F.layer_norm(x, (h,), P[pre + ".weight"], P[pre + ".bias"],  # noqa
                                     cfg.layernorm_epsilon)
    pos = torch.arange(ids.size(1)).unsqueeze(0).expand_as(ids)
    x = P["embedding.word_embeddings.weight"][ids] + P["embedding.position_embeddings.weight"][pos]
    if types is not None:
        x = x + P["embedding.tokentype_embeddings.weight"][types]
    x = drop(x.transpose(0, 1).contiguous(), cfg.hidden_dropout)  # [s, b, h]
    heads, d = cfg.num_attention_heads, h // cfg.num_attention_heads
    for i in range(cfg.num_layers):
        L = f"encoder.layers.{i}."
        y = ln(x, L + "input_layernorm")
        qkv = F.linear(y, P[L + "self_attention.query_key_value.weight"],
                       P[L + "self_attention.query_key_value.bias"])
        q, k, v = qkv.view(S, B, heads, 3, d).unbind(3)       # [head, (q, k, v), d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, -10000.0)
        probs = drop(torch.softmax(scores, -1), cfg.attention_dropout)  # fp32+ softmax
        ctx = (probs @ v).permute(2, 0, 1, 3).reshape(S, B, h)
        attn = F.linear(ctx, P[L + "self_attention.dense.weight"],
                        P[L + "self_attention.dense.bias"])
        x = (y if cfg.apply_residual_connection_post_layernorm else x) \
            + drop(attn, cfg.hidden_dropout)
        y = ln(x, L + "post_attention_layernorm")
        u = F.linear(y, P[L + "mlp.dense_h_to_4h.weight"], P[L + "mlp.dense_h_to_4h.bias"])
        u = torch.relu(u) ** 2 if cfg.squared_relu else \
            F.gelu(u, approximate="tanh" if cfg.openai_gelu else "none")
        out = F.linear(u, P[L + "mlp.dense_4h_to_h.weight"], P[L + "mlp.dense_4h_to_h.bias"])
        x = (y if cfg.apply_residual_connection_post_layernorm else x) \
            + drop(out, cfg.hidden_dropout)
    return ln(x, "encoder.final_layernorm")


@pytest.mark.parametrize("options", [
    {}, dict(apply_residual_connection_post_layernorm=True), dict(openai_gelu=True),
    dict(squared_relu=True), dict(hidden_dropout=0.0, attention_dropout=0.0)])
def test_gpt_matches_megatrons_forward_dropout_draws_included(options):
    cfg = _cfg(**options)
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, S))
    model = GPTModel(cfg, TPInfo()).train()
    torch.manual_seed(7)
    got = model(ids, None, None)                                   # [b, s, V]
    torch.manual_seed(7)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    hidden = _reference(model, cfg, ids, causal)
    want = (hidden @ model.embedding.word_embeddings.weight.t()).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_bert_heads_and_dropout_match_megatrons_forward():
    cfg = _cfg(num_tokentypes=2)
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, S))
    types = (torch.arange(S) >= S // 2).long().expand(B, S)
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, -3:] = 0
    model = BertModel(cfg, TPInfo()).train()
    torch.manual_seed(3)
    lm, binary = model(ids, pad, types)
    torch.manual_seed(3)
    keep = pad.bool()
    mask = (~(keep.unsqueeze(1) & keep.unsqueeze(2))).unsqueeze(1)
    hidden = _reference(model, cfg, ids, mask, types)
    P = dict(model.named_parameters())
    t = F.gelu(F.linear(hidden, P["lm_head.dense.weight"], P["lm_head.dense.bias"]))
    t = F.layer_norm(t, (cfg.hidden_size,), P["lm_head.layernorm.weight"],
                     P["lm_head.layernorm.bias"], cfg.layernorm_epsilon)
    want_lm = (t @ P["embedding.word_embeddings.weight"].t() + P["lm_head.bias"]).transpose(0, 1)
    pooled = torch.tanh(F.linear(hidden[0], P["pooler.dense.weight"], P["pooler.dense.bias"]))
    want_binary = F.linear(pooled, P["binary_head.weight"], P["binary_head.bias"])
    torch.testing.assert_close(lm, want_lm, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(binary, want_binary, rtol=1e-10, atol=1e-10)


class _DropoutLog:
    """Every F.dropout / sdpa call made from megatron/model while active: (p, where)."""

    def __init__(self, monkeypatch):
        self.calls = []
        real_dropout, real_sdpa = F.dropout, F.scaled_dot_product_attention

        def dropout(x, p=0.5, training=True, inplace=False):
            if training and p > 0:
                frames = [f for f in traceback.extract_stack()[:-1]
                          if "megatron/model" in f.filename.replace("\\", "/")]
                self.calls.append((p, frames[-1].name if frames else "?", x.dim()))
            return real_dropout(x, p, training, inplace)

        def sdpa(*args, dropout_p=0.0, **kw):
            if dropout_p > 0:
                self.calls.append((dropout_p, "sdpa", 4))
            return real_sdpa(*args, dropout_p=dropout_p, **kw)

        monkeypatch.setattr(F, "dropout", dropout)
        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)


@pytest.mark.parametrize("backend", ["unfused", "auto"])
def test_dropout_sites_are_megatrons(monkeypatch, backend):
    log = _DropoutLog(monkeypatch)
    cfg = _cfg(attention_backend=backend, params_dtype=torch.float32)
    ids = torch.randint(0, V, (B, S))
    model = GPTModel(cfg, TPInfo()).train()
    model(ids, None, None)
    probs = (0.3, "sdpa", 4) if backend == "auto" else (0.3, "_manual", 4)
    layer = [probs, (0.1, "_dropout", 3), (0.1, "_dropout", 3)]
    assert log.calls == [(0.1, "_dropout", 3)] + layer * cfg.num_layers
    log.calls.clear()
    model.eval()
    model(ids, None, None)
    assert log.calls == []


def test_classification_drops_out_the_pooled_output_only(monkeypatch):
    log = _DropoutLog(monkeypatch)
    cfg = _cfg(num_tokentypes=2, params_dtype=torch.float32, num_layers=1)
    model = Classification(cfg, TPInfo(), num_classes=3).train()
    ids = torch.randint(0, V, (B, S))
    model(ids, torch.ones(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long))
    assert log.calls[-1] == (0.1, "forward", 2)           # dropout(pooled [b, h])
    assert len(log.calls) == 1 + 3 * cfg.num_layers + 1


def test_query_key_layer_scaling_is_the_same_softmax():
    """Megatron-LM's --apply-query-key-layer-scaling: scores / (sqrt(d) * layer) in the
    matmul, times layer in the fp32 softmax -- what this trainer computes directly."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    plain = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    for layer in (1, 7, 24):
        scaled = (q @ k.transpose(-1, -2) / (math.sqrt(8) * layer)).float() * layer
        torch.testing.assert_close(torch.softmax(scaled, -1), plain, rtol=1e-5, atol=1e-6)

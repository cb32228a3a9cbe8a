"""BertModel and the finetuning heads in one process (float64)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel
from megatron.model.classification import Classification
from megatron.model.multiple_choice import MultipleChoice
from megatron.tensor_parallel import TPInfo

TP = TPInfo.single()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                padded_vocab_size=128, num_tokentypes=2, hidden_dropout=0.0,
                attention_dropout=0.0, params_dtype=torch.float64)
    base.update(kw)
    return ModelConfig(**base)


def _batch(b=3, s=16, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, s), generator=g)
    pad = torch.ones(b, s, dtype=torch.long)
    pad[0, 10:] = 0
    pad[1, 5:] = 0
    types = torch.zeros(b, s, dtype=torch.long)
    types[:, 6:] = 1
    return ids, pad, types


def _stages(cls, cfg, cuts, seed=3, **kw):
    out = []
    for i, (lo, hi) in enumerate(cuts):
        out.append(cls(cfg, TP, pre_process=lo == 0, post_process=hi == cfg.num_layers,
                       layer_numbers=range(lo, hi), seed=seed, **kw))
    return out


def _run_stages(stages, *inputs, **kw):
    hidden = None
    for st in stages:
        if not st.pre_process:
            st.set_input_tensor(hidden)
        hidden = st(*inputs, **kw)
    return hidden


def test_pipeline_split_gives_the_same_outputs_and_gradients():
    cfg = _cfg()
    ids, pad, types = _batch()
    full = BertModel(cfg, TP, seed=3)
    lm, sop = full(ids, pad, types, lm_labels=ids)
    stages = _stages(BertModel, cfg, [(0, 1), (1, 3), (3, 4)])
    lm2, sop2 = _run_stages(stages, ids, pad, types, lm_labels=ids)
    torch.testing.assert_close(lm2, lm, rtol=0, atol=1e-12)
    torch.testing.assert_close(sop2, sop, rtol=0, atol=1e-12)
    (lm.sum() + sop.sum()).backward()
    (lm2.sum() + sop2.sum()).backward()
    first, last = stages[0], stages[-1]
    # the tied word embedding gets gradient from both ends: first + last stage copies
    tied = first.embedding.word_embeddings.weight.grad + last.output_word_embeddings.weight.grad
    torch.testing.assert_close(tied, full.embedding.word_embeddings.weight.grad, rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(last.lm_head.dense.weight.grad, full.lm_head.dense.weight.grad,
                               rtol=0, atol=1e-12)


def test_logits_match_loss_and_tied_embedding_flags():
    cfg = _cfg()
    ids, pad, types = _batch()
    m = BertModel(cfg, TP, seed=1)
    logits, _ = m(ids, pad, types)
    loss, _ = m(ids, pad, types, lm_labels=ids)
    ref = F.cross_entropy(logits.reshape(-1, 128), ids.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), ref, rtol=0, atol=1e-10)
    assert getattr(m.embedding.word_embeddings.weight, "shared_embedding", False)
    stages = _stages(BertModel, cfg, [(0, 2), (2, 4)])
    flagged = [sum(getattr(p, "shared_embedding", False) for p in st.parameters())
               for st in stages]
    assert flagged == [1, 1]
    torch.testing.assert_close(stages[1].output_word_embeddings.weight,
                               stages[0].embedding.word_embeddings.weight, rtol=0, atol=0)


def test_padding_does_not_leak_into_real_tokens():
    cfg = _cfg()
    m = BertModel(cfg, TP, seed=2)
    ids, pad, types = _batch()
    logits, sop = m(ids, pad, types)
    ids2 = ids.clone()
    ids2[pad == 0] = 7  # change only the padding
    logits2, sop2 = m(ids2, pad, types)
    real = pad.bool()
    torch.testing.assert_close(logits2[real], logits[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(sop2, sop, rtol=0, atol=1e-12)


def test_token_types_matter_and_no_binary_head():
    cfg = _cfg()
    ids, pad, types = _batch()
    m = BertModel(cfg, TP, seed=2)
    a, _ = m(ids, pad, types)
    b, _ = m(ids, pad, torch.zeros_like(types))
    assert (a - b).abs().max() > 1e-6
    lm_only = BertModel(cfg, TP, seed=2, add_binary_head=False)
    assert lm_only.binary_head is None and lm_only.pooler is None
    out, sop = lm_only(ids, pad, types)
    assert sop is None
    torch.testing.assert_close(out, a, rtol=0, atol=1e-12)  # same init, same LM path


def test_classification_loads_pretrained_names_and_splits():
    cfg = _cfg()
    ids, pad, types = _batch()
    pre = BertModel(cfg, TP, seed=5)
    clf = Classification(cfg, TP, num_classes=3, seed=11)
    missing, unexpected = clf.load_state_dict(pre.state_dict(), strict=False)
    assert sorted(missing) == ["classification_head.bias", "classification_head.weight"]
    assert all(k.startswith(("lm_head.", "binary_head.")) for k in unexpected)
    logits = clf(ids, pad, types)
    assert logits.shape == (3, 3)
    stages = _stages(Classification, cfg, [(0, 2), (2, 4)], seed=11, num_classes=3)
    stages[0].load_state_dict({k: v for k, v in clf.state_dict().items()
                               if k.startswith("embedding.") or k.startswith("encoder.layers.0.")
                               or k.startswith("encoder.layers.1.")}, strict=False)
    torch.testing.assert_close(stages[0].embedding.word_embeddings.weight,
                               clf.embedding.word_embeddings.weight)


def test_multiple_choice_scores_each_option():
    cfg = _cfg()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (2, 4, 16), generator=g)
    pad = torch.ones(2, 4, 16, dtype=torch.long)
    types = torch.zeros(2, 4, 16, dtype=torch.long)
    m = MultipleChoice(cfg, TP, seed=4)
    scores = m(ids, pad, types)
    assert scores.shape == (2, 4)
    # option j of question i is scored alone exactly as in the batch
    one = m(ids[1:2, 2:3].expand(1, 4, 16).contiguous(), pad[:1], types[:1])
    torch.testing.assert_close(one[0, 0], scores[1, 2], rtol=0, atol=1e-12)
    assert m.stage_input_shape(3) == (16, 12, 32)
    stages = _stages(MultipleChoice, cfg, [(0, 2), (2, 4)], seed=4)
    torch.testing.assert_close(_run_stages(stages, ids, pad, types), scores, rtol=0, atol=1e-12)


def test_bad_stage_arguments_are_reported():
    cfg = _cfg()
    with pytest.raises(ValueError, match="pre_process"):
        BertModel(cfg, TP, pre_process=True, post_process=False, layer_numbers=range(1, 2))
    with pytest.raises(ValueError, match="num_tokentypes"):
        BertModel(_cfg(num_tokentypes=0), TP)

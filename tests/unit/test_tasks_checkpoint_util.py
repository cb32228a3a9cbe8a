"""tools/checkpoint_util.py: merge any (tensor, pipeline) layout and re-split it."""
from __future__ import annotations

import os

import pytest
import torch

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel
from megatron.model.classification import Classification
from megatron.model.gpt_model import GPTModel
from megatron.tensor_parallel import TPInfo
from tools.checkpoint_util import (convert, load_into_stage, merge_checkpoint, module_targets,
                                   partition_dim_by_name, read_checkpoint, split_for_stage,
                                   to_global)

TP = TPInfo.single()
LAYERS = 4


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _cfg() -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=16,
                       padded_vocab_size=128, num_tokentypes=2, hidden_dropout=0.0,
                       attention_dropout=0.0, params_dtype=torch.float64)


def _stage(cls, cfg, d, p, seed, **kw):
    per = cfg.num_layers // d
    return cls(cfg, TP, pre_process=p == 0, post_process=p == d - 1,
               layer_numbers=range(p * per, (p + 1) * per), seed=seed, **kw)


def _write(root, shards, tp, pp, iteration=5):
    base = os.path.join(root, f"iter_{iteration:07d}")
    for (t, p), sd in shards.items():
        path = os.path.join(base, f"mp_rank_{t:02d}_{p:03d}")
        os.makedirs(path, exist_ok=True)
        torch.save({"model": sd, "layout": {"tensor": tp, "pipeline": pp},
                    "config": {"model": {"num_layers": LAYERS}}, "iteration": iteration},
                   os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
    return root


def _tp_shards(stage_sd, targets, tp):
    """Cut a t=1 stage state dict into tp partitions like the tensor-parallel layers do."""
    out = []
    for r in range(tp):
        sd = {}
        for name, value in stage_sd.items():
            dim = targets[name][1]
            sd[name] = value if dim is None else torch.chunk(value, tp, dim)[r].clone()
        out.append(sd)
    return out


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (2, 16), generator=g)
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 9:] = 0
    return ids, pad, torch.zeros(2, 16, dtype=torch.long)


def test_partition_dims_by_name_agree_with_the_layers():
    model = BertModel(_cfg(), TP, seed=1)
    for name, (_, dim) in module_targets(model).items():
        assert partition_dim_by_name(name) == dim, name
    gpt_cfg = _cfg()
    gpt = GPTModel(gpt_cfg, TP, seed=1, share_embeddings_and_output_weights=False)
    for name, (_, dim) in module_targets(gpt).items():
        assert partition_dim_by_name(name) == dim, name
    assert to_global("encoder.layers.1.mlp.dense_4h_to_h.weight", 2) == \
        "encoder.layers.3.mlp.dense_4h_to_h.weight"


def test_pipeline_checkpoint_loads_into_one_stage_with_same_outputs(tmp_path):
    cfg = _cfg()
    stages = [_stage(BertModel, cfg, 2, p, seed=3) for p in range(2)]
    root = _write(str(tmp_path / "d2"), {(0, p): st.state_dict() for p, st in enumerate(stages)},
                  tp=1, pp=2)
    reference = BertModel(cfg, TP, seed=3)  # what the two stages are, in one piece
    target = BertModel(cfg, TP, seed=99)
    report = load_into_stage(target, root, layer_offset=0, tp_rank=0, tp_size=1)
    assert report.missing == [] and report.source_layout == (1, 2) and report.iteration == 5
    ids, pad, types = _batch()
    for got, want in zip(target(ids, pad, types, lm_labels=ids),
                         reference(ids, pad, types, lm_labels=ids)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_one_stage_checkpoint_resplits_into_a_pipeline(tmp_path):
    cfg = _cfg()
    full = BertModel(cfg, TP, seed=4)
    root = _write(str(tmp_path / "d1"), {(0, 0): full.state_dict()}, tp=1, pp=1)
    ids, pad, types = _batch()
    hidden = None
    for p in range(2):
        st = _stage(BertModel, cfg, 2, p, seed=77)
        load_into_stage(st, root, layer_offset=st.layer_numbers.start, tp_rank=0, tp_size=1)
        if p == 1:
            torch.testing.assert_close(st.output_word_embeddings.weight,
                                       full.embedding.word_embeddings.weight, rtol=0, atol=0)
            st.set_input_tensor(hidden)
        hidden = st(ids, pad, types, lm_labels=ids)
    for got, want in zip(hidden, full(ids, pad, types, lm_labels=ids)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tensor_and_pipeline_partitions_merge_to_the_full_model(tmp_path):
    cfg = _cfg()
    full = BertModel(cfg, TP, seed=6)
    shards = {}
    for p in range(2):
        st = _stage(BertModel, cfg, 2, p, seed=6)
        for t, sd in enumerate(_tp_shards(st.state_dict(), module_targets(st), 2)):
            shards[(t, p)] = sd
    root = _write(str(tmp_path / "t2d2"), shards, tp=2, pp=2)
    ckpt = read_checkpoint(root)
    assert (ckpt.tensor, ckpt.pipeline, ckpt.num_layers) == (2, 2, LAYERS)
    merged = merge_checkpoint(ckpt)
    expected = full.state_dict()
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=0, msg=name)
    # and a tensor-parallel stage of another layout gets exactly its slice
    st = _stage(BertModel, cfg, 4, 3, seed=0)
    targets = {n: (torch.Size([s[0] // 2] + list(s[1:])) if d == 0 else
                   torch.Size([s[0], s[1] // 2]) if d == 1 else s, d)
               for n, (s, d) in module_targets(st).items()}
    sd, missing = split_for_stage(merged, targets, layer_offset=3, tp_rank=1, tp_size=2)
    assert missing == []
    qkv = expected["encoder.layers.3.self_attention.query_key_value.weight"]
    torch.testing.assert_close(sd["encoder.layers.0.self_attention.query_key_value.weight"],
                               qkv[qkv.shape[0] // 2:], rtol=0, atol=0)


def test_convert_script_round_trip(tmp_path):
    cfg = _cfg()
    full = BertModel(cfg, TP, seed=8)
    src = _write(str(tmp_path / "src"), {(0, 0): full.state_dict()}, tp=1, pp=1)
    out = convert(src, str(tmp_path / "t2d2"), tp=2, pp=2)
    assert sorted(os.listdir(out)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                       "mp_rank_01_001"]
    ckpt = read_checkpoint(str(tmp_path / "t2d2"))
    last = ckpt.shards[(1, 1)]
    assert "output_word_embeddings.weight" in last and "encoder.layers.0.input_layernorm.weight" in last
    assert last["output_word_embeddings.weight"].shape == (64, 32)
    merged = merge_checkpoint(ckpt)
    for name, value in full.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=0, msg=name)


def test_finetuning_model_gets_new_head_and_errors_are_clear(tmp_path):
    cfg = _cfg()
    root = _write(str(tmp_path / "bert"), {(0, 0): BertModel(cfg, TP, seed=2).state_dict()},
                  tp=1, pp=1)
    clf = Classification(cfg, TP, num_classes=3, seed=5)
    head = clf.classification_head.weight.detach().clone()
    with pytest.raises(ValueError, match="classification_head"):
        load_into_stage(clf, root, layer_offset=0, tp_rank=0, tp_size=1)
    report = load_into_stage(clf, root, layer_offset=0, tp_rank=0, tp_size=1,
                             allow_missing=("classification_head.",))
    assert report.missing == ["classification_head.weight", "classification_head.bias"]
    torch.testing.assert_close(clf.classification_head.weight, head, rtol=0, atol=0)
    bigger = ModelConfig(**{**_cfg().__dict__, "hidden_size": 64, "ffn_hidden_size": 256})
    with pytest.raises(ValueError, match="--hidden-size"):
        load_into_stage(BertModel(bigger, TP, seed=1), root, layer_offset=0, tp_rank=0,
                        tp_size=1)


def test_different_vocab_padding_is_fitted(tmp_path):
    cfg = _cfg()
    src = BertModel(cfg, TP, seed=2)
    root = _write(str(tmp_path / "v128"), {(0, 0): src.state_dict()}, tp=1, pp=1)
    wide = ModelConfig(**{**cfg.__dict__, "padded_vocab_size": 192})
    target = BertModel(wide, TP, seed=0)
    with pytest.warns(UserWarning, match="vocabulary rows"):
        load_into_stage(target, root, layer_offset=0, tp_rank=0, tp_size=1)
    w = target.embedding.word_embeddings.weight
    torch.testing.assert_close(w[:128], src.embedding.word_embeddings.weight, rtol=0, atol=0)
    assert torch.all(w[128:] == 0) and torch.all(target.lm_head.bias[128:] == 0)


def test_merge_reads_an_uneven_stage_split(tmp_path):
    """Stages of 1 and 3 layers (--decoder-first-pipeline-num-layers 1) merge back into
    the full model: the split comes from the saved config."""
    cfg = _cfg()
    full = GPTModel(cfg, TP, seed=3)
    stages = [GPTModel(cfg, TP, pre_process=True, post_process=False,
                       layer_numbers=range(0, 1), seed=3),
              GPTModel(cfg, TP, pre_process=False, post_process=True,
                       layer_numbers=range(1, LAYERS), seed=3)]
    base = os.path.join(tmp_path, "iter_0000005")
    for p, st in enumerate(stages):
        path = os.path.join(base, f"mp_rank_00_{p:03d}")
        os.makedirs(path)
        torch.save({"model": st.state_dict(), "layout": {"tensor": 1, "pipeline": 2},
                    "config": {"model": {"num_layers": LAYERS},
                               "parallel": {"decoder_first_pipeline_num_layers": 1}},
                    "iteration": 5}, os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(tmp_path, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("5")
    ckpt = read_checkpoint(str(tmp_path))
    assert ckpt.stage_offsets == [0, 1]
    merged = merge_checkpoint(ckpt)
    ref = full.state_dict()
    assert set(merged) == set(ref)
    for name, value in ref.items():
        assert torch.equal(merged[name], value), name

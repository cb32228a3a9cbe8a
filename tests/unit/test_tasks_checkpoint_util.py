"""tools/checkpoint_util.py: merge any (tensor, pipeline) layout and re-split it."""
from __future__ import annotations

import os

import pytest
import torch

from megatron.checkpointing import save_payload
from megatron.config import ModelConfig
from megatron.errors import CheckpointError
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


def _write(root, shards, tp, pp, iteration=5, model=None):
    """``model``: the config["model"] to record (default: num_layers only, as old
    checkpoints and converted ones without the full config)."""
    base = os.path.join(root, f"iter_{iteration:07d}")
    for (t, p), sd in shards.items():
        path = os.path.join(base, f"mp_rank_{t:02d}_{p:03d}")
        os.makedirs(path, exist_ok=True)
        save_payload({"model": sd, "layout": {"tensor": tp, "pipeline": pp},
                      "config": {"model": model or {"num_layers": LAYERS},
                                 "data": {"make_vocab_size_divisible_by": 64}},
                      "iteration": iteration},
                     os.path.join(path, "model_optim_rng"))
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
    assert sorted(d for d in os.listdir(out) if d.startswith("mp_rank")) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
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
    with pytest.raises(CheckpointError, match="classification_head"):
        load_into_stage(clf, root, layer_offset=0, tp_rank=0, tp_size=1)
    report = load_into_stage(clf, root, layer_offset=0, tp_rank=0, tp_size=1,
                             allow_missing=("classification_head.",))
    assert report.missing == ["classification_head.weight", "classification_head.bias"]
    torch.testing.assert_close(clf.classification_head.weight, head, rtol=0, atol=0)
    bigger = ModelConfig(**{**_cfg().__dict__, "hidden_size": 64, "ffn_hidden_size": 256,
                           "kv_channels": None})
    with pytest.raises(CheckpointError, match="--hidden-size"):
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


# ------------------------------------------------------------- full-state resharding
def _trained_full_state_checkpoint(root, divisible_by=64, vocab=96, base_cfg=None):
    """A one-stage bf16 GPT with fp32 masters after one Adam step, saved like training.
    ``base_cfg``: the model (default ``_cfg()``); given, its whole config is recorded."""
    from megatron.config import OptimizerConfig, PrecisionConfig
    from megatron.optimizer import get_megatron_optimizer
    from megatron.tokenizer import vocab_size_with_padding

    padded = vocab_size_with_padding(vocab, divisible_by, 1)
    cfg = ModelConfig(**{**(base_cfg or _cfg()).__dict__, "padded_vocab_size": padded,
                         "params_dtype": torch.bfloat16})
    model = GPTModel(cfg, TP, seed=3)
    opt = get_megatron_optimizer(OptimizerConfig(), PrecisionConfig(bf16=True),
                                 list(model.parameters()))
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids, None, None, labels=ids).float().mean().backward()
    params = list(model.parameters())
    assert opt.step(params, params, params, lr=1e-3).skipped is False
    base = os.path.join(root, "iter_0000007", "mp_rank_00")  # Megatron's pp=1 name
    os.makedirs(base)
    save_payload({"iteration": 7, "consumed_train_samples": 56, "consumed_valid_samples": 8,
                  "layout": {"tensor": 1, "pipeline": 1, "data": 2},
                  "model": model.state_dict(), "model_shadow": None,
                  "optimizer": opt.state_dict(), "engine": {"iteration": 7, "batch_scales": {}},
                  "lr_scheduler": {"max_lr": 1e-3, "num_steps": 7},
                  "config": {"model": (_model_record(cfg) if base_cfg is not None
                                       else {"num_layers": LAYERS}),
                             "data": {"make_vocab_size_divisible_by": divisible_by,
                                      "tokenizer_type": "NullTokenizer", "vocab_size": vocab}}},
                 os.path.join(base, "model_optim_rng"))
    for d in range(2):
        save_payload({"cpu": torch.get_rng_state(), "d": d},
                     os.path.join(base, f"rng_dp_{d:03d}"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("7")
    return root, model, opt


def _assert_same(a, b, path="payload"):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), (path, list(a), list(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("divisible_by", [64, 128])  # 128: the padded vocab changes with t
def test_full_state_round_trip_through_another_layout(tmp_path, capsys, divisible_by):
    src, model, opt = _trained_full_state_checkpoint(str(tmp_path / "src"), divisible_by)
    convert(src, str(tmp_path / "t2d2"), tp=2, pp=2, dp=1)
    note = capsys.readouterr().err
    # a changed padded size is announced, with the divisor that would have kept it
    assert ("128 -> 256 rows" in note and "--make-vocab-size-divisible-by 64" in note) == \
        (divisible_by == 128)
    mid = read_checkpoint(str(tmp_path / "t2d2"))
    rows = 128 if divisible_by == 64 else 256  # 96 -> multiple of divisible_by * 2
    last = mid.payloads[(1, 1)]
    assert last["model"]["output_word_embeddings.weight"].shape[0] == rows // 2
    assert last["consumed_train_samples"] == 56 and last["lr_scheduler"]["num_steps"] == 7
    assert last["layout"] == {"tensor": 2, "pipeline": 2, "data": 1, "layers": [2, 4]}
    assert last["config"]["model"]["padded_vocab_size"] == rows
    # every stage's optimizer state matches its own parameters one to one
    for payload in mid.payloads.values():
        o = payload["optimizer"]
        shapes = [list(v.shape) for v in payload["model"].values()]
        assert o["meta"]["shapes"] == shapes
        assert [list(m.shape) for m in o["fp32_masters"]] == shapes
    if rows > 128:  # new padding rows copy the last (trained-down) padding row, moments too
        emb = merge_checkpoint(mid)["embedding.word_embeddings.weight"]
        src_emb = model.state_dict()["embedding.word_embeddings.weight"]
        assert torch.equal(emb[:128], src_emb)
        assert torch.equal(emb[128:], src_emb[127:].expand(128, -1))
        m = mid.payloads[(1, 0)]["optimizer"]
        wte_pos = 0  # word embedding: first matrix of stage 0, first in the decay group
        assert torch.equal(m["optimizer"]["state"][wte_pos]["exp_avg"][-1],
                           opt.state_dict()["optimizer"]["state"][0]["exp_avg"][127])
    # RNG files only where the (t, d) grid is unchanged: here none
    assert not [f for d in mid.dirs.values() for f in os.listdir(d) if f.startswith("rng")]
    convert(str(tmp_path / "t2d2"), str(tmp_path / "back"), tp=1, pp=1, dp=2)
    back = read_checkpoint(str(tmp_path / "back")).payloads[(0, 0)]
    _assert_same(model.state_dict(), back["model"], "model")
    _assert_same(opt.state_dict(), back["optimizer"], "optimizer")
    assert back["iteration"] == 7 and back["engine"] == {"iteration": 7, "batch_scales": {}}


def test_divisible_by_override_keeps_the_padded_vocabulary(tmp_path):
    from tools.checkpoint_util import main

    src, model, _ = _trained_full_state_checkpoint(str(tmp_path / "src"), divisible_by=128)
    main(["--load", src, "--save", str(tmp_path / "t2"), "--target-tensor-parallel-size", "2",
          "--make-vocab-size-divisible-by", "64"])
    ckpt = read_checkpoint(str(tmp_path / "t2"))
    assert ckpt.payloads[(0, 0)]["config"]["data"]["make_vocab_size_divisible_by"] == 64
    torch.testing.assert_close(merge_checkpoint(ckpt)["embedding.word_embeddings.weight"],
                               model.state_dict()["embedding.word_embeddings.weight"],
                               rtol=0, atol=0)


def test_same_grid_keeps_rng_files_and_uses_megatron_names(tmp_path):
    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    out = convert(src, str(tmp_path / "w1"), tp=1, pp=1, dp=1)
    ranks = [d for d in os.listdir(out) if d.startswith("mp_rank")]
    assert ranks in (["mp_rank_00"], ["mp_rank_00_000"])  # Megatron's name once rank_dir has it
    files = sorted(os.listdir(os.path.join(out, ranks[0])))
    assert [f for f in files if f.startswith("rng_dp_")][0].startswith("rng_dp_000")
    assert not [f for f in files if f.startswith("rng_dp_001")]
    assert not [f for f in os.listdir(str(tmp_path / "w1")) if f.endswith(".tmp")]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_script_refuses_save_inside_load(tmp_path, capsys, where):
    from tools.checkpoint_util import main

    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    before = sorted(os.listdir(os.path.join(src, "iter_0000007", "mp_rank_00")))
    save = src if where == "same" else os.path.join(src, "sub", "out")
    with pytest.raises(SystemExit) as exc:
        main(["--load", src, "--save", save, "--target-tensor-parallel-size", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --save") and "--load" in err[0], err
    assert sorted(os.listdir(os.path.join(src, "iter_0000007", "mp_rank_00"))) == before
    assert not os.path.exists(os.path.join(src, "sub"))


def test_help_lists_the_three_workflows(capsys):
    from tools.checkpoint_util import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--to-hf", "--from-hf", "--target-tensor-parallel-size", "reshard", "export",
                 "import"):
        assert flag in out, flag


@pytest.mark.parametrize("cls", [GPTModel, BertModel])
def test_name_targets_follow_the_stage_modules_parameter_order(cls):
    """The optimizer state is positional (model.parameters() order): the script, which
    has no module, must list each stage's names in exactly that order."""
    from megatron.checkpoint_convert import _name_targets

    cfg = _cfg()
    full = dict(_stage(cls, cfg, 1, 0, seed=1).state_dict())
    for d in (2, 4):
        for p in range(d):
            stage = _stage(cls, cfg, d, p, seed=1)
            targets, _ = _name_targets(full, LAYERS, 1, d, p)
            assert list(targets) == [n for n, _ in stage.named_parameters()], (cls, d, p)
            assert [tuple(s) for s, _ in targets.values()] == \
                [tuple(v.shape) for v in stage.parameters()]
def _write_first_stage_of_one(root: str, layers: bool = True) -> GPTModel:
    """A d=2 checkpoint at ``root`` whose stages hold 1 and 3 layers
    (--decoder-first-pipeline-num-layers 1); returns the full model it was cut from.
    ``layers``: record each stage's layers in its layout (as training saves do)."""
    cfg = _cfg()
    full = GPTModel(cfg, TP, seed=3)
    stages = [GPTModel(cfg, TP, pre_process=True, post_process=False,
                       layer_numbers=range(0, 1), seed=3),
              GPTModel(cfg, TP, pre_process=False, post_process=True,
                       layer_numbers=range(1, LAYERS), seed=3)]
    base = os.path.join(root, "iter_0000005")
    for p, st in enumerate(stages):
        path = os.path.join(base, f"mp_rank_00_{p:03d}")
        os.makedirs(path)
        layout = {"tensor": 1, "pipeline": 2}
        if layers:
            layout["layers"] = [[0, 1], [1, LAYERS]][p]
        save_payload({"model": st.state_dict(), "layout": layout,
                      "config": {"model": {"num_layers": LAYERS},
                                 "parallel": {"decoder_first_pipeline_num_layers": 1}},
                      "iteration": 5}, os.path.join(path, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("5")
    return full


def test_merge_reads_an_uneven_stage_split(tmp_path):
    """Stages of 1 and 3 layers (--decoder-first-pipeline-num-layers 1) merge back into
    the full model: the split comes from the saved config."""
    full = _write_first_stage_of_one(str(tmp_path), layers=False)
    ckpt = read_checkpoint(str(tmp_path))
    assert ckpt.stage_offsets == [0, 1]
    merged = merge_checkpoint(ckpt)
    ref = full.state_dict()
    assert set(merged) == set(ref)
    for name, value in ref.items():
        assert torch.equal(merged[name], value), name


def test_pretrained_checkpoint_of_another_vocabulary_is_refused():
    """Finetuning may pad or trim vocabulary rows only when they are padding: the same
    tokenizer padded another way (another tensor size or --make-vocab-size-divisible-by).
    A checkpoint of another vocabulary is one error naming the flag, not 10,000 real
    token rows dropped with a warning about padding."""
    from megatron.checkpoint_merge import CheckpointShards, check_same_vocabulary
    from megatron.errors import CheckpointError

    def ckpt(padded, divisible=128, tensor=1):
        return CheckpointShards(root="ck", iteration=1, tensor=tensor, pipeline=1, num_layers=2,
                                config={"model": {"padded_vocab_size": padded},
                                        "data": {"make_vocab_size_divisible_by": divisible},
                                        "parallel": {"tensor_model_parallel_size": tensor}})

    check_same_vocabulary(ckpt(30592), 30522, "--pretrained-checkpoint")  # BERT, t=1
    check_same_vocabulary(ckpt(30720, tensor=2), 30522, "--pretrained-checkpoint")  # t=2
    with pytest.raises(CheckpointError, match=r"--pretrained-checkpoint ck: vocabulary of "
                                              r"30592 rows .* this run's 20000-token"):
        check_same_vocabulary(ckpt(30592), 20000, "--pretrained-checkpoint")
    with pytest.raises(CheckpointError, match="--load ck"):
        check_same_vocabulary(ckpt(4096), 30522, "--load")
    # converted checkpoints carry no config: nothing to check against
    check_same_vocabulary(CheckpointShards(root="ck", iteration=1, tensor=1, pipeline=1,
                                           num_layers=2), 20000, "--pretrained-checkpoint")


def test_a_missing_pretrained_checkpoint_names_the_flag(tmp_path):
    model = GPTModel(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                 seq_length=16, padded_vocab_size=64), TPInfo.single())
    with pytest.raises(CheckpointError, match=r"^--pretrained-checkpoint \S*nockpt: expected a "
                                              r"checkpoint directory written by --save"):
        load_into_stage(model, str(tmp_path / "nockpt"), layer_offset=0, tp_rank=0, tp_size=1,
                        flag="--pretrained-checkpoint")


@pytest.mark.parametrize("workflow", [["--save", "out"], ["--to-hf", "hf"]])
def test_checkpoint_util_names_load_for_a_missing_or_foreign_directory(tmp_path, capsys,
                                                                      workflow):
    """The shared reader said 'checkpoint X'; the user typed --load X."""
    from tools.checkpoint_util import main

    workflow = [workflow[0], str(tmp_path / workflow[1])]
    (tmp_path / "empty").mkdir()
    for load, words in ((tmp_path / "nope", "expected a checkpoint directory written by --save"),
                        (tmp_path / "empty", "no latest_checkpointed_iteration.txt")):
        with pytest.raises(SystemExit):
            main(["--load", str(load)] + workflow)
        err = capsys.readouterr().err
        assert f"error: --load {load}: {words}" in err, err


def test_a_checkpoint_of_another_model_kind_is_one_line_naming_the_flag(tmp_path):
    """A GPT checkpoint (no token types) given to BERT finetuning: one error naming
    --pretrained-checkpoint and the differing setting, not one size mismatch per tensor."""
    cfg = _cfg()
    root = str(tmp_path / "gpt")
    path = os.path.join(root, "iter_0000005", "mp_rank_00")
    os.makedirs(path)
    save_payload({"model": BertModel(cfg, TP, seed=2).state_dict(),
                  "layout": {"tensor": 1, "pipeline": 1}, "iteration": 5,
                  "config": {"model": {"num_layers": LAYERS, "hidden_size": 32,
                                       "num_tokentypes": 0}}},
                 os.path.join(path, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("5")
    with pytest.raises(CheckpointError, match=r"^--pretrained-checkpoint .*another model shape: "
                                              r"token types \(GPT vs BERT\) 0 in the checkpoint, "
                                              r"2 in this run$"):
        load_into_stage(Classification(cfg, TP, num_classes=3, seed=5), root, layer_offset=0,
                        tp_rank=0, tp_size=1, allow_missing=("classification_head.",),
                        flag="--pretrained-checkpoint")


def test_reshard_writes_the_requested_uneven_stage_split(tmp_path):
    """--target-decoder-first/last-pipeline-num-layers: the written stages hold the layers
    the trainer's --decoder-first/last-pipeline-num-layers give them, and the config and
    layout record it.  Without them an unchanged d keeps the source's (uneven) split and
    a new d gets an even one; a split that does not fit is one error naming the flag."""
    from megatron.errors import UserError
    from megatron.model.utils import stage_layer_numbers
    from tools.checkpoint_util import main as util_main

    src = str(tmp_path / "src")
    full = _write_first_stage_of_one(src)

    def layers_of(root):
        ckpt = read_checkpoint(root)
        return ([ckpt.payloads[(0, p)]["layout"]["layers"] for p in range(ckpt.pipeline)],
                ckpt.payloads[(0, 0)]["config"]["parallel"])

    ref = full.state_dict()
    cases = [(["--target-pipeline-parallel-size", "2"], [[0, 1], [1, 4]], (1, None)),
             (["--target-pipeline-parallel-size", "2",
               "--target-decoder-last-pipeline-num-layers", "1"], [[0, 3], [3, 4]], (None, 1)),
             (["--target-pipeline-parallel-size", "3",
               "--target-decoder-first-pipeline-num-layers", "2"],
              [[0, 2], [2, 3], [3, 4]], (2, None)),
             (["--target-pipeline-parallel-size", "4"], [[p, p + 1] for p in range(4)],
              (None, None)),
             (["--target-pipeline-parallel-size", "2", "--target-decoder-first-pipeline-num-"
               "layers", "2"], [[0, 2], [2, 4]], (None, None))]  # even: no flags needed
    for i, (flags, want, (first, last)) in enumerate(cases):
        out = str(tmp_path / f"out{i}")
        util_main(["--load", src, "--save", out, *flags])
        layers, par = layers_of(out)
        assert layers == want, (flags, layers)
        assert (par["decoder_first_pipeline_num_layers"],
                par["decoder_last_pipeline_num_layers"]) == (first, last), flags
        d = len(want)
        for p, (a, b) in enumerate(want):  # the trainer's split from the recorded flags
            r = stage_layer_numbers(LAYERS, d, p, first, last)
            assert [r.start, r.stop] == [a, b], (flags, p)
        merged = merge_checkpoint(read_checkpoint(out))
        assert set(merged) == set(ref)
        for name, value in ref.items():
            assert torch.equal(merged[name], value), (flags, name)

    from megatron.checkpoint_convert import read_full_state, write_layout
    state = read_full_state(src)
    for pp, first, last, match in (
            (2, 4, None, "--target-decoder-first-pipeline-num-layers must be between 1 and"),
            (3, None, None, "divisible by --target-pipeline-parallel-size"),
            (1, None, 1, "need --target-pipeline-parallel-size > 1")):
        with pytest.raises(UserError, match=match):
            write_layout(state, str(tmp_path / "bad"), 1, pp, first=first, last=last)
        assert not os.path.exists(tmp_path / "bad"), (pp, first, last)
    with pytest.raises(SystemExit):
        util_main(["--load", src, "--to-hf", str(tmp_path / "hf"),
                   "--target-decoder-first-pipeline-num-layers", "1"])


# --------------------------------------------------- Llama-style blocks (swiglu, GQA, ...)
LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
             num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)


def _llama_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=16,
                padded_vocab_size=128, ffn_hidden_size=48, hidden_dropout=0.0,
                attention_dropout=0.0, params_dtype=torch.float64, **LLAMA)
    base.update(kw)
    return ModelConfig(**base)


def _model_record(cfg: ModelConfig) -> dict:
    """config["model"] as training saves it (dataclasses.asdict, dtypes as text)."""
    import dataclasses

    return {k: (str(v) if isinstance(v, torch.dtype) else v)
            for k, v in dataclasses.asdict(cfg).items()}


def _llama_stage(cfg: ModelConfig, tp: int, t: int, d: int, p: int, seed: int) -> GPTModel:
    """Tensor rank t of stage p of a (tp, d) layout.  The tensor-parallel layers talk to
    their group only in forward/backward, so a placeholder group builds any rank's
    parameters in one process: the slices the trainer's rank t holds."""
    per = cfg.num_layers // d
    info = TP if tp == 1 else TPInfo(group=object(), size=tp, rank=t)
    return GPTModel(cfg, info, pre_process=p == 0, post_process=p == d - 1,
                    layer_numbers=range(p * per, (p + 1) * per), seed=seed)


def _llama_shards(cfg, tp, d, seed):
    return {(t, p): _llama_stage(cfg, tp, t, d, p, seed).state_dict()
            for t in range(tp) for p in range(d)}


_LLAMA_VARIANTS = [dict(), dict(add_bias_linear=True, num_query_groups=4,
                                untie_embeddings_and_output_weights=False),
                   dict(add_qkv_bias=True)]


@pytest.mark.parametrize("extra", _LLAMA_VARIANTS, ids=["llama-gqa", "mha-bias-tied", "qkv-bias"])
def test_llama_tensor_parallel_shards_merge_into_the_full_model(tmp_path, extra):
    """swiglu + GQA + RMSNorm + RoPE (+ no biases, untied output): the ranks' state dicts
    at t=2, d=2 merge into exactly the t=1 model's.  SwiGLU's [gate; up] is split with
    stride 2 (rank r holds [gate_r; up_r]): concatenating the ranks' parts, as for every
    other tensor, would interleave gate and up rows."""
    cfg = _llama_cfg(**extra)
    full = _llama_stage(cfg, 1, 0, 1, 0, seed=11).state_dict()
    shards = _llama_shards(cfg, 2, 2, seed=11)
    root = _write(str(tmp_path / "t2d2"), shards, tp=2, pp=2, model=_model_record(cfg))
    merged = merge_checkpoint(read_checkpoint(root))
    assert list(merged) == list(full)
    for name, value in full.items():
        assert torch.equal(merged[name], value), name
    assert "embedding.position_embeddings.weight" not in merged  # RoPE: no table
    assert ("output_layer.weight" in merged) == cfg.untie_embeddings_and_output_weights
    w = "encoder.layers.0.mlp.dense_h_to_4h.weight"
    assert not torch.equal(torch.cat([shards[(0, 0)][w], shards[(1, 0)][w]]), full[w])
    # the same files without the config's swiglu key read as an old checkpoint would
    # (contiguous): the record is what tells the layouts apart
    old = _write(str(tmp_path / "old"), shards, tp=2, pp=2,
                 model={k: v for k, v in _model_record(cfg).items() if k != "swiglu"})
    assert not torch.equal(merge_checkpoint(read_checkpoint(old))[w], full[w])


def test_llama_checkpoint_converts_t2_to_t1_and_back(tmp_path):
    """t=2 d=2 -> t=1 d=1 -> t=2 d=2 gives back every rank file's model exactly, and the
    t=1 checkpoint is the one-rank model.  A t that does not divide the query groups is
    refused before anything is written, naming the flag."""
    cfg = _llama_cfg()
    shards = _llama_shards(cfg, 2, 2, seed=12)
    src = _write(str(tmp_path / "t2d2"), shards, tp=2, pp=2, model=_model_record(cfg))
    convert(src, str(tmp_path / "t1"), tp=1, pp=1)
    one = read_checkpoint(str(tmp_path / "t1"))
    for name, value in _llama_stage(cfg, 1, 0, 1, 0, seed=12).state_dict().items():
        assert torch.equal(one.shards[(0, 0)][name], value), name
    convert(str(tmp_path / "t1"), str(tmp_path / "back"), tp=2, pp=2)
    back = read_checkpoint(str(tmp_path / "back"))
    for key, sd in shards.items():
        assert list(back.shards[key]) == list(sd), key
        for name, value in sd.items():
            assert torch.equal(back.shards[key][name], value), (key, name)
    with pytest.raises(CheckpointError, match=r"--target-tensor-parallel-size 4 does not divide "
                                              r"the checkpoint's number of query groups"):
        convert(src, str(tmp_path / "t4"), tp=4, pp=1)
    assert not os.path.exists(tmp_path / "t4" / "iter_0000005")


def test_llama_full_state_with_adam_reshards_with_the_swiglu_stride(tmp_path):
    """Adam's moments and the fp32 master weights of SwiGLU's weight are cut like the
    weight (stride 2), and the round trip through t=2 gives back the whole state."""
    from megatron.tensor_parallel.param_init import shard

    src, model, opt = _trained_full_state_checkpoint(str(tmp_path / "src"),
                                                     base_cfg=_llama_cfg())
    convert(src, str(tmp_path / "t2"), tp=2, pp=1, dp=1)
    mid = read_checkpoint(str(tmp_path / "t2"))
    names = list(model.state_dict())
    w = "encoder.layers.1.mlp.dense_h_to_4h.weight"
    pos = names.index(w)
    full_state = opt.state_dict()
    matrices = [n for n in names if model.state_dict()[n].dim() >= 2]
    moment = full_state["optimizer"]["state"][matrices.index(w)]["exp_avg"]
    master = full_state["fp32_masters"][pos]
    for t in range(2):
        payload = mid.payloads[(t, 0)]
        assert torch.equal(payload["model"][w], shard(model.state_dict()[w], 0, t, 2, 2))
        state = payload["optimizer"]["optimizer"]["state"][matrices.index(w)]
        assert torch.equal(state["exp_avg"], shard(moment, 0, t, 2, 2))
        assert torch.equal(payload["optimizer"]["fp32_masters"][pos], shard(master, 0, t, 2, 2))
    convert(str(tmp_path / "t2"), str(tmp_path / "back"), tp=1, pp=1, dp=2)
    back = read_checkpoint(str(tmp_path / "back")).payloads[(0, 0)]
    _assert_same(model.state_dict(), back["model"], "model")
    _assert_same(opt.state_dict(), back["optimizer"], "optimizer")


def test_llama_checkpoint_loads_into_a_tensor_parallel_stage(tmp_path):
    """Finetuning's loader (load_into_stage) cuts SwiGLU's weight with the module's own
    partition_stride: rank 1 of t=2 gets exactly what a rank-1 model of the same seed has."""
    cfg = _llama_cfg()
    root = _write(str(tmp_path / "t1"), {(0, 0): _llama_stage(cfg, 1, 0, 1, 0, 13).state_dict()},
                  tp=1, pp=1, model=_model_record(cfg))
    target = _llama_stage(cfg, 2, 1, 2, 1, seed=99)
    report = load_into_stage(target, root, layer_offset=2, tp_rank=1, tp_size=2)
    assert report.missing == []
    for name, value in _llama_stage(cfg, 2, 1, 2, 1, seed=13).state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_llama_partition_dims_strides_and_order_agree_with_the_layers():
    """The names-only rules (no module at hand: merge, convert) give the layers' own
    partition dim and stride, and each stage's names in the module's parameter order
    (the optimizer state is positional)."""
    from megatron.checkpoint_convert import _name_targets
    from megatron.checkpoint_merge import partition_stride_by_name

    cfg = _llama_cfg()
    record = _model_record(cfg)
    full = _llama_stage(cfg, 1, 0, 1, 0, seed=1).state_dict()
    for name, p in _llama_stage(cfg, 2, 0, 1, 0, seed=1).named_parameters():
        assert partition_dim_by_name(name) == p.partition_dim if p.tensor_model_parallel \
            else partition_dim_by_name(name) is None, name
        if p.tensor_model_parallel:
            assert partition_stride_by_name(name, record) == p.partition_stride, name
    assert partition_stride_by_name("encoder.layers.0.mlp.dense_h_to_4h.bias", record) == 2
    assert partition_stride_by_name("encoder.layers.0.mlp.dense_h_to_4h.weight", {}) == 1
    assert partition_stride_by_name("encoder.layers.0.mlp.dense_4h_to_h.weight", record) == 1
    for d in (2, 4):
        for p in range(d):
            stage = _llama_stage(cfg, 2, 1, d, p, seed=1)
            targets, _ = _name_targets(full, LAYERS, 2, d, p, model_cfg=record)
            assert list(targets) == [n for n, _ in stage.named_parameters()], (d, p)
            assert [tuple(s) for s, _ in targets.values()] == \
                [tuple(v.shape) for v in stage.parameters()], (d, p)

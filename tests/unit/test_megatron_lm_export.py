"""Exporting our checkpoints to Megatron-LM's legacy layout: ``tools/checkpoint_util.py
--load CKPT --to-megatron OUT`` (megatron/megatron_lm_export.py).

* The exported rank files, read as Megatron-LM reads them (per tensor rank and stage,
  checkpoint_version 3.0), give through the hand-written Megatron-LM forward of
  tests/unit/test_megatron_lm_import.py the logits of our model (float32, < 1e-4):
  GPT tied and untied, LayerNorm/GELU and RMSNorm/RoPE/SwiGLU/grouped-query attention,
  t = 1, 2 and P = 1, 2 on either side; BERT with and without its binary head.
* ``--from-megatron`` reads the export back to the very tensors we exported, and a
  Megatron-LM checkpoint imported and exported at its own layout gives back its own
  rank tensors.
* Bad input is one line and writes nothing."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import pytest
import torch

from megatron.checkpointing import save_payload
from megatron.config import ModelConfig
from megatron.megatron_lm_files import PT_FILE, load_megatron_file
from megatron.model.bert_model import BertModel
from megatron.model.gpt_model import GPTModel
from megatron.tensor_parallel import TPInfo
from tests.unit.test_megatron_lm_import import (REAL_VOCAB, ROWS, UNSAFE, _args, _error,
                                                _ids, _ours, _spec, _write, reference)
from tools.checkpoint_util import convert, main, merge_checkpoint, read_checkpoint

TP1 = TPInfo.single()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


# ------------------------------------------------------------------ our checkpoints
def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                max_position_embeddings=16, padded_vocab_size=ROWS, hidden_dropout=0.0,
                attention_dropout=0.0, init_method_std=0.2)
    base.update(kw)
    return ModelConfig(**base)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight moved off its initial value (norm weights off 1, biases off 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _save(root: str, model: torch.nn.Module, cfg: ModelConfig,
          record: Optional[Dict[str, Any]] = None, extra: Optional[Dict[str, Any]] = None
          ) -> str:
    """Our t=1, d=1 checkpoint of ``model`` at iteration 4 (NullTokenizer, 99 data ids and
    its end-of-document id, padded to 128 with unit 64); ``record``: config["model"]
    entries recorded on top; ``extra``: tensors added to the state dict."""
    model_cfg = {k: (str(v) if isinstance(v, torch.dtype) else v)
                 for k, v in cfg.__dict__.items()}
    model_cfg.update(record or {})
    base = os.path.join(root, "iter_0000004", "mp_rank_00")
    os.makedirs(base)
    save_payload({"iteration": 4, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                  "model": {**model.state_dict(), **(extra or {})},
                  "config": {"model": model_cfg,
                             "data": {"tokenizer_type": "NullTokenizer",
                                      "vocab_size": REAL_VOCAB - 1,
                                      "tokenizer_vocab_size": REAL_VOCAB,
                                      "make_vocab_size_divisible_by": 64}}},
                 os.path.join(base, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    return root


LLAMA = dict(normalization="RMSNorm", position_embedding_type="rope", rotary_percent=0.5,
             swiglu=True, ffn_hidden_size=48, num_query_groups=2, kv_channels=8,
             add_bias_linear=False, untie_embeddings_and_output_weights=True,
             layernorm_epsilon=1e-6)


def _gpt(tmp_path, name="ours", seed=5, **kw):
    cfg = _cfg(**kw)
    model = _perturbed(GPTModel(cfg, TP1, seed=seed), seed)
    return _save(str(tmp_path / name), model, cfg), model


def _export(src, out, tp=None, pp=None, *extra):
    argv = ["--load", src, "--to-megatron", out]
    if tp:
        argv += ["--target-tensor-parallel-size", str(tp)]
    if pp:
        argv += ["--target-pipeline-parallel-size", str(pp)]
    return main(argv + list(extra))


# ------------------------------------------------------------------ reading the export
def _payloads(out, tp, pp):
    root = os.path.join(out, "release")
    names = {(t, p): f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
             for t in range(tp) for p in range(pp)}
    assert sorted(os.listdir(root)) == sorted(names.values())
    return {k: load_megatron_file(os.path.join(root, n, PT_FILE), allow_unsafe=True)
            for k, n in names.items()}


def _pair(d, name):
    return d[f"{name}.weight"], d.get(f"{name}.bias")


def _replicated(parts):
    """The one tensor every tensor rank holds (checked to be the same on each)."""
    for p in parts[1:]:
        assert (p is None) == (parts[0] is None)
        assert p is None or torch.equal(p, parts[0])
    return parts[0]


def _spec_from_files(out, tp, pp):
    """The per-rank tensors of the export in the form ``reference`` reads, as
    Megatron-LM's modules would hold them on each tensor rank and stage."""
    pl = _payloads(out, tp, pp)
    lms = {k: v["model"]["language_model"] for k, v in pl.items()}
    emb = [lms[(t, 0)]["embedding"] for t in range(tp)]
    spec: Dict[str, Any] = {
        "emb": [e["word_embeddings"]["weight"] for e in emb],
        "pos": _replicated([e.get("position_embeddings", {}).get("weight") for e in emb]),
        "tt": _replicated([e.get("tokentype_embeddings", {}).get("weight") for e in emb]),
        "layers": []}
    for p in range(pp):
        encs = [lms[(t, p)]["encoder"] for t in range(tp)]
        count = len({k.split(".")[1] for k in encs[0] if k.startswith("layers.")})
        assert all(set(e) == set(encs[0]) for e in encs)
        for i in range(count):
            pre = f"layers.{i}."

            def ranks(name, encs=encs, pre=pre):
                return [e[pre + name] for e in encs] if pre + name in encs[0] else None

            def rep(name, encs=encs, pre=pre):
                return _replicated([e.get(pre + name) for e in encs])

            spec["layers"].append({
                "ln1": (rep("input_layernorm.weight"), rep("input_layernorm.bias")),
                "ln2": (rep("post_attention_layernorm.weight"),
                        rep("post_attention_layernorm.bias")),
                "qkv_w": ranks("self_attention.query_key_value.weight"),
                "qkv_b": ranks("self_attention.query_key_value.bias"),
                "dense_w": ranks("self_attention.dense.weight"),
                "dense_b": rep("self_attention.dense.bias"),
                "h4_w": ranks("mlp.dense_h_to_4h.weight"),
                "h4_b": ranks("mlp.dense_h_to_4h.bias"),
                "w4h": ranks("mlp.dense_4h_to_h.weight"),
                "b4h": rep("mlp.dense_4h_to_h.bias")})
    last = [pl[(t, pp - 1)]["model"] for t in range(tp)]
    spec["final"] = (_replicated([m["language_model"]["encoder"]["final_layernorm.weight"]
                                  for m in last]),
                     _replicated([m["language_model"]["encoder"].get("final_layernorm.bias")
                                  for m in last]))
    if "output_layer" in last[0]["language_model"]:
        spec["out"] = [m["language_model"]["output_layer"]["weight"] for m in last]
    if "lm_head" in last[0]:
        spec["lm_dense"] = tuple(_replicated([_pair(m["lm_head"], "dense")[i] for m in last])
                                 for i in range(2))
        spec["lm_ln"] = tuple(_replicated([_pair(m["lm_head"], "layernorm")[i] for m in last])
                              for i in range(2))
        spec["lm_bias"] = [m["lm_head"]["bias"] for m in last]
    if "binary_head" in last[0]:
        spec["pooler"] = tuple(_replicated([_pair(m["language_model"]["pooler"], "dense")[i]
                                            for m in last]) for i in range(2))
        spec["binary"] = tuple(_replicated([m["binary_head"][k] for m in last])
                               for k in ("weight", "bias"))
    if pp > 1 and "out" not in spec:  # the last stage's copy of the tied embedding
        for t in range(tp):
            assert torch.equal(last[t]["word_embeddings_for_head"]["weight"], spec["emb"][t])
    else:
        assert all("word_embeddings_for_head" not in m for m in last)
    return spec, pl


def _files_check(out, tp, pp):
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read() == "release"
    assert sorted(os.listdir(out)) == ["latest_checkpointed_iteration.txt", "release"]
    spec, pl = _spec_from_files(out, tp, pp)
    for payload in pl.values():
        assert payload["checkpoint_version"] == 3.0 and payload["iteration"] == 0
        assert set(payload) == {"args", "checkpoint_version", "iteration", "model"}
        a = payload["args"]
        assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (tp, pp)
        assert a.padded_vocab_size == ROWS and a.tokenizer_type == "NullTokenizer"
        assert a.vocab_size == REAL_VOCAB - 1  # Megatron-LM's NullTokenizer: + its eod
        assert ROWS % (a.make_vocab_size_divisible_by * tp) == 0
    return spec, pl


def _same_tensors(a_root, b_root):
    a = merge_checkpoint(read_checkpoint(a_root))
    b = merge_checkpoint(read_checkpoint(b_root))
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------ GPT
GPT_CASES = [  # model options, source layout (t, p), target (t, p)
    ("gelu", (1, 1), (2, 2)),
    ("openai_gelu", (2, 2), (1, 1)),
    ("gelu", (1, 1), (1, 2)),
    ("llama", (1, 1), (2, 2)),
    ("llama", (2, 1), (1, 1)),
    ("llama", (1, 1), (2, 1)),
    ("llama_tied", (1, 2), (1, 2)),
]


@pytest.mark.parametrize("kind,source,target", GPT_CASES)
def test_gpt_export_gives_our_logits_in_megatron_lm_and_imports_back(tmp_path, capsys, kind,
                                                                     source, target):
    kw = {"gelu": {}, "openai_gelu": {"openai_gelu": True}, "llama": LLAMA,
          "llama_tied": dict(LLAMA, untie_embeddings_and_output_weights=False)}[kind]
    src, model = _gpt(tmp_path, seed=len(kind) + target[0], **kw)
    if source != (1, 1):  # the export merges any layout
        convert(src, str(tmp_path / "src"), tp=source[0], pp=source[1])
        src = str(tmp_path / "src")
    out = str(tmp_path / "mlm")
    assert _export(src, out, *target) == out
    err = capsys.readouterr().err
    assert "--use-legacy-models --ckpt-format torch" in err and f"--load {out}" in err
    assert f"--tensor-model-parallel-size {target[0]}" in err
    assert ("--no-bias-gelu-fusion" in err) == (kind == "gelu")
    assert ("--openai-gelu" in err) == (kind == "openai_gelu")
    if kind.startswith("llama"):
        for flag in ("--normalization RMSNorm", "--position-embedding-type rope",
                     "--rotary-percent 0.5", "--swiglu", "--disable-bias-linear",
                     "--group-query-attention --num-query-groups 2", "--norm-epsilon 1e-06"):
            assert flag in err, flag
        assert ("--untie-embeddings-and-output-weights" in err) == (kind == "llama")
    spec, pl = _files_check(out, *target)
    a = pl[(0, 0)]["args"]
    assert a.swiglu == kind.startswith("llama") and a.openai_gelu == (kind == "openai_gelu")
    ids = _ids()
    with torch.no_grad():
        ours = model(ids, None, None)
    llama = kind.startswith("llama")
    ref = reference(spec, tp=target[0], version=3, heads=4, groups=2 if llama else 4, kv=8,
                    eps=1e-6 if llama else 1e-5, rms=llama, swiglu=llama,
                    tanh_gelu=kind == "openai_gelu", rope_pct=0.5 if llama else None, ids=ids)
    assert ours.shape == ref.shape == (2, 16, ROWS)
    assert (ours - ref).abs().max().item() < 1e-4
    # and back: --from-megatron gives the very tensors exported
    back = str(tmp_path / "back")
    main(["--from-megatron", out, "--save", back, UNSAFE,
          "--target-tensor-parallel-size", str(source[0]),
          "--target-pipeline-parallel-size", str(source[1])])
    _same_tensors(src, back)
    record = read_checkpoint(back).config
    assert record["data"]["tokenizer_vocab_size"] == REAL_VOCAB
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_query_groups",
                "normalization", "position_embedding_type", "swiglu", "openai_gelu",
                "untie_embeddings_and_output_weights", "add_bias_linear", "layernorm_epsilon",
                "kv_channels") + (("rotary_percent", "rotary_base") if llama else ()):
        assert record["model"][key] == read_checkpoint(src).config["model"][key], key


@pytest.mark.parametrize("untied", [False, True])
def test_megatron_lm_checkpoint_round_trips_to_its_own_rank_tensors(tmp_path, capsys, untied):
    """Megatron-LM files (checkpoint_version 3.0, t=2, d=2) -> --from-megatron ->
    --to-megatron at t=2, d=2: every rank file holds the tensors it held (the layout
    this export writes is the one Megatron-LM wrote)."""
    llama = untied
    spec = _spec(bert=False, tp=2, layers=4, hidden=32, heads=4, groups=2 if llama else 4,
                 kv=8, ffn=48 if llama else 64, rms=llama, bias=not llama, swiglu=llama,
                 untied=untied, binary=False, rope=llama, seed=91)
    extra = (dict(ffn_hidden_size=48, normalization="RMSNorm", position_embedding_type="rope",
                  swiglu=True, group_query_attention=True, num_query_groups=2,
                  add_bias_linear=False, untie_embeddings_and_output_weights=True)
             if llama else {})
    args = _args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, **extra)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=2, style="mid", args=args)
    ours = str(tmp_path / "ours")
    main(["--from-megatron", src, "--save", ours, UNSAFE])
    out = str(tmp_path / "again")
    _export(ours, out, 2, 2)
    capsys.readouterr()
    theirs = _spec_from_files(out, 2, 2)[0]

    def same(a, b):
        if isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        elif isinstance(a, dict):
            assert set(a) == set(b)
            for k in a:
                same(a[k], b[k])
        else:
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)

    same(spec, theirs)


# ------------------------------------------------------------------ BERT
@pytest.mark.parametrize("binary,target", [(True, (2, 2)), (False, (2, 1))])
def test_bert_export_gives_our_logits_in_megatron_lm(tmp_path, capsys, binary, target):
    cfg = _cfg(num_tokentypes=2)
    model = _perturbed(BertModel(cfg, TP1, seed=7, add_binary_head=binary), 7)
    src = _save(str(tmp_path / "bert"), model, cfg)
    out = str(tmp_path / "mlm")
    _export(src, out, *target)
    err = capsys.readouterr().err
    assert "pretrain_bert.py" in err and ("--bert-no-binary-head" in err) == (not binary)
    spec, pl = _files_check(out, *target)
    assert pl[(0, 0)]["args"].bert_binary_head is binary
    ids = _ids()
    types = torch.zeros_like(ids)
    if binary:
        types[:, 9:] = 1
        assert spec["tt"] is not None
    else:  # Megatron-LM's BERT without the binary head has no token types: folded
        assert spec["tt"] is None and "folded into the position embeddings" in err
    pad = torch.ones_like(ids)
    pad[1, 12:] = 0
    with torch.no_grad():
        lm, bin_ours = model(ids, pad, types)
    ref_lm, ref_bin = reference(spec, tp=target[0], version=3, heads=4, groups=4, kv=8,
                                bert=True, ids=ids, types=types if binary else None, pad=pad)
    real = pad.bool()
    assert (lm - ref_lm)[real].abs().max().item() < 1e-4
    if binary:
        assert (bin_ours - ref_bin).abs().max().item() < 1e-4
    else:
        assert bin_ours is None and ref_bin is None
    back = str(tmp_path / "back")
    main(["--from-megatron", out, "--save", back, UNSAFE, "--true-vocab-size", str(REAL_VOCAB)])
    if binary:
        _same_tensors(src, back)
    else:  # the type-0 row lives in the positions now; the logits are the same
        again, _ = _ours(back, bert=True, binary=False)
        with torch.no_grad():
            lm2, _ = again(ids, pad, types)
        assert (lm2 - lm)[real].abs().max().item() < 1e-4


# ------------------------------------------------------------------ bad input
def _nothing_written(tmp_path, out):
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_non_empty_target_is_refused_and_left_alone(tmp_path, capsys):
    src, _ = _gpt(tmp_path, num_layers=2)
    out = tmp_path / "mlm"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = _error(capsys, ["--load", src, "--to-megatron", str(out)])
    assert "--to-megatron" in line and "new or empty directory" in line and "keep.txt" in line
    assert sorted(os.listdir(out)) == ["keep.txt"]
    assert not [n for n in os.listdir(tmp_path) if ".tmp." in n]
    empty = tmp_path / "empty"
    empty.mkdir()
    _export(src, str(empty))  # an empty directory is fine
    capsys.readouterr()
    assert sorted(os.listdir(empty)) == ["latest_checkpointed_iteration.txt", "release"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    line = _error(capsys, ["--load", src, "--to-megatron", str(a_file)])
    assert "is a file" in line
    line = _error(capsys, ["--load", src, "--to-megatron", os.path.join(src, "inside")])
    assert "--to-megatron" in line and "inside" in line


@pytest.mark.parametrize("what,expect", [
    ("qk_layernorm", "--qk-layernorm"),
    ("rotary_base", "base 500000"),
    ("rope_scaling", "--use-rope-scaling"),
    ("unknown_option", "brand_new_option"),
    ("task_head", "classification_head.weight"),
    ("layers_over_p", "--target-pipeline-parallel-size 3"),
    ("heads_over_t", "--target-tensor-parallel-size 3"),
    ("bert_untied", "--untie-embeddings-and-output-weights"),
])
def test_what_megatron_lm_cannot_express_is_one_line_and_writes_nothing(tmp_path, capsys,
                                                                        what, expect):
    cfg = _cfg(num_layers=2, **(LLAMA if what in ("rotary_base", "rope_scaling") else {}))
    record, extra, argv = {}, None, []
    model = _perturbed(GPTModel(cfg, TP1, seed=3), 3)
    if what == "qk_layernorm":
        record = {"qk_layernorm": True}
    elif what == "rotary_base":
        record = {"rotary_base": 500000}
    elif what == "rope_scaling":
        record = {"rope_scaling": True}
    elif what == "unknown_option":
        record = {"brand_new_option": 3}
    elif what == "task_head":
        extra = {"classification_head.weight": torch.zeros(3, 32)}
    elif what == "layers_over_p":
        argv = ["--target-pipeline-parallel-size", "3"]
    elif what == "heads_over_t":
        argv = ["--target-tensor-parallel-size", "3"]
    elif what == "bert_untied":
        cfg = _cfg(num_layers=2, num_tokentypes=2)
        model = BertModel(cfg, TP1, seed=3)
        record = {"untie_embeddings_and_output_weights": True}
    src = _save(str(tmp_path / "ours"), model, cfg, record=record, extra=extra)
    out = str(tmp_path / "mlm")
    line = _error(capsys, ["--load", src, "--to-megatron", out] + argv)
    assert expect in line, line
    _nothing_written(tmp_path, out)


def test_flags_megatron_lm_cannot_take(tmp_path, capsys):
    src, _ = _gpt(tmp_path, num_layers=2)
    out = str(tmp_path / "mlm")
    for argv, expect in (
            (["--target-data-parallel-size", "2"], "--target-data-parallel-size applies to"),
            (["--target-decoder-first-pipeline-num-layers", "1",
              "--target-pipeline-parallel-size", "2"],
             "--target-decoder-first-pipeline-num-layers applies to"),
            (["--to-hf", str(tmp_path / "hf")], "choose one workflow"),
            (["--save", str(tmp_path / "s")], "choose one workflow")):
        line = _error(capsys, ["--load", src, "--to-megatron", out] + argv)
        assert expect in line and ("--to-megatron" in line or "choose" in line), line
    line = _error(capsys, ["--to-megatron", out])
    assert "--to-megatron needs --load" in line
    _nothing_written(tmp_path, out)


def test_failed_write_leaves_nothing(tmp_path, capsys, monkeypatch):
    import megatron.megatron_lm_export as export

    src, _ = _gpt(tmp_path, num_layers=2)
    out = str(tmp_path / "mlm")
    calls = []
    real_save = torch.save

    def failing_save(obj, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", path)
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(export.torch, "save", failing_save)
    line = _error(capsys, ["--load", src, "--to-megatron", out, "--target-tensor-parallel-size",
                           "2"])
    assert "No space left on device" in line and "--to-megatron" in line
    _nothing_written(tmp_path, out)


def test_vocabulary_is_repadded_when_no_unit_keeps_it(tmp_path, capsys):
    """--make-vocab-size-divisible-by 48 for the Megatron-LM run: 100 ids -> 192 rows at
    t=2 (multiples of 96); the new rows copy the last padding row."""
    src, model = _gpt(tmp_path, num_layers=2)
    out = str(tmp_path / "mlm")
    _export(src, out, 2, 1, "--make-vocab-size-divisible-by", "48")
    assert "padded vocabulary 128 -> 192" in capsys.readouterr().err
    pl = _payloads(out, 2, 1)
    a = pl[(0, 0)]["args"]
    assert (a.padded_vocab_size, a.make_vocab_size_divisible_by) == (192, 48)
    emb = torch.cat([pl[(t, 0)]["model"]["language_model"]["embedding"]["word_embeddings"]
                     ["weight"] for t in range(2)])
    ours = model.state_dict()["embedding.word_embeddings.weight"]
    assert torch.equal(emb[:ROWS], ours) and torch.equal(emb[ROWS:], ours[-1:].expand(64, -1))

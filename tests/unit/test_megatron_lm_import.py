"""Importing Megatron-LM's own (legacy torch.save) checkpoints: ``tools/checkpoint_util.py
--from-megatron`` (megatron/megatron_lm_import.py).

The checkpoints here are written with torch.save in Megatron-LM's legacy layout
(``model["language_model"]["embedding"/"encoder"/...]``, per tensor rank and pipeline
stage, layers numbered from 0 on each stage), with random values on every rank.  The
imported model's logits are compared with a reference forward written from Megatron-LM's
math that reads those per-rank tensors directly: each tensor rank's vocabulary slice,
its query/key/value rows in the order of the file's checkpoint_version, its column- and
row-parallel MLP parts, summed as Megatron-LM's all-reduce sums them."""
from __future__ import annotations

import argparse
import enum
import math
import os
import random
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron.config import ModelConfig
from megatron.model.bert_model import BertModel
from megatron.model.gpt_model import GPTModel
from megatron.tensor_parallel import TPInfo
from tools.checkpoint_util import main, merge_checkpoint, read_checkpoint

TP1 = TPInfo.single()
REAL_VOCAB = 100  # Megatron-LM's NullTokenizer: args.vocab_size 99 + its end-of-document id
ROWS = 128        # padded to a multiple of 64 x t (t = 1, 2)
UNSAFE = "--allow-unsafe-checkpoint"


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


# ------------------------------------------------------------------ synthetic checkpoints
def _r(g, *shape, scale=0.3, shift=0.0):
    return torch.randn(*shape, generator=g) * scale + shift


def _spec(*, bert, tp, layers, hidden, heads, groups, kv, ffn, rms, bias, swiglu, untied,
          binary, rope, seed):
    """Random per-tensor-rank tensors of a Megatron-LM model (lists indexed by rank)."""
    g = torch.Generator().manual_seed(seed)
    qkv_rows = (heads + 2 * groups) * kv // tp
    ffn1 = (2 * ffn if swiglu else ffn) // tp

    def norm():
        return (_r(g, hidden, scale=0.1, shift=1.0), None if rms else _r(g, hidden, scale=0.1))

    s = {"emb": [_r(g, ROWS // tp, hidden) for _ in range(tp)],
         "pos": None if rope else _r(g, 16, hidden, scale=0.1),
         "tt": _r(g, 2, hidden, scale=0.1) if bert and binary else None,
         "layers": [], "final": norm()}
    for _ in range(layers):
        s["layers"].append({
            "ln1": norm(), "ln2": norm(),
            "qkv_w": [_r(g, qkv_rows, hidden, scale=0.2) for _ in range(tp)],
            "qkv_b": [_r(g, qkv_rows, scale=0.1) for _ in range(tp)] if bias else None,
            "dense_w": [_r(g, hidden, heads * kv // tp, scale=0.2) for _ in range(tp)],
            "dense_b": _r(g, hidden, scale=0.1) if bias else None,
            "h4_w": [_r(g, ffn1, hidden, scale=0.2) for _ in range(tp)],
            "h4_b": [_r(g, ffn1, scale=0.1) for _ in range(tp)] if bias else None,
            "w4h": [_r(g, hidden, ffn // tp, scale=0.2) for _ in range(tp)],
            "b4h": _r(g, hidden, scale=0.1) if bias else None})
    if untied:
        s["out"] = [_r(g, ROWS // tp, hidden) for _ in range(tp)]
    if bert:
        s["lm_dense"] = (_r(g, hidden, hidden, scale=0.2), _r(g, hidden, scale=0.1))
        s["lm_ln"] = (_r(g, hidden, scale=0.1, shift=1.0), _r(g, hidden, scale=0.1))
        s["lm_bias"] = [_r(g, ROWS // tp, scale=0.1) for _ in range(tp)]
        if binary:
            s["pooler"] = (_r(g, hidden, hidden, scale=0.2), _r(g, hidden, scale=0.1))
            s["binary"] = (_r(g, 2, hidden, scale=0.2), _r(g, 2, scale=0.1))
    return s


def _args(**kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                max_position_embeddings=16, seq_length=16, padded_vocab_size=ROWS,
                make_vocab_size_divisible_by=64, tokenizer_type="NullTokenizer",
                vocab_size=REAL_VOCAB - 1, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, layernorm_epsilon=1e-5, hidden_dropout=0.1,
                attention_dropout=0.1, init_method_std=0.02, openai_gelu=False,
                bias_gelu_fusion=False, onnx_safe=None, kv_channels=None,
                params_dtype=torch.float32, fp16=False, bf16=False, data_path=["x"],
                recompute_granularity=None, sequence_parallel=False, seed=1234)
    base.update(kw)
    return argparse.Namespace(**base)


def _write(root, spec, *, tp, pp, version=3.0, style="new", args=None, tracker="1000",
           bert=False, extra=None):
    """Megatron-LM's files for ``spec``: ``style`` 'old' (transformer / attention. /
    input_layernorm), 'mid' (encoder / self_attention.) or 'new' (input_norm, final_norm,
    lm_head.norm)."""
    layers = len(spec["layers"])
    per = layers // pp
    it_dir = os.path.join(root, "release" if tracker == "release" else f"iter_{int(tracker):07d}")
    attn = "attention" if style == "old" else "self_attention"
    ln1, ln2, fin = (("input_norm", "post_attention_norm", "final_norm") if style == "new"
                     else ("input_layernorm", "post_attention_layernorm", "final_layernorm"))

    def put(d, name, pair):
        d[f"{name}.weight"] = pair[0]
        if pair[1] is not None:
            d[f"{name}.bias"] = pair[1]

    for p in range(pp):
        for t in range(tp):
            lm = {}
            if p == 0:
                lm["embedding"] = {"word_embeddings": {"weight": spec["emb"][t]}}
                if spec["pos"] is not None:
                    lm["embedding"]["position_embeddings"] = {"weight": spec["pos"]}
                if spec["tt"] is not None:
                    lm["embedding"]["tokentype_embeddings"] = {"weight": spec["tt"]}
            enc = {}
            for i in range(per):
                L = spec["layers"][p * per + i]
                pre = f"layers.{i}."
                put(enc, pre + ln1, L["ln1"])
                put(enc, pre + f"{attn}.query_key_value",
                    (L["qkv_w"][t], L["qkv_b"][t] if L["qkv_b"] else None))
                put(enc, pre + f"{attn}.dense", (L["dense_w"][t], L["dense_b"]))
                put(enc, pre + ln2, L["ln2"])
                put(enc, pre + "mlp.dense_h_to_4h",
                    (L["h4_w"][t], L["h4_b"][t] if L["h4_b"] else None))
                put(enc, pre + "mlp.dense_4h_to_h", (L["w4h"][t], L["b4h"]))
            if p == pp - 1:
                put(enc, fin, spec["final"])
            lm["transformer" if style == "old" else "encoder"] = enc
            model = {"language_model": lm}
            if p == pp - 1:
                if "pooler" in spec:
                    lm["pooler"] = {}
                    put(lm["pooler"], "dense", spec["pooler"])
                if "out" in spec:
                    lm["output_layer"] = {"weight": spec["out"][t]}
                elif pp > 1:
                    model["word_embeddings_for_head"] = {"weight": spec["emb"][t]}
                if bert:
                    head = {"bias": spec["lm_bias"][t]}
                    put(head, "dense", spec["lm_dense"])
                    put(head, "norm" if style == "new" else "layernorm", spec["lm_ln"])
                    model["lm_head"] = head
                    if "binary" in spec:
                        model["binary_head"] = {"weight": spec["binary"][0],
                                                "bias": spec["binary"][1]}
            sd = {"iteration": 0 if tracker == "release" else int(tracker), "model": model,
                  "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}},
                                              "param_groups": [{"lr": 1e-4, "params": [0]}]},
                                "grad_scaler": {"scale": 4096.0, "growth_tracker": 7}},
                  "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 1000},
                  "rng_state": [{"random_rng_state": random.getstate(),
                                 "np_rng_state": np.random.get_state(),
                                 "torch_rng_state": torch.get_rng_state(),
                                 "cuda_rng_state": torch.zeros(16, dtype=torch.uint8),
                                 "rng_tracker_states": {"model-parallel-rng":
                                                        torch.zeros(16, dtype=torch.uint8)}}]}
            if version is not None:
                sd["checkpoint_version"] = version
            if args is not None:
                sd["args"] = args
            sd.update(extra or {})
            d = os.path.join(it_dir, f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            os.makedirs(d, exist_ok=True)
            torch.save(sd, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(tracker)
    return root


# ------------------------------------------------------------------ the reference forward
def _norm(x, pair, eps, rms):
    w, b = pair
    if rms:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def _rope(x, rot_dim, positions):
    """Megatron-LM's rotate-half RoPE (base 10000) on the first ``rot_dim`` dims."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(positions.float(), inv)
    emb = torch.cat([freqs, freqs], -1)[None, :, None, :]  # [1, s, 1, rot]
    t, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = t.chunk(2, -1)
    t = t * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()
    return torch.cat([t, rest], -1)


def _split_qkv(y, version, heads_l, groups_l, kv):
    """One rank's fused output [b, s, rows] -> q [b, s, heads_l, kv], k, v (as that
    version of Megatron-LM's attention reads it)."""
    b, s, _ = y.shape
    if version == 0:
        q, k, v = y.chunk(3, -1)
        return (q.view(b, s, heads_l, kv), k.view(b, s, heads_l, kv), v.view(b, s, heads_l, kv))
    if version == 1:
        y = y.view(b, s, heads_l, kv, 3)
        return y[..., 0], y[..., 1], y[..., 2]
    per = heads_l // groups_l
    y = y.view(b, s, groups_l, per + 2, kv)
    q = y[:, :, :, :per].reshape(b, s, heads_l, kv)
    k = y[:, :, :, per].repeat_interleave(per, dim=2)
    v = y[:, :, :, per + 1].repeat_interleave(per, dim=2)
    return q, k, v


def reference(spec, *, tp, version, heads, groups, kv, eps=1e-5, rms=False, swiglu=False,
              tanh_gelu=False, squared_relu=False, rope_pct=None, post_ln=False, bert=False,
              ids, types=None, pad=None, head_tanh_gelu=None):
    """Megatron-LM's forward, computed from the per-rank tensors of ``spec``."""
    b, s = ids.shape
    vl = ROWS // tp
    x = torch.zeros(b, s, spec["emb"][0].shape[1])
    for t in range(tp):  # VocabParallelEmbedding: each rank its rows, then all-reduce
        local = ids - t * vl
        hit = (local >= 0) & (local < vl)
        x = x + spec["emb"][t][local.clamp(0, vl - 1)] * hit[..., None]
    if spec["pos"] is not None:
        x = x + spec["pos"][torch.arange(s)]
    if bert and spec["tt"] is not None:
        x = x + spec["tt"][types]
    if bert:
        keep = pad[:, None, :].bool() & pad[:, :, None].bool()
        mask = ~keep[:, None]  # [b, 1, s, s], True = masked
    else:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    hl, gl = heads // tp, groups // tp
    for L in spec["layers"]:
        h1 = _norm(x, L["ln1"], eps, rms)
        attn = torch.zeros_like(x)
        for t in range(tp):
            y = h1 @ L["qkv_w"][t].T + (L["qkv_b"][t] if L["qkv_b"] else 0)
            q, k, v = _split_qkv(y, version, hl, gl, kv)
            if rope_pct is not None:
                rd = int(kv * rope_pct)
                q, k = _rope(q, rd, torch.arange(s)), _rope(k, rd, torch.arange(s))
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(kv)
            probs = scores.masked_fill(mask, -10000.0).softmax(-1)  # attention_mask_func
            ctx = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, hl * kv)
            attn = attn + ctx @ L["dense_w"][t].T  # row-parallel: partial sums
        if L["dense_b"] is not None:
            attn = attn + L["dense_b"]
        x = (h1 if post_ln else x) + attn
        h2 = _norm(x, L["ln2"], eps, rms)
        mlp = torch.zeros_like(x)
        for t in range(tp):
            u = h2 @ L["h4_w"][t].T + (L["h4_b"][t] if L["h4_b"] else 0)
            if swiglu:
                a_, b_ = u.chunk(2, -1)
                u = F.silu(a_) * b_
            elif squared_relu:
                u = F.relu(u) ** 2
            else:
                u = _gelu_tanh(u) if tanh_gelu else F.gelu(u)
            mlp = mlp + u @ L["w4h"][t].T
        if L["b4h"] is not None:
            mlp = mlp + L["b4h"]
        x = (h2 if post_ln else x) + mlp
    x = _norm(x, spec["final"], eps, rms)
    out = spec.get("out") or spec["emb"]
    if not bert:
        return torch.cat([x @ out[t].T for t in range(tp)], -1)
    hw, hb = spec["lm_dense"]
    hh = x @ hw.T + hb
    use_tanh = tanh_gelu if head_tanh_gelu is None else head_tanh_gelu
    hh = _norm(_gelu_tanh(hh) if use_tanh else F.gelu(hh), spec["lm_ln"], eps, False)
    lm = torch.cat([hh @ spec["emb"][t].T + spec["lm_bias"][t] for t in range(tp)], -1)
    binary = None
    if "binary" in spec:
        pooled = torch.tanh(x[:, 0] @ spec["pooler"][0].T + spec["pooler"][1])
        binary = pooled @ spec["binary"][0].T + spec["binary"][1]
    return lm, binary


# ------------------------------------------------------------------ our side
def _ours(out, bert=False, binary=True):
    ckpt = read_checkpoint(out)
    record = dict(ckpt.config["model"])
    record["params_dtype"] = getattr(torch, record["params_dtype"].removeprefix("torch."))
    cfg = ModelConfig(**record)
    model = (BertModel(cfg, TP1, seed=1, add_binary_head=binary) if bert
             else GPTModel(cfg, TP1, seed=1)).eval()
    model.load_state_dict(merge_checkpoint(ckpt))
    return model, ckpt


def _ids(vocab=REAL_VOCAB, b=2, s=16, seed=3):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _import(src, out, *extra):
    return main(["--from-megatron", src, "--save", out, UNSAFE, *extra])


def _error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ------------------------------------------------------------------ GPT
GPT_CASES = [  # version, tp, pp, naming style, tracker, target (t, d), tanh GELU through
    (0.0, 2, 2, "old", "release", (1, 1), "openai_gelu"),
    (1.0, 2, 1, "mid", "1000", (1, 1), None),
    (3.0, 2, 2, "new", "2000", (2, 2), "bias_gelu_fusion"),
    (3.0, 1, 1, "mid", "release", (1, 1), None),
]


@pytest.mark.parametrize("version,tp,pp,style,tracker,target,gelu", GPT_CASES)
def test_gpt_logits_equal_megatron_reference(tmp_path, capsys, version, tp, pp, style, tracker,
                                             target, gelu):
    spec = _spec(bert=False, tp=tp, layers=4, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=int(version * 10) + tp)
    args = _args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                 openai_gelu=gelu == "openai_gelu", bias_gelu_fusion=gelu == "bias_gelu_fusion")
    src = _write(str(tmp_path / "mlm"), spec, tp=tp, pp=pp, version=version, style=style,
                 args=args, tracker=tracker)
    out = str(tmp_path / "ours")
    _import(src, out, "--target-tensor-parallel-size", str(target[0]),
            "--target-pipeline-parallel-size", str(target[1]))
    err = capsys.readouterr().err
    assert "--num-layers 4 --hidden-size 32 --num-attention-heads 4" in err
    assert ("--openai-gelu" in err) == (gelu is not None)
    assert f"--tensor-model-parallel-size {target[0]}" in err and "--finetune" in err
    model, ckpt = _ours(out)
    assert (ckpt.tensor, ckpt.pipeline, ckpt.iteration) == (target[0], target[1], 0)
    # the same NullTokenizer convention as Megatron-LM's: --vocab-size 99, 100 ids
    assert (ckpt.config["data"]["vocab_size"],
            ckpt.config["data"]["tokenizer_vocab_size"]) == (REAL_VOCAB - 1, REAL_VOCAB)
    ids = _ids()
    with torch.no_grad():
        ours = model(ids, None, None)
    ref = reference(spec, tp=tp, version=version, heads=4, groups=4, kv=8,
                    tanh_gelu=gelu is not None, ids=ids)
    assert ours.shape == ref.shape == (2, 16, ROWS)
    assert (ours - ref).abs().max().item() < 1e-4


def test_qkv_orderings_differ_by_version(tmp_path, capsys):
    """The same tensors read as version 0, 1.0 and 3.0 are three different models: the
    reorderings matter, and each one matches its own reference (above)."""
    spec = _spec(bert=False, tp=2, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=9)
    outs = []
    for version in (0.0, 1.0, 3.0):
        args = _args(num_layers=2, tensor_model_parallel_size=2)
        src = _write(str(tmp_path / f"v{version}"), spec, tp=2, pp=1, version=version,
                     args=args)
        out = str(tmp_path / f"ours{version}")
        _import(src, out)
        model, _ = _ours(out)
        with torch.no_grad():
            outs.append(model(_ids(), None, None))
        ref = reference(spec, tp=2, version=version, heads=4, groups=4, kv=8, ids=_ids())
        assert (outs[-1] - ref).abs().max().item() < 1e-4
    assert (outs[0] - outs[1]).abs().max() > 1e-2 and (outs[0] - outs[2]).abs().max() > 1e-2
    assert (outs[1] - outs[2]).abs().max() > 1e-2


def test_llama_style_gpt_logits_equal_reference(tmp_path, capsys):
    """RMSNorm, RoPE on half of each head, SwiGLU (rank r holds [gate_r; up_r]),
    grouped-query attention, no biases, an untied output layer; t=2, d=2, version 3."""
    spec = _spec(bert=False, tp=2, layers=4, hidden=32, heads=4, groups=2, kv=8, ffn=48,
                 rms=True, bias=False, swiglu=True, untied=True, binary=False, rope=True,
                 seed=11)
    args = _args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                 ffn_hidden_size=48, normalization="RMSNorm", norm_epsilon=1e-6,
                 position_embedding_type="rope", rotary_percent=0.5, swiglu=True,
                 group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                 untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                 attention_dropout=0.0)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=2, args=args)
    out = str(tmp_path / "ours")
    _import(src, out)
    err = capsys.readouterr().err
    for flag in ("--normalization RMSNorm", "--position-embedding-type rope", "--swiglu",
                 "--group-query-attention --num-query-groups 2", "--disable-bias-linear",
                 "--untie-embeddings-and-output-weights", "--rotary-percent 0.5"):
        assert flag in err
    model, _ = _ours(out)
    ids = _ids()
    with torch.no_grad():
        ours = model(ids, None, None)
    ref = reference(spec, tp=2, version=3, heads=4, groups=2, kv=8, eps=1e-6, rms=True,
                    swiglu=True, rope_pct=0.5, ids=ids)
    assert (ours - ref).abs().max().item() < 1e-4


def test_post_layernorm_residual_and_squared_relu(tmp_path, capsys):
    spec = _spec(bert=False, tp=2, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=13)
    args = _args(num_layers=2, tensor_model_parallel_size=2, squared_relu=True,
                 apply_residual_connection_post_layernorm=True, bias_gelu_fusion=True)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=1, args=args)
    out = str(tmp_path / "ours")
    _import(src, out)
    err = capsys.readouterr().err
    assert "--squared-relu" in err and "--apply-residual-connection-post-layernorm" in err
    assert "--openai-gelu" not in err  # the fused bias-GELU is not used with squared ReLU
    model, _ = _ours(out)
    with torch.no_grad():
        ours = model(_ids(), None, None)
    ref = reference(spec, tp=2, version=3, heads=4, groups=4, kv=8, squared_relu=True,
                    post_ln=True, ids=_ids())
    assert (ours - ref).abs().max().item() < 1e-4


# ------------------------------------------------------------------ BERT
@pytest.mark.parametrize("version,style,binary", [(0.0, "old", True), (3.0, "new", True),
                                                   (3.0, "mid", False)])
def test_bert_logits_equal_megatron_reference(tmp_path, capsys, version, style, binary):
    spec = _spec(bert=True, tp=2, layers=4, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=binary, rope=False,
                 seed=21 + int(version))
    args = _args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                 tokenizer_type="BertWordPieceLowerCase", vocab_file="/nonexistent/vocab.txt",
                 vocab_size=None, bert_binary_head=binary)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=2, version=version, style=style,
                 args=args, bert=True)
    out = str(tmp_path / "ours")
    _import(src, out, "--true-vocab-size", str(REAL_VOCAB))
    err = capsys.readouterr().err
    assert "--tokenizer-type BertWordPieceLowerCase" in err and "not on this machine" in err
    assert ("--bert-no-binary-head" in err) == (not binary)
    assert ("token-type table is written as zeros" in err) == (not binary)
    model, ckpt = _ours(out, bert=True, binary=binary)
    assert ckpt.config["model"]["num_tokentypes"] == 2
    ids = _ids()
    types = torch.zeros_like(ids)
    types[:, 9:] = 1
    pad = torch.ones_like(ids)
    pad[1, 12:] = 0
    with torch.no_grad():
        lm, bin_ours = model(ids, pad, types)
    ref_lm, ref_bin = reference(spec, tp=2, version=version, heads=4, groups=4, kv=8,
                                bert=True, ids=ids, types=types, pad=pad)
    real = pad.bool()  # padded positions attend to nothing real: compare the real ones
    assert (lm - ref_lm)[real].abs().max().item() < 1e-4
    if binary:
        assert (bin_ours - ref_bin).abs().max().item() < 1e-4
    else:
        assert bin_ours is None


def test_bert_fused_gelu_note(tmp_path, capsys):
    """Megatron-LM's fused bias-GELU (tanh) in the blocks with an exact-GELU LM head: one
    GELU here; imported as the blocks', with a note, and close to the reference."""
    spec = _spec(bert=True, tp=1, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=True, rope=False,
                 seed=31)
    args = _args(num_layers=2, bias_gelu_fusion=True, tokenizer_type="BertWordPieceCase",
                 vocab_file="/nonexistent/vocab.txt", vocab_size=None)
    src = _write(str(tmp_path / "mlm"), spec, tp=1, pp=1, args=args, bert=True)
    out = str(tmp_path / "ours")
    _import(src, out, "--true-vocab-size", str(REAL_VOCAB))
    err = capsys.readouterr().err
    assert "--openai-gelu" in err and "LM head" in err
    model, _ = _ours(out, bert=True)
    ids = _ids()
    with torch.no_grad():
        lm, _ = model(ids, torch.ones_like(ids), torch.zeros_like(ids))
    ref, _ = reference(spec, tp=1, version=3, heads=4, groups=4, kv=8, bert=True,
                       tanh_gelu=True, head_tanh_gelu=False, ids=ids,
                       types=torch.zeros_like(ids), pad=torch.ones_like(ids))
    assert 0 < (lm - ref).abs().max().item() < 5e-3


# ------------------------------------------------------------------ the result is usable
def test_printed_flags_build_the_recorded_model(tmp_path, capsys):
    """The printed command line parses, and a run with it finds the checkpoint's shape
    (the check --load makes before loading)."""
    from megatron.arguments import parse_and_validate
    from megatron.checkpoint_discovery import read_saved_config
    from megatron.checkpoint_shape import check_model_shape

    spec = _spec(bert=False, tp=2, layers=4, hidden=32, heads=4, groups=2, kv=8, ffn=48,
                 rms=True, bias=False, swiglu=True, untied=True, binary=False, rope=True,
                 seed=41)
    args = _args(tensor_model_parallel_size=2, ffn_hidden_size=48, normalization="RMSNorm",
                 position_embedding_type="rope", swiglu=True, group_query_attention=True,
                 num_query_groups=2, add_bias_linear=False,
                 untie_embeddings_and_output_weights=True, rotary_percent=0.5)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=1, args=args)
    out = str(tmp_path / "ours")
    _import(src, out)
    line = [x for x in capsys.readouterr().err.splitlines() if "train with:" in x][0]
    entry, *flags = line.split("train with: ", 1)[1].split(" --load ")[0].split()
    assert entry == "pretrain_gpt.py" and line.endswith(f"--load {out} --finetune")
    _, cfg = parse_and_validate(flags + ["--micro-batch-size", "1", "--train-iters", "1",
                                         "--lr", "1e-4", "--mock-data"], world_size=1)
    _, saved = read_saved_config(out)
    check_model_shape(out, saved, cfg.model)  # raises on any difference


def test_imported_gpt_exports_to_transformers(tmp_path, capsys):
    """What tools/generate_samples_gpt.py does with the result: export it to transformers
    (GPT2LMHeadModel), whose logits equal Megatron-LM's reference."""
    transformers = pytest.importorskip("transformers")
    spec = _spec(bert=False, tp=2, layers=4, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=43)
    args = _args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                 bias_gelu_fusion=True)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=2, version=0.0, args=args)
    out = str(tmp_path / "ours")
    _import(src, out)
    main(["--load", out, "--to-hf", str(tmp_path / "hf")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.activation_function == "gelu_new"
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits
    ref = reference(spec, tp=2, version=0, heads=4, groups=4, kv=8, tanh_gelu=True, ids=ids)
    assert (theirs - ref[..., :REAL_VOCAB]).abs().max().item() < 1e-4


def test_imported_bert_loads_into_a_finetuning_stage(tmp_path, capsys):
    """tasks/main.py --pretrained-checkpoint: the last of two stages of a classification
    model takes its layers from the import (t=2, d=2 in Megatron-LM); only the new head
    is initialised."""
    from megatron.model.classification import Classification
    from tools.checkpoint_util import load_into_stage

    spec = _spec(bert=True, tp=2, layers=4, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=True, rope=False,
                 seed=45)
    args = _args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=2, args=args, bert=True)
    out = str(tmp_path / "ours")
    _import(src, out)
    record = dict(read_checkpoint(out).config["model"])
    record["params_dtype"] = torch.float32
    cfg = ModelConfig(**record)
    stage = Classification(cfg, TP1, num_classes=3, pre_process=False,
                           layer_numbers=range(2, 4))
    report = load_into_stage(stage, out, layer_offset=2, tp_rank=0, tp_size=1,
                             allow_missing=("classification_head",))
    assert sorted(report.missing) == ["classification_head.bias", "classification_head.weight"]
    L = spec["layers"][3]
    got = stage.state_dict()
    assert torch.equal(got["encoder.layers.1.mlp.dense_4h_to_h.weight"], torch.cat(L["w4h"], 1))
    assert torch.equal(got["encoder.final_layernorm.weight"], spec["final"][0])
    assert torch.equal(got["pooler.dense.weight"], spec["pooler"][0])


def test_stand_in_for_megatron_enums_in_args(tmp_path, capsys, monkeypatch):
    """args pickle Megatron-LM's own enums (args.model_type = ModelType...): read as inert
    records, never importing Megatron-LM."""
    class ModelType(enum.Enum):
        encoder_or_decoder = 1
    ModelType.__module__ = "megatron.core.enums"
    ModelType.__qualname__ = "ModelType"
    fake = types.ModuleType("megatron.core.enums")
    fake.ModelType = ModelType
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.setitem(sys.modules, "megatron.core.enums", fake)
    spec = _spec(bert=False, tp=1, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=51)
    src = _write(str(tmp_path / "mlm"), spec, tp=1, pp=1,
                 args=_args(num_layers=2, model_type=ModelType.encoder_or_decoder))
    monkeypatch.delitem(sys.modules, "megatron.core.enums")
    monkeypatch.delitem(sys.modules, "megatron.core")
    out = str(tmp_path / "ours")
    _import(src, out)
    assert "megatron.core" not in sys.modules
    model, _ = _ours(out)
    with torch.no_grad():
        ours = model(_ids(), None, None)
    ref = reference(spec, tp=1, version=3, heads=4, groups=4, kv=8, ids=_ids())
    assert (ours - ref).abs().max().item() < 1e-4


def test_checkpoint_without_args_needs_the_heads(tmp_path, capsys):
    """An early release: no args, no checkpoint_version (0), one rank; the sizes come
    from the tensors, the heads from --num-attention-heads, the tanh GELU of the time."""
    spec = _spec(bert=False, tp=1, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=61)
    src = _write(str(tmp_path / "mlm"), spec, tp=1, pp=1, version=None, style="old",
                 args=None, tracker="release")
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "a"), UNSAFE])
    assert "--num-attention-heads" in line and "model_optim_rng.pt" in line
    out = str(tmp_path / "ours")
    _import(src, out, "--num-attention-heads", "4")
    assert "records no args" in capsys.readouterr().err
    model, _ = _ours(out)
    with torch.no_grad():
        ours = model(_ids(), None, None)
    ref = reference(spec, tp=1, version=0, heads=4, groups=4, kv=8, tanh_gelu=True, ids=_ids())
    assert (ours - ref).abs().max().item() < 1e-4


def test_rank_file_or_rank_directory_can_be_given(tmp_path, capsys):
    spec = _spec(bert=False, tp=2, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=71)
    src = _write(str(tmp_path / "mlm"), spec, tp=2, pp=1,
                 args=_args(num_layers=2, tensor_model_parallel_size=2), tracker="300")
    one = os.path.join(src, "iter_0000300", "mp_rank_01", "model_optim_rng.pt")
    _import(one, str(tmp_path / "a"))  # the whole iteration it belongs to
    assert "iteration 300" in capsys.readouterr().err
    assert read_checkpoint(str(tmp_path / "a")).config["model"]["hidden_size"] == 32
    _import(src, str(tmp_path / "b"), "--iteration", "300")
    capsys.readouterr()
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "c"), UNSAFE,
                           "--iteration", "5"])
    assert "--iteration 5" in line and "iter_0000005" in line


# ------------------------------------------------------------------ refusals
def _small(tmp_path, **kw):
    spec = _spec(bert=False, tp=2, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=81)
    a = dict(num_layers=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    a.update(kw.pop("args", {}))
    return spec, _write(str(tmp_path / "mlm"), spec, tp=2, pp=2, args=_args(**a), **kw)


def test_refused_without_the_flag(tmp_path, capsys):
    _, src = _small(tmp_path)
    out = str(tmp_path / "ours")
    line = _error(capsys, ["--from-megatron", src, "--save", out])
    assert UNSAFE in line and "pickle" in line and "model_optim_rng.pt" in line
    assert not os.path.exists(out)


def test_disallowed_global_refused_even_with_the_flag(tmp_path, capsys):
    victim = tmp_path / "created_by_unpickling"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(victim),))

    _, src = _small(tmp_path, extra={"optimizer": {"evil": Evil()}})
    out = str(tmp_path / "ours")
    line = _error(capsys, ["--from-megatron", src, "--save", out, UNSAFE])
    assert UNSAFE in line and "mkdir" in line and "allow-list" in line
    assert "mp_rank_00_000" in line
    assert not victim.exists() and not os.path.exists(out)


def test_missing_rank_file(tmp_path, capsys):
    _, src = _small(tmp_path)
    gone = os.path.join(src, "iter_0001000", "mp_rank_01_001", "model_optim_rng.pt")
    os.remove(gone)
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "o"), UNSAFE])
    assert gone in line


def test_missing_tensor_rank_directory_against_args(tmp_path, capsys):
    """args say t=2 but only mp_rank_00 is there: the missing directory is named."""
    spec = _spec(bert=False, tp=1, layers=2, hidden=32, heads=4, groups=4, kv=8, ffn=64,
                 rms=False, bias=True, swiglu=False, untied=False, binary=False, rope=False,
                 seed=82)
    src = _write(str(tmp_path / "mlm"), spec, tp=1, pp=1,
                 args=_args(num_layers=2, tensor_model_parallel_size=2))
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "o"), UNSAFE])
    assert os.path.join("mp_rank_01", "model_optim_rng.pt") in line
    assert "tensor_model_parallel_size 2" in line


def test_mismatched_shapes(tmp_path, capsys):
    """A rank file whose tensor does not have the shape args give: file and tensor named."""
    spec, src = _small(tmp_path)
    path = os.path.join(src, "iter_0001000", "mp_rank_01_001", "model_optim_rng.pt")
    sd = torch.load(path, weights_only=False)
    enc = sd["model"]["language_model"]["encoder"]
    enc["layers.0.mlp.dense_4h_to_h.weight"] = torch.zeros(32, 40)
    torch.save(sd, path)
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "o"), UNSAFE])
    assert path in line and "layers.0.mlp.dense_4h_to_h.weight" in line
    assert "(32, 40)" in line and "(32, 32)" in line and "ffn_hidden_size 64" in line


def test_args_disagreeing_with_tensors(tmp_path, capsys):
    _, src = _small(tmp_path, args={"hidden_size": 48})
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "o"), UNSAFE])
    assert "model_optim_rng.pt" in line and "hidden_size 48" in line


def test_existing_save_refused(tmp_path, capsys):
    _, src = _small(tmp_path)
    out = tmp_path / "ours"
    (out / "iter_0000005").mkdir(parents=True)
    (out / "latest_checkpointed_iteration.txt").write_text("5")
    line = _error(capsys, ["--from-megatron", src, "--save", str(out), UNSAFE])
    assert "--save" in line and "already holds checkpoints" in line
    assert sorted(os.listdir(out)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("what", ["torch_dist", "mcore", "moe_args", "virtual", "te", "alibi"])
def test_unsupported_variants_name_what_was_found(tmp_path, capsys, what):
    root = tmp_path / "mlm"
    if what == "torch_dist":
        d = root / "iter_0000010"
        d.mkdir(parents=True)
        (d / ".metadata").write_bytes(b"x")
        (d / "__0_0.distcp").write_bytes(b"x")
        (root / "latest_checkpointed_iteration.txt").write_text("10")
        src, expect = str(root), "torch_dist"
    elif what == "mcore":
        d = root / "release" / "mp_rank_00"
        d.mkdir(parents=True)
        torch.save({"args": _args(), "checkpoint_version": 3.0,
                    "model": {"embedding.word_embeddings.weight": torch.zeros(4, 4),
                              "decoder.layers.0.self_attention.linear_qkv.weight":
                              torch.zeros(12, 4)}}, d / "model_optim_rng.pt")
        (root / "latest_checkpointed_iteration.txt").write_text("release")
        src, expect = str(root), "Megatron Core"
    elif what == "virtual":
        d = root / "release" / "mp_rank_00"
        d.mkdir(parents=True)
        torch.save({"args": _args(), "model0": {}, "model1": {}}, d / "model_optim_rng.pt")
        (root / "latest_checkpointed_iteration.txt").write_text("release")
        src, expect = str(root), "model0"
    elif what == "moe_args":
        _, src = _small(tmp_path, args={"num_experts": 8})
        expect = "num_experts 8"
    elif what == "alibi":
        _, src = _small(tmp_path, args={"position_embedding_type": "alibi"})
        expect = "alibi"
    else:
        _, src = _small(tmp_path)
        path = os.path.join(src, "iter_0001000", "mp_rank_00_000", "model_optim_rng.pt")
        sd = torch.load(path, weights_only=False)
        enc = sd["model"]["language_model"]["encoder"]
        enc["layers.0.self_attention.layernorm_qkv.weight"] = enc.pop(
            "layers.0.self_attention.query_key_value.weight")
        torch.save(sd, path)
        expect = "Transformer Engine"
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "o"), UNSAFE])
    assert expect in line and "--from-megatron" in line
    assert not os.path.exists(tmp_path / "o")


def test_flag_combinations(tmp_path, capsys):
    _, src = _small(tmp_path)
    line = _error(capsys, ["--from-megatron", src, UNSAFE])
    assert "--from-megatron needs --save" in line
    line = _error(capsys, ["--from-megatron", src, "--from-hf", src, "--save", "x"])
    assert "choose one workflow" in line
    line = _error(capsys, ["--load", src, "--save", "x", "--num-attention-heads", "4"])
    assert "--num-attention-heads applies to --from-megatron" in line


def test_trainer_load_of_a_megatron_lm_file_points_at_the_import(tmp_path):
    """--load (the trainer's pickle path) of a Megatron-LM file names --from-megatron,
    without the flag and, with it, when the file's args (argparse.Namespace) are refused."""
    from megatron.checkpoint_files import load_payload
    from megatron.errors import CheckpointError

    _, src = _small(tmp_path)
    stem = os.path.join(src, "iter_0001000", "mp_rank_00_000", "model_optim_rng")
    for allow in (False, True):
        with pytest.raises(CheckpointError, match="--from-megatron DIR --save CKPT") as info:
            load_payload(stem, allow_unsafe=allow)
        if allow:
            assert "argparse.Namespace" in str(info.value)


def test_torch_without_named_allow_list_is_named(tmp_path, capsys, monkeypatch):
    """torch < 2.6 cannot allow-list a global under another name (the stand-ins, numpy's
    moved modules): one line naming the version instead of an unpickling error."""
    import megatron.megatron_lm_files as files

    monkeypatch.setattr(files, "_torch_version", lambda: (2, 5))
    _, src = _small(tmp_path)
    line = _error(capsys, ["--from-megatron", src, "--save", str(tmp_path / "o"), UNSAFE])
    assert "needs torch >= 2.6" in line and "found torch" in line

"""The model a Megatron-LM legacy checkpoint holds, for ``megatron.megatron_lm_import``
(``megatron.megatron_lm_export`` writes the same shapes).

``infer_architecture`` reads a ``MegatronArch`` from the checkpoint's ``args`` and its tensors'
shapes, after ``_refuse_args`` has refused arguments whose model this trainer cannot
build; ``expected_shapes`` gives the model's full tensor shapes, which ``check_tensors``
holds every rank's tensors to; ``model_config_for`` and ``tokenizer_settings`` turn the model and
the ``args`` into our recorded config.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import WORD_EMBEDDING
from megatron.checkpoint_merge import partition_dim_by_name
from megatron.errors import CheckpointError, UserError
from megatron.megatron_lm_files import FLAG, CheckpointSource
from megatron.megatron_lm_shards import QKV_NAME, LAYER_KEY, FoundTensors


# ------------------------------------------------------------------------ args
def _refuse_args(a: Dict[str, Any], path: str, is_bert: bool) -> None:
    """Arguments whose model this trainer cannot build: one UserError naming them."""
    bad = []
    if a.get("num_experts") not in (None, 0, 1):
        bad.append(f"num_experts {a['num_experts']} (mixture of experts)")
    if a.get("use_mcore_models") is True or a.get("use_legacy_models") is False:
        bad.append("Megatron Core models (use_mcore_models / no --use-legacy-models)")
    if a.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        bad.append(f"virtual_pipeline_model_parallel_size "
                   f"{a['virtual_pipeline_model_parallel_size']}")
    pos = a.get("position_embedding_type")
    if pos not in (None, "learned_absolute", "rope"):
        bad.append(f"position_embedding_type {pos!r}")
    if pos is None and a.get("add_position_embedding") is False \
            and not a.get("use_rotary_position_embeddings"):
        bad.append("no position embedding (add_position_embedding false)")
    if a.get("normalization") not in (None, "LayerNorm", "RMSNorm"):
        bad.append(f"normalization {a['normalization']!r}")
    for key, what in (("apply_layernorm_1p", "zero-centred LayerNorm weights"),
                      ("qk_layernorm", "query/key norms"),
                      ("use_rope_scaling", "Llama 3.1 RoPE scaling"),
                      ("add_decoder", "an encoder-decoder model")):
        if a.get(key) is True:
            bad.append(f"{key} ({what})")
    base = a.get("rotary_base")
    if _rope(a) and base not in (None, 10000):
        bad.append(f"rotary_base {base} (Megatron-LM's legacy models rotate with base 10000 "
                   f"whatever it says)")
    if is_bert and (_rope(a) or a.get("normalization") == "RMSNorm" or a.get("swiglu")
                    or a.get("squared_relu") or a.get("add_bias_linear") is False
                    or a.get("untie_embeddings_and_output_weights")
                    or (a.get("group_query_attention") and a.get("num_query_groups")
                        not in (None, a.get("num_attention_heads")))):
        bad.append("a BERT with Llama-style options (this trainer's BERT has BERT's block)")
    if bad:
        raise UserError(f"{FLAG} {path}: the checkpoint's args record {'; '.join(bad)}, "
                        f"which this trainer's models do not have")


def _rope(a: Dict[str, Any]) -> bool:
    return a.get("position_embedding_type") == "rope" or a.get("use_rotary_position_embeddings") \
        is True


# ------------------------------------------------------------------------ the model
@dataclass
class MegatronArch:
    is_bert: bool
    layers: int
    hidden: int
    heads: int
    groups: int
    kv: int
    ffn: int
    vocab_rows: int
    positions: Optional[int]
    """Rows of the learned position table (None: RoPE)."""
    seq_length: int
    tokentypes: int
    rms: bool
    bias: bool
    qkv_bias: bool
    swiglu: bool
    untied: bool
    binary: bool


def _int_arg(a: Dict[str, Any], key: str, path: str) -> Optional[int]:
    v = a.get(key)
    if v is None:
        return None
    if type(v) is not int or v < 1:
        raise CheckpointError(f"{FLAG} {path}: args.{key} is {v!r}; expected a positive "
                              f"integer")
    return v


def expected_shapes(arch: MegatronArch) -> Dict[str, Tuple[int, ...]]:
    """Our full tensor names and shapes for ``arch``, in our modules' parameter order."""
    h, e = arch.hidden, {}
    e[WORD_EMBEDDING] = (arch.vocab_rows, h)
    if arch.positions is not None:
        e["embedding.position_embeddings.weight"] = (arch.positions, h)
    if arch.is_bert:
        e["embedding.tokentype_embeddings.weight"] = (arch.tokentypes, h)
    norm = ("weight",) if arch.rms else ("weight", "bias")
    qkv_rows = (arch.heads + 2 * arch.groups) * arch.kv
    ffn1 = arch.ffn * (2 if arch.swiglu else 1)
    for i in range(arch.layers):
        p = f"encoder.layers.{i}."
        for part in norm:
            e[p + f"input_layernorm.{part}"] = (h,)
        e[p + f"{QKV_NAME}.weight"] = (qkv_rows, h)
        if arch.bias or arch.qkv_bias:
            e[p + f"{QKV_NAME}.bias"] = (qkv_rows,)
        e[p + "self_attention.dense.weight"] = (h, arch.heads * arch.kv)
        if arch.bias:
            e[p + "self_attention.dense.bias"] = (h,)
        for part in norm:
            e[p + f"post_attention_layernorm.{part}"] = (h,)
        e[p + "mlp.dense_h_to_4h.weight"] = (ffn1, h)
        if arch.bias:
            e[p + "mlp.dense_h_to_4h.bias"] = (ffn1,)
        e[p + "mlp.dense_4h_to_h.weight"] = (h, arch.ffn)
        if arch.bias:
            e[p + "mlp.dense_4h_to_h.bias"] = (h,)
    for part in norm:
        e[f"encoder.final_layernorm.{part}"] = (h,)
    if arch.untied:
        e["output_layer.weight"] = (arch.vocab_rows, h)
    if arch.is_bert:
        if arch.binary:
            e["pooler.dense.weight"], e["pooler.dense.bias"] = (h, h), (h,)
        e["lm_head.bias"] = (arch.vocab_rows,)
        e["lm_head.dense.weight"], e["lm_head.dense.bias"] = (h, h), (h,)
        e["lm_head.layernorm.weight"], e["lm_head.layernorm.bias"] = (h,), (h,)
        if arch.binary:
            e["binary_head.weight"], e["binary_head.bias"] = (2, h), (2,)
    return e


def _local(shape: Tuple[int, ...], name: str, tp: int) -> Tuple[int, ...]:
    dim = partition_dim_by_name(name)
    if dim is None:
        return shape
    out = list(shape)
    out[dim] //= tp
    return tuple(out)


# ------------------------------------------------------------------------ reading it
def _heads(args: Dict[str, Any], recorded: bool, first: str, heads_flag: Optional[int],
           tp: int, notes: List[str]) -> int:
    heads = _int_arg(args, "num_attention_heads", first)
    if heads is None:
        what = ("no args (an early release?)" if not recorded
                else "no num_attention_heads in its args")
        if heads_flag is None:
            raise UserError(f"{FLAG} {first}: the checkpoint records {what}; give "
                            f"--num-attention-heads N (GPT-345M and BERT-345M: 16)")
        heads = heads_flag
        notes.append(f"note: the checkpoint records {what}: --num-attention-heads {heads} as "
                     f"given; sizes from the tensors"
                     + ("; the tanh GELU (--openai-gelu), LayerNorm epsilon 1e-5 and learned "
                        "positions of those versions" if not recorded else ""))
    elif heads_flag is not None and heads_flag != heads:
        raise UserError(f"--num-attention-heads {heads_flag}: the checkpoint's args record "
                        f"num_attention_heads {heads}; leave the flag out")
    if heads % tp:
        raise CheckpointError(f"{FLAG} {first}: {heads} attention heads do not split over "
                              f"{tp} tensor ranks")
    return heads

def infer_architecture(found: FoundTensors, args: Dict[str, Any], recorded: bool,
                       src: CheckpointSource, counts: List[int], version: float,
                       heads_flag: Optional[int], notes: List[str]) -> MegatronArch:
    """The model the tensors and ``args`` describe, checked against each other."""
    first = src.files[(0, 0)]
    is_bert = any(k.startswith(("lm_head.", "binary_head.")) for k in found)
    _refuse_args(args, first, is_bert)
    if WORD_EMBEDDING not in found:
        raise CheckpointError(f"{FLAG} {first}: no word embedding "
                              f"(language_model.embedding.word_embeddings.weight)")
    emb = found[WORD_EMBEDDING][0][0]
    hidden = _int_arg(args, "hidden_size", first) or emb.shape[1]
    heads = _heads(args, recorded, first, heads_flag, src.tp, notes)
    groups = heads
    if args.get("group_query_attention"):
        groups = _int_arg(args, "num_query_groups", first) or heads
    if heads % groups or groups % src.tp:
        raise CheckpointError(f"{FLAG} {first}: num_query_groups {groups} must divide "
                              f"num_attention_heads {heads} and be a multiple of the "
                              f"{src.tp} tensor ranks")
    if groups != heads and version < 2:
        raise CheckpointError(f"{FLAG} {first}: grouped-query attention in a checkpoint_version "
                              f"{version} file; expected version 3")
    kv = _int_arg(args, "kv_channels", first)
    if kv is None:
        if hidden % heads:
            raise CheckpointError(f"{FLAG} {first}: hidden size {hidden} is not a multiple of "
                                  f"{heads} heads and args record no kv_channels")
        kv = hidden // heads
    swiglu = bool(args.get("swiglu"))
    h4 = found.get("encoder.layers.0.mlp.dense_h_to_4h.weight")
    ffn = _int_arg(args, "ffn_hidden_size", first)
    if ffn is None:
        ffn = (h4[0][0].shape[0] * src.tp // (2 if swiglu else 1)) if h4 else 4 * hidden
    pos_table = found.get("embedding.position_embeddings.weight")
    positions = None
    if not _rope(args):
        positions = (_int_arg(args, "max_position_embeddings", first)
                     or (pos_table[0][0].shape[0] if pos_table else None))
        if positions is None:
            raise CheckpointError(f"{FLAG} {first}: no position embedding "
                                  f"(language_model.embedding.position_embeddings)")
    seq = (_int_arg(args, "seq_length", first) or positions
           or _int_arg(args, "max_position_embeddings", first))
    if seq is None:
        raise CheckpointError(f"{FLAG} {first}: args record neither seq_length nor "
                              f"max_position_embeddings")
    tt = found.get("embedding.tokentype_embeddings.weight")
    tokentypes = tt[0][0].shape[0] if tt else 0
    if tokentypes and not is_bert:
        raise UserError(f"{FLAG} {first}: a GPT with token-type embeddings; this trainer's GPT "
                        f"has none")
    bias = args.get("add_bias_linear", True) is not False
    arch = MegatronArch(is_bert=is_bert, layers=sum(counts), hidden=hidden, heads=heads,
                        groups=groups, kv=kv, ffn=ffn, vocab_rows=emb.shape[0] * src.tp,
                        positions=positions, seq_length=seq, tokentypes=tokentypes or 2,
                        rms=args.get("normalization") == "RMSNorm", bias=bias,
                        qkv_bias=bool(args.get("add_qkv_bias")) and not bias, swiglu=swiglu,
                        untied=bool(args.get("untie_embeddings_and_output_weights")),
                        binary="binary_head.weight" in found)
    layers_arg = _int_arg(args, "num_layers", first)
    if layers_arg is not None and layers_arg != arch.layers:
        raise CheckpointError(f"{FLAG} {src.iter_dir}: args record num_layers {layers_arg}, the "
                              f"rank files hold {arch.layers} layers ({'+'.join(map(str, counts))}"
                              f" over {src.pp} stage(s))")
    padded = _int_arg(args, "padded_vocab_size", first)
    if padded is not None and padded != arch.vocab_rows:
        raise CheckpointError(f"{FLAG} {first}: word embedding {tuple(emb.shape)} on each of "
                              f"{src.tp} tensor ranks ({arch.vocab_rows} rows), args record "
                              f"padded_vocab_size {padded}")
    if is_bert and tt is None:
        notes.append("note: a BERT without token types (no binary head); its token-type table "
                     "is written as zeros, which adds nothing, as this trainer's BERT has one")
    return arch

def check_tensors(found: FoundTensors, arch: MegatronArch,
                  expected: Dict[str, Tuple[int, ...]], src: CheckpointSource,
                  offsets: List[int]) -> None:
    """Every tensor has the shape ``arch`` gives it on its rank, and none is missing."""
    sizes = (f"args: num_layers {arch.layers}, hidden_size {arch.hidden}, num_attention_heads "
             f"{arch.heads}, num_query_groups {arch.groups}, kv_channels {arch.kv}, "
             f"ffn_hidden_size {arch.ffn}, padded vocabulary {arch.vocab_rows}"
             + (f", max_position_embeddings {arch.positions}" if arch.positions else "")
             + f"; tensor size {src.tp}")
    for g, parts in found.items():
        if g not in expected:
            raise CheckpointError(f"{FLAG} {parts[0][2]}: tensor {parts[0][1]!r}, which the "
                                  f"checkpoint's args do not account for ({_what_args_say(arch)})")
        want = _local(expected[g], g, src.tp)
        for tensor, mname, where in parts:
            if tuple(tensor.shape) != want:
                raise CheckpointError(f"{FLAG} {where}: tensor {mname!r} is "
                                      f"{tuple(tensor.shape)}, expected {want} ({sizes})")
    missing = [g for g in expected if g not in found
               and g != "embedding.tokentype_embeddings.weight"]
    if missing:
        stage = 0 if missing[0].startswith("embedding.") else src.pp - 1
        m = LAYER_KEY.match(missing[0])
        if m:
            stage = max(p for p in range(src.pp) if offsets[p] <= int(m[1]))
        raise CheckpointError(f"{FLAG} {src.files[(0, stage)]}: missing {missing[0]} "
                              f"({len(missing)} tensor(s) the args imply are absent; "
                              f"{_what_args_say(arch)})")

def _what_args_say(arch: MegatronArch) -> str:
    return (f"{'BERT' if arch.is_bert else 'GPT'}, "
            f"{'RMSNorm' if arch.rms else 'LayerNorm'}, "
            f"{'biases' if arch.bias else 'qkv biases only' if arch.qkv_bias else 'no biases'}"
            f"{', SwiGLU' if arch.swiglu else ''}{', RoPE' if arch.positions is None else ''}"
            f"{', untied output' if arch.untied else ''}")


# ------------------------------------------------------------------------ our config
def _gelu(a: Optional[Dict[str, Any]], arch: MegatronArch, notes: List[str]) -> bool:
    """--openai-gelu: the MLP's GELU is the tanh approximation (Megatron-LM's fused
    bias-GELU or --openai-gelu; files without args: the tanh GELU early versions used)."""
    if a is None:
        return True
    if arch.swiglu or a.get("squared_relu"):
        return False
    fused = bool(a.get("bias_gelu_fusion")) and arch.bias
    tanh = bool(a.get("openai_gelu")) or fused
    if arch.is_bert and fused and not a.get("openai_gelu"):
        notes.append("note: the blocks' GELU is Megatron-LM's fused bias-GELU (the tanh "
                     "approximation, --openai-gelu here) while its BERT LM head used the "
                     "exact GELU; this trainer's BERT takes one GELU for both, so the LM "
                     "head's transform differs by at most ~5e-4 per activation")
    return tanh

def tokenizer_settings(a: Optional[Dict[str, Any]], notes: List[str]) -> Dict[str, Any]:
    from megatron.tokenizer import TOKENIZER_TYPES

    if a is None:
        notes.append("note: the checkpoint records no tokenizer; give your --tokenizer-type "
                     "and its files when training")
        return {}
    kind = a.get("tokenizer_type")
    if kind not in TOKENIZER_TYPES:
        if kind is not None:
            notes.append(f"note: tokenizer {kind!r} has no equivalent here; none recorded "
                         f"(give --tokenizer-type and its files when training)")
        return {}
    out: Dict[str, Any] = {"tokenizer_type": kind}
    for key in ("vocab_file", "merge_file", "tokenizer_model"):
        if isinstance(a.get(key), str):
            out[key] = a[key]
    if kind == "NullTokenizer" and type(a.get("vocab_size")) is int:
        # the same convention here: --vocab-size data ids, the end-of-document id on top
        out["vocab_size"], out["tokenizer_vocab_size"] = a["vocab_size"], a["vocab_size"] + 1
    missing = [out[k] for k in ("vocab_file", "merge_file", "tokenizer_model")
               if k in out and not os.path.exists(out[k])]
    if missing:
        notes.append(f"note: tokenizer files recorded by the checkpoint are not on this "
                     f"machine ({', '.join(missing)}); give them with --vocab-file / "
                     f"--merge-file / --tokenizer-model when training")
    return out

def model_config_for(arch: MegatronArch, a: Optional[Dict[str, Any]],
                     full: Dict[str, torch.Tensor], notes: List[str]) -> Dict[str, Any]:
    """Our recorded config["model"] (ModelConfig's fields) for ``arch`` and args ``a``."""
    args = a or {}

    def number(key: str, default: float, *alts: str) -> float:
        for k in (key,) + alts:
            v = args.get(k)
            if type(v) in (int, float) and math.isfinite(v):
                return float(v)
        return default

    rope = _rope(args)
    cfg: Dict[str, Any] = {
        "num_layers": arch.layers, "hidden_size": arch.hidden,
        "num_attention_heads": arch.heads, "ffn_hidden_size": arch.ffn,
        "seq_length": arch.seq_length,
        "max_position_embeddings": (arch.positions if arch.positions is not None
                                    else args.get("max_position_embeddings") or arch.seq_length),
        "padded_vocab_size": arch.vocab_rows,
        "layernorm_epsilon": number("norm_epsilon", 1e-5, "layernorm_epsilon"),
        "hidden_dropout": number("hidden_dropout", 0.1),
        "attention_dropout": number("attention_dropout", 0.1),
        "init_method_std": number("init_method_std", 0.02),
        "openai_gelu": _gelu(a, arch, notes),
        "normalization": "RMSNorm" if arch.rms else "LayerNorm",
        "position_embedding_type": "rope" if rope else "learned_absolute",
        "swiglu": arch.swiglu, "squared_relu": bool(args.get("squared_relu")),
        "kv_channels": arch.kv, "num_query_groups": arch.groups,
        "add_bias_linear": arch.bias, "add_qkv_bias": arch.qkv_bias,
        "untie_embeddings_and_output_weights": arch.untied,
        "apply_residual_connection_post_layernorm":
            bool(args.get("apply_residual_connection_post_layernorm")),
        "num_tokentypes": arch.tokentypes if arch.is_bert else 0,
        "params_dtype": str(full[WORD_EMBEDDING].dtype),
    }
    if rope:
        interp = args.get("rotary_seq_len_interpolation_factor")
        cfg.update(rotary_base=10000, rotary_percent=number("rotary_percent", 1.0),
                   rotary_interleaved=bool(args.get("rotary_interleaved")),
                   rotary_seq_len_interpolation_factor=(float(interp) if interp else None))
    return cfg

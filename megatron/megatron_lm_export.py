"""Our checkpoints -> NVIDIA Megatron-LM's legacy checkpoint layout (``torch.save``).

``tools/checkpoint_util.py --load CKPT --to-megatron OUT [--target-tensor-parallel-size T
--target-pipeline-parallel-size P]`` writes a GPT or BERT checkpoint of this trainer as
Megatron-LM's legacy models (``megatron/legacy/model``, ``--use-legacy-models
--ckpt-format torch``) read it: the reverse of ``--from-megatron``
(``megatron.megatron_lm_import``), which reads the result back.

What is written
    ``OUT/latest_checkpointed_iteration.txt`` holding ``release`` and
    ``OUT/release/mp_rank_TT/model_optim_rng.pt`` (``mp_rank_TT_PPP`` when P > 1), one
    per (tensor rank, stage), each a ``torch.save`` dict of ``model`` (the rank's
    weights), ``args`` (an ``argparse.Namespace`` with the fields Megatron-LM's loader
    and ``--use-checkpoint-args`` read), ``checkpoint_version`` 3.0 and ``iteration`` 0.
    A ``release`` checkpoint is what Megatron-LM loads at iteration 0 without an
    optimizer state, an LR scheduler or RNG states, with ``--finetune`` or without it
    (a numbered iteration would make a plain ``--load`` look for them).  No optimizer
    state, scheduler, RNG state or sample counts are written.

The layout
    ``model["language_model"]`` holds ``embedding`` (``word_embeddings`` split by rows
    over the tensor ranks; ``position_embeddings``; BERT's ``tokentype_embeddings``)
    on the first stage, ``encoder`` (flat keys, the stage's layers numbered from 0,
    ``final_layernorm`` on the last stage), ``pooler`` (BERT) and ``output_layer`` (an
    untied GPT output, split by rows); beside it BERT's ``lm_head`` (its ``bias`` split
    by rows) and ``binary_head``, and, with P > 1, ``word_embeddings_for_head`` (the last
    stage's copy of the tied word embedding, as Megatron-LM keeps it).  Norms are
    written under their older names (``input_layernorm``, ``post_attention_layernorm``,
    ``final_layernorm``, ``lm_head.layernorm``): Megatron-LM before the 2023 rename reads
    them as they are, later versions rename ``layernorm`` to ``norm`` on load.
    Column-parallel tensors (query/key/value -- ours is Megatron-LM's version-3 order,
    [group, (its queries, k, v), head_dim], so each rank takes whole groups --, the
    first MLP weight and bias, SwiGLU's [gate; up] as [gate_r; up_r] per rank) are cut
    by rows, row-parallel ones (attention output, second MLP weight) by columns, the
    rest copied to every rank.  Stages hold num_layers / P layers each: Megatron-LM's
    legacy models split evenly.

The vocabulary
    Megatron-LM recomputes the padded vocabulary at start-up (its tokenizer's size
    rounded up to ``make_vocab_size_divisible_by`` x t) and refuses a table of another
    size, so ``args.make_vocab_size_divisible_by`` is chosen to keep the rows at the
    target t; where no unit does, the rows are re-padded as resharding does (and said).

Refused, one line each
    A ``--to-megatron`` directory that exists and is not empty (nothing is written into
    it: the export is staged beside it and renamed into place when complete), and any
    model option the legacy format cannot express: query/key norms, Llama 3.1 RoPE
    scaling, a RoPE base other than 10000 (the legacy models rotate with 10000), a GPT
    with token types, a BERT with Llama-style options or an untied output, sizes that
    do not split over the target t or P, a tensor the recorded config does not account
    for, and any recorded option this module does not know with a non-default value.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, check_true_vocab, divisor_keeping,
                                         read_full_state, refuse_unknown_model_options,
                                         repad_rows, target_padded_vocab, true_vocab_size)
from megatron.checkpoint_files import TRACKER
from megatron.checkpoint_merge import (LAYER_NAME, model_config_of, partition_dim_by_name,
                                       partition_stride_by_name)
from megatron.errors import CheckpointError, UserError
from megatron.export_output import check_export_path as hf_check_export_path
from megatron.export_output import publish_export, say
from megatron.hf_export_target import block_options
from megatron.megatron_lm_arch import MegatronArch, expected_shapes
from megatron.megatron_lm_files import PT_FILE
from megatron.tensor_parallel.param_init import shard

TO_FLAG = "--to-megatron"
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's checkpoint_version of the written files: query/key/value rows in
[group, (queries, k, v), head_dim] order, tensor and pipeline sizes in ``args``."""
_TOKENTYPES = "embedding.tokentype_embeddings.weight"
_POSITIONS = "embedding.position_embeddings.weight"

_READS = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
    "max_position_embeddings", "hidden_dropout", "attention_dropout", "init_method_std",
    "layernorm_epsilon", "openai_gelu", "num_tokentypes", "normalization",
    "position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling",
    "rope_scaling_factor", "rotary_interleaved", "rotary_seq_len_interpolation_factor",
    "swiglu", "squared_relu", "apply_residual_connection_post_layernorm",
    "fp32_residual_connection", "qk_layernorm", "kv_channels", "num_query_groups",
    "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
    "init_method_xavier_uniform"})
"""config["model"] keys written into ``args`` or checked here."""
_IGNORES = frozenset({
    "padded_vocab_size", "params_dtype", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "compile_layers", "cross_entropy_loss_fusion",
    "attention_backend", "sequence_parallel"})
"""config["model"] keys that say how the model was trained, not what it computes (the
padded vocabulary and dtype are the tensors')."""


# ------------------------------------------------------------------------ paths
def check_export_path(load: Optional[str], out: str) -> None:
    """--to-megatron must be a new or empty directory outside --load (as --to-hf)."""
    hf_check_export_path(load, out, TO_FLAG)


# ------------------------------------------------------------------------ what can be written
def _check_known_options(model_cfg: Dict[str, Any]) -> None:
    refuse_unknown_model_options(model_cfg, set(_READS) | set(_IGNORES), TO_FLAG,
                                 "Megatron-LM would build a model without it and compute "
                                 "something else")


def _refuse_options(model_cfg: Dict[str, Any], opts: Dict[str, Any], is_bert: bool,
                    full: Dict[str, torch.Tensor]) -> None:
    """One UserError for the first option Megatron-LM's legacy models do not have."""
    _check_known_options(model_cfg)
    rope = opts["position_embedding_type"] == "rope"
    if opts["qk_layernorm"]:
        raise UserError(f"{TO_FLAG}: this model has query/key norms (--qk-layernorm); "
                        f"Megatron-LM's legacy models have none, so it cannot be exported")
    if rope and opts["rope_scaling"]:
        raise UserError(f"{TO_FLAG}: this model uses Llama 3.1's RoPE scaling "
                        f"(--use-rope-scaling); Megatron-LM's legacy models do not, so it "
                        f"cannot be exported")
    base = model_cfg.get("rotary_base", 10000)
    if rope and base != 10000:
        raise UserError(f"{TO_FLAG}: this model rotates with RoPE base {base}; Megatron-LM's "
                        f"legacy models rotate with base 10000 whatever --rotary-base says, "
                        f"so it cannot be exported")
    if opts["position_embedding_type"] not in ("rope", "learned_absolute"):
        raise UserError(f"{TO_FLAG}: position_embedding_type "
                        f"{opts['position_embedding_type']!r} is not one of Megatron-LM's "
                        f"legacy models' (learned_absolute, rope)")
    if opts["normalization"] not in ("LayerNorm", "RMSNorm"):
        raise UserError(f"{TO_FLAG}: normalization {opts['normalization']!r} is not one of "
                        f"Megatron-LM's legacy models' (LayerNorm, RMSNorm)")
    if opts["swiglu"] and opts["squared_relu"]:
        raise UserError(f"{TO_FLAG}: the config records both swiglu and squared_relu")
    if not is_bert and _TOKENTYPES in full:
        raise UserError(f"{TO_FLAG}: this GPT has token-type embeddings; Megatron-LM's GPT "
                        f"has none, so it cannot be exported")
    if is_bert:
        llama = [flag for flag, on in (
            ("--normalization RMSNorm", opts["normalization"] == "RMSNorm"),
            ("--position-embedding-type rope", rope), ("--swiglu", opts["swiglu"]),
            ("--squared-relu", opts["squared_relu"]),
            ("--disable-bias-linear", not opts["add_bias_linear"]),
            ("--untie-embeddings-and-output-weights",
             model_cfg.get("untie_embeddings_and_output_weights") is True),
            ("--group-query-attention",
             opts["num_query_groups"] != opts["num_attention_heads"])) if on]
        if llama:
            raise UserError(f"{TO_FLAG}: this BERT was built with {' '.join(llama)}; "
                            f"Megatron-LM's legacy BERT is exported with BERT's block only "
                            f"(it cannot untie its output; --from-megatron reads no other), "
                            f"so it cannot be exported")


def _int_cfg(model_cfg: Dict[str, Any], key: str, default: Optional[int], load: str) -> int:
    value = model_cfg.get(key, default)
    if value is None:
        value = default
    if type(value) is not int or value < 1:
        raise CheckpointError(f"--load {load}: its config records {key} {value!r}; expected "
                              f"a positive integer")
    return value


def _architecture(model_cfg: Dict[str, Any], opts: Dict[str, Any], full: Dict[str, torch.Tensor],
                  is_bert: bool, load: str) -> MegatronArch:
    hidden = _int_cfg(model_cfg, "hidden_size", None, load)
    heads = _int_cfg(model_cfg, "num_attention_heads", None, load)
    seq = _int_cfg(model_cfg, "seq_length", 1024, load)
    rope = opts["position_embedding_type"] == "rope"
    positions = None
    if not rope:
        positions = _int_cfg(model_cfg, "max_position_embeddings", seq, load)
    tt = full.get(_TOKENTYPES)
    return MegatronArch(is_bert=is_bert, layers=_int_cfg(model_cfg, "num_layers", None, load),
                 hidden=hidden, heads=heads, groups=int(opts["num_query_groups"]),
                 kv=int(opts["kv_channels"]),
                 ffn=_int_cfg(model_cfg, "ffn_hidden_size", 4 * hidden, load),
                 vocab_rows=int(full[WORD_EMBEDDING].shape[0]), positions=positions,
                 seq_length=seq, tokentypes=int(tt.shape[0]) if tt is not None else 2,
                 rms=opts["normalization"] == "RMSNorm", bias=opts["add_bias_linear"],
                 qkv_bias=opts["add_qkv_bias"] and not opts["add_bias_linear"],
                 swiglu=opts["swiglu"],
                 untied=model_cfg.get("untie_embeddings_and_output_weights") is True,
                 binary="binary_head.weight" in full)


def _check_tensors(full: Dict[str, torch.Tensor], arch: MegatronArch, load: str) -> None:
    """Every tensor is one ``arch`` implies, of its shape, and none is missing."""
    expected = expected_shapes(arch)
    extra = [n for n in full if n not in expected]
    if extra:
        raise CheckpointError(f"--load {load}: the checkpoint holds {extra[0]!r}"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, "
                              f"which its recorded config does not account for (a task head? "
                              f"only pretraining GPT and BERT models export); the export "
                              f"would drop it, so it is refused")
    missing = [n for n in expected if n not in full]
    if missing:
        raise CheckpointError(f"--load {load}: the checkpoint has no {missing[0]!r}, which its "
                              f"config (num_layers {arch.layers}) implies")
    for name, shape in expected.items():
        if tuple(full[name].shape) != shape:
            raise CheckpointError(f"--load {load}: {name} is {tuple(full[name].shape)}; its "
                                  f"config ({arch.heads} heads of {arch.kv}, {arch.groups} "
                                  f"query groups, hidden size {arch.hidden}, ffn size "
                                  f"{arch.ffn}) implies {shape}")


def _check_split(arch: MegatronArch, tp: int, pp: int, rows: int) -> None:
    for what, value, over, flag in (
            ("attention heads", arch.heads, tp, "tensor"),
            ("query groups", arch.groups, tp, "tensor"),
            ("ffn_hidden_size", arch.ffn, tp, "tensor"),
            ("padded vocabulary rows", rows, tp, "tensor"),
            ("layers", arch.layers, pp, "pipeline")):
        if value % over:
            extra = (" (Megatron-LM's legacy models give every stage num_layers / P)"
                     if flag == "pipeline" else "")
            raise UserError(f"{TO_FLAG}: {value} {what} do not split evenly over "
                            f"--target-{flag}-parallel-size {over}{extra}")


# ------------------------------------------------------------------------ the vocabulary
def _vocabulary(full: Dict[str, torch.Tensor], config: Dict[str, Any], src_tp: int, tp: int,
                real: Optional[int], divisible_by: Optional[int], notes: List[str]
                ) -> Tuple[Dict[str, torch.Tensor], int, int]:
    """(tensors with the vocabulary tables Megatron-LM will expect at ``tp``, rows,
    the make_vocab_size_divisible_by that pads to them)."""
    from megatron.tokenizer import vocab_size_with_padding

    rows = int(full[WORD_EMBEDDING].shape[0])
    unit = int((config.get("data") or {}).get("make_vocab_size_divisible_by") or 128)
    if divisible_by:
        if real is None:
            raise UserError(f"--make-vocab-size-divisible-by {divisible_by}: the checkpoint's "
                            f"unpadded vocabulary is unknown here (its tokenizer files are "
                            f"not on this machine); pass --true-vocab-size N")
        unit, new_rows = divisible_by, vocab_size_with_padding(real, divisible_by, tp)
    else:
        keep = divisor_keeping(rows, real, config, src_tp, tp)
        if keep is not None:
            unit, new_rows = keep, rows
        else:
            new_rows = target_padded_vocab(rows, config, tp, real)
    if real is None:
        notes.append(f"note: the unpadded vocabulary is unknown (pass --true-vocab-size); "
                     f"{rows} rows kept, which Megatron-LM accepts only if its tokenizer pads "
                     f"to them with --make-vocab-size-divisible-by {unit}")
    if new_rows != rows:
        notes.append(f"note: padded vocabulary {rows} -> {new_rows} rows for Megatron-LM at "
                     f"tensor size {tp} with --make-vocab-size-divisible-by {unit} (real "
                     f"vocabulary {real}); padding rows copy the last one")
        full = repad_rows(full, new_rows, real)
    return full, new_rows, unit


# ------------------------------------------------------------------------ args
def _tokenizer_args(data: Dict[str, Any], real: Optional[int], notes: List[str]
                    ) -> Dict[str, Any]:
    kind = data.get("tokenizer_type")
    out: Dict[str, Any] = {"tokenizer_type": kind, "vocab_file": data.get("vocab_file"),
                           "merge_file": data.get("merge_file"),
                           "tokenizer_model": data.get("tokenizer_model"), "vocab_size": None}
    if kind == "NullTokenizer":
        # Megatron-LM's NullTokenizer: --vocab-size data ids, its end-of-document id on top
        out["vocab_size"] = (real - 1) if real else data.get("vocab_size")
    elif kind == "CharTokenizer":
        notes.append("note: CharTokenizer has no Megatron-LM equivalent; args record no "
                     "tokenizer (give Megatron-LM a tokenizer with the same ids)")
        out["tokenizer_type"] = None
    elif kind is None:
        notes.append("note: the checkpoint records no tokenizer; give Megatron-LM your "
                     "--tokenizer-type and its files")
    return out


def megatron_lm_args(arch: MegatronArch, model_cfg: Dict[str, Any], opts: Dict[str, Any],
                     tokenizer: Dict[str, Any], *, tp: int, pp: int, rows: int, unit: int,
                     dtype: torch.dtype) -> argparse.Namespace:
    """The ``args`` Megatron-LM's loader (``check_checkpoint_args``,
    ``load_args_from_checkpoint``) and ``--from-megatron`` read."""
    rope = arch.positions is None
    eps = float(model_cfg.get("layernorm_epsilon", 1e-5))
    interp = opts["rotary_seq_len_interpolation_factor"]
    return argparse.Namespace(
        num_layers=arch.layers, hidden_size=arch.hidden, ffn_hidden_size=arch.ffn,
        num_attention_heads=arch.heads, kv_channels=arch.kv,
        group_query_attention=arch.groups != arch.heads, num_query_groups=arch.groups,
        seq_length=arch.seq_length,
        max_position_embeddings=int(model_cfg.get("max_position_embeddings")
                                    or arch.seq_length),
        position_embedding_type="rope" if rope else "learned_absolute",
        add_position_embedding=True,  # Megatron-LM's default; the type decides the table
        use_rotary_position_embeddings=rope, rotary_base=10000,
        rotary_percent=float(opts["rotary_percent"]),
        rotary_interleaved=bool(opts["rotary_interleaved"]),
        rotary_seq_len_interpolation_factor=interp, use_rope_scaling=False,
        normalization="RMSNorm" if arch.rms else "LayerNorm", norm_epsilon=eps,
        layernorm_epsilon=eps, apply_layernorm_1p=False, qk_layernorm=False,
        swiglu=arch.swiglu, squared_relu=bool(opts["squared_relu"]),
        openai_gelu=model_cfg.get("openai_gelu") is True, bias_gelu_fusion=False,
        onnx_safe=None, add_bias_linear=arch.bias, add_qkv_bias=bool(opts["add_qkv_bias"]),
        untie_embeddings_and_output_weights=arch.untied,
        apply_residual_connection_post_layernorm=bool(
            opts["apply_residual_connection_post_layernorm"]),
        fp32_residual_connection=model_cfg.get("fp32_residual_connection") is True,
        hidden_dropout=float(model_cfg.get("hidden_dropout", 0.1)),
        attention_dropout=float(model_cfg.get("attention_dropout", 0.1)),
        init_method_std=float(model_cfg.get("init_method_std", 0.02)),
        padded_vocab_size=rows, make_vocab_size_divisible_by=unit, **tokenizer,
        tensor_model_parallel_size=tp, model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=1,
        num_experts=None, use_legacy_models=True, use_mcore_models=False,
        transformer_impl="local", ckpt_format="torch", params_dtype=dtype,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16,
        bert_binary_head=arch.binary if arch.is_bert else None,
        iteration=0, consumed_train_samples=0, consumed_valid_samples=0,
        skipped_train_samples=0)


# ------------------------------------------------------------------------ the rank files
def _place(model: Dict[str, Any], name: str, local: str, tensor: torch.Tensor) -> None:
    """Put our tensor ``name`` (stage-local name ``local``) where Megatron-LM keeps it."""
    lm = model.setdefault("language_model", {})
    if name.startswith("embedding."):
        table, _, part = name[len("embedding."):].partition(".")
        lm.setdefault("embedding", {}).setdefault(table, {})[part] = tensor
    elif name.startswith("encoder."):
        lm.setdefault("encoder", {})[local[len("encoder."):]] = tensor
    elif name.startswith(("output_layer.", "pooler.")):
        top, _, part = name.partition(".")
        lm.setdefault(top, {})[part] = tensor
    else:  # lm_head.*, binary_head.*
        top, _, part = name.partition(".")
        model.setdefault(top, {})[part] = tensor


def _stage_of(name: str, per_stage: int, pp: int) -> Tuple[int, str]:
    """(stage, stage-local name) of our full tensor ``name``."""
    m = LAYER_NAME.match(name)
    if m:
        layer = int(m["num"])
        stage = layer // per_stage
        return stage, f"{m['head']}{layer - stage * per_stage}{m['tail']}"
    return (0 if name.startswith("embedding.") else pp - 1), name


def rank_models(full: Dict[str, torch.Tensor], arch: MegatronArch, tp: int, pp: int
                ) -> Dict[Tuple[int, int], Dict[str, Any]]:
    """(tensor rank, stage) -> Megatron-LM's ``model`` dict of that rank file."""
    per_stage = arch.layers // pp
    strides_cfg = {"swiglu": arch.swiglu}
    models: Dict[Tuple[int, int], Dict[str, Any]] = {
        (t, p): {"language_model": {}} for p in range(pp) for t in range(tp)}
    for name, tensor in full.items():
        stage, local = _stage_of(name, per_stage, pp)
        dim = partition_dim_by_name(name)
        stride = partition_stride_by_name(name, strides_cfg)
        for t in range(tp):
            part = tensor if dim is None or tp == 1 else shard(tensor, dim, t, tp, stride)
            _place(models[(t, stage)], name, local, part.detach().clone().contiguous())
    if pp > 1 and (arch.is_bert or not arch.untied):
        emb = full[WORD_EMBEDDING]
        for t in range(tp):
            part = emb if tp == 1 else shard(emb, 0, t, tp)
            models[(t, pp - 1)]["word_embeddings_for_head"] = {
                "weight": part.detach().clone().contiguous()}
    for p in range(pp):  # every stage has an encoder (perhaps only the final norm)
        for t in range(tp):
            models[(t, p)]["language_model"].setdefault("encoder", {})
    return models


def _rank_dir(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def _fold_tokentypes(full: Dict[str, torch.Tensor], notes: List[str]) -> Dict[str, torch.Tensor]:
    """A BERT without the sentence-order head: Megatron-LM builds it without token types
    (``num_tokentypes = 2 if bert_binary_head else 0``).  Every token of its inputs is of
    type 0, so row 0 of our table is added to every position: folded into the position
    table (exact for those inputs); the table is dropped."""
    full = dict(full)
    tt = full.pop(_TOKENTYPES)
    if bool(tt[0].abs().sum() > 0):
        full[_POSITIONS] = full[_POSITIONS] + tt[0].to(full[_POSITIONS].dtype)
        notes.append("note: BERT without a binary head: Megatron-LM's has no token-type "
                     "table; its type-0 row (added to every token of single-segment inputs) "
                     "is folded into the position embeddings")
    return full


# ------------------------------------------------------------------------ the flags
def megatron_lm_command(arch: MegatronArch, args: argparse.Namespace, out: str) -> str:
    """The Megatron-LM command line that loads the export (its legacy models)."""
    flags = ["pretrain_bert.py" if arch.is_bert else "pretrain_gpt.py",
             "--use-legacy-models --ckpt-format torch",
             f"--num-layers {arch.layers} --hidden-size {arch.hidden} "
             f"--num-attention-heads {arch.heads} --ffn-hidden-size {arch.ffn} "
             f"--seq-length {arch.seq_length} "
             f"--max-position-embeddings {args.max_position_embeddings}"]
    if arch.kv * arch.heads != arch.hidden:
        flags.append(f"--kv-channels {arch.kv}")
    if args.group_query_attention:
        flags.append(f"--group-query-attention --num-query-groups {arch.groups}")
    if arch.positions is None:
        flags.append("--position-embedding-type rope")
        if args.rotary_percent != 1.0:
            flags.append(f"--rotary-percent {args.rotary_percent:g}")
        if args.rotary_interleaved:
            flags.append("--rotary-interleaved")
        if args.rotary_seq_len_interpolation_factor is not None:
            flags.append(f"--rotary-seq-len-interpolation-factor "
                         f"{args.rotary_seq_len_interpolation_factor:g}")
    if arch.rms:
        flags.append("--normalization RMSNorm")
    if args.norm_epsilon != 1e-5:
        flags.append(f"--norm-epsilon {args.norm_epsilon:g}")
    if arch.swiglu:
        flags.append("--swiglu")
    elif args.squared_relu:
        flags.append("--squared-relu")
    elif args.openai_gelu:
        flags.append("--openai-gelu")
    elif arch.bias:  # its fused bias-GELU (on by default) is the tanh approximation
        flags.append("--no-bias-gelu-fusion")
    if not arch.bias:
        flags.append("--disable-bias-linear")
        if args.add_qkv_bias:
            flags.append("--add-qkv-bias")
    if arch.untied:
        flags.append("--untie-embeddings-and-output-weights")
    if args.apply_residual_connection_post_layernorm:
        flags.append("--apply-residual-connection-post-layernorm")
    if arch.is_bert and not arch.binary:
        flags.append("--bert-no-binary-head")
    flags.append(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} "
                 f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} "
                 f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}")
    if args.tokenizer_type:
        flags.append(f"--tokenizer-type {args.tokenizer_type}")
        for key in ("vocab_file", "merge_file", "tokenizer_model"):
            if getattr(args, key):
                flags.append(f"--{key.replace('_', '-')} {getattr(args, key)}")
        if args.tokenizer_type == "NullTokenizer" and args.vocab_size:
            flags.append(f"--vocab-size {args.vocab_size}")
    else:
        flags.append("--tokenizer-type TYPE (and its files)")
    flags.append(f"--load {out} [--finetune]")
    return " ".join(flags)


# ------------------------------------------------------------------------ the export
def export_megatron_lm(load: str, out: str, *, tp: Optional[int] = None,
                       pp: Optional[int] = None, iteration: Optional[int] = None,
                       true_vocab: Optional[int] = None, divisible_by: Optional[int] = None,
                       allow_unsafe: bool = False, vocab_flag: Optional[str] = None) -> str:
    """Write checkpoint ``load`` as a Megatron-LM legacy ``release`` checkpoint at ``out``
    (a new or empty directory) for tensor size ``tp`` and ``pp`` stages (default: the
    checkpoint's); returns ``out``.  Written into a sibling staging directory renamed to
    ``out`` at the end: a failed export leaves no ``out``.  ``divisible_by``: the
    Megatron-LM run's --make-vocab-size-divisible-by (default: one that keeps the rows);
    ``vocab_flag``: the option ``true_vocab`` came from, when a user gave it."""
    check_export_path(load, out)
    state = read_full_state(load, iteration, allow_unsafe=allow_unsafe)
    config = state.common.get("config") or {}
    config = config if isinstance(config, dict) else {}
    model_cfg = dict(model_config_of(config))
    if not model_cfg:
        raise CheckpointError(f"--load {load}: the checkpoint records no model config; "
                              f"expected a checkpoint written by this trainer")
    full = state.model
    if WORD_EMBEDDING not in full:
        raise CheckpointError(f"--load {load}: the checkpoint has no {WORD_EMBEDDING}; "
                              f"expected a GPT or BERT checkpoint of this trainer")
    model_cfg.setdefault("num_layers", state.ckpt.num_layers)
    tp = tp or state.layout[0]
    pp = pp or state.layout[1]
    is_bert = "lm_head.bias" in full
    opts = block_options(model_cfg)
    _refuse_options(model_cfg, opts, is_bert, full)
    arch = _architecture(model_cfg, opts, full, is_bert, load)
    _check_tensors(full, arch, load)
    if vocab_flag:
        check_true_vocab(true_vocab, arch.vocab_rows, config, vocab_flag)
    real = true_vocab_size(config, true_vocab)
    notes: List[str] = []
    full, rows, unit = _vocabulary(full, config, state.layout[0], tp, real, divisible_by,
                                   notes)
    arch = dataclasses.replace(arch, vocab_rows=rows)
    _check_split(arch, tp, pp, rows)
    if arch.is_bert and not arch.binary:
        full = _fold_tokentypes(full, notes)
    dtype = full[WORD_EMBEDDING].dtype
    args = megatron_lm_args(arch, model_cfg, opts,
                            _tokenizer_args(config.get("data") or {}, real, notes),
                            tp=tp, pp=pp, rows=rows, unit=unit, dtype=dtype)
    models = rank_models(full, arch, tp, pp)
    check_export_path(load, out)  # again: the checkpoint took a while to read
    staging = f"{os.path.abspath(out)}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(staging), exist_ok=True)
        if os.path.isdir(staging):  # left by a killed export of a process with this pid
            shutil.rmtree(staging)
        for (t, p), model in models.items():
            rank = os.path.join(staging, "release", _rank_dir(t, p, pp))
            os.makedirs(rank)
            torch.save({"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                        "iteration": 0, "model": model}, os.path.join(rank, PT_FILE))
        with open(os.path.join(staging, TRACKER), "w") as fh:
            fh.write("release")
        publish_export(staging, out, TO_FLAG)
    except OSError as exc:  # unwritable, disk full: nothing half-written stays
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"{TO_FLAG} {out}: cannot write the export "
                        f"({exc.strerror or type(exc).__name__}: "
                        f"{exc.filename or staging})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for note in notes:
        say(note)
    say(f"wrote Megatron-LM checkpoint_version {CHECKPOINT_VERSION:g} 'release' (tensor "
        f"{tp}, pipeline {pp}, {len(models)} rank files), model weights only: no "
        f"optimizer state, LR scheduler, RNG state or sample counts")
    say(f"load in Megatron-LM with: {megatron_lm_command(arch, args, out)}")
    return out


__all__ = ["TO_FLAG", "CHECKPOINT_VERSION", "check_export_path", "export_megatron_lm",
           "megatron_lm_args", "megatron_lm_command", "rank_models"]

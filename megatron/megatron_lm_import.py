"""NVIDIA Megatron-LM's own checkpoints (the legacy ``torch.save`` layout) -> our checkpoints.

``tools/checkpoint_util.py --from-megatron DIR --save OUT --allow-unsafe-checkpoint``
reads a GPT or BERT checkpoint written by Megatron-LM's legacy models (``megatron/model``,
later ``megatron/legacy/model``): NVIDIA's released GPT-345M / BERT-345M or a user's own
run, and writes an iteration-0 checkpoint of ours for ``--load OUT --finetune``,
``tasks/main.py --pretrained-checkpoint OUT`` or ``tools/generate_samples_gpt.py``.

What is read
    ``DIR`` is the ``--save`` directory of the Megatron-LM run (its tracker
    ``latest_checkpointed_iteration.txt`` holds an iteration or ``release``), one
    iteration directory (``iter_0001000``, ``release``), one rank directory or one
    ``model_optim_rng.pt``.  Every rank file ``mp_rank_TT/model_optim_rng.pt``
    (``mp_rank_TT_PPP`` with pipeline stages) of the iteration is read; only its
    ``model``, ``args`` and ``checkpoint_version`` are used.  The optimizer state (and
    ``distrib_optim.pt``), the LR scheduler, the RNG state and the sample counts are
    dropped: the result is a model to finetune or train from, at iteration 0.

The layout
    ``model["language_model"]`` holds ``embedding`` (``word_embeddings``, split by rows
    across tensor ranks; ``position_embeddings``; BERT's ``tokentype_embeddings``),
    ``encoder`` (``transformer`` before 2021) with the stage's layers numbered from 0
    on every pipeline stage, ``pooler`` (BERT) and ``output_layer`` (an untied GPT
    output); beside it BERT's ``lm_head`` (its ``bias`` split by vocabulary rows) and
    ``binary_head``, and ``word_embeddings_for_head`` (the last stage's copy of the
    tied embedding, dropped: it equals the first stage's).  Older layer names
    (``attention.``; ``input_norm``/``post_attention_norm``/``final_norm`` of later
    versions) are renamed to ours.  Column-parallel weights (query/key/value, the first
    MLP weight, their biases) are concatenated by rows across tensor ranks -- SwiGLU's
    [gate_r; up_r] section by section --, row-parallel ones (attention output, second
    MLP weight) by columns; everything else is the same on every rank.

Query/key/value rows
    Each tensor rank's fused QKV rows are ordered by ``checkpoint_version``: version 0
    (and files without one) [q of the rank's heads | k | v], version 1.0 [head,
    head_dim, (q, k, v)], version 2.0 and later [head, (q, k, v), head_dim], which is
    ours; grouped-query attention (version 3) is [group, (its queries, k, v),
    head_dim], also ours.  Each rank's rows are put in our order before the ranks are
    concatenated.

The model config
    comes from the checkpoint's ``args`` (sizes are checked against the tensors):
    layers, hidden size, heads, query groups, kv channels, ffn size, positions,
    sequence length, the padded vocabulary (its rows), the norm and its epsilon, RoPE
    (``rotary_percent``, ``rotary_interleaved``, interpolation), SwiGLU, squared ReLU,
    biases, untied output, post-LayerNorm residuals, dropouts, the tokenizer.  The
    GELU is Megatron-LM's: its fused bias-GELU (``bias_gelu_fusion``, on by default)
    and ``--openai-gelu`` compute the tanh approximation, so either imports as
    ``--openai-gelu``.  A checkpoint without ``args`` (early releases) needs
    ``--num-attention-heads``; the rest is read from the tensors and the GELU is taken
    as the tanh one those versions used.

Refused, one line each
    Without ``--allow-unsafe-checkpoint`` (the files are pickles, which can run code);
    with it, any pickled global outside the allow-list (``megatron_lm_files``): plain
    unpickling is never used.  Megatron Core checkpoints (``torch_dist`` directories;
    ``decoder.layers`` state dicts), Transformer Engine layers, MoE, virtual pipeline
    stages (``model0``, ``model1``), encoder-decoder models, finetuned task heads, and
    any argument whose model this trainer cannot build (ALiBi, ``apply_layernorm_1p``,
    a RoPE base other than 10000, ...).  Missing rank files, a tensor of another shape
    than ``args`` say, or a tensor ``args`` do not account for.

Where it is done
    ``megatron_lm_files`` finds and reads the rank files, ``megatron_lm_shards`` maps
    their tensors to our names, ``megatron_lm_arch`` infers and checks the model and
    our config for it; this module merges the tensor ranks and writes the checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, CheckpointShards, FullState,
                                         check_save_path, recorded_split,
                                         target_stage_counts, true_vocab_size, write_layout)
from megatron.checkpoint_load import split_text
from megatron.checkpoint_merge import partition_dim_by_name
from megatron.errors import CheckpointError
from megatron.hf_import import model_flags
from megatron.export_output import say
from megatron.megatron_lm_arch import (MegatronArch, infer_architecture, check_tensors,
                                       model_config_for, tokenizer_settings, expected_shapes)
from megatron.megatron_lm_files import FLAG, PT_FILE, CheckpointSource, load_megatron_file, locate
from megatron.megatron_lm_shards import (QKV_NAME, args_dict, global_tensors, read_shard,
                                         Shard, checkpoint_version)


# ------------------------------------------------------------------------ merging ranks
def _qkv_rank_to_ours(t: torch.Tensor, version: float, heads_here: int, kv: int) -> torch.Tensor:
    """One tensor rank's fused QKV rows (weight or bias) in checkpoint ``version``'s order
    -> ours, [head, (q, k, v), head_dim] (Megatron-LM's own reordering on load)."""
    rest = tuple(t.shape[1:])
    if version == 0:  # [(q, k, v), head, head_dim]
        return t.reshape(3, heads_here, kv, *rest).transpose(0, 1).reshape(-1, *rest)
    if version == 1:  # [head, head_dim, (q, k, v)]
        return t.reshape(heads_here, kv, 3, *rest).transpose(1, 2).reshape(-1, *rest)
    return t


def _merge(name: str, parts: List[torch.Tensor], arch: MegatronArch, version: float
           ) -> torch.Tensor:
    dim = partition_dim_by_name(name)
    if dim is None:
        return parts[0]
    tp = len(parts)
    if name.endswith((f"{QKV_NAME}.weight", f"{QKV_NAME}.bias")):
        parts = [_qkv_rank_to_ours(p, version, arch.heads // tp, arch.kv) for p in parts]
    if arch.swiglu and "mlp.dense_h_to_4h." in name:  # rank r: [gate_r; up_r]
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, dim)


# ------------------------------------------------------------------------ the conversion
@dataclass
class MegatronModel:
    """A Megatron-LM checkpoint in our terms."""

    full: Dict[str, torch.Tensor]
    model_cfg: Dict[str, Any]
    data_cfg: Dict[str, Any]
    source: CheckpointSource
    iteration: Any
    version: float
    notes: List[str]
    unit: int
    """Megatron-LM's --make-vocab-size-divisible-by (128 where args do not say)."""

def read_megatron_lm(path: str, *, allow_unsafe: bool = False,
                     iteration: Optional[int] = None,
                     num_attention_heads: Optional[int] = None) -> MegatronModel:
    """Read and merge the Megatron-LM checkpoint ``path`` (see the module doc)."""
    src = locate(path, iteration)
    notes: List[str] = []
    first = src.files[(0, 0)]
    payload = load_megatron_file(first, allow_unsafe)
    if not isinstance(payload, dict):
        raise CheckpointError(f"{FLAG} {first}: expected a Megatron-LM checkpoint (a dict), "
                              f"found {type(payload).__name__}")
    a = args_dict(payload.get("args"), first)
    version = checkpoint_version(payload, first)
    src_iteration = payload.get("iteration")
    if a is not None:  # the rank files the run wrote, before reading the others
        for keys, have, what in ((("tensor_model_parallel_size", "model_parallel_size"),
                                  src.tp, "tensor"),
                                 (("pipeline_model_parallel_size",), src.pp, "pipeline")):
            want = next((a[k] for k in keys if type(a.get(k)) is int), None)
            if want is not None and want != have:
                if want > have:
                    miss = (f"mp_rank_{have:02d}" if what == "tensor" and src.pp == 1 else
                            f"mp_rank_{have:02d}_000" if what == "tensor" else
                            f"mp_rank_00_{have:03d}")
                    raise CheckpointError(f"{FLAG} {src.iter_dir}: args record {keys[0]} "
                                          f"{want} but {have} {what} rank(s) are here: missing "
                                          f"{os.path.join(src.iter_dir, miss, PT_FILE)}")
                raise CheckpointError(f"{FLAG} {src.iter_dir}: {have} {what} ranks, but args "
                                      f"record {keys[0]} {want}")
    shards: Dict[Tuple[int, int], Shard] = {(0, 0): read_shard(first, payload)}
    del payload
    for key, f in src.files.items():
        if key == (0, 0):
            continue
        other = load_megatron_file(f, allow_unsafe)
        if isinstance(other, dict) and checkpoint_version(other, f) != version:
            raise CheckpointError(f"{FLAG} {f}: checkpoint_version "
                                  f"{checkpoint_version(other, f)}, but {first} has "
                                  f"{version}: rank files of two checkpoints")
        shards[key] = read_shard(f, other)
    return _convert(src, shards, a, version, src_iteration, num_attention_heads, notes)

def _convert(src: CheckpointSource, shards: Dict[Tuple[int, int], Shard],
             a: Optional[Dict[str, Any]], version: float, src_iteration: Any,
             heads_flag: Optional[int], notes: List[str]) -> MegatronModel:
    found, counts, offsets = global_tensors(src, shards)
    args = a or {}
    arch = infer_architecture(found, args, a is not None, src, counts, version, heads_flag, notes)
    expected = expected_shapes(arch)
    check_tensors(found, arch, expected, src, offsets)
    emb = found[WORD_EMBEDDING][0][0]
    full: Dict[str, torch.Tensor] = {}
    for g in expected:
        if g == "embedding.tokentype_embeddings.weight" and g not in found:
            full[g] = torch.zeros(expected[g], dtype=emb.dtype)
            continue
        full[g] = _merge(g, [p[0] for p in found[g]], arch, version).contiguous().clone()
    model_cfg = model_config_for(arch, args if a is not None else None, full, notes)
    data_cfg = tokenizer_settings(a, notes)
    unit = args.get("make_vocab_size_divisible_by")
    return MegatronModel(full, model_cfg, data_cfg, src, src_iteration, version, notes,
                         unit if type(unit) is int and unit > 0 else 128)


# ------------------------------------------------------------------------ writing
def _keeping_divisor(unit: int, rows: int, src_tp: int, tp: int) -> int:
    """The --make-vocab-size-divisible-by that keeps the source's ``rows`` padded rows at
    tensor size ``tp`` (Megatron-LM padded to a multiple of its ``unit`` x its t): the
    unit scaled by src_tp / tp where that is a whole number dividing the rows, else the
    unit."""
    scaled = unit * src_tp
    if scaled % tp == 0 and rows % scaled == 0:
        return scaled // tp
    return unit


def _train_flags(m: MegatronModel, divisible_by: int, tp: int, pp: int, split: str,
                 save: str) -> str:
    """The command that trains (or finetunes) the imported model."""
    cfg = m.model_cfg
    bert = bool(cfg["num_tokentypes"])
    flags = ["pretrain_bert.py" if bert else "pretrain_gpt.py", model_flags(cfg),
             f"--seq-length {cfg['seq_length']}"]
    if cfg.get("rotary_percent", 1.0) != 1.0:
        flags.append(f"--rotary-percent {cfg['rotary_percent']}")
    if cfg.get("rotary_interleaved"):
        flags.append("--rotary-interleaved")
    if cfg.get("rotary_seq_len_interpolation_factor") is not None:
        flags.append(f"--rotary-seq-len-interpolation-factor "
                     f"{cfg['rotary_seq_len_interpolation_factor']:g}")
    if cfg["apply_residual_connection_post_layernorm"]:
        flags.append("--apply-residual-connection-post-layernorm")
    if not cfg["swiglu"] and (cfg["hidden_dropout"], cfg["attention_dropout"]) != (0.1, 0.1):
        flags.append(f"--hidden-dropout {cfg['hidden_dropout']} "
                     f"--attention-dropout {cfg['attention_dropout']}")
    if bert and "binary_head.weight" not in m.full:
        flags.append("--bert-no-binary-head")
    flags.append(f"--make-vocab-size-divisible-by {divisible_by} "
                 f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}{split}")
    data = m.data_cfg
    kind = data.get("tokenizer_type")
    if kind:
        flags.append(f"--tokenizer-type {kind}")
        for key in ("vocab_file", "merge_file", "tokenizer_model"):
            if data.get(key):
                flags.append(f"--{key.replace('_', '-')} {data[key]}")
        if kind == "NullTokenizer" and data.get("vocab_size"):
            flags.append(f"--vocab-size {data['vocab_size']}")
    else:
        flags.append("--tokenizer-type TYPE (and its files: the checkpoint records none)")
    flags.append(f"--load {save} --finetune")
    if bert:
        flags.append(f"(or a task: tasks/main.py --task ... --pretrained-checkpoint {save})")
    return " ".join(flags)


def import_megatron_lm(path: str, save: str, *, tp: int = 1, pp: int = 1,
                       divisible_by: Optional[int] = None, allow_unsafe: bool = False,
                       iteration: Optional[int] = None, true_vocab: Optional[int] = None,
                       num_attention_heads: Optional[int] = None,
                       first: Optional[int] = None, last: Optional[int] = None) -> str:
    """Write Megatron-LM checkpoint ``path`` as an iteration-0 checkpoint of layout
    (``tp``, ``pp``) under ``save``; returns the iteration directory written.

    ``divisible_by``: the vocabulary padding unit of the runs that will load it (default:
    the one keeping Megatron-LM's padded rows at ``tp``, ``_keeping_divisor``).
    ``true_vocab``: --true-vocab-size (for a re-padding when the tokenizer files are not
    here).  ``first``/``last``: the stage split, as --decoder-first/last-pipeline-num-layers.
    A ``save`` holding checkpoints is refused before anything is read."""
    check_save_path(path, save, load_flag=FLAG)
    m = read_megatron_lm(path, allow_unsafe=allow_unsafe, iteration=iteration,
                         num_attention_heads=num_attention_heads)
    rows = m.full[WORD_EMBEDDING].shape[0]
    unit_note = divisible_by is None
    if divisible_by is None:
        divisible_by = _keeping_divisor(m.unit, rows, m.source.tp, tp)
    data = {"make_vocab_size_divisible_by": divisible_by, **m.data_cfg}
    config = {"model": m.model_cfg, "data": data}
    real = true_vocab or true_vocab_size(config)
    if real is not None and not data.get("tokenizer_vocab_size"):
        data["tokenizer_vocab_size"] = int(real)
    layers = m.model_cfg["num_layers"]
    ckpt = CheckpointShards(root=m.source.iter_dir, iteration=0, tensor=1, pipeline=1,
                            num_layers=layers)
    label = m.source.label if m.iteration is None else (
        "release" if m.source.label == "release" else f"iteration {m.iteration}")
    state = FullState(iteration=0, model=m.full, shadow=None, optimizer=None,
                      common={"consumed_train_samples": 0, "consumed_valid_samples": 0,
                              "lr_scheduler": None, "config": config,
                              "megatron_lm_source": {"checkpoint": label,
                                                     "checkpoint_version": m.version}},
                      layout=(1, 1, 1), ckpt=ckpt)
    for note in m.notes:
        say(note)
    out = write_layout(state, save, tp, pp, 1, true_vocab=true_vocab,
                       source=os.path.abspath(path), first=first, last=last,
                       vocab_flag="--true-vocab-size" if true_vocab else None)
    split = split_text(*recorded_split(target_stage_counts(state, pp, first, last), first,
                                       last))
    if unit_note and divisible_by != m.unit:
        say(f"note: --make-vocab-size-divisible-by {divisible_by} keeps the "
             f"{rows} padded vocabulary rows at tensor size {tp} (Megatron-LM's "
             f"{m.unit} x {m.source.tp})")
    say(f"imported Megatron-LM {label} (checkpoint_version {m.version:g}, tensor "
         f"{m.source.tp}, pipeline {m.source.pp}) as iteration 0; its optimizer, LR "
         f"scheduler, RNG state and sample counts are not carried over")
    say(f"train with: {_train_flags(m, divisible_by, tp, pp, split, save)}")
    return out

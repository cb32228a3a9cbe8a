"""Full-state resharding: a checkpoint of any (t, d, w) layout rewritten for any other.

``read_full_state`` merges every rank file into one layout-free ``FullState``: the model
weights and 2BW shadow weights (see ``megatron.checkpoint_merge``), the optimizer state
(Adam moments and fp32 master weights split and merged exactly like their parameters;
per-parameter scalars such as Adam's step count copied), and what every rank shares
(iteration, consumed samples, LR scheduler, grad scaler, the engine's per-batch loss
scales, the run config).  ``write_layout`` cuts it for the target layout:

* the vocabulary tables are re-padded when t changes the padded size (Megatron pads to
  a multiple of ``make_vocab_size_divisible_by * t``); new rows copy the last padding
  row (and its moments), rows beyond the new size are dropped;
* files are written into ``iter_X.tmp`` and renamed into place, the tracker last, with
  a manifest when ``megatron.checkpointing`` provides one; a ``save`` directory that
  already holds checkpoints is refused (``check_save_path``), as the trainer refuses a
  new run's --save holding another run's, so nothing there is replaced;
* RNG state (``rng_dp_DDD`` per rank) is carried over only where the (t, d) grid is
  unchanged and the data-parallel rank exists in both layouts; other ranks start from
  the streams ``--seed`` gives them (one layout's generator states do not describe
  another's: dropout masks are drawn per rank and per slice).  The data position is
  exact in every case: the sampler resumes from ``consumed_train_samples`` whatever w.
"""
from __future__ import annotations

import glob
import os
import shutil
import sys
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint_merge import (LAYER_NAME, MODEL_FILE, OUTPUT_EMBEDDING_COPY,
                                       VOCAB_NAMES, WORD_EMBEDDING, CheckpointShards,
                                       load_stage_payload, megatron_rank_dir, merge_checkpoint,
                                       merge_shards, model_config_of, partition_dim_by_name,
                                       partition_stride_by_name, read_checkpoint,
                                       split_for_stage, to_global, to_local)
from megatron.checkpoint_discovery import existing_checkpoints
from megatron.checkpoint_files import TRACKER, iteration_dir
from megatron.checkpoint_payload import CHECKPOINT_VERSION, payload_exists, save_payload
from megatron.errors import CheckpointError, UserError, check_parents_are_directories

try:  # the manifest (size + sha256 per file) that training saves write
    from megatron.checkpoint_files import write_manifest
except ImportError:  # pragma: no cover - checkpointing without manifests
    write_manifest = None


def _name_targets(full: Dict[str, torch.Tensor], num_layers: int, tp: int, pp: int,
                  stage: int, padded_vocab: Optional[int] = None,
                  counts: Optional[Sequence[int]] = None,
                  model_cfg: Optional[Dict[str, Any]] = None
                  ) -> Tuple[Dict[str, Tuple[torch.Size, Optional[int]]], int]:
    """Local (shape, dim) of a stage's names when no module is available, in the stage
    module's parameter order.  ``padded_vocab``: rows of the vocabulary tables in the
    target layout (default: as in ``full``).  ``counts``: layers of each stage (default:
    an even split).  ``model_cfg``: the checkpoint's config["model"] (SwiGLU's [gate; up]
    must split in both halves; the error names the model's sizes)."""
    counts = list(counts) if counts is not None else [num_layers // pp] * pp
    per = counts[stage]
    offset = sum(counts[:stage])
    targets = {}
    for gname, tensor in full.items():
        m = LAYER_NAME.match(gname)
        if m:
            if not offset <= int(m["num"]) < offset + per:
                continue
        elif gname.startswith("embedding."):
            if stage != 0:
                continue
        elif stage != pp - 1:
            continue
        dim = partition_dim_by_name(gname)
        shape = list(tensor.shape)
        if padded_vocab is not None and is_vocab(gname):
            shape[0] = padded_vocab
        if dim is not None:
            stride = partition_stride_by_name(gname, model_cfg)
            if shape[dim] % (tp * stride):
                size = shape[dim] // stride if shape[dim] % stride == 0 else shape[dim]
                raise CheckpointError(f"--target-tensor-parallel-size {tp} does not divide the "
                                      f"checkpoint's {_split_size_name(gname, model_cfg)} "
                                      f"({size}; dim {dim} of {gname})")
            shape[dim] //= tp
        targets[to_local(gname, offset)] = (torch.Size(shape), dim)
    tied = "output_layer.weight" not in full and WORD_EMBEDDING in full
    if pp > 1 and stage == pp - 1 and tied:
        shape = list(full[WORD_EMBEDDING].shape)
        shape[0] = (padded_vocab or shape[0]) // tp
        targets[OUTPUT_EMBEDDING_COPY] = (torch.Size(shape), 0)
    return targets, offset


def _split_size_name(gname: str, model_cfg: Optional[Dict[str, Any]] = None) -> str:
    """What the tensor-parallel dim of ``gname`` measures: a model size the user knows,
    for an error they can act on.  ``model_cfg``: the checkpoint's config["model"]
    (grouped-query attention's and SwiGLU's rows are other multiples)."""
    model_cfg = model_cfg or {}
    if is_vocab(gname):
        return "padded vocabulary size"
    if "query_key_value" in gname:
        heads, groups = model_cfg.get("num_attention_heads"), model_cfg.get("num_query_groups")
        if isinstance(groups, int) and groups != heads:
            return ("query/key/value rows ((heads + 2 x query groups) x head size; whole "
                    "query groups go to each rank)")
        return "query/key/value rows (3 x hidden size)"
    if "self_attention.dense" in gname:
        return "hidden size"
    if "dense_h_to_4h" in gname and partition_stride_by_name(gname, model_cfg) == 2:
        return "ffn hidden size (each of SwiGLU's gate and up halves)"
    if "dense_h_to_4h" in gname or "dense_4h_to_h" in gname:
        return "ffn hidden size"
    return "tensor-parallel dimension"


# (config["model"] key, name): the sizes t must divide, as the trainer requires of
# --tensor-model-parallel-size (megatron/arguments.py).  num_query_groups: a rank holds
# whole groups (their queries, key and value); older checkpoints lack the key (their
# groups are the heads, checked above).
_TP_SPLIT_SIZES = (("num_attention_heads", "number of attention heads"),
                   ("num_query_groups", "number of query groups (--num-query-groups)"),
                   ("ffn_hidden_size", "ffn hidden size"))


def _check_tensor_split(config: dict, tp: int) -> None:
    """Refuse a t the checkpoint's model cannot be split by before anything is written,
    naming the model size (a head, or a query group, must not be cut between ranks: the
    weight shapes alone can divide when the heads do not)."""
    model = model_config_of(config)
    for key, name in _TP_SPLIT_SIZES:
        size = model.get(key)
        if isinstance(size, int) and size > 0 and size % tp:
            raise CheckpointError(f"--target-tensor-parallel-size {tp} does not divide the "
                                  f"checkpoint's {name} ({size})")


def is_vocab(gname: str) -> bool:
    return gname in VOCAB_NAMES or gname.endswith("word_embeddings.weight")


@dataclass
class FullOptimizer:
    """A layout-free optimizer state: every per-parameter quantity as a full tensor."""

    name: str
    """--optimizer (adam, sgd)."""
    tensors: Dict[str, Dict[str, torch.Tensor]]
    """quantity (exp_avg, exp_avg_sq, momentum_buffer, ...) -> global name -> full tensor."""
    scalars: Dict[str, Dict[str, Any]]
    """global name -> per-parameter values that are not split (Adam's step count)."""
    masters: Optional[Dict[str, torch.Tensor]]
    """fp32 master weights by global name (mixed precision), else None."""
    groups: Dict[str, Dict[str, Any]]
    """'decay' / 'no_decay' -> torch param-group hyper-parameters (without 'params')."""
    grad_scaler: Any
    weight_prediction: Any = None
    """--2bw-mitigation predict's state (the lr its forecast used), the same on every rank."""


@dataclass
class FullState:
    """Everything a checkpoint holds, independent of its (t, d, w) layout."""

    iteration: int
    model: Dict[str, torch.Tensor]
    shadow: Optional[Dict[str, torch.Tensor]]
    optimizer: Optional[FullOptimizer]
    common: Dict[str, Any]
    """Entries every rank file shares: consumed samples, lr_scheduler, engine, config, ..."""
    layout: Tuple[int, int, int]
    """Source (tensor, pipeline, data) sizes."""
    ckpt: CheckpointShards


def _decay_order(shapes: Sequence[Sequence[int]]) -> List[int]:
    """Model-order positions in the order torch numbers them in the optimizer state:
    the weight-decay group (matrices) first, then the no-decay group (biases, norms),
    as ``get_megatron_optimizer`` builds its param groups."""
    decay = [i for i, s in enumerate(shapes) if len(s) >= 2]
    return decay + [i for i, s in enumerate(shapes) if len(s) < 2]


def _stage_optimizer_by_name(opt: Dict[str, Any], names: List[str], where: str
                             ) -> Tuple[Dict[str, Dict[str, torch.Tensor]],
                                        Dict[str, Dict[str, Any]], Optional[Dict[str, Any]],
                                        Dict[str, Dict[str, Any]]]:
    """One stage's ``MegatronOptimizer.state_dict()`` keyed by local parameter names."""
    meta = opt.get("meta") or {}
    shapes = [tuple(s) for s in meta.get("shapes", [])]
    if len(shapes) != len(names):
        raise CheckpointError(f"{where}: optimizer state holds {len(shapes)} parameters, the "
                              f"model {len(names)}; not written by this trainer's optimizer")
    torch_sd = opt["optimizer"]
    order = _decay_order(shapes)
    flat = [int(i) for g in torch_sd["param_groups"] for i in g["params"]]
    if sorted(flat) != list(range(len(names))):
        raise CheckpointError(f"{where}: optimizer param groups number {len(flat)} "
                              f"parameters, expected 0..{len(names) - 1}")
    index_to_name = {idx: names[order[pos]] for pos, idx in enumerate(flat)}
    groups: Dict[str, Dict[str, Any]] = {}
    for g in torch_sd["param_groups"]:
        kinds = {len(shapes[order[flat.index(int(i))]]) >= 2 for i in g["params"]}
        if len(kinds) != 1:
            raise CheckpointError(f"{where}: an optimizer param group mixes matrices and "
                                  f"vectors; expected the decay / no-decay split")
        groups["decay" if kinds.pop() else "no_decay"] = {k: v for k, v in g.items()
                                                          if k != "params"}
    tensors: Dict[str, Dict[str, torch.Tensor]] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for idx, entry in torch_sd["state"].items():
        name = index_to_name[int(idx)]
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors.setdefault(key, {})[name] = value
            else:
                scalars.setdefault(name, {})[key] = value
    masters = None
    if opt.get("fp32_masters") is not None:
        masters = dict(zip(names, opt["fp32_masters"]))
    return tensors, scalars, masters, groups


def read_full_state(root: str, iteration: Optional[int] = None, *,
                    allow_unsafe: bool = False, flag: str = "--load") -> FullState:
    """Merge every file of a checkpoint into one layout-free ``FullState``; ``flag``
    names the option ``root`` came from in errors."""
    ckpt = read_checkpoint(root, iteration, allow_unsafe=allow_unsafe, flag=flag)
    first = ckpt.payloads[(0, 0)]
    layout = first.get("layout") or {}
    data = int(layout.get("data") or 1)
    model = merge_checkpoint(ckpt)
    shadow = None
    if all(p.get("model_shadow") is not None for p in ckpt.payloads.values()):
        shadow = merge_shards({k: p["model_shadow"] for k, p in ckpt.payloads.items()}, ckpt)
    optimizer = None
    if all(p.get("optimizer") is not None for p in ckpt.payloads.values()):
        optimizer = _merge_optimizer(ckpt)
    # (model_predicted: a --2bw-mitigation predict run's newest buffer, per shard; the
    # converted checkpoint goes without it, and a resume predicts again from "model")
    skip = {"model", "model_shadow", "model_predicted", "optimizer", "layout", "iteration",
            "rng_state"}
    common = {k: v for k, v in first.items() if k not in skip}
    return FullState(iteration=ckpt.iteration, model=model, shadow=shadow,
                     optimizer=optimizer, common=common,
                     layout=(ckpt.tensor, ckpt.pipeline, data), ckpt=ckpt)


def _merge_optimizer(ckpt: CheckpointShards) -> FullOptimizer:
    per_key: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}
    scalars_by_shard, masters_by_shard = {}, {}
    groups: Dict[str, Dict[str, Any]] = {}
    for key, payload in ckpt.payloads.items():
        names = list(payload["model"].keys())
        try:
            tensors, scalars, masters, g = _stage_optimizer_by_name(
                payload["optimizer"], names, f"{ckpt.dirs[key]}")
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"{ckpt.dirs[key]}: malformed optimizer state "
                                  f"({type(exc).__name__}: {exc}); expected the state of "
                                  f"this trainer's optimizer (or drop it: --no-load-optim "
                                  f"when resuming)") from None
        for quantity, by_name in tensors.items():
            per_key.setdefault(quantity, {})[key] = by_name
        scalars_by_shard[key] = scalars
        masters_by_shard[key] = masters
        for kind, hp in g.items():
            groups.setdefault(kind, hp)
    shards_all = list(ckpt.payloads)
    tensors_full = {}
    for quantity, shards in per_key.items():
        if set(shards) != set(shards_all):
            raise CheckpointError(f"checkpoint {ckpt.root}: optimizer quantity {quantity} is "
                                  f"missing on some ranks")
        tensors_full[quantity] = merge_shards(shards, ckpt)
    scalars_full = merge_shards(scalars_by_shard, _NoSplit(ckpt))  # type: ignore[arg-type]
    masters_full = None
    if all(m is not None for m in masters_by_shard.values()):
        masters_full = merge_shards(masters_by_shard, ckpt)  # type: ignore[arg-type]
    first = ckpt.payloads[(0, 0)]["optimizer"]
    return FullOptimizer(name=first["meta"]["optimizer"], tensors=tensors_full,
                         scalars=scalars_full, masters=masters_full, groups=groups,
                         grad_scaler=first.get("grad_scaler"),
                         weight_prediction=first.get("weight_prediction"))


class _NoSplit:
    """A CheckpointShards view with tensor size 1, for values replicated across TP."""

    def __init__(self, ckpt: CheckpointShards) -> None:
        self.root, self.num_layers, self.pipeline, self.tensor = (ckpt.root, ckpt.num_layers,
                                                                  ckpt.pipeline, 1)
        self.stage_offsets = ckpt.stage_offsets


def true_vocab_size(config: Optional[dict], override: Optional[int] = None) -> Optional[int]:
    """The unpadded vocabulary size of a checkpoint (None when it cannot be told)."""
    if override:
        return override
    data = (config or {}).get("data") or {}
    if data.get("tokenizer_vocab_size"):
        return int(data["tokenizer_vocab_size"])
    if data.get("tokenizer_type") == "NullTokenizer" and data.get("vocab_size"):
        # recorded before tokenizer_vocab_size: this trainer's NullTokenizer then had
        # --vocab-size ids, end of document included
        return int(data["vocab_size"])
    try:
        from megatron.config import DataConfig
        from megatron.tokenizer import build_tokenizer
        if data.get("tokenizer_type"):
            return int(build_tokenizer(DataConfig(**data), 1,
                                       vocab_size=data.get("vocab_size")).vocab_size)
    except Exception:  # noqa: BLE001 - vocabulary files not on this machine: fall back
        pass
    return int(data["vocab_size"]) if data.get("vocab_size") else None


def check_true_vocab(value: Optional[int], rows: int, config: Optional[dict],
                     flag: str = "--true-vocab-size") -> None:
    """``value`` (``flag``, given by the user) is a vocabulary the checkpoint can have: 1 to
    its ``rows`` embedding rows, and the size of the tokenizer ``config`` records where
    that loads here (the option is for tokenizer files that are not on this machine)."""
    if value is None:
        return
    if not 1 <= value <= rows:
        raise UserError(f"{flag} {value}: expected 1 to {rows} (the rows of the checkpoint's "
                        f"word embedding, padding included)")
    found = true_vocab_size(config)
    if found is not None and found != value:
        kind = ((config or {}).get("data") or {}).get("tokenizer_type")
        raise UserError(f"{flag} {value}: the checkpoint's recorded tokenizer ({kind}) has "
                        f"{found} tokens here; leave {flag} out")


def target_padded_vocab(state_rows: int, config: Optional[dict], tp: int,
                        true_vocab: Optional[int]) -> int:
    """Padded vocabulary rows for tensor size ``tp``: Megatron pads to a multiple of
    make_vocab_size_divisible_by * tp, so the table may grow or shrink with tp."""
    from megatron.tokenizer import vocab_size_with_padding

    divisible = int(((config or {}).get("data") or {}).get("make_vocab_size_divisible_by")
                    or 128)
    return vocab_size_with_padding(true_vocab or state_rows, divisible, tp)


def divisor_keeping(rows: int, real: Optional[int], config: dict, src_tp: int,
                     tp: int) -> Optional[int]:
    """A --make-vocab-size-divisible-by that pads to ``rows`` at tensor size ``tp``
    (the source's unit scaled by src_tp / tp when that works), or None."""
    from megatron.tokenizer import vocab_size_with_padding

    unit = int(((config or {}).get("data") or {}).get("make_vocab_size_divisible_by") or 128)
    candidates = [unit * src_tp // tp] if (unit * src_tp) % tp == 0 else []
    candidates += [d for d in (64, 32, 16, 8, 4, 2, 1) if d not in candidates]
    for d in candidates:
        if d >= 1 and vocab_size_with_padding(real or rows, d, tp) == rows:
            return d
    return None


def _fit_rows(tensor: torch.Tensor, rows: int, real: Optional[int]) -> torch.Tensor:
    """Cut or extend the vocabulary rows to ``rows``.

    New rows copy the source's last PADDING row when it has one: padding rows are never
    an input and only ever pushed down as outputs, so a copy keeps the new logits as
    unlikely as the old padding ones (a zero row would give logit 0, which can be a
    likely token).  Its optimizer moments are copied alike.  Without padding rows in the
    source, new rows are the mean row: its logit is the mean of the real ones, so each
    new row adds at most 1/have of the softmax mass (Jensen), where a zero row's logit 0
    can outweigh every real token of a model whose logits are negative (GPT-2's)."""
    have = tensor.shape[0]
    if have >= rows:
        return tensor if have == rows else tensor[:rows].clone()
    shape = (rows - have,) + tuple(tensor.shape[1:])
    if real is not None and real < have:
        extra = tensor[-1:].expand(shape).clone()
    else:
        extra = tensor.double().mean(0, keepdim=True).to(tensor.dtype).expand(shape)
    return torch.cat([tensor, extra], 0)


def repad_rows(full: Dict[str, torch.Tensor], rows: int, real: Optional[int] = None
           ) -> Dict[str, torch.Tensor]:
    """Vocabulary tables (and their optimizer state) fitted to ``rows`` padded rows;
    ``real``: the unpadded vocabulary size (None: unknown)."""
    return {k: (_fit_rows(v, rows, real) if is_vocab(k) and v.dim() > 0 else v)
            for k, v in full.items()}


def _split(full: Dict[str, torch.Tensor], targets, offset: int, t: int, tp: int,
           model_cfg: Optional[Dict[str, Any]] = None) -> Dict[str, torch.Tensor]:
    """Tensor rank ``t``'s part of one stage; ``model_cfg`` (the checkpoint's
    config["model"]) tells which tensors split in sections (SwiGLU's [gate; up])."""
    sub = {n: spec for n, spec in targets.items()
           if to_global(n, offset) in full or n == OUTPUT_EMBEDDING_COPY}
    strides = {n: partition_stride_by_name(to_global(n, offset), model_cfg) for n in sub}
    state, missing = split_for_stage(full, sub, layer_offset=offset, tp_rank=t, tp_size=tp,
                                     strides={n: s for n, s in strides.items() if s > 1})
    if missing:
        raise CheckpointError(f"cannot place {missing[:4]} in the target layout")
    return state


def _stage_optimizer(opt: FullOptimizer, targets, offset: int, t: int, tp: int,
                     rows: int, real: Optional[int] = None,
                     model_cfg: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A ``MegatronOptimizer.state_dict()`` for one (tensor rank, stage) of the target;
    moments and master weights are cut exactly like their parameters (``model_cfg``:
    SwiGLU's stride)."""
    names = list(targets)
    shapes = [tuple(targets[n][0]) for n in names]
    order = _decay_order(shapes)
    quantities = {q: _split(repad_rows(full, rows, real), targets, offset, t, tp, model_cfg)
                  for q, full in opt.tensors.items()}
    state: Dict[int, Dict[str, Any]] = {}
    for pos, i in enumerate(order):
        name = names[i]
        gname = to_global(name, offset)
        if name == OUTPUT_EMBEDDING_COPY and gname not in opt.scalars:
            gname = WORD_EMBEDDING
        entry = {k: (v.clone() if torch.is_tensor(v) else v)
                 for k, v in opt.scalars.get(gname, {}).items()}
        for q, by_name in quantities.items():
            if name in by_name:
                entry[q] = by_name[name]
        if entry:
            state[pos] = entry
    n_decay = sum(1 for s in shapes if len(s) >= 2)
    groups = []
    for kind, positions in (("decay", range(n_decay)), ("no_decay", range(n_decay, len(names)))):
        if len(positions):
            if kind not in opt.groups:
                raise CheckpointError(f"the source optimizer has no {kind} parameter group "
                                      f"to copy hyper-parameters from")
            groups.append(dict(opt.groups[kind], params=list(positions)))
    masters = None
    if opt.masters is not None:
        split = _split(repad_rows(opt.masters, rows, real), targets, offset, t, tp, model_cfg)
        masters = [split[n] for n in names]
    return {"meta": {"optimizer": opt.name, "num_params": len(names),
                     "shapes": [list(s) for s in shapes], "fp32_masters": masters is not None},
            "optimizer": {"state": state, "param_groups": groups},
            "fp32_masters": masters, "grad_scaler": opt.grad_scaler,
            "weight_prediction": opt.weight_prediction}


def check_outside(load: Optional[str], out: str, load_flag: str = "--load",
                  out_flag: str = "--save") -> None:
    """``out`` must not be ``load`` or inside it: a failed rewrite would mix old and new
    files in the only copy of the source.  The flags name what the user passed."""
    if load is None:
        return
    src, dst = os.path.realpath(load), os.path.realpath(out)
    if dst == src or dst.startswith(src.rstrip(os.sep) + os.sep):
        raise UserError(f"{out_flag} {out}: expected a directory outside {load_flag} {load}, "
                        f"found {'the same directory' if dst == src else 'a directory inside it'}")


def check_not_a_file(flag: str, path: str) -> None:
    """A directory will be created at ``path``: a file there, or a file where one of its
    parents should be, is one error now rather than an OSError traceback later."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file; expected a directory (new or empty) to "
                        f"write into")
    check_parents_are_directories(flag, path)


def _checkpoints_in(root: str) -> Optional[str]:
    """What ``root`` holds that a converted checkpoint would replace (final iteration
    directories, the tracker, iterations a crashed save moved aside), or None."""
    found = existing_checkpoints(root)
    if found is None and os.path.isdir(root):
        aside = sorted(glob.glob(os.path.join(glob.escape(root), "iter_*.old.*")))
        if aside:
            found = (f"an iteration directory a crashed save moved aside, "
                     f"{os.path.basename(aside[0])}")
    return found


def check_save_path(load: Optional[str], save: str, *, load_flag: str = "--load",
                    save_flag: str = "--save") -> None:
    """Where a converted checkpoint may go: outside ``load`` (``load_flag`` names it:
    --load, --from-hf), not a file, and holding no checkpoint.  As the trainer refuses a
    new run's --save holding another run's checkpoints: writing there would replace an
    ``iter_N`` of the same number and move its tracker back to this iteration."""
    check_outside(load, save, load_flag, save_flag)
    check_not_a_file(save_flag, save)
    found = _checkpoints_in(save)
    if found is not None:
        raise UserError(f"{save_flag} {save} already holds checkpoints ({found}); writing the "
                        f"converted checkpoint there would replace them and move {TRACKER}: "
                        f"choose a new or empty {save_flag} directory")


def _write_atomically(save: str, iteration: int, write_files) -> str:
    """Write one iteration into ``iter_X.tmp`` and rename it into place; the tracker file
    is rewritten last, so a crash leaves ``save`` as it was.  (Training saves do the
    same; see megatron/checkpointing.py.)"""
    os.makedirs(save, exist_ok=True)
    final = iteration_dir(save, iteration)
    staging = final + ".tmp"
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    try:
        write_files(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written stays in --save
        raise
    aside = None
    if os.path.exists(final):
        aside = f"{final}.old.{os.getpid()}"
        os.replace(final, aside)
    os.replace(staging, final)
    tmp = os.path.join(save, f"{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(str(iteration))
    os.replace(tmp, os.path.join(save, TRACKER))
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def source_stage_counts(state: FullState) -> List[int]:
    """Layers of each stage of the checkpoint ``state`` was read from."""
    num_layers, pp = state.ckpt.num_layers, state.layout[1]
    offsets = list(getattr(state.ckpt, "stage_offsets", None) or [])
    if len(offsets) != pp:
        return [num_layers // pp] * pp
    return [b - a for a, b in zip(offsets, offsets[1:] + [num_layers])]


def split_flags(counts: Sequence[int]) -> Tuple[Optional[int], Optional[int]]:
    """(--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers) that
    give the stage split ``counts`` (None where a stage has the even share)."""
    counts = list(counts)
    if len(set(counts)) <= 1:
        return None, None
    if len(counts) == 2:
        return counts[0], None
    middle = counts[1]
    return (counts[0] if counts[0] != middle else None,
            counts[-1] if counts[-1] != middle else None)


def recorded_split(counts: Sequence[int], first: Optional[int], last: Optional[int]
                   ) -> Tuple[Optional[int], Optional[int]]:
    """The --decoder-first/last-pipeline-num-layers a checkpoint of stage split ``counts``
    records: those asked for (``first``/``last``), else ones that give ``counts``; none
    for an even split."""
    if len(set(counts)) == 1 or (first is None and last is None):
        return split_flags(counts)
    return first, last


def target_stage_counts(state: FullState, pp: int, first: Optional[int] = None,
                        last: Optional[int] = None) -> List[int]:
    """Layers of each stage of the written checkpoint: ``first``/``last`` as the trainer's
    --decoder-first/last-pipeline-num-layers; without them the source's split when the
    stage count is unchanged (an uneven split stays uneven), else an even one."""
    from megatron.model.utils import stage_layer_counts

    num_layers = state.ckpt.num_layers
    if first is None and last is None and pp == state.layout[1]:
        return source_stage_counts(state)
    try:
        return stage_layer_counts(num_layers, pp, first, last)
    except ValueError as exc:
        msg = (str(exc).replace("--decoder-", "--target-decoder-")
               .replace("--pipeline-model-parallel-size", "--target-pipeline-parallel-size")
               .replace("--num-layers", "the checkpoint's num_layers"))
        raise UserError(msg) from None


def write_layout(state: FullState, save: str, tp: int, pp: int, dp: Optional[int] = None,
                 *, true_vocab: Optional[int] = None, source: Optional[str] = None,
                 allow_unsafe: bool = False, divisible_by: Optional[int] = None,
                 first: Optional[int] = None, last: Optional[int] = None,
                 vocab_flag: Optional[str] = None) -> str:
    """Write ``state`` as a checkpoint for (tp, pp, dp) under ``save``.

    ``vocab_flag``: the option ``true_vocab`` came from, when a user gave it (it is then
    checked against the checkpoint, ``check_true_vocab``).

    Stage split: ``first``/``last`` layers on the first/last stage, as the trainer's
    --decoder-first/last-pipeline-num-layers (``target_stage_counts``).

    RNG files: a rank whose (tensor rank, stage) position and data-parallel rank exist
    in the source with the same t and d gets its own RNG state back; every other rank
    gets none and keeps the streams ``--seed`` gives it (the RNG state of one layout
    does not describe another: dropout masks are drawn per rank and per slice).
    """
    check_save_path(None, save)  # before any note or file: never over another checkpoint
    num_layers = state.ckpt.num_layers
    counts = target_stage_counts(state, pp, first, last)
    src_t, src_p, src_w = state.layout
    dp = dp or src_w
    config = _config_copy(state.common.get("config"))
    if vocab_flag and WORD_EMBEDDING in state.model:
        check_true_vocab(true_vocab, state.model[WORD_EMBEDDING].shape[0], config, vocab_flag)
    if divisible_by:  # the resumed run's --make-vocab-size-divisible-by
        config["data"] = dict(config.get("data") or {}, make_vocab_size_divisible_by=divisible_by)
    _check_tensor_split(config, tp)
    model_cfg = model_config_of(config)
    real = true_vocab_size(config, true_vocab)
    rows = (target_padded_vocab(state.model[WORD_EMBEDDING].shape[0], config, tp, real)
            if WORD_EMBEDDING in state.model else None)
    for stage in range(pp):  # every weight splits by tp: fail before any note or file
        _name_targets(state.model, num_layers, tp, pp, stage, rows, counts, model_cfg)
    if rows is not None and rows != state.model[WORD_EMBEDDING].shape[0]:
        have = state.model[WORD_EMBEDDING].shape[0]
        keep = divisor_keeping(have, real, config, src_t, tp)
        hint = (f"; --make-vocab-size-divisible-by {keep} (here and in the resumed run) "
                f"keeps {have} rows and exact losses" if keep else "")
        print(f"checkpoint_util.py: note: padded vocabulary {have} -> {rows} rows for "
              f"tensor size {tp} (real vocabulary: {real or 'unknown: --true-vocab-size'})"
              f"{hint}", file=sys.stderr)
    if config:
        config = dict(config)
        first_layers, last_layers = recorded_split(counts, first, last)
        config["parallel"] = dict(config.get("parallel") or {}, tensor_model_parallel_size=tp,
                                  pipeline_model_parallel_size=pp, world_size=tp * pp * dp,
                                  decoder_first_pipeline_num_layers=first_layers,
                                  decoder_last_pipeline_num_layers=last_layers)
        if rows is not None:
            config["model"] = dict(config.get("model") or {}, padded_vocab_size=rows)
    model = repad_rows(state.model, rows, real) if rows else state.model
    shadow = (repad_rows(state.shadow, rows, real) if rows and state.shadow is not None
              else state.shadow)
    same_grid = (src_t, src_p) == (tp, pp) and bool(state.ckpt.dirs)

    def write_files(staging: str) -> None:
        for stage in range(pp):
            targets, offset = _name_targets(model, num_layers, tp, pp, stage, rows, counts,
                                            model_cfg)
            for t in range(tp):
                payload = dict(state.common)
                payload.update({
                    "checkpoint_version": CHECKPOINT_VERSION, "iteration": state.iteration,
                    "layout": {"tensor": tp, "pipeline": pp, "data": dp,
                               "layers": [offset, offset + counts[stage]]},
                    "model": _split(model, targets, offset, t, tp, model_cfg),
                    "model_shadow": (_split(shadow, targets, offset, t, tp, model_cfg)
                                     if shadow is not None else None),
                    "optimizer": (_stage_optimizer(state.optimizer, targets, offset, t, tp,
                                                   rows or 0, real, model_cfg)
                                  if state.optimizer is not None else None),
                    "config": config})
                if source:
                    payload["converted_from"] = source
                out_dir = megatron_rank_dir(staging, t, stage, pp)
                os.makedirs(out_dir, exist_ok=True)
                save_payload(payload, os.path.join(out_dir, MODEL_FILE))
                if same_grid:
                    src_dir = state.ckpt.dirs[(t, stage)]
                    for d in range(min(dp, src_w)):
                        stem = os.path.join(src_dir, f"rng_dp_{d:03d}")
                        if payload_exists(stem):
                            save_payload(load_stage_payload(stem, allow_unsafe),
                                         os.path.join(out_dir, f"rng_dp_{d:03d}"))

    def write_all(staging: str) -> None:
        write_files(staging)
        if write_manifest is not None:
            write_manifest(staging, state.iteration, {"tensor": tp, "pipeline": pp, "data": dp})

    try:
        return _write_atomically(save, state.iteration, write_all)
    except CheckpointError as exc:  # a tensor that does not fit: say which checkpoint
        if source is None or source in str(exc):
            raise
        raise CheckpointError(f"converting {source}: {exc}") from None


def _config_copy(config: Any) -> dict:
    """A shallow copy of the run config stored in the checkpoint ({} when absent)."""
    return dict(config) if isinstance(config, dict) else {}


def convert(load: str, save: str, tp: int, pp: int, iteration: Optional[int] = None,
            dp: Optional[int] = None, true_vocab: Optional[int] = None,
            allow_unsafe: bool = False, first: Optional[int] = None,
            last: Optional[int] = None) -> str:
    """Rewrite checkpoint ``load`` (full state) for layout (tp, pp, dp) under ``save``;
    ``first``/``last``: the stage split (see ``write_layout``)."""
    check_save_path(load, save)
    state = read_full_state(load, iteration, allow_unsafe=allow_unsafe)
    return write_layout(state, save, tp, pp, dp, true_vocab=true_vocab,
                        source=os.path.abspath(load), allow_unsafe=allow_unsafe,
                        first=first, last=last)


def refuse_unknown_model_options(model_cfg: Dict[str, Any], known: Any, flag: str,
                                 consequence: str) -> None:
    """Refuse a recorded model option an exporter does not know (not in ``known``)
    unless it has ``ModelConfig``'s default, or, for a key ``ModelConfig`` lacks too (a
    newer trainer's), unless it is null or false.  A block option added to the trainer
    then stops the export until it is mapped there, instead of being dropped from a
    model that would load and silently compute something else (``consequence``)."""
    from megatron.config import ModelConfig

    defaults = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
    for key, value in model_cfg.items():
        if key in known:
            continue
        if (value == defaults[key]) if key in defaults else value in (None, False):
            continue
        shown = "" if key not in defaults else f" (default {defaults[key]!r})"
        raise UserError(f"{flag}: the checkpoint's config records {key}={value!r}{shown}, "
                        f"a model option this export does not know how to write; "
                        f"{consequence}, so it cannot be exported")

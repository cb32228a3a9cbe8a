"""Validation of the parsed command line (``megatron.arguments`` parses it and turns it
into configs).

``validate_args`` runs before ``torch.distributed`` is initialised, identically on every
rank, so a bad command line makes every rank exit at once with the same one-line
message (an ``ArgumentError`` naming the flags) instead of leaving some ranks waiting in
a collective.  It also fills the values derived from others (data-parallel size, global
batch, iterations from samples, a checkpoint's recorded arguments).
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import socket
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Union

import torch

from megatron import megatron_lm_flags
from megatron.config import GRAD_DTYPE_SUPPORTED, SPLIT_PATH_FLAGS
from megatron.data.dataset_utils import is_number  # what --data-path reads as a weight
from megatron.errors import UserError


class ArgumentError(UserError, ValueError):
    """An inconsistent or incomplete command line; the message names the flag(s)."""

    every_rank_alike = True


# ------------------------------------------------------------------------ validation
# Each validator checks one concern, fills the derived values it owns, and raises
# ArgumentError on the first problem.  Their order matters: later ones use values
# derived by earlier ones (data-parallel size, global batch, train iterations).

def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ArgumentError(message)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _require_positive(args: argparse.Namespace, *dests: str, allow_none: bool = True) -> None:
    for dest in dests:
        value = getattr(args, dest)
        if value is None and allow_none:
            continue
        _require(value is not None and value > 0,
                 f"{_flag(dest)} must be a positive number, got {value}")


def _check_required(args: argparse.Namespace) -> None:
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        _require(getattr(args, dest) is not None, f"{_flag(dest)} is required")
    _require_positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                      "micro_batch_size", "global_batch_size", "ffn_hidden_size",
                      "max_position_embeddings", "make_vocab_size_divisible_by",
                      "init_method_std", "layernorm_epsilon", "train_iters", "train_samples")
    _require(not (args.train_iters is not None and args.train_samples is not None),
             "--train-iters and --train-samples are mutually exclusive; give one")
    if not args.skip_train:
        _require(args.train_iters is not None or args.train_samples is not None,
                 "exactly one of --train-iters or --train-samples is required (or --skip-train)")
        _require(args.lr is not None, "--lr is required for training (or --skip-train)")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default MLP width: 4h, or with SwiGLU (three matrices instead of
    two) 2/3 of that, rounded down to a multiple of 64, for about the same parameters."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def _check_model(args: argparse.Namespace) -> None:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length ({args.seq_length}) must be <= --max-position-embeddings "
             f"({args.max_position_embeddings})")
    if args.kv_channels is None:
        _require(args.hidden_size % args.num_attention_heads == 0,
                 f"--hidden-size ({args.hidden_size}) must be divisible by "
                 f"--num-attention-heads ({args.num_attention_heads}), or give --kv-channels")
    else:
        _require(args.kv_channels >= 1, f"--kv-channels must be >= 1, got {args.kv_channels}")
    for dest in ("hidden_dropout", "attention_dropout"):
        p = getattr(args, dest)
        _require(0.0 <= p < 1.0, f"{_flag(dest)} must be in [0, 1), got {p}")
    _check_architecture(args)


def _check_architecture(args: argparse.Namespace) -> None:
    """The Llama-style block options (RoPE, GQA, ...) and what they need."""
    rope = args.position_embedding_type == "rope"
    _require(rope or not args.no_position_embedding,
             "--no-position-embedding: a model without any position information is not "
             "built here; use --position-embedding-type rope (which has no position table)")
    if args.group_query_attention:
        g, a = args.num_query_groups, args.num_attention_heads
        _require(g >= 1 and a % g == 0,
                 f"--num-query-groups ({g}) must divide --num-attention-heads ({a})")
        args.query_groups = g
    else:
        args.query_groups = args.num_attention_heads
    if rope:
        _require(0.0 < args.rotary_percent <= 1.0,
                 f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
        head = args.kv_channels or args.hidden_size // args.num_attention_heads
        _require(int(head * args.rotary_percent) >= 2,
                 f"--rotary-percent {args.rotary_percent} of the head size {head} "
                 f"(--kv-channels, or --hidden-size / --num-attention-heads) leaves fewer "
                 f"than 2 dimensions to rotate")
        _require(args.rotary_base > 0, f"--rotary-base must be positive, got {args.rotary_base}")
    if args.rope_scaling:
        _require(rope, "--use-rope-scaling needs --position-embedding-type rope")
        _require(args.rope_scaling_factor >= 1.0,
                 f"--rope-scaling-factor must be >= 1, got {args.rope_scaling_factor}")
    _require(rope or not args.rotary_interleaved,
             "--rotary-interleaved needs --position-embedding-type rope")
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None:
        _require(rope, "--rotary-seq-len-interpolation-factor needs "
                       "--position-embedding-type rope")
        _require(math.isfinite(factor) and factor >= 1.0,
                 f"--rotary-seq-len-interpolation-factor must be >= 1 (how many times "
                 f"longer the context is stretched), got {factor}")
    given = [flag for flag, on in (("--squared-relu", args.squared_relu),
                                   ("--swiglu", args.swiglu),
                                   ("--openai-gelu", args.openai_gelu)) if on]
    _require(len(given) < 2,
             f"{' and '.join(given)} are {'two' if len(given) == 2 else 'three'} MLP "
             f"activations: give one of them")


def _check_parallel(args: argparse.Namespace, world_size: int) -> None:
    _require(isinstance(world_size, int) and world_size >= 1,
             f"world size (WORLD_SIZE) must be a positive integer, got {world_size!r}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
    _require(pp >= 1, f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    _require(world_size % (tp * pp) == 0,
             f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) "
             f"x --pipeline-model-parallel-size ({pp}) = {tp * pp}")
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    from megatron.model.utils import stage_layer_counts
    try:
        counts = stage_layer_counts(args.num_layers, pp, args.decoder_first_pipeline_num_layers,
                                    args.decoder_last_pipeline_num_layers)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    args.stage_layer_counts = counts
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if tp == 1 and args.sequence_parallel:
        # nothing to split; Megatron-LM disables it too, with a warning
        args.sequence_parallel = False
        args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
            "note: --sequence-parallel changes nothing with --tensor-model-parallel-size 1 "
            "(it splits sequences over the tensor-parallel ranks)"]
    if args.sequence_parallel:
        _require(args.seq_length % tp == 0,
                 f"--sequence-parallel splits each sequence over the {tp} tensor ranks: "
                 f"--seq-length ({args.seq_length}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp})")
    if args.group_query_attention:
        _require(args.num_query_groups % tp == 0,
                 f"--num-query-groups ({args.num_query_groups}) must be divisible by "
                 f"--tensor-model-parallel-size ({tp}): each rank holds whole key/value heads")
    _require(args.measure_memory_interval >= 0,
             f"--measure-memory-interval must be >= 0, got {args.measure_memory_interval}")
    _require(args.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    if args.distributed_backend == "nccl":
        _require(torch.cuda.is_available(),
                 "--distributed-backend nccl needs CUDA, but no CUDA device is available; "
                 "use --distributed-backend gloo (or leave it unset)")
    _check_local_gpus(args)


def _check_local_gpus(args: argparse.Namespace) -> None:
    """More nccl ranks on this node than GPUs: stop here, before any process group."""
    from megatron.initialize import check_gpus_for_local_ranks, resolve_backend

    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        local_world_size = int(raw)
    except ValueError:
        raise ArgumentError(f"environment variable LOCAL_WORLD_SIZE must be an integer, "
                            f"got '{raw}'") from None
    cuda = torch.cuda.is_available()
    check_gpus_for_local_ranks(resolve_backend(args.distributed_backend, None),
                               local_world_size, torch.cuda.device_count() if cuda else 0)


def _check_batches(args: argparse.Namespace) -> None:
    mbs, dp, pp = args.micro_batch_size, args.data_parallel_size, args.pipeline_model_parallel_size
    schedule = _batch_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    _require(gbs % (mbs * dp) == 0,
             f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size ({mbs}) "
             f"x data-parallel size ({dp}) = {mbs * dp}")
    args.num_microbatches = gbs // (mbs * dp)
    m = args.num_microbatches
    _require(args.tbw_mitigation == "none" or args.pipeline_schedule == "2bw",
             f"--2bw-mitigation {args.tbw_mitigation} needs --pipeline-schedule 2bw, got "
             f"--pipeline-schedule {args.pipeline_schedule}")
    _require(not args.overlap_param_gather or args.use_distributed_optimizer,
             "--overlap-param-gather overlaps the distributed optimizer's weight all-gathers: "
             "it needs --use-distributed-optimizer")
    _require(args.ddp_bucket_size is None or args.ddp_bucket_size >= 1,
             f"--ddp-bucket-size must be a positive number of parameters, got "
             f"{args.ddp_bucket_size}")
    _require(not (args.use_distributed_optimizer and args.tbw_mitigation == "predict"),
             "--2bw-mitigation predict needs every parameter's optimizer state on every rank: "
             "it cannot run with --use-distributed-optimizer")
    if args.pipeline_schedule == "2bw":
        _require(m >= pp,
                 f"PipeDream-2BW needs m >= d: --global-batch-size ({gbs}) / (--micro-batch-size "
                 f"({mbs}) x data-parallel size ({dp})) = {m} microbatches, fewer than "
                 f"--pipeline-model-parallel-size ({pp}); raise --global-batch-size to at least "
                 f"{pp * mbs * dp}")
    if schedule is not None:
        _check_schedule(args, schedule, mbs, dp, pp)
    if args.train_samples is not None:
        first = schedule.batch_size_at(0) if schedule is not None else gbs
        _require(args.train_samples >= first,
                 f"--train-samples ({args.train_samples}) must be >= "
                 + (f"the first batch of {schedule.source} ({first})" if schedule is not None
                    else f"--global-batch-size ({gbs})"))
        args.train_iters = (schedule.iterations(args.train_samples) if schedule is not None
                            else args.train_samples // gbs)
    if args.tbw_flush_warmup_iters is None:  # after --train-samples set train_iters
        args.tbw_flush_warmup_iters = (args.train_iters or 0) // 2
    _require(args.tbw_flush_warmup_iters >= 0,
             f"--2bw-flush-warmup-iters must be >= 0, got {args.tbw_flush_warmup_iters}")


def _batch_schedule(args: argparse.Namespace):
    """--rampup-batch-size or --step-batch-size-schedule as a BatchSchedule (None: the
    batch is --global-batch-size throughout).  A step schedule's last batch becomes the
    global batch size."""
    from megatron.batch_schedule import BatchSchedule, BatchScheduleError

    ramp, steps = args.rampup_batch_size, args.step_batch_size_schedule
    if ramp is None and steps is None:
        return None
    _require(ramp is None or steps is None,
             "--rampup-batch-size and --step-batch-size-schedule are mutually exclusive")
    try:
        if steps is not None:
            schedule = BatchSchedule.parse(steps, args.seq_length)
            if args.global_batch_size not in (None, schedule.final_batch_size):
                args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
                    f"note: --global-batch-size {args.global_batch_size} is replaced by the last "
                    f"batch of --step-batch-size-schedule, {schedule.final_batch_size}"]
            args.global_batch_size = schedule.final_batch_size
        else:
            _require(args.global_batch_size is not None,
                     "--rampup-batch-size needs --global-batch-size (the batch it ramps up to)")
            schedule = BatchSchedule.from_rampup(ramp, args.global_batch_size)
    except BatchScheduleError as exc:
        raise ArgumentError(str(exc)) from None
    return schedule


def _check_schedule(args: argparse.Namespace, schedule, mbs: int, dp: int, pp: int) -> None:
    from megatron.batch_schedule import BatchScheduleError

    flag = schedule.source.split(" ")[0]
    # --train-samples: the length of training and of the LR schedule are counted in
    # samples, where an iteration count would mean a different amount for each batch
    # size (Megatron-LM allows only this).  --train-iters (as Megatron-LM's GPT-3 script
    # writes it, which Megatron-LM itself refuses): that many iterations, each of its
    # own size, and the LR schedule counted in iterations.
    if args.train_samples is not None:
        for dest, instead in (("lr_decay_iters", "--lr-decay-samples"),
                              ("lr_warmup_iters", "--lr-warmup-samples or --lr-warmup-fraction")):
            _require(getattr(args, dest) is None,
                     f"{_flag(dest)} counts iterations, whose size changes under {flag}, and "
                     f"--train-samples counts samples; give {instead}")
    else:
        for dest in ("lr_decay_samples", "lr_warmup_samples"):
            _require(getattr(args, dest) is None,
                     f"{_flag(dest)} counts samples, and --train-iters with {flag} counts the "
                     f"LR schedule in iterations; give {_flag(dest.replace('samples', 'iters'))} "
                     "or train with --train-samples")
    # A fresh run trains every size; a resumed one (--load) only those after the samples
    # its checkpoint consumed, checked once it is read (training.check_batch_schedule).
    try:
        schedule.check(mbs, dp, min_microbatches=pp if args.pipeline_schedule == "2bw" else 1,
                       consumed_samples=0 if args.load is None else schedule.points[-1][0])
    except BatchScheduleError as exc:
        raise ArgumentError(str(exc)) from None
    args.batch_schedule = schedule.points
    args.batch_schedule_source = schedule.source


def _whole_if_integral(x: float) -> Union[int, float]:
    """``x`` as an int when it is a whole number (how schedules print and compare)."""
    return int(x) if float(x).is_integer() else float(x)


def _samples_to_iters(args: argparse.Namespace, samples_dest: str) -> int:
    return math.ceil(getattr(args, samples_dest) / args.global_batch_size)


def _check_precision(args: argparse.Namespace) -> None:
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    _require(not (args.fp64 and (args.fp16 or args.bf16)),
             "--fp64 cannot be combined with --fp16 or --bf16")
    if args.loss_scale is not None:
        _require(args.loss_scale > 0, f"--loss-scale must be positive, got {args.loss_scale}")
        if not (args.fp16 or args.bf16):
            print(f"warning: --loss-scale {args.loss_scale} is ignored: only --fp16 and --bf16 "
                  "runs scale the loss", file=sys.stderr)
    _require_positive(args, "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                      "hysteresis", allow_none=False)
    _require(args.min_loss_scale <= args.initial_loss_scale,
             f"--min-loss-scale ({args.min_loss_scale}) must be <= --initial-loss-scale "
             f"({args.initial_loss_scale})")
    if args.accumulate_allreduce_grads_in_fp32:
        _require(GRAD_DTYPE_SUPPORTED,
                 f"--accumulate-allreduce-grads-in-fp32 needs torch >= 2.10 (Tensor.grad_dtype); "
                 f"this is torch {torch.__version__}")
    elif args.bf16:
        # Megatron-LM: bf16 gradients are accumulated and all-reduced in fp32.  A sum of
        # many microbatches' bf16 gradients in bf16 loses about one part in 100 at
        # m = 64 (bench/grad_accumulation.py).
        if GRAD_DTYPE_SUPPORTED:
            args.accumulate_allreduce_grads_in_fp32 = True
        else:
            print(f"warning: --bf16 gradients accumulate in bf16: fp32 accumulation needs "
                  f"torch >= 2.10 (Tensor.grad_dtype), this is torch {torch.__version__}",
                  file=sys.stderr)
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
            "note: --fp32-residual-connection changes nothing without --fp16/--bf16 (the "
            "residual stream is in the weights' float32 or float64 already)"]
    if args.fp16:
        args.params_dtype = torch.float16
    elif args.bf16:
        args.params_dtype = torch.bfloat16
    elif args.fp64:
        args.params_dtype = torch.float64
    else:
        args.params_dtype = torch.float32


def _check_lr_schedule(args: argparse.Namespace) -> None:
    """Fill lr_decay_iters and lr_warmup_iters, converting sample counts to iterations."""
    _require(not (args.lr_decay_iters is not None and args.lr_decay_samples is not None),
             "--lr-decay-iters and --lr-decay-samples are mutually exclusive")
    _require_positive(args, "lr_decay_iters", "lr_decay_samples")
    decay_iters_given = args.lr_decay_iters is not None
    frac = args.lr_warmup_fraction
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _samples_to_iters(args, "lr_decay_samples")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    given = [f for f in ("lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_samples")
             if getattr(args, f) is not None]
    _require(len(given) <= 1,
             f"{' and '.join(_flag(f) for f in given)} are mutually exclusive; give one warmup flag")
    if args.lr_warmup_fraction is not None:
        frac = args.lr_warmup_fraction
        _require(0.0 <= frac <= 1.0, f"--lr-warmup-fraction must be in [0, 1], got {frac}")
        # (--skip-train takes no step: the schedule is never read, a fraction of nothing is 0)
        _require(args.lr_decay_iters is not None or args.skip_train,
                 "--lr-warmup-fraction needs the LR decay length: give --lr-decay-iters "
                 "(or --train-iters/--train-samples)")
        # not rounded: Megatron-LM counts this warmup in samples, so 0.001 of 400
        # iterations is 0.4 of one (its first step at --lr-warmup-init), not none
        args.lr_warmup_iters = (_whole_if_integral(frac * args.lr_decay_iters)
                                if args.lr_decay_iters is not None else 0)
    elif args.lr_warmup_samples is not None:
        _require(args.lr_warmup_samples >= 0,
                 f"--lr-warmup-samples must be >= 0, got {args.lr_warmup_samples}")
        args.lr_warmup_iters = _samples_to_iters(args, "lr_warmup_samples")
    elif args.lr_warmup_iters is None:
        args.lr_warmup_iters = 0
    _require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    _check_wsd(args)
    _sample_based_schedule(args, decay_iters_given, frac)
    # (a --train-samples run is checked in samples, by _sample_based_schedule)
    if (args.lr_decay_iters is not None and args.lr_decay_style != "constant"
            and args.train_samples is None):
        _require(args.lr_warmup_iters < args.lr_decay_iters,
                 f"LR warmup ({args.lr_warmup_iters} iterations, "
                 f"{_flag(given[0]) if given else '--lr-warmup-iters'}) must be "
                 f"shorter than the LR decay ({args.lr_decay_iters} iterations, --lr-decay-iters "
                 f"or --train-iters) for --lr-decay-style {args.lr_decay_style}")


def _check_wsd(args: argparse.Namespace) -> None:
    """--lr-decay-style WSD anneals over --lr-wsd-decay-iters/-samples, which must fit
    in the decay after warmup; the anneal flags mean nothing to another style."""
    _require(not (args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_samples is not None),
             "--lr-wsd-decay-iters and --lr-wsd-decay-samples are mutually exclusive")
    _require_positive(args, "lr_wsd_decay_iters", "lr_wsd_decay_samples")
    if args.lr_wsd_decay_samples is not None:
        args.lr_wsd_decay_iters = _samples_to_iters(args, "lr_wsd_decay_samples")
    if args.lr_decay_style != "WSD":
        given = [f for f in ("lr_wsd_decay_iters", "lr_wsd_decay_samples")
                 if getattr(args, f) is not None]
        if given:
            args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
                f"note: {_flag(given[-1])} changes nothing with --lr-decay-style "
                f"{args.lr_decay_style} (it is the anneal of --lr-decay-style WSD)"]
        return
    _require(args.lr_wsd_decay_iters is not None,
             "--lr-decay-style WSD needs the length of its anneal: give "
             "--lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    # a --train-samples run checks its anneal in samples (_sample_based_schedule): the
    # iteration counts here are rounded and would refuse an anneal that fits
    if args.lr_decay_iters is not None and args.train_samples is None:
        room = args.lr_decay_iters - args.lr_warmup_iters
        _require(args.lr_wsd_decay_iters <= room,
                 f"--lr-wsd-decay-iters ({args.lr_wsd_decay_iters}) must fit in the decay "
                 f"after warmup: {args.lr_decay_iters} iterations (--lr-decay-iters or "
                 f"--train-iters) - {args.lr_warmup_iters} of warmup = {room}")


def _sample_based_schedule(args: argparse.Namespace, decay_iters_given: bool,
                           frac: Optional[float]) -> None:
    """A --train-samples run counts its LR schedule in samples, as Megatron does: warmup
    and decay stay where the user put them when --global-batch-size changes on resume.
    The iteration values above remain (checks, banner); the samples are what is used."""
    args.lr_schedule_unit = "iterations"
    if args.train_samples is None:
        return
    gbs = args.global_batch_size
    args.lr_schedule_unit = "samples"
    if args.lr_decay_samples is None:
        args.lr_decay_samples = (args.lr_decay_iters * gbs if decay_iters_given
                                 else args.train_samples)
    if frac is not None:
        args.lr_warmup_samples = _whole_if_integral(frac * args.lr_decay_samples)
    elif args.lr_warmup_samples is None:
        args.lr_warmup_samples = args.lr_warmup_iters * gbs
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_samples is None:
        args.lr_wsd_decay_samples = args.lr_wsd_decay_iters * gbs
    if args.lr_decay_style == "WSD":
        room = args.lr_decay_samples - args.lr_warmup_samples
        _require(args.lr_wsd_decay_samples <= room,
                 f"the WSD anneal ({args.lr_wsd_decay_samples} samples, "
                 f"--lr-wsd-decay-samples/-iters) must fit in the decay after warmup: "
                 f"{room} samples")
    if args.lr_decay_style != "constant":
        _require(args.lr_warmup_samples < args.lr_decay_samples,
                 f"LR warmup ({args.lr_warmup_samples} samples) must be shorter than the LR "
                 f"decay ({args.lr_decay_samples} samples, --lr-decay-samples or "
                 f"--train-samples) for --lr-decay-style {args.lr_decay_style}")


def _check_decoupled_lr(args: argparse.Namespace) -> None:
    """--decoupled-lr and its floor: non-negative, floor <= peak, no floor alone."""
    peak, floor = args.decoupled_lr, args.decoupled_min_lr
    _require(floor is None or peak is not None,
             "--decoupled-min-lr needs --decoupled-lr (the input and output layers follow "
             "--lr and --min-lr without it)")
    if peak is None:
        return
    _require(peak >= 0, f"--decoupled-lr must be >= 0, got {peak}")
    if floor is None:
        _require(args.min_lr <= peak,
                 f"--decoupled-lr ({peak}) must be >= its floor, --min-lr ({args.min_lr}) "
                 "when --decoupled-min-lr is not given")
        return
    _require(floor >= 0, f"--decoupled-min-lr must be >= 0, got {floor}")
    _require(floor <= peak,
             f"--decoupled-min-lr ({floor}) must be <= --decoupled-lr ({peak})")


def _check_weight_decay_incr(args: argparse.Namespace) -> None:
    """Megatron-LM's weight-decay ramp: constant keeps --weight-decay (start and end, if
    given, must equal it); linear and cosine need 0 <= start <= end, and ramp over the
    run (--train-iters or --train-samples, one of which _check_required demands)."""
    style, start, end = (args.weight_decay_incr_style, args.start_weight_decay,
                         args.end_weight_decay)
    if style == "constant":
        for dest, value in (("start_weight_decay", start), ("end_weight_decay", end)):
            _require(value is None or value == args.weight_decay,
                     f"{_flag(dest)} ({value}) must equal --weight-decay ({args.weight_decay}) "
                     "with --weight-decay-incr-style constant; give --weight-decay-incr-style "
                     "linear or cosine for a weight decay that changes during training")
        return
    missing = [_flag(d) for d, v in (("start_weight_decay", start), ("end_weight_decay", end))
               if v is None]
    _require(not missing, f"--weight-decay-incr-style {style} needs {' and '.join(missing)} "
                          "(the weight decay at the start and at the end of the run)")
    _require(start >= 0, f"--start-weight-decay must be >= 0, got {start}")
    _require(start <= end, f"--start-weight-decay ({start}) must be <= --end-weight-decay "
                           f"({end}) with --weight-decay-incr-style {style} (the weight decay "
                           "rises over the run)")


def _check_optimizer(args: argparse.Namespace) -> None:
    if args.lr is None:  # only reachable with --skip-train: no step is ever taken
        args.lr = 0.0
    _require(args.lr >= 0, f"--lr must be >= 0, got {args.lr}")
    _require(args.min_lr >= 0, f"--min-lr must be >= 0, got {args.min_lr}")
    _require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    _require(0 <= args.lr_warmup_init <= args.lr,
             f"--lr-warmup-init must be in [0, --lr ({args.lr})], got {args.lr_warmup_init}")
    _check_decoupled_lr(args)
    _require(args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}")
    _check_weight_decay_incr(args)
    _require(args.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {args.clip_grad}")
    for dest in ("adam_beta1", "adam_beta2", "sgd_momentum"):
        v = getattr(args, dest)
        _require(0.0 <= v < 1.0, f"{_flag(dest)} must be in [0, 1), got {v}")
    _require(args.adam_eps > 0, f"--adam-eps must be positive, got {args.adam_eps}")
    # the GPT and BERT datasets shuffle with numpy's RandomState(--seed), which takes
    # [0, 2^32 - 1]; outside it the run failed with a traceback while building them
    _require(0 <= args.seed < 2 ** 32,
             f"--seed must be between 0 and 2^32 - 1 = {2 ** 32 - 1}, got {args.seed}")
    _check_lr_schedule(args)


def _data_prefixes(data_path: Sequence[str], flag: str = "--data-path") -> List[str]:
    """Prefixes named by --data-path (or ``flag``, a per-split path flag), checking the
    weighted 'w1 p1 w2 p2' form."""
    if not any(is_number(item) for item in data_path):
        return list(data_path)
    _require(len(data_path) % 2 == 0,
             f"{flag} in weighted form must alternate weight and prefix "
             f"('0.3 a 0.7 b'), got {len(data_path)} entries: {' '.join(data_path)}")
    prefixes = []
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        _require(is_number(weight) and not is_number(prefix),
                 f"{flag} in weighted form must alternate weight and prefix "
                 f"('0.3 a 0.7 b'), got '{weight} {prefix}'")
        _require(float(weight) > 0 and math.isfinite(float(weight)),
                 f"{flag} weights must be positive, got {weight} for {prefix}")
        prefixes.append(prefix)
    return prefixes


def _parse_split(split: str) -> List[float]:
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    _require(1 <= len(parts) <= 3 and all(is_number(p) for p in parts),
             f"--split must be up to three numbers 'train, valid, test' (e.g. '969, 30, 1'), "
             f"got '{split}'")
    values = [float(p) for p in parts]
    _require(all(v >= 0 for v in values) and sum(values) > 0,
             f"--split parts must be >= 0 with a positive sum, got '{split}'")
    return values


def _check_data(args: argparse.Namespace) -> None:
    _require(args.num_workers >= 0, f"--num-workers must be >= 0, got {args.num_workers}")
    _require(args.data_path != [], "--data-path was given without any prefix")
    paths = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in
             ("--data-path",) + SPLIT_PATH_FLAGS}
    per_split = [flag for flag in SPLIT_PATH_FLAGS if paths[flag] is not None]
    for flag in per_split:
        _require(paths[flag] != [], f"{flag} was given without any prefix")
    has_paths = bool(args.data_path)
    _require(not (has_paths and args.mock_data), "--data-path and --mock-data are mutually exclusive")
    if per_split:
        # Megatron-LM's per-split datasets replace --data-path and --split
        _require(not has_paths, f"--data-path and {per_split[0]} are mutually exclusive: give "
                 f"one dataset (or blend) split by --split, or one per split with "
                 f"--train-data-path/--valid-data-path/--test-data-path")
        _require(not args.mock_data, f"{per_split[0]} and --mock-data are mutually exclusive")
        _require(args.skip_train or args.train_data_path,
                 f"training needs data: {' and '.join(per_split)} without --train-data-path "
                 f"has no training split; add --train-data-path PREFIX (or --skip-train to "
                 f"only evaluate)")
        if "--split" in getattr(args, "flags_given", set()):
            args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
                f"note: --split '{args.split}' is ignored with {' and '.join(per_split)}: each "
                f"split reads its own datasets whole (as in Megatron-LM)"]
    else:
        _parse_split(args.split)
        if not args.skip_train:
            _require(has_paths or args.mock_data,
                     "training needs data: give --data-path PREFIX (prefix.bin/.idx made by "
                     "tools/preprocess_data.py) or --mock-data")
    for flag in ["--data-path"] + per_split:
        for prefix in _data_prefixes(paths[flag] or [], flag):
            for suffix in (".bin", ".idx"):
                path = Path(prefix + suffix)
                stem, ext = os.path.splitext(prefix)
                hint = (f"; a prefix names the pair without its extension: {flag} {stem}"
                        if ext in (".bin", ".idx") and not path.exists()
                        and Path(stem + suffix).is_file() else "")
                _require(path.is_file(), f"{flag} prefix '{prefix}': file {path} "
                         f"{'is not a regular file' if path.exists() else 'does not exist'}"
                         f"{hint}")


def _require_file(flag: str, path: Optional[str], tokenizer: str) -> None:
    _require(path is not None, f"--tokenizer-type {tokenizer} needs {flag}")
    _require(Path(path).is_file(), f"{flag} {path} does not exist (needed by --tokenizer-type {tokenizer})")


def _check_tokenizer(args: argparse.Namespace, default: Optional[str] = None) -> None:
    # A bare --vocab-size means the synthetic NullTokenizer (handy with --mock-data).
    if args.tokenizer_type is None and args.vocab_size is not None and args.vocab_file is None:
        args.tokenizer_type = "NullTokenizer"
    elif args.tokenizer_type is None and default is not None and (
            args.vocab_file is not None or args.tokenizer_model is not None):
        # Megatron-LM's pretrain_gpt.py / pretrain_bert.py default, which its example
        # scripts rely on (they pass --vocab-file without --tokenizer-type)
        args.tokenizer_type = default
        args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
            f"note: --tokenizer-type {default} (this entry point's default, as in Megatron-LM)"]
    kind = args.tokenizer_type
    if kind is None:
        _require(args.skip_train, "--tokenizer-type is required for training (e.g. "
                 "GPT2BPETokenizer with --vocab-file and --merge-file, or NullTokenizer with "
                 "--vocab-size for --mock-data)")
    elif kind == "GPT2BPETokenizer":
        _require_file("--vocab-file", args.vocab_file, kind)
        _require_file("--merge-file", args.merge_file, kind)
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        _require_file("--tokenizer-model", args.tokenizer_model, kind)
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import is_hub_name

        spec = args.tokenizer_model
        _require(spec is not None, f"--tokenizer-type {kind} needs --tokenizer-model (a "
                 "tokenizer directory save_pretrained wrote, or a model name)")
        _require(Path(spec).is_dir() or is_hub_name(spec),
                 f"--tokenizer-model {spec} is not a directory (needed by --tokenizer-type "
                 f"{kind}: the directory save_pretrained wrote, or a model name)")
        _require(importlib.util.find_spec("transformers") is not None,
                 f"--tokenizer-type {kind} needs the transformers package, which is not "
                 "installed: pip install transformers")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        _require_file("--vocab-file", args.vocab_file, kind)
    elif kind == "NullTokenizer":
        _require(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size")
    elif kind == "CharTokenizer" and args.vocab_file is not None:
        _require_file("--vocab-file", args.vocab_file, kind)
    if args.vocab_size is not None:
        _require(args.vocab_size > 0, f"--vocab-size must be positive, got {args.vocab_size}")


def _check_recompute(args: argparse.Namespace) -> None:
    if args.recompute_activations:
        _require(args.recompute_granularity in (None, "full"),
                 "--recompute-activations means --recompute-granularity full; it conflicts "
                 f"with --recompute-granularity {args.recompute_granularity}")
        _require(args.recompute_method is None,
                 "--recompute-activations (whole-stage recomputation here) cannot be combined "
                 f"with --recompute-method {args.recompute_method} (layer checkpointing, which "
                 "--checkpoint-activations also asks for): keep one of them")
        args.recompute_granularity = "full"
    method, n = args.recompute_method, args.recompute_num_layers
    if args.recompute_granularity == "selective":
        _require(method is None, "--recompute-granularity selective cannot be combined with "
                 "--recompute-method (layer checkpointing needs --recompute-granularity full)")
    if method is not None:
        _require(args.recompute_granularity == "full",
                 f"--recompute-method {method} needs --recompute-granularity full")
        _require(n is not None, f"--recompute-method {method} needs --recompute-num-layers")
    if n is not None:
        _require(method is not None, "--recompute-num-layers needs --recompute-method (uniform or block)")
        per_stage = max(args.stage_layer_counts)
        _require(1 <= n <= per_stage,
                 f"--recompute-num-layers ({n}) must be between 1 and the layers of the "
                 f"largest pipeline stage ({per_stage})")


def _check_megatron_lm_flags(args: argparse.Namespace) -> None:
    """Megatron-LM flags given under two names, or of features not built here, stop the
    run (every refused flag in one line); the ignored and renamed ones become one note
    (``args.megatron_lm_notes``, printed by rank 0 once the command line is valid)."""
    conflicts = getattr(args, "megatron_lm_conflicts", [])
    _require(not conflicts, "conflicting Megatron-LM flags: " + "; ".join(conflicts))
    ignored, refused = megatron_lm_flags.verdicts(args)
    _require(not refused, ("a Megatron-LM flag" if len(refused) == 1 else "Megatron-LM flags")
             + " this trainer does not implement (remove or change; docs/megatron_lm_flags.md): "
             + "; ".join(refused))
    if getattr(args, "launcher_local_rank", None) is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.launcher_local_rank)  # a launcher of old
    notes = getattr(args, "megatron_lm_notes", [])
    if ignored:
        notes.append("note: Megatron-LM flags accepted with no effect here: " + "; ".join(ignored))
    if getattr(args, "recompute_activations", False):
        notes.append("note: --recompute-activations is the paper's whole-stage recomputation "
                     "here; Megatron-LM's means --recompute-granularity selective")
    args.megatron_lm_notes = notes


CHECKPOINT_ARGS = (
    ("model", "num_layers"), ("model", "hidden_size"), ("model", "num_attention_heads"),
    ("model", "ffn_hidden_size"), ("model", "seq_length"), ("model", "max_position_embeddings"),
    ("model", "layernorm_epsilon"), ("model", "openai_gelu"),
    ("model", "normalization"), ("model", "position_embedding_type"), ("model", "rotary_base"),
    ("model", "rotary_percent"), ("model", "rope_scaling"), ("model", "rope_scaling_factor"),
    ("model", "rotary_interleaved"), ("model", "rotary_seq_len_interpolation_factor"),
    ("model", "swiglu"), ("model", "squared_relu"),
    ("model", "apply_residual_connection_post_layernorm"),
    ("model", "qk_layernorm"), ("model", "add_qkv_bias"),
    ("model", "kv_channels"),
    ("model", "untie_embeddings_and_output_weights"),
    ("data", "tokenizer_type"), ("data", "vocab_file"), ("data", "merge_file"),
    ("data", "tokenizer_model"), ("data", "vocab_size"), ("data", "make_vocab_size_divisible_by"),
)
"""(config section, flag dest) that --use-checkpoint-args reads from the checkpoint, as
Megatron-LM's load_args_from_checkpoint: the model's shape and its tokenizer.  Not the
precision flags (--bf16, --fp32-residual-connection): they change no weight, and a run
may resume a checkpoint in another precision."""


_PATH_ARGS = ("vocab_file", "merge_file", "tokenizer_model")


def _apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: each CHECKPOINT_ARGS flag the command line did not give
    takes the --load checkpoint's recorded value (the command line wins where given).

    As Megatron-LM: without --load, or with no checkpoint there yet (the first run of a
    restart loop), the command line's flags are used, with a note.  A recorded vocabulary
    or tokenizer file that is not on this machine is not taken (the note says so)."""
    if not getattr(args, "use_checkpoint_args", False):
        return
    from megatron.checkpointing import find_checkpoint, read_saved_config
    from megatron.errors import CheckpointError

    notes = args.megatron_lm_notes = getattr(args, "megatron_lm_notes", [])
    head = "note: --use-checkpoint-args: "
    try:
        if args.load is None or find_checkpoint(args.load).iteration is None:
            notes.append(head + ("no --load" if args.load is None else
                                 f"no checkpoint in --load {args.load} yet")
                         + "; using the command line's flags")
            return
        iteration, config = read_saved_config(args.load)
    except CheckpointError as exc:
        raise ArgumentError(f"--use-checkpoint-args: {exc}") from None
    taken, left = [], []
    given = getattr(args, "flags_given", set())
    for section, dest in CHECKPOINT_ARGS:
        saved = (config.get(section) or {}).get(dest)
        flag = _flag(dest)
        if saved is None or flag in given or getattr(args, dest, None) == saved:
            continue
        if dest in _PATH_ARGS and not os.path.exists(str(saved)):
            left.append(f"{flag} {saved} (not on this machine)")
            continue
        setattr(args, dest, saved)
        taken.append(flag if saved is True else f"{flag} {saved}")
    model = config.get("model") or {}
    # two fields whose flags are not their names: a recorded GQA and a model without biases
    groups, heads = model.get("num_query_groups"), model.get("num_attention_heads")
    if (isinstance(groups, int) and groups != heads and not given & {
            "--group-query-attention", "--num-query-groups"}):
        args.group_query_attention, args.num_query_groups = True, groups
        taken.append(f"--group-query-attention --num-query-groups {groups}")
    if model.get("add_bias_linear") is False and "--disable-bias-linear" not in given \
            and args.add_bias_linear:
        args.add_bias_linear = False
        taken.append("--disable-bias-linear")
    notes.append(head + f"from --load {args.load} (iteration {iteration}): "
                 + (", ".join(taken) if taken else "nothing the command line did not already say")
                 + (f"; not taken: {', '.join(left)}" if left else ""))


def _check_finite_floats(args: argparse.Namespace) -> None:
    """No float flag may be inf or nan (``--lr inf`` parses as a float and would train
    straight to NaN weights).  Covers entry-point flags too: every float in ``args``."""
    for dest, value in sorted(vars(args).items()):
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ArgumentError(f"{_flag(dest)} must be a finite number, got {v}")


def _check_writable_dir(flag: str, path: str) -> None:
    """Create ``path`` if missing and write (then delete) a probe file in it, so an
    unwritable --save is found now rather than after hours of training."""
    probe = os.path.join(path, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ArgumentError(f"{flag} {path} is not a writable directory ({reason})") from None


def _check_save_holds_no_other_run(args: argparse.Namespace) -> None:
    """A run that trains into a --save directory holding checkpoints must resume from
    them: a fresh run would replace their iterations one by one and move the tracker
    file back to its own (worse) ones."""
    from megatron.checkpointing import existing_checkpoints, newest_iteration

    resumes = (args.load is not None
               and os.path.realpath(args.load) == os.path.realpath(args.save))
    if args.skip_train or (resumes and not args.finetune):
        return
    if resumes:  # --finetune starts again at iteration 0 from --load's weights
        newest = newest_iteration(args.save)
        _require(not newest, f"--finetune with --load and --save both {args.save}: a "
                 f"finetuning run counts again from iteration 0 and would overwrite the "
                 f"checkpoints there (up to iteration {newest}); choose another --save "
                 f"directory")
        return  # an imported checkpoint (iteration 0 only) keeps its directory
    found = existing_checkpoints(args.save)
    if found is not None:
        raise ArgumentError(
            f"--save {args.save} already holds checkpoints ({found}) and this run does not "
            f"resume from them (--load {args.load or 'not given'}); a new run would overwrite "
            f"them: pass --load {args.save} to continue from the latest, or choose an empty "
            f"--save directory")


def _check_checkpoint_and_logging(args: argparse.Namespace) -> None:
    if args.save is not None:
        _check_writable_dir("--save", args.save)
        _check_save_holds_no_other_run(args)
    if args.tensorboard_dir is not None:
        _check_writable_dir("--tensorboard-dir", args.tensorboard_dir)
        _require(importlib.util.find_spec("tensorboard") is not None,
                 f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard package, "
                 "which is not installed: pip install tensorboard (or drop the flag)")
    _require(args.max_consecutive_skipped_steps >= 0,
             f"--max-consecutive-skipped-steps must be >= 0 (0 disables the limit), got "
             f"{args.max_consecutive_skipped_steps}")
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval needs --save (a checkpoint directory)")
        _require(args.save_interval > 0, f"--save-interval must be positive, got {args.save_interval}")
    for dest in ("tensorboard_log_interval", "tensorboard_queue_size"):
        v = getattr(args, dest, None)
        if v is not None:  # an entry point's own parser may lack them
            _require(v >= 1, f"{_flag(dest)} must be >= 1, got {v}")
    for dest in ("log_interval", "eval_interval"):
        v = getattr(args, dest)
        _require(v > 0, f"{_flag(dest)} must be positive, got {v}")
    _require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.exit_interval is not None:
        _require(args.exit_interval > 0, f"--exit-interval must be positive, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None:
        _require(args.exit_duration_in_mins > 0,
                 f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    if args.exit_on_missing_checkpoint:
        _require(args.load is not None, "--exit-on-missing-checkpoint needs --load")
        from megatron.checkpointing import existing_checkpoints

        _require(os.path.isdir(args.load) and existing_checkpoints(args.load) is not None,
                 f"--exit-on-missing-checkpoint: --load {args.load} holds no checkpoint "
                 f"({'not a directory' if not os.path.isdir(args.load) else 'no iter_* directory or tracker file'})")


def validate_args(args: argparse.Namespace, world_size: int,
                  default_tokenizer: Optional[str] = None) -> argparse.Namespace:
    """Check ``args`` for a run on ``world_size`` ranks and fill the derived values.

    ``default_tokenizer``: the entry point's --tokenizer-type when the flag is absent but
    a vocabulary is given (Megatron-LM's ``args_defaults`` of pretrain_gpt.py and
    pretrain_bert.py).

    Derived (set on ``args``): world_size, data_parallel_size, num_microbatches,
    ffn_hidden_size, max_position_embeddings, global_batch_size, train_iters (from
    --train-samples), lr_decay_iters, lr_warmup_iters, recompute_granularity,
    tokenizer_type (NullTokenizer for a bare --vocab-size), params_dtype.
    Raises ``ArgumentError`` naming the flag(s) on the first inconsistency.
    """
    _apply_checkpoint_args(args)
    _check_megatron_lm_flags(args)
    _check_required(args)
    _check_finite_floats(args)
    _check_model(args)
    _check_parallel(args, world_size)
    _check_batches(args)
    _check_precision(args)
    _check_optimizer(args)
    _check_data(args)
    _check_tokenizer(args, default_tokenizer)
    _check_recompute(args)
    _check_checkpoint_and_logging(args)
    return args

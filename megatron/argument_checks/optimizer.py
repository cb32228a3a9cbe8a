"""Checks of the precision (fp16/bf16/fp64, loss scaling, fp32 gradient accumulation)
and of the optimizer and its LR and weight-decay schedules; they fill params_dtype,
lr_decay_iters, lr_warmup_iters and, for a --train-samples run, the schedule in samples.
Run by ``megatron.argument_checks.validate_args``.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Union

import torch

from megatron.argument_checks.errors import flag_of, require, require_positive
from megatron.config import GRAD_DTYPE_SUPPORTED


def check_precision(args: argparse.Namespace) -> None:
    require(not (args.fp16 and args.bf16), "--fp16 and --bf16 are mutually exclusive")
    require(not (args.fp64 and (args.fp16 or args.bf16)),
            "--fp64 cannot be combined with --fp16 or --bf16")
    if args.loss_scale is not None:
        require(args.loss_scale > 0, f"--loss-scale must be positive, got {args.loss_scale}")
        if not (args.fp16 or args.bf16):
            print(f"warning: --loss-scale {args.loss_scale} is ignored: only --fp16 and --bf16 "
                  "runs scale the loss", file=sys.stderr)
    require_positive(args, "initial_loss_scale", "min_loss_scale", "loss_scale_window",
                     "hysteresis", allow_none=False)
    require(args.min_loss_scale <= args.initial_loss_scale,
            f"--min-loss-scale ({args.min_loss_scale}) must be <= --initial-loss-scale "
            f"({args.initial_loss_scale})")
    if args.accumulate_allreduce_grads_in_fp32:
        require(GRAD_DTYPE_SUPPORTED,
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


def check_optimizer(args: argparse.Namespace) -> None:
    if args.lr is None:  # only reachable with --skip-train: no step is ever taken
        args.lr = 0.0
    require(args.lr >= 0, f"--lr must be >= 0, got {args.lr}")
    require(args.min_lr >= 0, f"--min-lr must be >= 0, got {args.min_lr}")
    require(args.min_lr <= args.lr, f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    require(0 <= args.lr_warmup_init <= args.lr,
            f"--lr-warmup-init must be in [0, --lr ({args.lr})], got {args.lr_warmup_init}")
    _check_decoupled_lr(args)
    require(args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}")
    _check_weight_decay_incr(args)
    require(args.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables clipping), got {args.clip_grad}")
    for dest in ("adam_beta1", "adam_beta2", "sgd_momentum"):
        v = getattr(args, dest)
        require(0.0 <= v < 1.0, f"{flag_of(dest)} must be in [0, 1), got {v}")
    require(args.adam_eps > 0, f"--adam-eps must be positive, got {args.adam_eps}")
    # the GPT and BERT datasets shuffle with numpy's RandomState(--seed), which takes
    # [0, 2^32 - 1]; outside it the run failed with a traceback while building them
    require(0 <= args.seed < 2 ** 32,
            f"--seed must be between 0 and 2^32 - 1 = {2 ** 32 - 1}, got {args.seed}")
    _check_lr_schedule(args)


def _check_decoupled_lr(args: argparse.Namespace) -> None:
    """--decoupled-lr and its floor: non-negative, floor <= peak, no floor alone."""
    peak, floor = args.decoupled_lr, args.decoupled_min_lr
    require(floor is None or peak is not None,
            "--decoupled-min-lr needs --decoupled-lr (the input and output layers follow "
            "--lr and --min-lr without it)")
    if peak is None:
        return
    require(peak >= 0, f"--decoupled-lr must be >= 0, got {peak}")
    if floor is None:
        require(args.min_lr <= peak,
                f"--decoupled-lr ({peak}) must be >= its floor, --min-lr ({args.min_lr}) "
                "when --decoupled-min-lr is not given")
        return
    require(floor >= 0, f"--decoupled-min-lr must be >= 0, got {floor}")
    require(floor <= peak,
            f"--decoupled-min-lr ({floor}) must be <= --decoupled-lr ({peak})")


def _check_weight_decay_incr(args: argparse.Namespace) -> None:
    """Megatron-LM's weight-decay ramp: constant keeps --weight-decay (start and end, if
    given, must equal it); linear and cosine need 0 <= start <= end, and ramp over the
    run (--train-iters or --train-samples, one of which _check_required demands)."""
    style, start, end = (args.weight_decay_incr_style, args.start_weight_decay,
                         args.end_weight_decay)
    if style == "constant":
        for dest, value in (("start_weight_decay", start), ("end_weight_decay", end)):
            require(value is None or value == args.weight_decay,
                    f"{flag_of(dest)} ({value}) must equal --weight-decay ({args.weight_decay}) "
                    "with --weight-decay-incr-style constant; give --weight-decay-incr-style "
                    "linear or cosine for a weight decay that changes during training")
        return
    missing = [flag_of(d) for d, v in (("start_weight_decay", start), ("end_weight_decay", end))
               if v is None]
    require(not missing, f"--weight-decay-incr-style {style} needs {' and '.join(missing)} "
                          "(the weight decay at the start and at the end of the run)")
    require(start >= 0, f"--start-weight-decay must be >= 0, got {start}")
    require(start <= end, f"--start-weight-decay ({start}) must be <= --end-weight-decay "
                           f"({end}) with --weight-decay-incr-style {style} (the weight decay "
                           "rises over the run)")


def _check_lr_schedule(args: argparse.Namespace) -> None:
    """Fill lr_decay_iters and lr_warmup_iters, converting sample counts to iterations."""
    require(not (args.lr_decay_iters is not None and args.lr_decay_samples is not None),
            "--lr-decay-iters and --lr-decay-samples are mutually exclusive")
    require_positive(args, "lr_decay_iters", "lr_decay_samples")
    decay_iters_given = args.lr_decay_iters is not None
    frac = args.lr_warmup_fraction
    if args.lr_decay_samples is not None:
        args.lr_decay_iters = _samples_to_iters(args, "lr_decay_samples")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    given = [f for f in ("lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_samples")
             if getattr(args, f) is not None]
    require(len(given) <= 1,
            f"{' and '.join(flag_of(f) for f in given)} are mutually exclusive; give one warmup flag")
    if args.lr_warmup_fraction is not None:
        frac = args.lr_warmup_fraction
        require(0.0 <= frac <= 1.0, f"--lr-warmup-fraction must be in [0, 1], got {frac}")
        # (--skip-train takes no step: the schedule is never read, a fraction of nothing is 0)
        require(args.lr_decay_iters is not None or args.skip_train,
                "--lr-warmup-fraction needs the LR decay length: give --lr-decay-iters "
                "(or --train-iters/--train-samples)")
        # not rounded: Megatron-LM counts this warmup in samples, so 0.001 of 400
        # iterations is 0.4 of one (its first step at --lr-warmup-init), not none
        args.lr_warmup_iters = (_whole_if_integral(frac * args.lr_decay_iters)
                                if args.lr_decay_iters is not None else 0)
    elif args.lr_warmup_samples is not None:
        require(args.lr_warmup_samples >= 0,
                f"--lr-warmup-samples must be >= 0, got {args.lr_warmup_samples}")
        args.lr_warmup_iters = _samples_to_iters(args, "lr_warmup_samples")
    elif args.lr_warmup_iters is None:
        args.lr_warmup_iters = 0
    require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    _check_wsd(args)
    _sample_based_schedule(args, decay_iters_given, frac)
    # (a --train-samples run is checked in samples, by _sample_based_schedule)
    if (args.lr_decay_iters is not None and args.lr_decay_style != "constant"
            and args.train_samples is None):
        require(args.lr_warmup_iters < args.lr_decay_iters,
                f"LR warmup ({args.lr_warmup_iters} iterations, "
                f"{flag_of(given[0]) if given else '--lr-warmup-iters'}) must be "
                f"shorter than the LR decay ({args.lr_decay_iters} iterations, --lr-decay-iters "
                f"or --train-iters) for --lr-decay-style {args.lr_decay_style}")


def _check_wsd(args: argparse.Namespace) -> None:
    """--lr-decay-style WSD anneals over --lr-wsd-decay-iters/-samples, which must fit
    in the decay after warmup; the anneal flags mean nothing to another style."""
    require(not (args.lr_wsd_decay_iters is not None and args.lr_wsd_decay_samples is not None),
            "--lr-wsd-decay-iters and --lr-wsd-decay-samples are mutually exclusive")
    require_positive(args, "lr_wsd_decay_iters", "lr_wsd_decay_samples")
    if args.lr_wsd_decay_samples is not None:
        args.lr_wsd_decay_iters = _samples_to_iters(args, "lr_wsd_decay_samples")
    if args.lr_decay_style != "WSD":
        given = [f for f in ("lr_wsd_decay_iters", "lr_wsd_decay_samples")
                 if getattr(args, f) is not None]
        if given:
            args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
                f"note: {flag_of(given[-1])} changes nothing with --lr-decay-style "
                f"{args.lr_decay_style} (it is the anneal of --lr-decay-style WSD)"]
        return
    require(args.lr_wsd_decay_iters is not None,
            "--lr-decay-style WSD needs the length of its anneal: give "
            "--lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    # a --train-samples run checks its anneal in samples (_sample_based_schedule): the
    # iteration counts here are rounded and would refuse an anneal that fits
    if args.lr_decay_iters is not None and args.train_samples is None:
        room = args.lr_decay_iters - args.lr_warmup_iters
        require(args.lr_wsd_decay_iters <= room,
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
        require(args.lr_wsd_decay_samples <= room,
                f"the WSD anneal ({args.lr_wsd_decay_samples} samples, "
                f"--lr-wsd-decay-samples/-iters) must fit in the decay after warmup: "
                f"{room} samples")
    if args.lr_decay_style != "constant":
        require(args.lr_warmup_samples < args.lr_decay_samples,
                f"LR warmup ({args.lr_warmup_samples} samples) must be shorter than the LR "
                f"decay ({args.lr_decay_samples} samples, --lr-decay-samples or "
                f"--train-samples) for --lr-decay-style {args.lr_decay_style}")


def _whole_if_integral(x: float) -> Union[int, float]:
    """``x`` as an int when it is a whole number (how schedules print and compare)."""
    return int(x) if float(x).is_integer() else float(x)


def _samples_to_iters(args: argparse.Namespace, samples_dest: str) -> int:
    return math.ceil(getattr(args, samples_dest) / args.global_batch_size)

"""Checks of the parallel layout and the batch sizes: tensor/pipeline/data-parallel sizes
against the world size, the distributed backend and this node's GPUs, the global batch
and its microbatches, and a batch-size ramp or step schedule.  They fill world_size,
data_parallel_size, stage_layer_counts, num_microbatches, global_batch_size and
train_iters (from --train-samples).  Run by ``megatron.argument_checks.validate_args``.
"""
from __future__ import annotations

import argparse
import os

import torch

from megatron.argument_checks.errors import ArgumentError, flag_of, require


def check_parallel(args: argparse.Namespace, world_size: int) -> None:
    require(isinstance(world_size, int) and world_size >= 1,
            f"world size (WORLD_SIZE) must be a positive integer, got {world_size!r}")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    require(tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
    require(pp >= 1, f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    require(world_size % (tp * pp) == 0,
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
    require(args.num_attention_heads % tp == 0,
            f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})")
    require(args.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
            f"--tensor-model-parallel-size ({tp})")
    if tp == 1 and args.sequence_parallel:
        # nothing to split; Megatron-LM disables it too, with a warning
        args.sequence_parallel = False
        args.megatron_lm_notes = getattr(args, "megatron_lm_notes", []) + [
            "note: --sequence-parallel changes nothing with --tensor-model-parallel-size 1 "
            "(it splits sequences over the tensor-parallel ranks)"]
    if args.sequence_parallel:
        require(args.seq_length % tp == 0,
                f"--sequence-parallel splits each sequence over the {tp} tensor ranks: "
                f"--seq-length ({args.seq_length}) must be divisible by "
                f"--tensor-model-parallel-size ({tp})")
    if args.group_query_attention:
        require(args.num_query_groups % tp == 0,
                f"--num-query-groups ({args.num_query_groups}) must be divisible by "
                f"--tensor-model-parallel-size ({tp}): each rank holds whole key/value heads")
    require(args.measure_memory_interval >= 0,
            f"--measure-memory-interval must be >= 0, got {args.measure_memory_interval}")
    require(args.distributed_timeout_minutes > 0,
            f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    if args.distributed_backend == "nccl":
        require(torch.cuda.is_available(),
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


def check_batches(args: argparse.Namespace) -> None:
    mbs, dp, pp = args.micro_batch_size, args.data_parallel_size, args.pipeline_model_parallel_size
    schedule = _batch_schedule(args)
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    require(gbs % (mbs * dp) == 0,
            f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size ({mbs}) "
            f"x data-parallel size ({dp}) = {mbs * dp}")
    args.num_microbatches = gbs // (mbs * dp)
    m = args.num_microbatches
    require(args.tbw_mitigation == "none" or args.pipeline_schedule == "2bw",
            f"--2bw-mitigation {args.tbw_mitigation} needs --pipeline-schedule 2bw, got "
            f"--pipeline-schedule {args.pipeline_schedule}")
    require(not args.overlap_param_gather or args.use_distributed_optimizer,
            "--overlap-param-gather overlaps the distributed optimizer's weight all-gathers: "
            "it needs --use-distributed-optimizer")
    require(args.ddp_bucket_size is None or args.ddp_bucket_size >= 1,
            f"--ddp-bucket-size must be a positive number of parameters, got "
            f"{args.ddp_bucket_size}")
    require(not (args.use_distributed_optimizer and args.tbw_mitigation == "predict"),
            "--2bw-mitigation predict needs every parameter's optimizer state on every rank: "
            "it cannot run with --use-distributed-optimizer")
    if args.pipeline_schedule == "2bw":
        require(m >= pp,
                f"PipeDream-2BW needs m >= d: --global-batch-size ({gbs}) / (--micro-batch-size "
                f"({mbs}) x data-parallel size ({dp})) = {m} microbatches, fewer than "
                f"--pipeline-model-parallel-size ({pp}); raise --global-batch-size to at least "
                f"{pp * mbs * dp}")
    if schedule is not None:
        _check_schedule(args, schedule, mbs, dp, pp)
    if args.train_samples is not None:
        first = schedule.batch_size_at(0) if schedule is not None else gbs
        require(args.train_samples >= first,
                f"--train-samples ({args.train_samples}) must be >= "
                + (f"the first batch of {schedule.source} ({first})" if schedule is not None
                    else f"--global-batch-size ({gbs})"))
        args.train_iters = (schedule.iterations(args.train_samples) if schedule is not None
                            else args.train_samples // gbs)
    if args.tbw_flush_warmup_iters is None:  # after --train-samples set train_iters
        args.tbw_flush_warmup_iters = (args.train_iters or 0) // 2
    require(args.tbw_flush_warmup_iters >= 0,
            f"--2bw-flush-warmup-iters must be >= 0, got {args.tbw_flush_warmup_iters}")


def _batch_schedule(args: argparse.Namespace):
    """--rampup-batch-size or --step-batch-size-schedule as a BatchSchedule (None: the
    batch is --global-batch-size throughout).  A step schedule's last batch becomes the
    global batch size."""
    from megatron.batch_schedule import BatchSchedule, BatchScheduleError

    ramp, steps = args.rampup_batch_size, args.step_batch_size_schedule
    if ramp is None and steps is None:
        return None
    require(ramp is None or steps is None,
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
            require(args.global_batch_size is not None,
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
            require(getattr(args, dest) is None,
                    f"{flag_of(dest)} counts iterations, whose size changes under {flag}, and "
                    f"--train-samples counts samples; give {instead}")
    else:
        for dest in ("lr_decay_samples", "lr_warmup_samples"):
            require(getattr(args, dest) is None,
                    f"{flag_of(dest)} counts samples, and --train-iters with {flag} counts the "
                    f"LR schedule in iterations; give {flag_of(dest.replace('samples', 'iters'))} "
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

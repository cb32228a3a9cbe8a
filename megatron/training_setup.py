"""Set-up before the first batch: the tokenizer, process groups and seeds
(``initialize_megatron``); one pipeline stage's model, its optimizer, LR schedule and
``PipelineEngine`` (``setup_model_and_optimizer``); and, once the checkpoint is loaded,
the checks of what a (resumed) run has left to train.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.config import MegatronConfig
from megatron.errors import UserError, alike_on_every_rank
from megatron.initialize import (exit_when_parent_dies, initialize_distributed, set_random_seed,
                                 tune_host_malloc)
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.engine import PipelineEngine


def _warn_precision(cfg: MegatronConfig, groups: ParallelGroups, device: torch.device) -> None:
    """--fp16 (or a slow --bf16) on a CPU device: say what it costs, measured here."""
    from megatron.initialize import half_matmul_slowdown, precision_warning

    dtype = cfg.model.params_dtype
    if groups.rank != 0 or device.type != "cpu" or dtype not in (torch.float16, torch.bfloat16):
        return
    message = precision_warning(dtype, device, half_matmul_slowdown(dtype))
    if message:
        print(message, file=sys.stderr, flush=True)


def initialize_megatron(args, cfg: MegatronConfig):
    """Tokenizer (and the padded vocabulary size it implies), process groups and seeds.

    Everything that reads user files runs before the process groups exist, so a bad
    vocabulary file stops every rank at once.  Returns (tokenizer or None, groups, device).
    """
    from megatron.tokenizer import build_tokenizer, vocab_size_with_padding

    tokenizer = None
    vocab = getattr(args, "vocab_size", None)
    if cfg.data.tokenizer_type is not None:
        try:
            tokenizer = build_tokenizer(cfg.data, cfg.parallel.tensor_model_parallel_size,
                                        vocab_size=vocab)
        except (ValueError, OSError) as exc:  # each names its flag (--vocab-file, ...)
            raise UserError(str(exc)) from exc
        vocab = tokenizer.vocab_size
        cfg.data.tokenizer_vocab_size = int(vocab)
    if vocab:
        cfg.model.padded_vocab_size = vocab_size_with_padding(
            vocab, cfg.data.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    if cfg.training.save and not cfg.training.skip_train and _global_rank() == 0:
        from megatron.save_lock import lock_save_dir

        lock_save_dir(cfg.training.save)  # another run saving there stops here
    exit_when_parent_dies()
    groups, device = initialize_distributed(cfg.parallel)
    if device.type == "cpu" and cfg.training.host_malloc_tuning:
        tune_host_malloc()
    _warn_precision(cfg, groups, device)
    set_random_seed(cfg.training.seed, groups, device,
                    data_parallel_random_init=cfg.training.data_parallel_random_init)
    return tokenizer, groups, device


def _global_rank() -> int:
    """This process's rank in the job: its process group's, else torchrun's RANK (the
    check of the launch variables comes later, in initialize_distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def build_on_device(device: torch.device, provider: Callable, *args: Any) -> torch.nn.Module:
    """``provider(*args)`` with its tensors created on ``device`` when it is a GPU: the
    weights are drawn there (megatron.tensor_parallel.param_init) instead of on the CPU
    and copied.  On the CPU the model is built exactly as before."""
    if device.type == "cpu":
        return provider(*args)
    with torch.device(device):
        return provider(*args)


def setup_model_and_optimizer(cfg: MegatronConfig, groups: ParallelGroups, device: torch.device,
                              model_provider, forward_step, *, trace: bool = False,
                              fault_injection=None):
    from megatron.optimizer import get_megatron_optimizer
    from megatron.optimizer.lr_scheduler import OptimizerParamScheduler
    from megatron.tensor_parallel.random import get_rng_state, set_rng_state

    model = build_on_device(device, model_provider, cfg, groups, groups.is_first_stage,
                            groups.is_last_stage)
    model.to(device=device)
    optimizer = get_megatron_optimizer(cfg.optimizer, cfg.precision, list(model.parameters()),
                                       model_groups=groups.model, tp_rank=groups.tp_rank,
                                       log_num_zeros=cfg.training.log_num_zeros_in_grad,
                                       log_params_norm=cfg.training.log_params_norm,
                                       dp_group=groups.data if groups.dp_size > 1 else None)
    par = cfg.parallel
    optimizer.enable_mitigation(par.tbw_mitigation, par.tbw_dc_lambda)
    if cfg.training.skip_train:  # evaluation only: no step is taken, any schedule will do
        scheduler = OptimizerParamScheduler(cfg.optimizer.lr or 0.0, 0.0, 0, 1, "constant")
    else:
        # (the global batch: inverse-square-root's floor of one sample, as Megatron-LM)
        scheduler = OptimizerParamScheduler.from_config(
            cfg.optimizer, cfg.training.train_iters,
            global_batch_size=cfg.training.global_batch_size)
    # --decoupled-lr: the input and output layers' rate of the step being taken
    optimizer.decoupled_lr_provider = scheduler.get_decoupled_lr
    # the weight decay of the step being taken (--weight-decay-incr-style; constant: the
    # --weight-decay the groups were built with)
    optimizer.weight_decay_provider = scheduler.get_wd
    engine = PipelineEngine(
        model=model, optimizer=optimizer, groups=groups,
        schedule=cfg.parallel.pipeline_schedule,
        num_microbatches=cfg.training.num_microbatches(groups.dp_size),
        micro_batch_size=cfg.training.micro_batch_size, forward_step=forward_step,
        device=device, activation_dtype=cfg.model.residual_dtype,
        stage_recompute=cfg.model.stage_recompute, trace=trace,
        get_rng_state=get_rng_state, set_rng_state=set_rng_state,
        fault_injection=fault_injection,
        memory_count_interval=cfg.training.measure_memory_interval,
        flush_warmup_iters=par.tbw_flush_warmup_iters if par.tbw_mitigation == "warmup" else 0,
        grad_dtype=cfg.precision.grad_dtype,
        per_token_loss=cfg.training.calculate_per_token_loss,
        grad_bucket_elements=cfg.optimizer.ddp_bucket_size)
    return model, optimizer, scheduler, engine


def check_batch_schedule(cfg: MegatronConfig, groups: ParallelGroups, state: TrainState) -> None:
    """The batch sizes still ahead of a resumed run must split into this layout's
    microbatches (the arguments checked only the last one: they did not know where the
    checkpoint stands).  Same verdict on every rank, before any collective of training."""
    from megatron.batch_schedule import BatchScheduleError

    tr = cfg.training
    schedule = tr.batch_sizes()
    if schedule is None or tr.skip_train:
        return
    depth = groups.pp_size if cfg.parallel.pipeline_schedule == "2bw" else 1
    try:
        schedule.check(tr.micro_batch_size, groups.dp_size, depth,
                       consumed_samples=state.consumed_train_samples)
    except BatchScheduleError as exc:
        raise UserError(f"{exc} (the run resumes at sample {state.consumed_train_samples:,} "
                        f"of --load {tr.load})") from None


def count_iterations_from_samples(cfg: MegatronConfig, state: TrainState) -> None:
    """--train-samples counts samples, not iterations: a resumed run trains the batches
    that fit in what is left of it at this run's --global-batch-size (the iteration
    count the arguments derived assumed the batch size never changed)."""
    tr = cfg.training
    if tr.train_samples is None or tr.skip_train:
        return
    batch_sizes = tr.batch_sizes()
    if batch_sizes is not None:
        tr.train_iters = state.iteration + batch_sizes.iterations(tr.train_samples,
                                                                  state.consumed_train_samples)
        return
    left = max(0, tr.train_samples - state.consumed_train_samples)
    tr.train_iters = state.iteration + left // tr.global_batch_size


def check_iterations_left(cfg: MegatronConfig, state: TrainState) -> None:
    """Training was asked for: the loaded checkpoint must leave iterations to train.

    Same verdict on every rank (same flags, same checkpoint), raised before the data
    loaders are positioned past the end and before any collective of training."""
    tr = cfg.training
    train_iters = tr.train_iters or 0
    if not tr.skip_train and state.iteration >= train_iters and tr.train_samples is not None:
        raise alike_on_every_rank(UserError(
            f"nothing to train: the checkpoint in --load {tr.load} has consumed "
            f"{state.consumed_train_samples} samples and --train-samples is "
            f"{tr.train_samples}, less than one more batch of "
            f"{tr.batch_size_at(state.consumed_train_samples)} samples "
            f"(--global-batch-size {tr.global_batch_size}"
            + (f", {tr.batch_schedule_source}" if tr.batch_schedule else "")
            + "); raise --train-samples to continue, or pass --skip-train to only evaluate"))
    if not tr.skip_train and state.iteration >= train_iters:
        raise alike_on_every_rank(UserError(
            f"nothing to train: the checkpoint in --load {tr.load} is at iteration "
            f"{state.iteration} and --train-iters is {train_iters}; raise --train-iters to "
            f"continue, or pass --skip-train to only evaluate"))

"""The training loop: ``pretrain(datasets_provider, model_provider, forward_step)``.

Megatron's shape: the entry point (pretrain_gpt.py, pretrain_bert.py, tasks/) supplies
three functions and this module does the rest: flags, process groups, model split into
pipeline stages, optimizer, data loaders, the pipeline engine, logging, evaluation and
checkpoints.

* ``model_provider(config, groups, pre_process, post_process) -> nn.Module``: one stage.
* ``datasets_provider(config, tokenizer, (n_train, n_valid, n_test)) -> (train, valid, test)``
* ``forward_step(data_iterator, model) -> (output, loss_fn)``

Training runs in segments of batches between "drain points" (evaluation, checkpoint,
exit, end of training).  Inside a segment the pipeline is never flushed under 2BW.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import torch

from megatron.config import MegatronConfig
from megatron.entry import run_entry_point  # noqa: F401 - entry points import it from here
from megatron.initialize import barrier_with_message
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.engine import PipelineEngine
from megatron.training_checkpoint import maybe_load
from megatron.training_data import build_data_iterators, check_eval_data, check_train_data
from megatron.training_exits import ExitRequests
from megatron.training_log import TrainingLogger
from megatron.training_loop import TrainingResult, _end_of_run, train
from megatron.training_setup import (check_batch_schedule, check_iterations_left,
                                     count_iterations_from_samples, initialize_megatron,
                                     setup_model_and_optimizer)


def pretrain(datasets_provider: Callable, model_provider: Callable, forward_step: Callable, *,
             extra_args_provider: Optional[Callable] = None, argv: Optional[Sequence[str]] = None,
             flops_per_iteration: Optional[Callable[[MegatronConfig], float]] = None,
             fault_injection=None, default_tokenizer: Optional[str] = None,
             per_token_loss: bool = False) -> TrainingResult:
    """Parse flags, set up every rank, train, evaluate, save.  Returns this rank's result.

    ``default_tokenizer``: --tokenizer-type when absent and a vocabulary is given.
    ``per_token_loss``: with --calculate-per-token-loss, ``forward_step``'s loss function
    returns (loss_sum, num_tokens, {name: sum}) (``PipelineEngine``); without this the
    flag is refused."""
    from megatron.arguments import parse_and_validate

    args, cfg = parse_and_validate(list(argv) if argv is not None else None,
                                   extra_args_provider=extra_args_provider,
                                   default_tokenizer=default_tokenizer,
                                   per_token_loss=per_token_loss)
    try:
        tokenizer, groups, device = initialize_megatron(args, cfg)
        result = _pretrain(cfg, tokenizer, groups, device, datasets_provider, model_provider,
                           forward_step, flops_per_iteration, fault_injection)
        # A second pretrain in this process starts from a clean slate.  Not on an error
        # path: a group whose worker still waits in a collective could not be torn down.
        groups.destroy()
    finally:
        if cfg.training.save:
            from megatron.save_lock import release_save_dir

            release_save_dir(cfg.training.save)
    return result


def _pretrain(cfg: MegatronConfig, tokenizer, groups: ParallelGroups, device: torch.device,
              datasets_provider: Callable, model_provider: Callable, forward_step: Callable,
              flops_per_iteration: Optional[Callable[[MegatronConfig], float]],
              fault_injection) -> TrainingResult:
    model, optimizer, scheduler, engine = setup_model_and_optimizer(
        cfg, groups, device, model_provider, forward_step,
        trace=cfg.training.timeline_file is not None, fault_injection=fault_injection)
    state = maybe_load(cfg, groups, engine, optimizer, scheduler)
    check_batch_schedule(cfg, groups, state)
    count_iterations_from_samples(cfg, state)
    check_iterations_left(cfg, state)
    train_iter, valid_iter, test_iter = build_data_iterators(cfg, groups, tokenizer,
                                                             datasets_provider, state)
    check_train_data(cfg, train_iter)
    check_eval_data(cfg, valid_iter)
    flops = flops_per_iteration(cfg) if flops_per_iteration else None
    logger = TrainingLogger(cfg, groups, flops_per_iteration=flops, device=device)
    # --log-timers-to-tensorboard: the per-phase times come from the executor's trace
    logger.watch_timers(engine, keep_events=cfg.training.timeline_file is not None)
    logger.banner(engine, model)
    result = TrainingResult()
    with logger.paused():  # waiting for the slowest rank's set-up is no iteration's time
        barrier_with_message("start of training")
    engine.clock_origin = time.perf_counter()  # CLOCK_MONOTONIC: comparable across local ranks
    exits = None if cfg.training.skip_train else ExitRequests(cfg)
    if exits is not None:
        # --exit-signal-handler: a SIGTERM is noted until the run returns (Megatron-LM's
        # handler covers the whole run), so one during the end-of-run save or evaluation
        # does not kill the process; the run ends as planned and exits 0
        exits.install()
    try:
        if exits is not None:
            train(cfg, groups, engine, optimizer, scheduler, state, train_iter, valid_iter,
                  logger, result, exits)
        _end_of_run(cfg, groups, engine, optimizer, scheduler, state, valid_iter, test_iter,
                    logger, result)
    finally:
        if exits is not None:
            exits.restore()
    if cfg.training.timeline_file:
        _write_timeline(cfg.training.timeline_file, engine, groups, cfg)
    logger.close()
    return result


def _write_timeline(path: str, engine: PipelineEngine, groups: ParallelGroups,
                    cfg: MegatronConfig) -> None:
    from megatron.pipeline.trace import TraceEvent, save_trace

    root, ext = os.path.splitext(path)
    out = f"{root}_rank{groups.rank}{ext or '.json'}"
    events = [TraceEvent(rank=e["rank"], stage=e["stage"], action=e["action"], op=e["op"],
                         microbatch=e["microbatch"], batch=e["batch"], start=e["start"],
                         end=e["end"], version=e["version"], cpu=e.get("cpu"))
              for e in engine.trace_events if e["train"]]
    meta = {"schedule": cfg.parallel.pipeline_schedule, "stages": groups.pp_size,
            "microbatches": cfg.training.num_microbatches(groups.dp_size),
            "data_parallel": groups.dp_size, "rank": groups.rank,
            "clock_origin": engine.clock_origin}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_trace(out, events, meta)

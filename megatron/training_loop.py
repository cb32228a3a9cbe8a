"""The training loop and the run's end.

``train`` runs the engine in segments of batches between drain points (evaluation,
--save-interval, --exit-interval, the periodic fault checks, the end of training); at
each, every rank agrees on an exit request and the skip monitor's verdict.
``_end_of_run`` is Megatron-LM's end: the final save, then the evaluation on the
validation and test sets.  Both fill this rank's ``TrainingResult``.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.config import MegatronConfig
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.engine import PipelineEngine
from megatron.pipeline.update import StepReport
from megatron.manual_gc import ManualGC
from megatron.profiling import StepProfiler
from megatron.training_checkpoint import save
from megatron.training_exits import ExitRequests, NonFiniteError, SkipMonitor, check_weights_finite
from megatron.training_log import TrainingLogger, print_rank_last


STEPS_KEPT = 100_000
"""Iterations whose step reports and losses a ``TrainingResult`` keeps (the newest): a
report and its loss dict take a few hundred bytes, so a run of millions of iterations
would otherwise grow by gigabytes per node."""


@dataclass
class TrainingResult:
    """What pretrain() returns on each rank (used by tests and benches)."""

    iteration: int = 0
    losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """Last stage: the losses of the newest ``STEPS_KEPT`` iterations, by iteration."""
    reports: List[StepReport] = field(default_factory=list)
    """The newest ``STEPS_KEPT`` step reports, oldest first."""
    eval_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    test_losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """The test split's losses at the end of training (last stage; --test-data-path or
    --split's third share), as Megatron-LM evaluates it."""
    memory: Dict[str, Any] = field(default_factory=dict)
    seconds_per_iteration: float = 0.0
    """Wall time of the training loop per iteration, its evaluations and interval saves
    left out (as the log line leaves them out); the first batches' start-up is in it."""
    exited_early: bool = False
    shared_embedding: Optional[torch.Tensor] = None
    """Copy of this stage's tied word embedding (first/last stage), for consistency checks."""
    nonfinite_ending: Optional[str] = None
    """Set when training ended on steps skipped for non-finite values (the run fails)."""


def evaluate_and_print(engine: PipelineEngine, iterator, eval_iters: int, label: str,
                       iteration: int, logger: TrainingLogger, *,
                       samples: Optional[int] = None, at_end: bool = False,
                       to_tensorboard: bool = True) -> Optional[Dict[str, float]]:
    """Megatron-LM's ``evaluate_and_print_results``: the line
    `` validation loss at iteration N | lm loss value: X | lm loss PPL: Y | `` between
    two rules of its length (at the end ``iteration N on validation set`` or ``on test
    set``, the test split's line starting ``validation loss`` too), and the TensorBoard
    scalars ``lm loss validation`` (and with --log-validation-ppl-to-tensorboard
    ``lm loss validation ppl``) against the iteration, their `` vs samples`` twins
    against ``samples`` (the consumed training samples), at every evaluation
    (--tensorboard-log-interval does not apply, as in Megatron-LM).
    The test split's scalars are ``lm loss test`` (Megatron-LM writes them over the
    validation ones)."""
    losses = engine.evaluate(iterator, eval_iters)
    ppl_scalars = logger.tb.validation_ppl
    if losses:
        prefix = f"iteration {iteration}" + (f" on {label} set" if at_end else "")
        line = f" validation loss at {prefix} | "
        for k, v in losses.items():
            # min(20, nan) is 20: a NaN loss would print a perfectly normal-looking PPL.
            ppl = math.exp(min(20.0, v)) if math.isfinite(v) else float("nan")
            shown = f"{ppl:.6E}" if math.isfinite(ppl) else "nan"
            line += f"{k} value: {v:.6E} | {k} PPL: {shown} | "
            if to_tensorboard:
                logger.scalars(f"{k} {label}", v, iteration, samples)
                if ppl_scalars:
                    logger.scalars(f"{k} {label} ppl", ppl, iteration, samples)
        rule = "-" * (len(line) + 1)
        print_rank_last(f"{rule}\n{line}\n{rule}")
    return losses


def _next_drain(it: int, cfg: MegatronConfig, train_iters: int, do_eval: bool,
                check_every: int = 0) -> int:
    """First iteration > it where the pipeline must drain (eval, save, exit, end, and
    every ``check_every`` iterations the fault checks of ``_check_every``)."""
    tr = cfg.training
    stops = [train_iters]
    for interval, on in ((tr.eval_interval, do_eval), (tr.save_interval, bool(tr.save)),
                         (tr.exit_interval, True), (check_every, True)):
        if on and interval:
            stops.append((it // interval + 1) * interval)
    return min(stops)


SIGNAL_CHECK_SECONDS = 20.0
"""2BW with --exit-signal-handler: drain about this often to look for a SIGTERM."""


SIGNAL_CHECK_SECONDS_FLUSH = 1.0
"""flush/gpipe/none with --exit-signal-handler: agree on a SIGTERM about this often (one
all-reduce and one segment start, no pipeline fill: a flushing schedule drains anyway)."""
NAN_CHECK_BATCHES_2BW = 100
"""2BW: drain at least this often to stop a run that keeps skipping steps."""


def profiled_run_end(cfg: MegatronConfig, first_iteration: int,
                     train_iters: Optional[int] = None) -> int:
    """Batches done when a run starting at ``first_iteration`` stops by its flags:
    --train-iters, or the first --exit-interval multiple before it (where the profiler
    window closes at the latest)."""
    tr = cfg.training
    end = (tr.train_iters or 0) if train_iters is None else train_iters
    if tr.exit_interval:
        end = min(end, (first_iteration // tr.exit_interval + 1) * tr.exit_interval)
    return end


def _check_every(cfg: MegatronConfig, seconds_per_iteration: float) -> int:
    """Iterations between the drain points at which every rank agrees on a SIGTERM and
    stops a run that keeps skipping steps (0: no extra drain points).

    flush/gpipe/none drain after every batch anyway, so a check costs no pipeline fill;
    they end a segment exactly where the run could first be stopped
    (``SkipMonitor.batches_before_verdict``, applied by ``train``: no extra drain points
    here) and, with --exit-signal-handler, agree on a SIGTERM about every
    SIGNAL_CHECK_SECONDS_FLUSH.  A segment per batch would cost the first stage, which
    ends every batch last, about 0.45 ms a batch of segment set-up on the small GPT at
    d=2 (one-off timers, 2026-11-23).
    2BW never drains inside a segment, and each drain costs a pipeline fill (simulated,
    d=4 m=8: +3% when draining every 10 batches, +37% every batch), so it checks every
    NAN_CHECK_BATCHES_2BW batches (a stuck run stops that much later, its steps all
    skipped) and, with --exit-signal-handler, about every SIGNAL_CHECK_SECONDS of
    training (``seconds_per_iteration`` is agreed by all ranks, so every rank picks the
    same segment length; 1 batch until a time has been measured)."""
    tr = cfg.training
    watch = tr.exit_signal_handler or tr.exit_duration_in_mins is not None
    if cfg.parallel.pipeline_schedule != "2bw":
        if not watch:
            return 0
        return (max(1, int(SIGNAL_CHECK_SECONDS_FLUSH / seconds_per_iteration))
                if seconds_per_iteration > 0 else 1)
    every = max(NAN_CHECK_BATCHES_2BW, tr.max_consecutive_skipped_steps)
    if tr.max_consecutive_skipped_steps == 0:
        every = 0
    if watch:
        by_time = (max(1, int(SIGNAL_CHECK_SECONDS / seconds_per_iteration))
                   if seconds_per_iteration > 0 else 1)
        every = min(every, by_time) if every else by_time
    return every


def _agree(code: int, seconds_per_iteration: float, device: torch.device) -> Tuple[int, float]:
    """(highest ExitRequests code of any rank, slowest rank's seconds per iteration):
    one all-reduce."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return code, seconds_per_iteration
    t = torch.tensor([float(code), seconds_per_iteration], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0].item()), float(t[1].item())


def _save_checked(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine,
                  optimizer, scheduler, state: TrainState,
                  monitor: Optional[SkipMonitor] = None) -> bool:
    """Save unless the weights are suspect; True if saved.  The verdict is the same on
    every rank (agreed step reports, agreed finiteness check)."""
    if monitor is not None and monitor.suspect:
        print_rank_last(f"warning: not saving the checkpoint of iteration {state.iteration}: "
                        f"the last step(s) ({monitor.streak()}) were skipped for non-finite "
                        f"loss or gradients; the last saved checkpoint stays the latest")
        return False
    check_weights_finite(engine, state.iteration)
    save(cfg, groups, engine, optimizer, scheduler, state)
    return True


def _segment_end(cfg: MegatronConfig, state: TrainState, train_iters: int, do_eval: bool,
                 check_every: int, monitor: SkipMonitor, scaler, batch_sizes) -> int:
    """The iteration the next segment of batches ends at: the next drain point, earlier
    under a flushing schedule where the skip monitor could first stop the run (no
    pipeline fill is lost there), and no later than the last batch of the current
    global batch size (a segment trains batches of one size)."""
    stop = _next_drain(state.iteration, cfg, train_iters, do_eval, check_every)
    if cfg.parallel.pipeline_schedule != "2bw":
        to_min = getattr(scaler, "steps_to_min_scale", None)
        ahead = monitor.batches_before_verdict(to_min() if to_min else None)
        if ahead is not None:
            stop = min(stop, state.iteration + ahead)
    if batch_sizes is not None:
        same = batch_sizes.batches_at_this_size(state.consumed_train_samples)
        if same is not None:
            stop = min(stop, state.iteration + same)
    return stop


def _step_callback(cfg: MegatronConfig, scheduler, state: TrainState, result: TrainingResult,
                   logger: TrainingLogger, monitor: SkipMonitor,
                   batch_at: Callable[[int], int],
                   after_step: Sequence[Callable[[int], None]]) -> Callable[[StepReport], None]:
    """The engine's ``on_step``: after each agreed optimizer step, move the LR schedule
    (unless the step was skipped), the iteration and sample counters, record the report
    in ``result``, log it, show it to the skip monitor, then call each of ``after_step``
    (the profiler's window, manual garbage collection) with the batch's iteration."""
    decoupled = cfg.optimizer.decoupled_lr is not None
    # a weight decay that changes (the scheduler's, after a resume that may adopt the
    # checkpoint's): the log line shows it
    wd_ramp = getattr(scheduler, "wd_incr_style", "constant") != "constant"

    def on_step(report: StepReport) -> None:
        size = batch_at(state.consumed_train_samples)
        # the rate the step just taken used (the counter has not moved yet)
        decoupled_lr = scheduler.get_decoupled_lr() if decoupled else None
        weight_decay = scheduler.get_wd() if wd_ramp else None
        if not report.skipped:
            scheduler.step_batch(size)
        state.iteration = report.iteration + 1
        state.consumed_train_samples += size
        result.reports.append(report)
        if report.losses:
            result.losses[report.iteration + 1] = report.losses
        if len(result.reports) >= 2 * STEPS_KEPT:  # trimmed in halves: amortised O(1)
            del result.reports[:-STEPS_KEPT]
            first_kept = result.reports[0].iteration + 1
            for k in [k for k in result.losses if k < first_kept]:
                del result.losses[k]
        logger.on_step(report, state, size, decoupled_lr, weight_decay)
        monitor.update(report)
        for hook in after_step:
            hook(report.iteration)

    return on_step


def train(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine, optimizer,
          scheduler, state: TrainState, train_iter, valid_iter, logger: TrainingLogger,
          result: TrainingResult, exits: Optional[ExitRequests] = None,
          profiler: Optional[StepProfiler] = None,
          manual_gc: Optional[ManualGC] = None) -> TrainingResult:
    """Train until --train-iters (or an early stop).  ``profiler`` and ``manual_gc``: a
    caller that trains in several calls (finetuning's epochs) passes its own, entered
    around all of them, so that one profiler window and one collector setting span the
    calls; otherwise this call makes and enters its own."""
    tr = cfg.training
    train_iters = tr.train_iters or 0
    batch_sizes = tr.batch_sizes()  # built once: batch_size_at runs every step

    def batch_at(consumed: int) -> int:
        return (batch_sizes.batch_size_at(consumed) if batch_sizes is not None
                else tr.global_batch_size)

    samples_per_microbatch = tr.micro_batch_size * groups.dp_size
    monitor = SkipMonitor.from_config(cfg)

    own_hooks = contextlib.ExitStack()
    if profiler is None:
        profiler = own_hooks.enter_context(StepProfiler(
            tr.profile, groups.rank, state.iteration, engine.device,
            run_end=profiled_run_end(cfg, state.iteration)))
    if manual_gc is None:
        manual_gc = own_hooks.enter_context(ManualGC(tr))
    on_step = _step_callback(cfg, scheduler, state, result, logger, monitor, batch_at,
                             (profiler.on_step, manual_gc.after_step))

    start_iteration = state.iteration
    t0 = time.perf_counter()
    off_clock = 0.0  # seconds of evaluations and saves between segments
    check_every = _check_every(cfg, 0.0)
    scaler = getattr(optimizer, "scaler", None)
    # --profile: the window's edges are steps (on_step), so nothing drains for it
    with own_hooks:
        while state.iteration < train_iters:
            stop = _segment_end(cfg, state, train_iters, valid_iter is not None, check_every,
                                monitor, scaler, batch_sizes)
            profiler.next_segment()  # (finetuning's next epoch)
            profiler.segment_end = stop
            segment_batch = batch_at(state.consumed_train_samples)
            if batch_sizes is not None:  # a segment trains batches of one size
                engine.set_num_microbatches(segment_batch // samples_per_microbatch)
            t_segment, first = time.perf_counter(), state.iteration
            engine.train_batches(train_iter, stop - state.iteration,
                                 lr_provider=scheduler.get_lr, on_step=on_step)
            it = state.iteration
            # Identical on every rank (agreed step reports): all stop here, none saves.
            if monitor.reason is not None:
                logger.close()
                raise NonFiniteError(monitor.reason)
            code = ExitRequests.NONE
            if exits is not None and exits.active:
                per_iter = (time.perf_counter() - t_segment) / max(1, it - first)
                code, per_iter = _agree(exits.local_code(), per_iter, engine.device)
                # the next batches' size: a larger batch takes longer per iteration
                per_iter *= batch_at(state.consumed_train_samples) / segment_batch
                check_every = _check_every(cfg, per_iter)
            # at the end of the run (or of a finetuning epoch) the caller's own end follows:
            # its evaluation, score and save; the request is acted on at the next check
            if code != ExitRequests.NONE and it < train_iters:
                profiler.stop()  # the trace ends with the last batch, not with the save
                saved = tr.save and _save_checked(cfg, groups, engine, optimizer, scheduler,
                                                  state, monitor)
                print_rank_last(f"stopped at iteration {it}: {exits.describe(code)}"
                                + (f", checkpoint saved to {tr.save}" if saved else
                                   ", no checkpoint (no --save)" if not tr.save else
                                   ", no checkpoint saved"))
                result.exited_early = True
                break
            profiler.next_segment()
            # evaluation and saves are not training time: the log line after them would
            # count them in its time per iteration (Megatron-LM leaves them out too)
            # (and not in result.seconds_per_iteration either: ``off_clock``)
            t_off = time.perf_counter()
            if valid_iter is not None and tr.eval_interval and it % tr.eval_interval == 0:
                with logger.paused(), manual_gc.around_evaluation():
                    losses = evaluate_and_print(engine, valid_iter, tr.eval_iters, "validation",
                                                it, logger, samples=state.consumed_train_samples)
                state.consumed_valid_samples += tr.eval_iters * tr.global_batch_size
                if losses:
                    result.eval_losses[it] = losses
            if tr.save and tr.save_interval and it % tr.save_interval == 0:
                with logger.paused():
                    _save_checked(cfg, groups, engine, optimizer, scheduler, state, monitor)
            off_clock += time.perf_counter() - t_off
            if tr.exit_interval and it % tr.exit_interval == 0 and it < train_iters:
                if tr.save and not (tr.save_interval and it % tr.save_interval == 0):
                    _save_checked(cfg, groups, engine, optimizer, scheduler, state, monitor)
                print_rank_last(f"exiting at iteration {it} (--exit-interval {tr.exit_interval})")
                result.exited_early = True
                break
    engine.finish_sums()
    done = state.iteration - start_iteration
    if done:
        result.seconds_per_iteration = (time.perf_counter() - t0 - off_clock) / done
    result.nonfinite_ending = monitor.ending_verdict()
    return result


def _end_of_run(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine, optimizer,
                scheduler, state: TrainState, valid_iter, test_iter, logger: TrainingLogger,
                result: TrainingResult) -> None:
    """After training: the memory table; then, unless the run stopped early (its stop
    saved already), Megatron-LM's end: the final save (when the last iteration was not a
    --save-interval multiple), then the evaluation 'on validation set' and 'on test set'.

    The save comes first, as in Megatron-LM's ``pretrain``: the checkpoint's consumed
    validation samples do not count the end-of-run evaluation (a longer run resumed from
    it evaluates the batches an uninterrupted run does, whether or not the last
    iteration was a --save-interval multiple), and a job stopped during that evaluation
    keeps its trained iterations."""
    tr = cfg.training
    result.iteration = state.iteration
    result.shared_embedding = _shared_embedding_copy(engine)
    result.memory = gather_memory_report(engine, groups)
    logger.memory_table(result.memory)
    if result.nonfinite_ending is not None:
        # same verdict on every rank (agreed step reports): all raise, none saves
        logger.close()
        raise NonFiniteError(result.nonfinite_ending)
    if result.exited_early:
        return
    if tr.save and state.iteration > 0 and not tr.skip_train and not (
            tr.save_interval and state.iteration % tr.save_interval == 0):
        _save_checked(cfg, groups, engine, optimizer, scheduler, state)
    # as Megatron-LM: 'iteration N on validation set' / 'on test set'; an evaluation-only
    # run (--skip-train) writes no TensorBoard scalars
    tb = not tr.skip_train
    if valid_iter is not None and tr.eval_iters:
        losses = evaluate_and_print(engine, valid_iter, tr.eval_iters, "validation",
                                    state.iteration, logger,
                                    samples=state.consumed_train_samples, at_end=True,
                                    to_tensorboard=tb)
        state.consumed_valid_samples += tr.eval_iters * tr.global_batch_size
        if losses:
            result.eval_losses[state.iteration] = losses
    if test_iter is not None and tr.eval_iters:
        losses = evaluate_and_print(engine, test_iter, tr.eval_iters, "test", state.iteration,
                                    logger, samples=state.consumed_train_samples, at_end=True,
                                    to_tensorboard=tb)
        if losses:
            result.test_losses[state.iteration] = losses


def gather_memory_report(engine: PipelineEngine, groups: ParallelGroups) -> Dict[str, Any]:
    """Every rank's stage memory counters, gathered so the logging rank can print them."""
    mine = {"rank": groups.rank, "stage": groups.pp_rank, "dp": groups.dp_rank,
            "tp": groups.tp_rank, **engine.memory_stats()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    return {"per_rank": everyone}


def _shared_embedding_copy(engine: PipelineEngine) -> Optional[torch.Tensor]:
    for p in engine.weights.params(engine.latest_buffer):
        if getattr(p, "shared_embedding", False):
            return p.detach().cpu().clone()
    return None

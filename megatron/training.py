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

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.checkpointing import TrainState
from megatron.config import MegatronConfig
from megatron.entry import run_entry_point  # noqa: F401 - entry points import it from here
from megatron.errors import DataError, UserError, alike_on_every_rank
from megatron.initialize import (barrier_with_message, exit_when_parent_dies,
                                 initialize_distributed, set_random_seed, tune_host_malloc)
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.engine import PipelineEngine
from megatron.pipeline.update import StepReport
from megatron.training_checkpoint import maybe_load, save
from megatron.training_log import TrainingLogger, print_rank_last


class NonFiniteError(UserError):
    """The run stopped because its steps keep producing inf/nan (or its weights are not
    finite).  One line; the entry point exits 1 without saving."""

    exit_code = 1


@dataclass
class SkipMonitor:
    """Decides, from the agreed step reports, when a run that keeps skipping must stop.

    Every rank sees the same ``skipped``/``grad_scale`` sequence (the optimizer agrees
    on them), so every rank reaches the same verdict at the same iteration.

    * ``limit`` skipped steps in a row stop the run (0: never).  With dynamic fp16 loss
      scaling the skips before the first applied step are the scale calibrating down
      from --initial-loss-scale (dozens with the default 2^32) and do not count, unless
      the batch already ran at --min-loss-scale (the scale cannot calibrate further);
      any later skip (loss-scale backoff included) does.  An overflow at
      --min-loss-scale is one more skipped step, as in Megatron-LM, not a stop: a
      one-off spike must not end a run whose scale floor the user raised.
    * ``suspect``: the latest steps were skipped for a non-finite loss or gradients that
      no loss-scale backoff explains (any run but dynamic fp16): the weights produced
      them, so they are not checkpointed (``_save_checked``), and a run that ends so
      fails (``ending_verdict``).
    """

    limit: int
    dynamic_fp16: bool = False
    min_loss_scale: float = 1.0
    consecutive: int = 0
    first_skipped: int = 0
    applied_any: bool = False
    reason: Optional[str] = None

    @classmethod
    def from_config(cls, cfg: MegatronConfig) -> "SkipMonitor":
        prec = cfg.precision
        return cls(limit=cfg.training.max_consecutive_skipped_steps,
                   dynamic_fp16=bool(prec.fp16 and prec.loss_scale is None),
                   min_loss_scale=prec.min_loss_scale)

    def update(self, report: StepReport) -> None:
        if self.reason is not None:
            return
        t = report.iteration + 1  # 1-based, as logged
        if not report.skipped:
            self.consecutive, self.applied_any = 0, True
            return
        at_floor = self.dynamic_fp16 and report.grad_scale <= self.min_loss_scale
        if self.dynamic_fp16 and not self.applied_any and not at_floor:
            return  # the scale is still calibrating down
        if self.consecutive == 0:
            self.first_skipped = t
        self.consecutive += 1
        if self.limit and self.consecutive >= self.limit:
            floor = (f" at the minimum loss scale {report.grad_scale:g} (--min-loss-scale)"
                     if at_floor else "")
            self.reason = (f"{self.consecutive} optimizer steps in a row were skipped for "
                           f"non-finite loss or gradients{floor} (iterations "
                           f"{self.first_skipped}-{t}, --max-consecutive-skipped-steps "
                           f"{self.limit}); stopped without saving (lower --lr, or check the "
                           "data and the last checkpoint)")

    def batches_before_verdict(self, steps_to_min_scale: Optional[int] = None
                               ) -> Optional[int]:
        """How many more batches can run before one whose report could stop the run
        (that batch included), or None if no report ever can.  A training segment of
        that many batches ends exactly where one-batch segments would first stop.

        ``steps_to_min_scale``: dynamic fp16, the fewest updates until the loss scale can
        be --min-loss-scale (``DynamicGradScaler.steps_to_min_scale``); before the first
        applied step, skips count only from the batch that runs at that scale."""
        if self.reason is not None:
            return 1
        if not self.limit:
            return None
        left = max(1, self.limit - self.consecutive)
        if self.dynamic_fp16 and not self.applied_any and self.consecutive == 0:
            left += steps_to_min_scale or 0
        return left

    @property
    def suspect(self) -> bool:
        return self.consecutive > 0 and not self.dynamic_fp16

    def streak(self) -> str:
        """The current run of skipped steps, as logged (1-based iterations)."""
        last = self.first_skipped + self.consecutive - 1
        return (f"iteration {last}" if self.consecutive == 1
                else f"iterations {self.first_skipped}-{last}")

    def ending_verdict(self) -> Optional[str]:
        """Why a run that ends now failed (its last steps were non-finite), or None."""
        if not self.suspect:
            return None
        return (f"the last {self.consecutive} optimizer step(s) ({self.streak()}) were skipped "
                "for non-finite loss or gradients, so the run ends on weights that produce "
                "them; not saved, the last saved checkpoint is kept (lower --lr, or check "
                "the data)")


STARTED = time.monotonic()
"""When this module was imported (early in every entry point): --exit-duration-in-mins
counts from here, as Megatron-LM counts from its own start."""


class _SignalFlag:
    """SIGTERM noted by a handler; acted on at the next drain point (never mid-batch)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: Any = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.received = signum

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class ExitRequests:
    """Why a run may stop early at a batch boundary: a SIGTERM (--exit-signal-handler)
    or the time limit (--exit-duration-in-mins).  ``install`` the SIGTERM handler for
    the training loop, ``restore`` it after."""

    NONE, DURATION, SIGNAL = 0, 1, 2
    """Codes agreed across ranks by a MAX all-reduce (a SIGTERM outranks the clock)."""

    def __init__(self, cfg: MegatronConfig) -> None:
        tr = cfg.training
        self.signals = _SignalFlag() if tr.exit_signal_handler else None
        self.minutes = tr.exit_duration_in_mins

    @property
    def active(self) -> bool:
        return self.signals is not None or self.minutes is not None

    def install(self) -> None:
        if self.signals is not None:
            self.signals.install()

    def restore(self) -> None:
        if self.signals is not None:
            self.signals.restore()

    def minutes_elapsed(self) -> float:
        return (time.monotonic() - STARTED) / 60.0

    def local_code(self) -> int:
        if self.signals is not None and self.signals.received is not None:
            return self.SIGNAL
        if self.minutes is not None and self.minutes_elapsed() > self.minutes:
            return self.DURATION
        return self.NONE

    def describe(self, code: int) -> str:
        if code == self.SIGNAL:
            return "SIGTERM (--exit-signal-handler)"
        return (f"{self.minutes_elapsed():.2f} minutes since start "
                f"(--exit-duration-in-mins {self.minutes:g})")


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any rank (one tiny all-reduce)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def check_weights_finite(engine: PipelineEngine, iteration: int) -> None:
    """Refuse to checkpoint inf/nan weights (every weight buffer, every rank agrees).

    Collective: every rank calls it before the same save."""
    bad = None
    with torch.no_grad():
        for b in range(engine.weights.num_buffers):
            for p in engine.weights.params(b):
                if not bool(torch.isfinite(p).all()):
                    bad = f"pipeline stage {engine.stage}"
                    break
            if bad:
                break
    if _any_rank(bad is not None, engine.device):
        raise NonFiniteError(f"refusing to save the checkpoint of iteration {iteration}: the "
                             f"weights are not finite ({bad or 'on another rank'}); the last "
                             "saved checkpoint is kept")


@dataclass
class TrainingResult:
    """What pretrain() returns on each rank (used by tests and benches)."""

    iteration: int = 0
    losses: Dict[int, Dict[str, float]] = field(default_factory=dict)
    reports: List[StepReport] = field(default_factory=list)
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


def _cyclic(loader, first=None) -> Iterator[Any]:
    """``first`` (a loader starting later in the same data) once, then ``loader`` over
    and over."""
    if first is not None:
        yield from first
    while True:
        for item in loader:
            yield item


def _until_exhausted(iterator, start_iteration: int, start_samples: int, train_iters: int,
                     dataset_samples: int, samples_per_microbatch: int, tr) -> Iterator[Any]:
    """``iterator``'s items; when it runs out, a one-line DataError naming the iteration
    (the engine would fail with a traceback).  The trainer asks the datasets provider
    for every sample the run needs, so only a provider that returns fewer gets here."""
    read = 0
    for item in iterator:
        read += 1
        yield item
    samples = read * samples_per_microbatch
    batches = tr.batch_sizes()
    done = (batches.iterations(start_samples + samples, start_samples) if batches is not None
            else samples // tr.global_batch_size)
    needed = tr.samples_after(train_iters - start_iteration, start_samples)
    raise alike_on_every_rank(DataError(
        f"the training data ran out at iteration {start_iteration + done + 1} of "
        f"{train_iters}: the training dataset holds {dataset_samples} samples "
        f"and this run reads samples {start_samples} to {needed - 1} (the datasets provider "
        f"returned fewer samples than it was asked for); the last saved checkpoint stays "
        f"the latest"))


def build_data_iterators(cfg: MegatronConfig, groups: ParallelGroups, tokenizer,
                         datasets_provider, state: TrainState) -> Tuple[Any, Any, Any]:
    from megatron.data.samplers import build_pretraining_data_loader

    tr = cfg.training
    gbs = tr.global_batch_size
    train_iters = tr.train_iters or 0
    eval_runs = (train_iters // tr.eval_interval + 1) if tr.eval_interval else 1
    # a resumed run reads on from its consumed samples (more or fewer than
    # iteration x gbs when --global-batch-size changed)
    n_train = max(tr.samples_after(train_iters, 0),
                  tr.samples_after(train_iters - state.iteration, state.consumed_train_samples))
    n_valid = eval_runs * tr.eval_iters * gbs
    n_test = tr.eval_iters * gbs
    train_ds, valid_ds, test_ds = datasets_provider(cfg, tokenizer, (n_train, n_valid, n_test))

    def loader(ds, consumed):
        if ds is None or len(ds) == 0:
            return None
        return build_pretraining_data_loader(ds, consumed, tr.micro_batch_size, groups.dp_rank,
                                             groups.dp_size, cfg.data.num_workers)

    # Evaluation only: no train loader, whose position (consumed samples of a finished
    # run) may lie at the end of the training set.
    train = None if tr.skip_train else loader(train_ds, state.consumed_train_samples)
    valid = loader(valid_ds, 0)
    test = loader(test_ds, 0)
    if tr.eval_iters:
        # a split too small for one micro-batch yields nothing, and the cyclic reader
        # below would spin forever at the first evaluation
        for split, name, ld, ds in ((1, "validation", valid, valid_ds),
                                    (2, "test", test, test_ds)):
            if ld is not None and len(ld) == 0:
                n = len(ds)
                raise alike_on_every_rank(DataError(
                    f"the {name} split holds {n} sample{'s' if n != 1 else ''}, fewer than one "
                    f"micro-batch of --micro-batch-size {tr.micro_batch_size} x data-parallel "
                    f"size {groups.dp_size} ({cfg.data.describe_split(split)}); give it more "
                    f"data, or pass --eval-iters 0 to train without evaluating"))
    # validation reads on from where the checkpoint's run left it (Megatron-LM's
    # consumed_valid_samples), so a resumed run evaluates the batches an uninterrupted
    # one would; past the end it starts over from the first sample
    ahead = (loader(valid_ds, state.consumed_valid_samples % len(valid_ds))
             if valid is not None and state.consumed_valid_samples else None)
    if train is not None:
        train_iter = _until_exhausted(iter(train), state.iteration,
                                      state.consumed_train_samples, train_iters, len(train_ds),
                                      tr.micro_batch_size * groups.dp_size, tr)
    return (train_iter if train is not None else None,
            _cyclic(valid, first=ahead) if valid is not None else None,
            _cyclic(test) if test is not None else None)


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


def train(cfg: MegatronConfig, groups: ParallelGroups, engine: PipelineEngine, optimizer,
          scheduler, state: TrainState, train_iter, valid_iter, logger: TrainingLogger,
          result: TrainingResult, exits: Optional[ExitRequests] = None) -> TrainingResult:
    tr = cfg.training
    train_iters = tr.train_iters or 0
    batch_sizes = tr.batch_sizes()  # built once: batch_size_at runs every step

    def batch_at(consumed: int) -> int:
        return (batch_sizes.batch_size_at(consumed) if batch_sizes is not None
                else tr.global_batch_size)

    samples_per_microbatch = tr.micro_batch_size * groups.dp_size
    monitor = SkipMonitor.from_config(cfg)

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
        logger.on_step(report, state, size, decoupled_lr, weight_decay)
        monitor.update(report)

    start_iteration = state.iteration
    t0 = time.perf_counter()
    off_clock = 0.0  # seconds of evaluations and saves between segments
    check_every = _check_every(cfg, 0.0)
    flushing = cfg.parallel.pipeline_schedule != "2bw"
    scaler = getattr(optimizer, "scaler", None)
    while state.iteration < train_iters:
        stop = _next_drain(state.iteration, cfg, train_iters, valid_iter is not None,
                           check_every)
        if flushing:  # end where the skip monitor could first stop the run (no fill lost)
            to_min = getattr(scaler, "steps_to_min_scale", None)
            ahead = monitor.batches_before_verdict(to_min() if to_min else None)
            if ahead is not None:
                stop = min(stop, state.iteration + ahead)
        segment_batch = batch_at(state.consumed_train_samples)
        if batch_sizes is not None:  # a segment trains batches of one size
            same = batch_sizes.batches_at_this_size(state.consumed_train_samples)
            if same is not None:
                stop = min(stop, state.iteration + same)
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
            saved = tr.save and _save_checked(cfg, groups, engine, optimizer, scheduler,
                                              state, monitor)
            print_rank_last(f"stopped at iteration {it}: {exits.describe(code)}"
                            + (f", checkpoint saved to {tr.save}" if saved else
                               ", no checkpoint (no --save)" if not tr.save else
                               ", no checkpoint saved"))
            result.exited_early = True
            break
        # evaluation and saves are not training time: the log line after them would
        # count them in its time per iteration (Megatron-LM leaves them out too)
        # (and not in result.seconds_per_iteration either: ``off_clock``)
        t_off = time.perf_counter()
        if valid_iter is not None and tr.eval_interval and it % tr.eval_interval == 0:
            with logger.paused():
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


def check_train_data(cfg: MegatronConfig, train_iter) -> None:
    """Training was asked for: there must be samples to train on (every rank builds the
    same datasets, so every rank raises)."""
    if not cfg.training.skip_train and train_iter is None:
        raise alike_on_every_rank(DataError(
            f"nothing to train on: the training split is empty ({cfg.data.describe_split(0)}); "
            f"give the training part a share of the data"))


def check_eval_data(cfg: MegatronConfig, valid_iter) -> None:
    """Evaluation only (--skip-train) was asked for: there must be something to
    evaluate, or the run would do nothing and exit 0 (every rank builds the same
    datasets, so every rank raises)."""
    from megatron.arguments import ArgumentError  # a verdict on flags: one line a node

    tr = cfg.training
    if not tr.skip_train:
        return
    if not tr.eval_iters:
        raise ArgumentError("nothing to do: --skip-train only evaluates, and --eval-iters 0 "
                            "evaluates nothing; give --eval-iters a positive number of "
                            "batches")
    if valid_iter is None:
        raise alike_on_every_rank(DataError(
            f"nothing to evaluate: --skip-train only evaluates, and the validation split is "
            f"empty ({cfg.data.describe_split(1)}); give the validation part a share of the "
            f"data" + (" (--valid-data-path)" if cfg.data.split_data_paths else "")))


def _shared_embedding_copy(engine: PipelineEngine) -> Optional[torch.Tensor]:
    for p in engine.weights.params(engine.latest_buffer):
        if getattr(p, "shared_embedding", False):
            return p.detach().cpu().clone()
    return None


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

"""Megatron-style log lines, printed by the last rank (it holds the losses)."""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron.config import MegatronConfig, TensorBoardOptions
from megatron.parallel_state import ParallelGroups


def is_logging_rank() -> bool:
    if not dist.is_initialized():
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(msg: str) -> None:
    if is_logging_rank():
        print(msg, flush=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


PHASE_TIMERS: Dict[str, str] = {
    "F": "forward-compute", "B": "backward-compute",
    "SA": "forward-send", "RA": "forward-recv", "SG": "backward-send", "RG": "backward-recv",
    "R@": "all-grads-sync", "S@": "optimizer"}
"""Pipeline action code -> Megatron-LM's timer name.  With --log-timers-to-tensorboard
the logging (last) rank writes ``<name>-time``: the wall seconds its executor spent in
actions of that kind, per iteration, averaged over the iterations since the last log line
(as Megatron-LM's timers, which are reset by the log line); ``forward-backward-time`` is
the sum of every kind but the optimizer step.  Megatron-LM writes each timer's maximum
over the ranks; here only the last rank's own times are written (no collective)."""

MEMORY_SCALARS = (("mem-reserved-bytes", "reserved_bytes.all.current"),
                  ("mem-allocated-bytes", "allocated_bytes.all.current"),
                  ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
                  ("mem-allocated-count", "allocation.all.current"))
"""--log-memory-to-tensorboard: tag -> torch.cuda.memory_stats() key, as Megatron-LM."""


class TrainingLogger:
    """Accumulates per-step reports and prints one line every --log-interval steps."""

    def __init__(self, cfg: MegatronConfig, groups: ParallelGroups,
                 flops_per_iteration: Optional[float] = None,
                 device: Optional[torch.device] = None) -> None:
        """``device``: this rank's device, for --log-memory-to-tensorboard (default: the
        current CUDA device where CUDA is in use, else the CPU)."""
        self.cfg = cfg
        self.groups = groups
        self.flops = flops_per_iteration
        self.total_iterations: Optional[int] = None
        """The N of 'iteration i/N' when it is not --train-iters (finetuning trains one
        epoch at a time, each to its own end)."""
        self.world = groups.layout.world_size
        self.decoupled_lr: Optional[float] = None
        """The last step's --decoupled-lr rate (None without the flag)."""
        self.weight_decay: Optional[float] = None
        """The last step's weight decay (only with --weight-decay-incr-style linear or
        cosine, else None)."""
        self.active = is_logging_rank()
        self.tb: TensorBoardOptions = cfg.training.tensorboard
        self.writer = None
        if self.active and cfg.training.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("--tensorboard-dir needs the tensorboard package: "
                                   "pip install tensorboard") from exc
            self.writer = SummaryWriter(log_dir=cfg.training.tensorboard_dir,
                                        max_queue=self.tb.queue_size)
        self.memory_device: Optional[torch.device] = None
        """The CUDA device whose memory counters are written (None: none written)."""
        if self.writer is not None and self.tb.memory:
            if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
                device = torch.device("cuda", torch.cuda.current_device())
            if device is not None and device.type == "cuda":
                self.memory_device = device
            else:  # torch.cuda.memory_stats exists only for CUDA devices
                print("warning: --log-memory-to-tensorboard: this run is not on a CUDA "
                      "device, so no mem-* scalars are written (they are torch.cuda's "
                      "allocator counters)", flush=True)
        self._timer_engine = None
        self._timer_keep = True
        self._timer_pos = 0
        self._reset()

    def watch_timers(self, engine, keep_events: bool) -> None:
        """--log-timers-to-tensorboard: time ``engine``'s pipeline actions (its trace)
        on this rank for the per-phase timer scalars (``PHASE_TIMERS``).  Without
        ``keep_events`` (no --timeline-file wants them) the events read are dropped, so
        a long run's trace does not grow.  Nothing happens on the other ranks, or without
        --tensorboard-dir or the flag."""
        if self.writer is None or not self.tb.timers:
            return
        engine.trace_enabled = True
        self._timer_engine = engine
        self._timer_keep = keep_events
        self._timer_pos = len(engine.trace_events)

    def _collect_timers(self) -> None:
        events = self._timer_engine.trace_events
        for e in events[self._timer_pos:]:
            if e["train"] and e["op"] in PHASE_TIMERS:
                self.timer_sums[e["op"]] = (self.timer_sums.get(e["op"], 0.0)
                                            + e["end"] - e["start"])
        if self._timer_keep:
            self._timer_pos = len(events)
        else:
            del events[:]
            self._timer_pos = 0

    def _reset(self) -> None:
        self.t_last = time.perf_counter()
        self.steps = 0
        self.samples = 0
        self.skipped = 0
        self.nan = 0
        self.loss_sums: Dict[str, float] = {}
        self.loss_count = 0
        self.loss_keys: set = set()
        self.timer_sums: Dict[str, float] = {}
        """Seconds per pipeline action code since the last log line (timers' reset)."""

    def _recompute(self, engine) -> str:
        mc = self.cfg.model
        if engine.stage_recompute:
            return "whole stage"
        if mc.recompute_method == "uniform":
            return f"layers, {mc.recompute_num_layers} per chunk"
        if mc.recompute_method == "block":
            return f"first {mc.recompute_num_layers} layers of the stage"
        return "selective" if mc.recompute_granularity == "selective" else "off"

    def banner(self, engine, model) -> None:
        tr, par = self.cfg.training, self.cfg.parallel
        m = str(tr.num_microbatches(self.groups.dp_size))
        if tr.batch_schedule:  # the range the batch schedule goes through
            unit = tr.micro_batch_size * self.groups.dp_size
            ms = [size // unit for _, size in tr.batch_schedule]
            m = f"{min(ms)}..{max(ms)}" if min(ms) != max(ms) else m
        n_params = sum(p.numel() for p in model.parameters())
        schedule = par.pipeline_schedule
        if schedule == "2bw" and par.tbw_mitigation == "warmup":
            schedule += (f" (--2bw-mitigation warmup: flush semantics before iteration "
                         f"{par.tbw_flush_warmup_iters})")
        elif schedule == "2bw" and par.tbw_mitigation != "none":
            schedule += f" (--2bw-mitigation {par.tbw_mitigation})"
        print_rank_last(
            f"pipeline schedule: {schedule} | microbatches per batch m={m} | "
            f"pipeline depth d={self.groups.pp_size} | parallel pipelines w={self.groups.dp_size} | "
            f"tensor parallel t={self.groups.tp_size} | micro batch {tr.micro_batch_size} | "
            f"global batch {tr.global_batch_size}"
            + (f" (batch sizes {tr.batch_sizes().describe()})" if tr.batch_schedule else "")
            + f" | recompute {self._recompute(engine)}"
            + (f" | receives posted {'ahead' if engine.p2p.prepost_receives else 'when needed'}"
               if self.groups.pp_size > 1 else "")
            + f" | parameters on the last stage: {n_params:,}")

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside (evaluation, checkpoint saves, the start-up barrier)
        out of the next log line's time per iteration, samples/s and TFLOP/s, as
        Megatron-LM stops its 'interval-time' timer around them: otherwise the first line
        after an evaluation reports the evaluation as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.t_last += time.perf_counter() - start

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, step)

    def scalars(self, name: str, value: float, iteration: int,
                samples: Optional[int]) -> None:
        """Megatron-LM's pair: ``name`` against the iteration and ``name vs samples``
        against the consumed training samples."""
        self.scalar(name, value, iteration)
        if samples is not None:
            self.scalar(f"{name} vs samples", value, samples)

    def on_step(self, report, state, batch_size: Optional[int] = None,
                decoupled_lr: Optional[float] = None,
                weight_decay: Optional[float] = None) -> None:
        """``batch_size``: the step's global batch (default --global-batch-size; it
        differs under --rampup-batch-size or --step-batch-size-schedule).
        ``decoupled_lr``: the input and output layers' rate of the step (--decoupled-lr),
        printed after the regular rate as Megatron-LM does.
        ``weight_decay``: the step's weight decay where it changes during training
        (--weight-decay-incr-style), printed after the rates and written to TensorBoard
        as ``weight-decay``."""
        if not self.active:
            return
        self.decoupled_lr = decoupled_lr
        self.weight_decay = weight_decay
        self.steps += 1
        self.last_batch = (batch_size if batch_size is not None
                           else self.cfg.training.global_batch_size)
        self.samples += self.last_batch
        self.skipped += int(report.skipped)
        if self.is_nan_iteration(report):
            self.nan += 1
        finite = report.losses and all(math.isfinite(v) for v in report.losses.values())
        # As Megatron-LM: the interval's loss is the mean over the iterations applied; a
        # skipped one (an fp16 overflow, or a NaN batch) adds neither its loss nor a count.
        if finite and not report.skipped:
            for k, v in report.losses.items():
                self.loss_sums[k] = self.loss_sums.get(k, 0.0) + v
            self.loss_count += 1
        if report.losses:
            self.loss_keys.update(report.losses)
        if self._timer_engine is not None:
            self._collect_timers()
        if self.writer is not None and state.iteration % self.tb.log_interval == 0:
            self._write_scalars(report, state)
        interval = self.cfg.training.log_interval
        if state.iteration % interval == 0:
            self._print(report, state)

    @staticmethod
    def shown_grad_norm(report) -> Optional[float]:
        """As Megatron-LM, whose optimizer returns no norm for a step it skips: a skipped
        iteration has no grad norm (nor num zeros) in the log line or TensorBoard."""
        return None if report.skipped else report.grad_norm

    def _write_scalars(self, report, state) -> None:
        """The per-iteration scalars of an iteration divisible by
        --tensorboard-log-interval: the iteration's own values, not interval averages."""
        tb = self.tb
        it, samples = state.iteration, state.consumed_train_samples
        if report.losses:
            for k, v in report.losses.items():
                self.scalars(k, v, it, samples)
        if tb.learning_rate:
            self.scalars("learning-rate", report.lr, it, samples)
            if self.decoupled_lr is not None:
                self.scalar("decoupled-learning-rate", self.decoupled_lr, it)
        if self.weight_decay is not None:
            self.scalars("weight-decay", self.weight_decay, it, samples)
        if tb.batch_size:
            self.scalars("batch-size", self.last_batch, it, samples)
        if tb.loss_scale:
            self.scalars("loss-scale", report.loss_scale, it, samples)
        if tb.world_size:
            self.scalars("world-size", self.world, it, samples)
        grad_norm = self.shown_grad_norm(report)
        if grad_norm is not None:
            self.scalars("grad-norm", grad_norm, it, samples)
        if report.num_zeros is not None and not report.skipped:
            self.scalars("num-zeros", report.num_zeros, it, samples)
        if report.params_norm is not None:
            self.scalars("params-norm", report.params_norm, it, samples)
        if self.memory_device is not None:
            stats = torch.cuda.memory_stats(self.memory_device)
            for tag, key in MEMORY_SCALARS:
                self.scalar(tag, stats.get(key, 0), it)
        if self._timer_engine is not None and self.steps:
            for code, name in PHASE_TIMERS.items():
                if code in self.timer_sums:
                    self.scalar(f"{name}-time", self.timer_sums[code] / self.steps, it)
            fb = sum(v for code, v in self.timer_sums.items() if code != "S@")
            self.scalar("forward-backward-time", fb / self.steps, it)

    def is_nan_iteration(self, report) -> bool:
        """A non-finite loss, or non-finite gradients where they are not the routine
        overflow that fp16 loss scaling expects (those count as skipped only)."""
        if report.losses and any(not math.isfinite(v) for v in report.losses.values()):
            return True
        grad_nan = report.grad_norm is not None and not math.isfinite(report.grad_norm)
        return grad_nan and not self.cfg.precision.fp16

    def _print(self, report, state) -> None:
        """Megatron-LM's line: its fields in its order and number formats; ours
        (samples/s, weight decay) sit between them."""
        tr = self.cfg.training
        elapsed = time.perf_counter() - self.t_last
        per_iter = elapsed / max(self.steps, 1)
        samples_per_s = self.samples / elapsed if elapsed > 0 else 0.0
        total = self.total_iterations if self.total_iterations is not None else tr.train_iters
        parts = [f" iteration {state.iteration:8d}/{total or 0:8d}",
                 f"consumed samples: {state.consumed_train_samples:12d}",
                 f"elapsed time per iteration (ms): {per_iter * 1000:.1f}"]
        if self.tb.timers:  # Megatron-LM writes these with --log-timers-to-tensorboard
            self.scalar("iteration-time", per_iter, state.iteration)
        if self.flops and elapsed > 0:  # flops of a full batch, per sample trained
            tflops = self.flops / tr.global_batch_size * self.samples / elapsed / self.world / 1e12
            # fixed-point, as Megatron-LM's {:.1f}; below 1 with the digits a CPU run needs
            shown = f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.4f}"
            parts.append(f"throughput per GPU (TFLOP/s/GPU): {shown}")
            if self.tb.timers:
                self.scalar("throughput", tflops, state.iteration)
        parts.append(f"samples/s: {samples_per_s:.2f}")
        parts.append(f"learning rate: {report.lr:.6E}")
        if self.decoupled_lr is not None:
            parts.append(f"decoupled learning rate: {self.decoupled_lr:.6E}")
        parts.append(f"global batch size: {self.last_batch:5d}")  # on every line, as Megatron-LM
        if self.weight_decay is not None:
            parts.append(f"weight decay: {self.weight_decay:.6E}")
        for k in list(self.loss_sums) + sorted(self.loss_keys - set(self.loss_sums)):
            if k in self.loss_sums:
                parts.append(f"{k}: {self.loss_sums[k] / max(self.loss_count, 1):.6E}")
            else:  # no iteration of the interval was applied with a finite loss
                parts.append(f"{k}: nan")
        parts.append(f"loss scale: {report.loss_scale:.1f}")
        grad_norm = self.shown_grad_norm(report)
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        if report.num_zeros is not None and not report.skipped:
            parts.append(f"num zeros: {float(report.num_zeros):.1f}")  # Megatron-LM's float
        if report.params_norm is not None:
            parts.append(f"params norm: {report.params_norm:.3f}")
        parts += [f"number of skipped iterations: {self.skipped:3d}",
                  f"number of nan iterations: {self.nan:3d}"]
        print(" | ".join(parts) + " |", flush=True)
        self._reset()

    def memory_table(self, report: Dict[str, Any]) -> None:
        if not self.active:
            return
        rows = sorted(report["per_rank"], key=lambda r: (r["stage"], r["dp"], r["tp"]))
        lines = ["per-stage memory (measured by the pipeline executor):",
                 f"{'rank':>5} {'stage':>5} {'in-flight':>9} {'stashed activations':>20} "
                 f"{'weight versions':>15} {'weight bytes':>14}"]
        for r in rows:
            lines.append(f"{r['rank']:>5} {r['stage']:>5} {r['peak_in_flight']:>9} "
                         f"{_fmt_bytes(r['peak_stashed_activation_bytes']):>20} "
                         f"{r['peak_weight_versions']:>15} {_fmt_bytes(r['peak_weight_bytes']):>14}")
        print("\n".join(lines), flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

"""Megatron-LM's --profile: a profiler over batches --profile-step-start <= t <
--profile-step-end on the global ranks of --profile-ranks.

* ``--use-pytorch-profiler``: ``torch.profiler`` (CPU activity, and CUDA's on a CUDA
  device; shapes and stacks, as Megatron-LM records them) over those batches; each
  profiled rank writes one Chrome/TensorBoard trace,
  ``<--tensorboard-dir>/<host>_rank<R>.<ns>.pt.trace.json`` (``chrome://tracing``,
  Perfetto, or TensorBoard's profiler plugin).
* otherwise (CUDA ranks only; refused on CPU before any rank waits):
  ``cudaProfilerStart`` before batch start and ``cudaProfilerStop`` after batch end - 1,
  with ``emit_nvtx`` ranges in between, for ``nsys profile
  --capture-range=cudaProfilerApi``.

The window's edges are optimizer steps (``on_step`` follows each applied batch), so the
pipeline is never drained for it: under 2BW the profiled stretch starts while the
forward passes of the first profiled batch may already be in flight, as a steady-state
profile should.  Batch numbers are the log's 0-based iterations; a resumed run whose
first batch is past the window profiles nothing (and says so), one inside it profiles the
rest.

A run that ends before the window does (``run_end``: --train-iters, or the first
--exit-interval stop) is stopped after its last batch.  The training loop tells the
profiler where each segment of batches ends (``segment_end``): the next
``ProfilerStep`` is opened only when the next segment starts (``next_segment``), so a
run stopped between segments (SIGTERM, --exit-duration-in-mins) leaves no step in the
trace for a batch it never trained, and its checkpoint save is not profiled.
"""
from __future__ import annotations

import gc
import os
import socket
import sys
import time
from typing import Optional

import torch

from megatron.config import ProfileOptions


class StepProfiler:
    """One rank's profiler window; inert on ranks outside --profile-ranks."""

    def __init__(self, options: Optional[ProfileOptions], rank: int, first_iteration: int,
                 device: torch.device, run_end: Optional[int] = None) -> None:
        self.options = options
        self.rank = rank
        self.device = device
        self.first_iteration = first_iteration
        self.enabled = (options is not None and rank in options.ranks
                        and first_iteration < options.end)
        self._stop_at = None if options is None else (
            options.end if run_end is None else min(options.end, run_end))
        """Batches done when the window closes: its end, or the run's when that is first."""
        self.segment_end: Optional[int] = None
        """Batches done at the end of the segment now training (set by the loop)."""
        self._step_pending = False
        self.trace_path: Optional[str] = None
        """The trace file this rank wrote (torch.profiler), once written."""
        self._prof = None
        self._nvtx = None
        self._cuda_open = False
        self._last_applied: Optional[int] = None

    # -- the run's hooks ---------------------------------------------------------------
    def start(self) -> None:
        """Before the first batch of the run (or of the resumed run)."""
        if not self.enabled:
            if (self.options is not None and self.rank in self.options.ranks
                    and self.first_iteration >= self.options.end):
                self._say(f"nothing profiled: this run starts at iteration "
                          f"{self.first_iteration}, past the window (batches "
                          f"{self.options.start}..{self.options.end - 1})")
            return
        opts = self.options
        first_profiled = max(opts.start, self.first_iteration)
        if opts.pytorch:
            before = first_profiled - self.first_iteration  # batches before the window
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=max(before - 1, 0),
                                                 warmup=1 if before > 0 else 0,
                                                 active=opts.end - first_profiled, repeat=1),
                on_trace_ready=self._write_trace, record_shapes=True, with_stack=True)
            self._prof.start()
        elif self.first_iteration >= opts.start:
            self._open_cuda_window()

    def on_step(self, iteration: int) -> None:
        """Batch ``iteration`` (0-based) has been applied."""
        if not self.enabled:
            return
        self._last_applied = iteration
        done = iteration + 1
        if self._prof is not None:
            if done >= self.options.end:
                self._prof.step()  # the schedule's last active step: the trace is written
                self.stop()
            elif done >= self._stop_at:
                self.stop()  # the run ends first: no step is opened for a batch not run
            elif done == self.segment_end:
                self._step_pending = True  # opened if and when the next segment starts
            else:
                self._prof.step()
        elif done == self.options.start and done < self._stop_at:
            self._open_cuda_window()
        elif done >= self._stop_at:
            self.stop()

    def next_segment(self) -> None:
        """The run goes on after a segment's end: the next batch's step opens now."""
        if self._step_pending:
            self._step_pending = False
            if self._prof is not None:
                self._prof.step()

    def stop(self) -> None:
        """At the window's end, or wherever the run stops first (what was recorded is
        written).  Safe to call again."""
        self._step_pending = False
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
            # its results go now, while the process groups they recorded are alive (left
            # to the collector after the groups are destroyed, they crashed the process)
            prof.on_trace_ready = None
            del prof
            gc.collect()
        if self._cuda_open:
            self._cuda_open = False
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaProfilerStop()
            self._say(f"cudaProfilerStop after batch {self._last_batch()}")

    # -- the two kinds ------------------------------------------------------------------
    def _open_cuda_window(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.cudart().cudaProfilerStart()
        self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
        self._nvtx.__enter__()
        self._cuda_open = True
        self._say(f"cudaProfilerStart before batch {max(self.options.start, self.first_iteration)}")

    def _write_trace(self, prof) -> None:
        opts = self.options
        os.makedirs(opts.trace_dir, exist_ok=True)
        name = f"{socket.gethostname()}_rank{self.rank}.{time.time_ns()}.pt.trace.json"
        path = os.path.join(opts.trace_dir, name)
        tmp = os.path.join(opts.trace_dir, f".{name}.tmp")
        try:
            prof.export_chrome_trace(tmp)
            os.replace(tmp, path)  # a reader never sees half a trace
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.trace_path = path
        first = max(opts.start, self.first_iteration)
        self._say(f"wrote the torch.profiler trace of batches {first}..{self._last_batch()} "
                  f"to {path}")

    def _last_batch(self) -> int:
        """The window's last batch, or the last one applied where the run stopped first."""
        last = self.options.end - 1
        return last if self._last_applied is None else min(last, self._last_applied)

    def __enter__(self) -> "StepProfiler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _say(self, text: str) -> None:
        print(f"profiler (rank {self.rank}): {text}", file=sys.stderr, flush=True)

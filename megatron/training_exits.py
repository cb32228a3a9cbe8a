"""Why a training run stops before its last iteration.

* Steps that keep producing inf/nan: ``SkipMonitor`` gives the verdict from the agreed
  step reports, ``NonFiniteError`` is the one line the run then fails with, and
  ``check_weights_finite`` refuses to checkpoint weights that are not finite.
* Exit requests, acted on at the next batch boundary: a SIGTERM (--exit-signal-handler)
  or the time limit (--exit-duration-in-mins, counted from ``STARTED``).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.config import MegatronConfig
from megatron.errors import UserError
from megatron.pipeline.engine import PipelineEngine
from megatron.pipeline.update import StepReport


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

"""Loss scalers for fp16 training.

The scale is a host-side Python float: the skip decision for a step is taken on the
host anyway (every pipeline stage must agree on it), so keeping the scale on the
device would only add synchronisations.

Semantics of ``DynamicGradScaler`` follow Megatron-LM:

* an overflow resets the clean-step counter and consumes one unit of hysteresis; the
  scale is multiplied by ``backoff_factor`` only once the hysteresis is used up (and
  then on every further overflow until the scale grows again);
* after ``growth_interval`` consecutive clean steps the scale is multiplied by
  ``growth_factor`` and the hysteresis budget is refilled;
* the scale never drops below ``min_scale``.

The hysteresis tracker is not floored: every overflow after the budget is spent takes it
one lower (-3 after five overflows with ``--hysteresis 2``), as Megatron-LM's does, and a
checkpoint stores it so; any integer loads.  A growth tracker at or past the window (a
resume with a shorter ``--loss-scale-window``) grows the scale at the next clean step.
"""
from __future__ import annotations

import math
from typing import Any, Dict


class ConstantGradScaler:
    """A fixed loss scale (static fp16 scaling, or 1.0 for bf16/fp32)."""

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"--loss-scale must be > 0, got {scale}")
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        """A constant scale ignores overflows (the step is still skipped by the caller)."""

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "constant", "scale": self._scale}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        # The configured constant wins: a static scale is a command-line choice,
        # not training state worth restoring.
        if sd.get("kind") not in ("constant", "dynamic"):
            raise ValueError(f"grad scaler state: unknown kind {sd.get('kind')!r}")


class DynamicGradScaler:
    """Loss scale that backs off on overflow and grows after a clean window."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2) -> None:
        if not initial_scale > 0:
            raise ValueError(f"--initial-loss-scale must be > 0, got {initial_scale}")
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"--min-loss-scale must be in (0, initial scale {initial_scale}], "
                             f"got {min_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"loss-scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss-scale backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {hysteresis}")
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale

    def steps_to_min_scale(self) -> int:
        """The fewest updates after which the scale can be ``min_scale``: 0 when it is
        already, else one per backoff (hysteresis only ever delays a backoff)."""
        scale, steps = self._scale, 0
        while scale > self.min_scale:
            scale, steps = max(scale * self.backoff_factor, self.min_scale), steps + 1
        return steps

    def update(self, found_inf: bool) -> None:
        """Advance the scaler by one step; ``found_inf`` must already be agreed by all ranks."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {"kind": "dynamic", "scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("kind") != "dynamic":
            # Switching from a static to a dynamic scale keeps our initial scale.
            return
        scale = float(sd["scale"])
        growth, hysteresis = int(sd["growth_tracker"]), int(sd["hysteresis_tracker"])
        # the hysteresis tracker is below 0 after repeated overflows (module docstring)
        if not (math.isfinite(scale) and scale > 0) or growth < 0:
            raise ValueError(f"grad scaler state: scale {sd['scale']!r}, growth tracker "
                             f"{sd['growth_tracker']!r}, hysteresis tracker "
                             f"{sd['hysteresis_tracker']!r}; expected a finite scale > 0 and "
                             f"a growth tracker >= 0")
        self._scale, self._growth_tracker, self._hysteresis_tracker = scale, growth, hysteresis


GradScaler = ConstantGradScaler | DynamicGradScaler

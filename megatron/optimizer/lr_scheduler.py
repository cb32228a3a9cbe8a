"""Learning-rate schedule: linear warmup, then constant, linear, cosine,
inverse-square-root or warmup-stable-decay (WSD), Megatron-LM's five styles.

Step counting follows Megatron-LM: ``decay_steps`` is counted from step 0 (it includes
the warmup), so after warmup the decay ratio is
``(step - warmup_steps) / (decay_steps - warmup_steps)`` and the rate stays at
``min_lr`` once ``step > decay_steps``.  During warmup the rate rises linearly from
``warmup_init`` (Megatron-LM's --lr-warmup-init, default 0) at step 0 to ``max_lr`` at
``step == warmup_steps`` (the decoupled schedule's warmup starts from it too).

* ``inverse-square-root``: after warmup, ``max_lr * sqrt(warmup_steps / step)``, never
  below ``min_lr``; ``min_lr`` after ``decay_steps``, as every decaying style (Megatron-LM
  checks ``step > decay_steps`` first).  Warmup and step are counted as at least one
  SAMPLE (``min_count``), as Megatron-LM, whose schedule always counts samples: without
  warmup the rate after k iterations of b samples is ``max_lr / sqrt(k b)``, so an
  iteration-counted schedule is given ``min_count = 1 / b`` (``from_config``'s
  ``global_batch_size``); with warmup the ratio is the same in either unit.
* ``WSD``: ``max_lr`` until the last ``wsd_decay_steps`` steps before ``decay_steps``,
  then an anneal to ``min_lr`` over them, shaped by ``wsd_decay_style``: ``linear``
  (1 - r), ``cosine``, ``exponential`` (2 * 0.5^r - 1) or ``minus_sqrt`` (1 - sqrt r),
  with r the fraction of the anneal done.

The schedule is a pure function of the step (``get_lr(step)``), so the trainer can ask
for the rate of any iteration; ``step()`` only advances the stored counter.

``--decoupled-lr`` (Megatron-LM's): the input and output layers follow a second schedule
of the same shape (warmup, style, decay length, WSD anneal) from ``decoupled_lr`` to
``decoupled_min_lr`` (``get_decoupled_lr``); ``get_lr`` stays the rate of every other
parameter, the one the log line shows.

Weight decay (Megatron-LM's ``--weight-decay-incr-style``, ``--start-weight-decay``,
``--end-weight-decay``): ``get_wd(step)`` is the decay of the weight-decay groups (biases
and norms stay at 0: the optimizer multiplies by each group's ``wd_mult``).  With style
``constant`` it is ``start_wd == end_wd`` (``--weight-decay``).  Otherwise it rises from
``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (the whole run: --train-iters, or
--train-samples in samples; Megatron-LM counts ``train_iters * global_batch_size``
samples, the same fraction of the run), with r = min(step / wd_incr_steps, 1):
``linear``: ``start + (end - start) * r``; ``cosine``: ``start + (end - start) * 0.5 *
(cos(pi * (1 - r)) + 1)`` (slow at both ends), as Megatron-LM's ``get_wd``.  After the
run (``step > wd_incr_steps``) it stays at ``end_wd``.  An update takes the value at
the counter before it, as the learning rate does: the first one ``start_wd`` (Megatron-LM
sets the groups after each step for the next).  A scheduler built without
``start_wd`` has no weight-decay schedule (``get_wd()`` is None: groups keep theirs).

A step is an iteration, or, for a ``--train-samples`` run (``unit="samples"``), a
sample: the counter then advances by the global batch size per applied batch, as in
Megatron-LM, and warmup and decay stay put when the batch size changes on resume.
A checkpoint of the other unit is converted on load with its own samples per iteration.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# Hyper-parameters stored in a checkpoint and compared on load.
_HPARAMS = ("max_lr", "min_lr", "warmup_steps", "decay_steps", "decay_style",
            "wsd_decay_steps", "wsd_decay_style")
_DECOUPLED = ("decoupled_lr", "decoupled_min_lr")
"""Saved and compared only where --decoupled-lr is given (None: no decoupled schedule)."""
_DEFAULTS = {"wsd_decay_steps": None, "wsd_decay_style": "exponential",
             "decoupled_lr": None, "decoupled_min_lr": None, "warmup_init": 0.0}
"""What a checkpoint saved before the WSD style, --decoupled-lr or --lr-warmup-init
holds (no such fields; ``warmup_init`` is saved only where it is not 0)."""
_WD = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")
"""The weight-decay schedule: saved where the scheduler has one, compared on load where
the checkpoint has one too (one saved before it trained with a constant decay it does not
record: nothing to compare, this run's decay applies, as in Megatron-LM)."""
UNITS = ("iterations", "samples")


def _wsd_coefficient(style: str, ratio: float) -> float:
    """Share of (max_lr - min_lr) left after the fraction ``ratio`` of a WSD anneal."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * 0.5 ** ratio - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


class OptimizerParamScheduler:
    """Megatron-style learning-rate schedule over optimizer steps."""

    def __init__(self, max_lr: float, min_lr: float, warmup_steps: float, decay_steps: int,
                 decay_style: str, unit: str = "iterations",
                 wsd_decay_steps: Optional[int] = None,
                 wsd_decay_style: str = "exponential",
                 decoupled_lr: Optional[float] = None,
                 decoupled_min_lr: Optional[float] = None,
                 start_wd: Optional[float] = None, end_wd: Optional[float] = None,
                 wd_incr_steps: Optional[int] = None,
                 wd_incr_style: str = "constant", warmup_init: float = 0.0,
                 min_count: float = 1.0) -> None:
        _check_wd(start_wd, end_wd, wd_incr_steps, wd_incr_style)
        if unit not in UNITS:
            raise ValueError(f"lr scheduler unit must be one of {', '.join(UNITS)}, got {unit!r}")
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, "
                             f"got {decay_style!r}")
        if wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"--lr-wsd-decay-style must be one of "
                             f"{', '.join(WSD_DECAY_STYLES)}, got {wsd_decay_style!r}")
        if decay_style == "WSD" and not (
                wsd_decay_steps is not None
                and 0 < wsd_decay_steps <= decay_steps - max(warmup_steps, 0)):
            raise ValueError(f"--lr-decay-style WSD needs an anneal of 1 to "
                             f"{decay_steps - warmup_steps} {unit} (the decay after warmup): "
                             f"--lr-wsd-decay-iters/--lr-wsd-decay-samples, got "
                             f"{wsd_decay_steps}")
        if not 0.0 < min_count <= 1.0:
            raise ValueError(f"lr scheduler: min_count (one sample in {unit}) must be in "
                             f"(0, 1], got {min_count}")
        if max_lr < 0.0 or min_lr < 0.0 or min_lr > max_lr:
            raise ValueError(f"learning rates need 0 <= --min-lr <= --lr, got min_lr={min_lr}, "
                             f"lr={max_lr}")
        if decoupled_lr is None and decoupled_min_lr is not None:
            raise ValueError("--decoupled-min-lr needs --decoupled-lr")
        if decoupled_lr is not None:
            decoupled_min_lr = min_lr if decoupled_min_lr is None else decoupled_min_lr
            if decoupled_lr < 0.0 or decoupled_min_lr < 0.0 or decoupled_min_lr > decoupled_lr:
                raise ValueError(f"decoupled learning rates need 0 <= --decoupled-min-lr <= "
                                 f"--decoupled-lr, got decoupled_min_lr={decoupled_min_lr}, "
                                 f"decoupled_lr={decoupled_lr}")
        if warmup_steps < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {warmup_steps}")
        if not 0.0 <= warmup_init <= max_lr:
            raise ValueError(f"--lr-warmup-init must be in [0, --lr], got {warmup_init} "
                             f"(lr={max_lr})")
        if decay_style != "constant" and decay_steps <= warmup_steps:
            raise ValueError(f"--lr-decay-iters ({decay_steps}) must exceed --lr-warmup-iters "
                             f"({warmup_steps}) for decay style {decay_style!r}")
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        # a whole number, except a warmup from --lr-warmup-fraction (Megatron-LM keeps
        # fraction x decay as it is: 0.4 of an iteration still starts at warmup_init)
        self.warmup_steps = (int(warmup_steps) if float(warmup_steps).is_integer()
                             else float(warmup_steps))
        self.decay_steps = int(decay_steps)
        self.decay_style = decay_style
        self.wsd_decay_steps = None if wsd_decay_steps is None else int(wsd_decay_steps)
        self.wsd_decay_style = wsd_decay_style
        self.decoupled_lr = None if decoupled_lr is None else float(decoupled_lr)
        """Peak rate of the input and output layers (None: they follow ``max_lr``)."""
        self.decoupled_min_lr = None if decoupled_min_lr is None else float(decoupled_min_lr)
        """Their floor (``min_lr`` where --decoupled-min-lr is not given)."""
        self.start_wd = None if start_wd is None else float(start_wd)
        """Weight decay at step 0 (None: no weight-decay schedule)."""
        self.end_wd = None if end_wd is None else float(end_wd)
        self.wd_incr_steps = None if wd_incr_steps is None else int(wd_incr_steps)
        """Steps of the ramp from ``start_wd`` to ``end_wd``, the run's length (None
        where unknown: constant style only)."""
        self.wd_incr_style = wd_incr_style
        self.warmup_init = float(warmup_init)
        """Rate at step 0, where the warmup starts (--lr-warmup-init)."""
        self.unit = unit
        self.min_count = float(min_count)
        """One sample in ``unit``: the least warmup and step inverse-square-root divides
        by (1 in samples, 1 / the global batch size in iterations).  Not saved: it
        follows this run's batch size, as Megatron-LM's sample counts do."""
        self.num_steps = 0
        self.load_notes: List[str] = []
        """After ``load_state_dict``: each field the checkpoint and this run differ on, with
        the value kept (--override/--use-checkpoint-opt_param-scheduler), for the log."""

    @classmethod
    def from_config(cls, opt_cfg: Any, train_iters: Optional[int],
                    global_batch_size: Optional[int] = None) -> "OptimizerParamScheduler":
        """Build from an ``OptimizerConfig``; decay defaults to the whole run.
        ``global_batch_size``: the samples of an iteration, for inverse-square-root's
        floor of one sample in an iteration-counted schedule (None: one iteration)."""
        wsd_style = getattr(opt_cfg, "lr_wsd_decay_style", "exponential")
        decoupled = dict(decoupled_lr=getattr(opt_cfg, "decoupled_lr", None),
                         decoupled_min_lr=getattr(opt_cfg, "decoupled_min_lr", None))
        samples = getattr(opt_cfg, "lr_schedule_unit", "iterations") == "samples"
        decoupled.update(_wd_from_config(opt_cfg, train_iters, samples),
                         warmup_init=getattr(opt_cfg, "lr_warmup_init", 0.0))
        if samples:
            return cls(opt_cfg.lr, opt_cfg.min_lr, opt_cfg.lr_warmup_samples,
                       opt_cfg.lr_decay_samples, opt_cfg.lr_decay_style, unit="samples",
                       wsd_decay_steps=getattr(opt_cfg, "lr_wsd_decay_samples", None),
                       wsd_decay_style=wsd_style, **decoupled)
        decay = opt_cfg.lr_decay_iters if opt_cfg.lr_decay_iters is not None else train_iters
        if decay is None:
            if opt_cfg.lr_decay_style != "constant":
                raise ValueError("--lr-decay-iters (or --train-iters) is required for "
                                 f"--lr-decay-style {opt_cfg.lr_decay_style}")
            decay = opt_cfg.lr_warmup_iters
        return cls(opt_cfg.lr, opt_cfg.min_lr, opt_cfg.lr_warmup_iters, decay,
                   opt_cfg.lr_decay_style,
                   wsd_decay_steps=getattr(opt_cfg, "lr_wsd_decay_iters", None),
                   wsd_decay_style=wsd_style,
                   min_count=1.0 / global_batch_size if global_batch_size else 1.0,
                   **decoupled)

    def get_lr(self, step: Optional[int] = None) -> float:
        """Learning rate at ``step`` (default: the current step counter)."""
        return self._rate(self.num_steps if step is None else step, self.max_lr, self.min_lr)

    def get_decoupled_lr(self, step: Optional[int] = None) -> float:
        """Learning rate of the input and output layers at ``step``: the schedule's shape
        from ``decoupled_lr`` to ``decoupled_min_lr``, or ``get_lr`` without a
        decoupled rate."""
        if self.decoupled_lr is None:
            return self.get_lr(step)
        return self._rate(self.num_steps if step is None else step, self.decoupled_lr,
                          self.decoupled_min_lr)

    def get_wd(self, step: Optional[int] = None) -> Optional[float]:
        """Weight decay at ``step`` (default: the current step counter); None without a
        weight-decay schedule.  See the module docstring for the formulas."""
        if self.start_wd is None:
            return None
        step = self.num_steps if step is None else step
        if self.wd_incr_style == "constant" or step >= self.wd_incr_steps:
            return self.end_wd
        ratio = max(step, 0) / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine: 0 at the start, 1 at the end
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _rate(self, step: int, max_lr: float, min_lr: float) -> float:
        """The schedule at ``step`` between ``max_lr`` and ``min_lr``."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            init = self.warmup_init
            return init + (max_lr - init) * step / self.warmup_steps
        if self.decay_style == "constant":
            return max_lr
        if step > self.decay_steps:  # before inverse-square-root too, as Megatron-LM
            return min_lr
        if self.decay_style == "inverse-square-root":
            floor = self.min_count
            lr = max_lr * math.sqrt(max(self.warmup_steps, floor) / max(step, floor))
            return max(min_lr, lr)
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if step <= anneal_start:
                return max_lr
            coeff = _wsd_coefficient(self.wsd_decay_style,
                                     (step - anneal_start) / self.wsd_decay_steps)
            return min_lr + coeff * (max_lr - min_lr)
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> float:
        """Advance the counter and return the new learning rate."""
        self.num_steps += increment
        return self.get_lr()

    def step_batch(self, global_batch_size: int) -> float:
        """One applied batch: one step, or its samples under ``unit="samples"``."""
        return self.step(global_batch_size if self.unit == "samples" else 1)

    def state_dict(self) -> Dict[str, Any]:
        sd = {name: getattr(self, name) for name in _HPARAMS}
        if self.decoupled_lr is not None:  # absent otherwise, as before --decoupled-lr
            sd.update({name: getattr(self, name) for name in _DECOUPLED})
        if self.start_wd is not None:
            sd.update({name: getattr(self, name) for name in _WD})
        if self.warmup_init:  # absent otherwise, as before --lr-warmup-init
            sd["warmup_init"] = self.warmup_init
        sd["num_steps"] = self.num_steps
        sd["unit"] = self.unit
        return sd

    def load_state_dict(self, sd: Dict[str, Any], *, override: bool = False,
                        use_checkpoint: bool = False,
                        samples_per_iteration: Optional[float] = None,
                        convert: Optional[Callable[[int, str], int]] = None) -> None:
        """Restore the step counter, checking the schedule's hyper-parameters.

        ``override``: keep this run's hyper-parameters whatever the checkpoint says.
        ``use_checkpoint``: adopt the checkpoint's hyper-parameters.
        Otherwise any difference is an error naming the field.
        ``samples_per_iteration``: the checkpoint's consumed samples per iteration, to
        convert a state counted in the other unit (a state without ``unit`` counts
        iterations).  ``convert(steps, unit)``: the exact conversion where batches differ
        in size (a batch-size ramp-up), used instead of that one factor.
        """
        if override and use_checkpoint:
            raise ValueError("lr scheduler: override and use_checkpoint are mutually exclusive")
        sd = {**_DEFAULTS, **sd}  # saved before the WSD style or --decoupled-lr
        missing = [k for k in _HPARAMS + ("num_steps",) if k not in sd]
        if missing:
            raise ValueError(f"lr scheduler checkpoint state lacks {missing}")
        theirs_unit = sd.get("unit", "iterations")
        if theirs_unit not in UNITS:
            raise ValueError(f"lr scheduler checkpoint state has unit {theirs_unit!r}, "
                             f"expected one of {', '.join(UNITS)}")
        if theirs_unit != self.unit:
            sd = _convert_units(sd, self.unit, samples_per_iteration, convert)
        # decay length means nothing to a constant schedule on both sides, nor an anneal
        # to a schedule that is not WSD on both sides
        constant = self.decay_style == sd["decay_style"] == "constant"
        no_wsd = self.decay_style != "WSD" and sd["decay_style"] != "WSD"
        # nor a decoupled floor where neither side has a decoupled rate
        no_decoupled = self.decoupled_lr is None and sd["decoupled_lr"] is None
        if use_checkpoint and self.decoupled_lr is None and sd["decoupled_lr"] is not None:
            # the optimizer's groups follow this run's flags: without --decoupled-lr no
            # parameter has the decoupled rate, so the checkpoint's would go unused
            floor = sd["decoupled_min_lr"]
            raise ValueError(
                f"lr scheduler: the checkpoint's schedule has decoupled_lr="
                f"{sd['decoupled_lr']!r} but this run has no --decoupled-lr, so no "
                f"parameter would take it; to take the checkpoint's schedule with "
                f"--use-checkpoint-opt_param-scheduler pass --decoupled-lr "
                f"{sd['decoupled_lr']!r}"
                + (f" --decoupled-min-lr {floor!r}" if floor is not None else ""))
        self.load_notes = []
        differ = []
        for name in _HPARAMS + _DECOUPLED + ("warmup_init",):
            ours, theirs = getattr(self, name), sd[name]
            moot = ((constant and name == "decay_steps")
                    or (no_wsd and name.startswith("wsd_"))
                    or (no_decoupled and name == "decoupled_min_lr")
                    # where neither side warms up, nothing starts from it
                    or (name == "warmup_init" and self.warmup_steps == 0
                        and sd["warmup_steps"] == 0))
            if ours != theirs and not moot:
                self._note(name, ours, theirs, use_checkpoint)
            if use_checkpoint:
                setattr(self, name, theirs)
            elif not override and ours != theirs and not moot:
                differ.append(f"({flag_text(name, self.unit)}): checkpoint has "
                              f"{name}={theirs!r} but this run has {name}={ours!r}"
                              f"{f' ({self.unit})' if name in _STEP_FIELDS else ''}")
        if differ:  # every field that differs, in one line
            raise ValueError(
                f"lr scheduler {', and '.join(differ)}; pass --override-opt_param-scheduler "
                "to keep this run's value or --use-checkpoint-opt_param-scheduler to take "
                "the checkpoint's")
        self._load_wd(sd, override, use_checkpoint)
        self.num_steps = int(sd["num_steps"])

    def _note(self, name: str, ours: Any, theirs: Any, use_checkpoint: bool) -> None:
        """Record in ``load_notes`` a field whose value the checkpoint and this run differ
        on, and whose value the loaded schedule keeps (read after a load that did not
        raise: with --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler)."""
        unit = f" {self.unit}" if name in _STEP_FIELDS else ""
        kept, other = (theirs, ours) if use_checkpoint else (ours, theirs)
        self.load_notes.append(f"{name} {kept!r}{unit} ({flag_text(name, self.unit)}; "
                               f"{'this run' if use_checkpoint else 'the checkpoint'} has "
                               f"{other!r})")

    def _load_wd(self, sd: Dict[str, Any], override: bool, use_checkpoint: bool) -> None:
        """The weight-decay schedule of ``load_state_dict`` (its rules, see ``_WD``)."""
        if sd.get("start_wd") is None or (self.start_wd is None and not use_checkpoint):
            return  # saved before the weight-decay schedule, or none here to compare
        theirs = {"end_wd": sd["start_wd"], "wd_incr_steps": None,
                  "wd_incr_style": "constant", **sd}
        # the ramp's length means nothing where both sides keep the decay constant
        constant = self.wd_incr_style == theirs["wd_incr_style"] == "constant"
        for name in _WD:
            ours = getattr(self, name)
            if ours != theirs[name] and not (constant and name == "wd_incr_steps"):
                self._note(name, ours, theirs[name], use_checkpoint)
            if use_checkpoint:
                setattr(self, name, theirs[name])
            elif (not override and ours != theirs[name]
                  and not (constant and name == "wd_incr_steps")):
                flags = ("the length of the weight-decay ramp: the run's, --train-iters or "
                         "--train-samples" if name == "wd_incr_steps" else
                         "the weight decay: --weight-decay, --start-weight-decay, "
                         "--end-weight-decay, --weight-decay-incr-style")
                raise ValueError(
                    f"lr scheduler: checkpoint has {name}={theirs[name]!r} but this run has "
                    f"{name}={ours!r}{f' ({self.unit})' if name in _STEP_FIELDS else ''} "
                    f"({flags}); pass "
                    "--override-opt_param-scheduler to keep this run's value or "
                    "--use-checkpoint-opt_param-scheduler to take the checkpoint's")


def _check_wd(start_wd: Optional[float], end_wd: Optional[float],
              wd_incr_steps: Optional[int], style: str) -> None:
    """The weight-decay schedule's arguments (the trainer's flags are checked earlier, in
    ``megatron.arguments``, with the flags' names)."""
    if style not in WD_INCR_STYLES:
        raise ValueError(f"--weight-decay-incr-style must be one of "
                         f"{', '.join(WD_INCR_STYLES)}, got {style!r}")
    if start_wd is None and end_wd is None and style == "constant":
        return  # no weight-decay schedule
    if start_wd is None or end_wd is None:
        raise ValueError(f"weight decay schedule needs both start_wd and end_wd, got "
                         f"start_wd={start_wd}, end_wd={end_wd}")
    if not 0.0 <= start_wd <= end_wd:
        raise ValueError(f"weight decay schedule needs 0 <= start_wd <= end_wd, got "
                         f"start_wd={start_wd}, end_wd={end_wd}")
    if style == "constant":
        if start_wd != end_wd:
            raise ValueError(f"weight decay style constant needs start_wd == end_wd, got "
                             f"start_wd={start_wd}, end_wd={end_wd}")
    elif wd_incr_steps is None or wd_incr_steps <= 0:
        raise ValueError(f"weight decay style {style} needs the length of its ramp "
                         f"(wd_incr_steps > 0, the run's length), got {wd_incr_steps}")


def _wd_from_config(opt_cfg: Any, train_iters: Optional[int],
                    samples: bool) -> Dict[str, Any]:
    """The scheduler's weight-decay arguments from an ``OptimizerConfig``: start and end
    default to ``weight_decay``; the ramp is the whole run (``train_samples`` in a
    samples-counted schedule, else ``train_iters``)."""
    wd = float(getattr(opt_cfg, "weight_decay", 0.0))
    start = getattr(opt_cfg, "start_weight_decay", None)
    end = getattr(opt_cfg, "end_weight_decay", None)
    steps = getattr(opt_cfg, "wd_incr_samples", None) if samples else train_iters
    return dict(start_wd=wd if start is None else start, end_wd=wd if end is None else end,
                wd_incr_steps=steps,
                wd_incr_style=getattr(opt_cfg, "weight_decay_incr_style", "constant"))


_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "decay_style": "--lr-decay-style",
          "wsd_decay_style": "--lr-wsd-decay-style", "decoupled_lr": "--decoupled-lr",
          "decoupled_min_lr": "--decoupled-min-lr", "warmup_init": "--lr-warmup-init",
          "start_wd": "--start-weight-decay, by default --weight-decay",
          "end_wd": "--end-weight-decay, by default --weight-decay",
          "wd_incr_style": "--weight-decay-incr-style"}
_STEP_FLAGS = {"warmup_steps": ("--lr-warmup-iters or --lr-warmup-fraction",
                                "--lr-warmup-samples or --lr-warmup-fraction"),
               "decay_steps": ("--lr-decay-iters, by default --train-iters",
                               "--lr-decay-samples, by default --train-samples"),
               "wsd_decay_steps": ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"),
               "wd_incr_steps": ("--train-iters", "--train-samples")}


def flag_text(name: str, unit: str) -> str:
    """The flag(s) that set schedule field ``name`` in a schedule counted in ``unit``."""
    if name in _STEP_FLAGS:
        return _STEP_FLAGS[name][unit == "samples"]
    return _FLAGS.get(name, name)


_STEP_FIELDS = ("warmup_steps", "decay_steps", "wsd_decay_steps", "wd_incr_steps", "num_steps")


def _convert_units(sd: Dict[str, Any], unit: str, samples_per_iteration: Optional[float],
                   convert: Optional[Callable[[int, str], int]] = None) -> Dict[str, Any]:
    """``sd``'s step counts in ``unit`` (iterations <-> samples)."""
    if convert is not None:
        out = {**sd, "unit": unit}
        for name in _STEP_FIELDS:
            if sd.get(name) is not None and name != "wsd_decay_steps":
                out[name] = int(convert(int(sd[name]), unit))
        if sd.get("wsd_decay_steps") is not None:  # a length: the anneal ends at the decay's end
            end = int(sd["decay_steps"])
            out["wsd_decay_steps"] = out["decay_steps"] - int(
                convert(end - int(sd["wsd_decay_steps"]), unit))
        return out
    if not samples_per_iteration or samples_per_iteration <= 0:
        raise ValueError(f"lr scheduler: the checkpoint counts its schedule in "
                         f"{sd.get('unit', 'iterations')} and this run in {unit}, and the "
                         "checkpoint's samples per iteration are unknown")
    factor = samples_per_iteration if unit == "samples" else 1.0 / samples_per_iteration
    out = dict(sd)
    for name in _STEP_FIELDS:
        if sd.get(name) is not None:
            out[name] = int(round(sd[name] * factor))
    out["unit"] = unit
    return out

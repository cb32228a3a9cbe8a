"""One optimizer for every pipeline schedule, including PipeDream-2BW's double buffer.

A stage may hold two weight buffers with identical shapes (paper section 3.1): X, used by
batch b, and Y, used by batch b+1 which is still in flight.  When batch b's gradients
are complete (in ``X[i].grad``) the new weights are computed from the LATEST weights Y
and written INTO X, leaving Y untouched:

    X := Y - lr * update(grad X)         step(grads_from=X, write_to=X, base=Y, lr)

With one buffer (flush, gpipe, no pipelining) all three arguments are that buffer and
the update is in place.

The torch optimizer runs on stable "main" parameters, one per model parameter, so its
state (Adam moments, SGD momentum) exists once per stage whatever buffer is written:

* mixed precision (fp16/bf16 weights with fp32 masters): the main parameters are fp32
  master copies that always hold the latest weights; after the update they are cast
  into ``write_to``;
* otherwise (fp32/float64, or half precision without masters): the main parameters
  own no storage of their own; before each update their ``.data`` is pointed at the
  buffer being written (first refreshed from ``base``) and their ``.grad`` at the
  gradient, so no third copy of the weights exists.

Everything the update decides is agreed by all ranks of the model replica with ONE
all-reduce: the global gradient norm (for clipping), whether any gradient overflowed
(so every stage skips the same batch and weight versions stay aligned), and the
optional zero count.

Non-finite gradients: they are detected for every precision, reported in
``StepInfo.num_nonfinite`` and the step is skipped everywhere (weights and optimizer
state unchanged; ``write_to`` gets a copy of ``base``); fp16 also backs off its loss
scale.  The trainer counts skipped steps and stops a run that keeps skipping.
``extra_found_inf=True`` on any rank skips the step everywhere too.

Distributed optimizer (``--use-distributed-optimizer``, ZeRO stage 1): the data-parallel
replicas of a stage split the optimizer state evenly, as Megatron-LM does
(``megatron.optimizer.sharding``): the stage's flat gradient buckets are padded to a
multiple of w and cut into w equal segments, and rank r owns segment r of every bucket,
i.e. pieces of parameters (a parameter may be cut between ranks).  A rank keeps the Adam
moments (or SGD momentum) and, with mixed precision, the fp32 master weights of its
pieces only, one 1-D main parameter per piece in its parameter's weight-decay group:
12 (1 - 1/w) bytes per parameter less for Adam with masters, within a bucket's padding
of an even share however large one parameter (the word embedding) is.  The trainer's
``GradientReduction`` reduce-scatters each bucket, so a rank receives the average of its
own segment only; the gradient statistics are summed per parameter over the replicas
(``local_piece_stats``), so every rank forms the same global norm and overflow verdict,
each logical parameter counted once.  Each rank updates its pieces, then the new
weights, in the working dtype, are all-gathered bucket by bucket into every replica's
parameters: a reduce-scatter and an all-gather move what one all-reduce moves, the
traffic of plain data parallelism.  The update is elementwise, so with the same gradient
scale each piece gets the same bits as its parameter would without sharding; the global
norm is the same to rounding only (a cut parameter's squares are summed per piece), and
so is a clipped update.  Checkpoints hold the whole state in the unsharded format
(``megatron.optimizer.sharded_state``).

``get_megatron_optimizer`` (``megatron.optimizer.builder``) builds the optimizer from the
arguments; ``megatron.optimizer.main_grads`` takes each main parameter's gradient and
weights out of a buffer, and ``megatron.optimizer.state_checks`` checks a checkpoint
before it is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.exchange import ExchangeSum, exchange_pays
from megatron.optimizer.clip_grads import (clip_coefficient, local_grad_stats,
                                           local_piece_stats, local_weight_sq, norm_mask,
                                           scale_grads_)
from megatron.optimizer.grad_scaler import GradScaler
from megatron.optimizer.main_grads import unit_grads, unit_weights, unscaled_grads
from megatron.optimizer.param_groups import GroupLayout
from megatron.optimizer.sharded_state import UnshardedFormat
from megatron.optimizer.sharding import OptimizerShard, Piece, WeightGather, copy_all
from megatron.optimizer.staleness import WeightPrediction, delay_compensate_, true_weights
from megatron.optimizer.state_checks import (check_saved_meta, check_saved_tensors,
                                             group_flag_values, kept_from_checkpoint)

_NUM_STATS = 6  # the agreement: sum of squares, non-finite tensors, zeros, extra flag,
# the weights' sum of squares (--log-params-norm) and the tokens the loss summed over
# (--calculate-per-token-loss)


@dataclass(frozen=True)
class StepInfo:
    """What one call of ``MegatronOptimizer.step`` did (identical on all model ranks)."""

    skipped: bool
    """True when the weights were not updated (``write_to`` holds a copy of ``base``)."""
    grad_norm: float
    """Global L2 norm of the unscaled gradients, before clipping (inf/nan on overflow)."""
    loss_scale: float
    """Loss scale after this step's scaler update (use it for the next batch)."""
    num_zeros: Optional[int] = None
    """Zero gradient elements over the model replica (only with ``log_num_zeros``)."""
    num_nonfinite: int = 0
    """Gradient tensors holding inf/nan, summed over the model replica's ranks."""
    params_norm: Optional[float] = None
    """L2 norm of the weights the gradients were computed with, over the model replica
    (only with ``log_params_norm``)."""


@dataclass
class PendingStep:
    """A step whose agreement all-reduce is in flight (see ``begin_step``)."""

    grads_from: List[nn.Parameter]
    grads: List[Optional[torch.Tensor]]
    """The unscaled gradient of each main parameter (with the distributed optimizer: of
    each piece this rank owns)."""
    stats: torch.Tensor
    work: Any
    late: Tuple[int, ...] = ()
    """Gradients left out of ``grads`` until ``take_late_grads`` (see ``begin_step``)."""
    inv_scale: float = 1.0
    per_token: bool = False
    """The gradients are of loss sums: divide them by the tokens summed (``begin_step``)."""


class MegatronOptimizer:
    """Adam(W)/SGD over stable main parameters; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, main_params: List[nn.Parameter],
                 params: Sequence[nn.Parameter], *, scaler: GradScaler, use_masters: bool,
                 skip_on_nonfinite: bool, clip_grad: float, model_groups: Any = None,
                 tp_rank: int = 0, log_num_zeros: bool = False, grads_to_none: bool = True,
                 name: str = "adam", log_params_norm: bool = False,
                 shard: Optional[OptimizerShard] = None,
                 layout: Optional[GroupLayout] = None, dp_group: Any = None) -> None:
        self.optimizer = optimizer
        self.main_params = main_params
        """One per model parameter; with the distributed optimizer (``shard``) one per
        piece this rank owns (``shard.pieces()``, 1-D)."""
        if shard is not None and shard.size < 2:
            raise ValueError("MegatronOptimizer: a shard over one replica (use shard=None)")
        self.shard = shard
        # the stage's data-parallel group (None: one replica): the replicas' own findings
        # (``extra_found_inf``, a replica's loss check) are agreed over it at each step
        self.dp_group = dp_group
        # torch's parameter numbering without sharding: the parameter index of each
        # member of each param group, in order (decay group, then no-decay, each cut
        # into runs of one learning rate: ``megatron.optimizer.param_groups``)
        self.layout = layout if layout is not None else GroupLayout.plain(
            [[next(i for i, m in enumerate(main_params) if m is p) for p in g["params"]]
             for g in optimizer.param_groups],
            [g.get("weight_decay", 0.0) for g in optimizer.param_groups])
        self.decoupled_lr_provider: Optional[Callable[[], float]] = None
        """The input and output layers' rate for the step being taken (the trainer sets
        ``OptimizerParamScheduler.get_decoupled_lr``); needed where ``layout`` has
        decoupled groups and ``finish_step`` is given no ``decoupled_lr``."""
        self.weight_decay_provider: Optional[Callable[[], Optional[float]]] = None
        """The weight decay of the step being taken (the trainer sets
        ``OptimizerParamScheduler.get_wd``): each group's ``weight_decay`` becomes it times
        the group's ``wd_mult`` (0 for biases and norms) before the update; None, or a
        provider returning None, leaves the groups' own values."""
        self._wd_mults = self.layout.wd_mults
        decoupled = {i for ids, flag in zip(self.layout.members, self.layout.decoupled)
                     if flag for i in ids}
        # checkpoints hold the unsharded format (``megatron.optimizer.sharded_state``)
        self._format = (UnshardedFormat(shard, self.layout.members,
                                        [tuple(p.shape) for p in params],
                                        params[0].device) if shard is not None else None)
        self._pieces: Optional[List[Piece]] = (self._format.pieces if self._format is not None
                                               else None)
        self.scaler = scaler
        self.use_masters = use_masters
        self.skip_on_nonfinite = skip_on_nonfinite
        self.clip_grad = float(clip_grad)
        self.model_groups = model_groups
        self.log_num_zeros = log_num_zeros
        self.log_params_norm = log_params_norm
        self.grads_to_none = grads_to_none
        self.name = name
        self._shapes = [tuple(p.shape) for p in params]
        self._dtypes = [p.dtype for p in params]
        self._device = params[0].device
        # per main parameter: the model parameter it updates (all of it, or a piece) and
        # that parameter's dtype
        self._unit_param = ([pc.param for pc in self._pieces] if self._pieces is not None
                            else list(range(len(params))))
        self._unit_dtype = [self._dtypes[i] for i in self._unit_param]
        self._unit_decoupled = [i in decoupled for i in self._unit_param]
        # Attributes (shared, tensor_model_parallel) are read once, from the first buffer.
        self._mask = norm_mask(params, tp_rank)
        # the last stage's copy of the tied word embedding (see ``late_grad_indices``)
        self._shared = tuple(i for i, p in enumerate(params) if getattr(p, "shared", False))
        # 2BW staleness mitigations (megatron.optimizer.staleness), off by default.
        self.prediction: Optional[WeightPrediction] = None
        self.dc_lambda = 0.0
        self.load_notes: List[str] = []
        """After ``load_state_dict``: the flags whose values came from the checkpoint's
        state instead of this run's (``state_checks.kept_from_checkpoint``)."""
        # the new weights' all-gathers (the distributed optimizer; None otherwise)
        self.gather: Optional[WeightGather] = (
            WeightGather(shard, self._format.pieces_by_bucket) if shard is not None else None)
        # how the agreement is summed: an ExchangeSum, False for all_reduce, None: not
        # decided yet (at the first step, when the process group is known to exist)
        self._agreement: Union[None, bool, ExchangeSum] = None

    def enable_mitigation(self, mitigation: str, dc_lambda: float = 0.0) -> None:
        """Turn on ``--2bw-mitigation predict`` or ``dc`` (others need nothing here)."""
        if mitigation == "predict":
            if self.shard is not None:
                raise ValueError("--2bw-mitigation predict needs every parameter's optimizer "
                                 "state on every rank: it cannot run with "
                                 "--use-distributed-optimizer")
            self.prediction = WeightPrediction(
                self.optimizer, self.main_params,
                decoupled=self._unit_decoupled if any(self._unit_decoupled) else None)
        elif mitigation == "dc":
            self.dc_lambda = float(dc_lambda)

    def true_weights(self, latest: Sequence[nn.Parameter]):
        """Context in which ``latest`` holds the un-predicted latest weights."""
        return true_weights(self.prediction, latest,
                            self.main_params if self.use_masters else None)

    def predict_latest(self, latest: Sequence[nn.Parameter]) -> None:
        """``--2bw-mitigation predict``, after a resume that loaded the true newest weights
        into ``latest`` and this optimizer's state: ``latest`` := their prediction, made as
        the step that wrote them made it (from the fp32 masters where there are some),
        with the learning rate and weight decay of the checkpoint's last step."""
        pred = self.prediction
        if pred is None:
            return
        self.wait_gathers()
        source = ([m.data for m in self.main_params] if self.use_masters
                  else [p.data for p in latest])
        pred.predict_(latest, source, pred.last_lr, pred.last_decoupled_lr)

    # -- loss scaling ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (multiplied by the fp16 loss scale)."""
        scale = self.scaler.scale
        return loss if scale == 1.0 else loss * scale

    def zero_grad(self, params: Sequence[nn.Parameter]) -> None:
        """Drop (or zero, with ``grads_to_none=False``) the gradients of ``params``."""
        for p in params:
            if p.grad is None:
                continue
            if self.grads_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    # -- the update --------------------------------------------------------------------
    def step(self, grads_from: Sequence[nn.Parameter], write_to: Sequence[nn.Parameter],
             base: Sequence[nn.Parameter], lr: float, *,
             extra_found_inf: bool = False, grad_scale: Optional[float] = None,
             decoupled_lr: Optional[float] = None) -> StepInfo:
        """Compute W(t+1) from ``base`` (= W(t)) and ``grads_from[i].grad``; write it into
        ``write_to``.  Collective over ``model_groups``: every rank of the replica must call
        it once per batch.

        ``grad_scale``: the loss scale the gradients were computed with, when the caller
        tracks it per batch (under 2BW a batch's backward passes may run before the
        previous batch's step has updated the scaler); default: the current scale.
        ``decoupled_lr``: see ``finish_step``."""
        pending = self.begin_step(grads_from, extra_found_inf=extra_found_inf,
                                  grad_scale=grad_scale)
        return self.finish_step(pending, write_to, base, lr, decoupled_lr=decoupled_lr)

    @property
    def late_grad_indices(self) -> Tuple[int, ...]:
        """Parameters whose gradients ``begin_step`` can take late: the last stage's copy
        of the tied word embedding (``param.shared``).  Its gradient is the sum with the
        first stage's, the same bits on both ends, and the first stage counts it in the
        norm and the overflow check; this copy adds nothing to the statistics."""
        return self._shared

    def begin_step(self, grads_from: Sequence[nn.Parameter], *,
                   extra_found_inf: Union[bool, torch.Tensor] = False,
                   grad_scale: Optional[float] = None,
                   late: Sequence[int] = (),
                   num_tokens: Union[None, float, torch.Tensor] = None) -> "PendingStep":
        """First half of ``step``: unscale, take local statistics and START the one
        all-reduce that makes every model rank agree on overflow and the global norm.

        Returns at once; ``finish_step`` waits for the agreement and updates the weights.
        2BW uses the gap: batch t's new weights are first needed by batch t+2, so the
        stages need not wait for each other at every step.

        ``late``: indices (of ``late_grad_indices``) whose gradients are still being
        summed with another rank's; the caller finishes that sum and then calls
        ``take_late_grads``.  The last pipeline stage so starts the agreement before the
        tied-embedding sum with the first stage is complete: under a flushing schedule
        the first stage finishes its backward passes last, and it would otherwise wait
        in the agreement for the last stage, which waited for its embedding gradient.

        ``num_tokens`` (--calculate-per-token-loss; every rank of the model replica passes
        it, 0 where it computed no loss): the gradients are of the batch's loss SUM, and
        this rank's share of the tokens it was summed over joins the agreement.
        ``finish_step`` adds the data-parallel replicas' counts and divides the
        gradients, and so their norm, by the total: the step follows the mean over every
        token of the global batch, as Megatron-LM's flag does."""
        self._check_buffers("grads_from", grads_from)
        late = tuple(late)
        if not set(late) <= set(self._shared):
            raise ValueError(f"optimizer step: late gradients {late} are not the tied "
                             f"word-embedding copy {self._shared}")
        with torch.no_grad():
            inv = self.scaler.inv_scale if grad_scale is None else 1.0 / grad_scale
            grads = unscaled_grads(unit_grads(grads_from, self._pieces, skip=late), inv,
                                   self.use_masters, self._unit_dtype)
            stats = torch.zeros(_NUM_STATS, dtype=torch.float64, device=self._device)
            if self.shard is None:
                counted = ([None if i in late else g for i, g in enumerate(grads)] if late
                           else grads)
                stats[:3] = local_grad_stats(counted, self._mask, self._device,
                                             self.log_num_zeros)
            else:  # this rank's pieces (late ones are None), summed per parameter
                stats[:3] = local_piece_stats(grads, self._unit_param, self._mask,
                                              self._device, self.log_num_zeros,
                                              group=self.shard.group)
            # a tensor flag (the last stage's loss check) joins the agreement on the device,
            # without a device-to-host sync here
            stats[3] = (extra_found_inf.to(stats.dtype) if torch.is_tensor(extra_found_inf)
                        else (1.0 if extra_found_inf else 0.0))
            if num_tokens is not None:
                stats[5] = (num_tokens.to(stats.dtype) if torch.is_tensor(num_tokens)
                            else float(num_tokens))
            if self.log_params_norm:
                self.wait_gathers()  # a parameter no forward read may still be in flight
                # the weights batch t was computed with (W(t), under 2BW W(t-1)): the only
                # version every stage still holds, untouched, when its agreement starts
                # (a later one may or may not be written yet, by stage timing)
                stats[4] = local_weight_sq(grads_from, self._mask, self._device)
            work = None
            if self.model_groups is not None:
                work = self._start_agreement(stats)
        return PendingStep(grads_from=list(grads_from), grads=grads, stats=stats, work=work,
                           late=late, inv_scale=inv, per_token=num_tokens is not None)

    def take_late_grads(self, pending: "PendingStep") -> None:
        """The gradients ``begin_step`` left out (``late``) are now final: unscale them."""
        with torch.no_grad():
            late = set(pending.late)
            units = [k for k, i in enumerate(self._unit_param) if i in late]
            every = unit_grads(pending.grads_from, self._pieces)
            for k, g in zip(units, unscaled_grads([every[k] for k in units], pending.inv_scale,
                                                  self.use_masters,
                                                  [self._unit_dtype[k] for k in units])):
                pending.grads[k] = g
        pending.late = ()

    def agreement_exchange(self) -> Optional[ExchangeSum]:
        """The ``ExchangeSum`` the agreement uses on gloo (built at the first call; the
        pipeline engine posts its receives ahead), or None where it is an all_reduce."""
        if self._agreement is None:
            self._agreement = (ExchangeSum(self.model_groups, (_NUM_STATS,), torch.float64,
                                           self._device)
                               if self.model_groups is not None
                               and exchange_pays(self.model_groups) else False)
        return self._agreement or None

    def _start_agreement(self, stats: torch.Tensor) -> Any:
        """Start summing ``stats`` over the model replica's ranks: on gloo by direct
        exchange (``megatron.exchange``: the rank that finishes its backward passes last
        then finds the others' numbers already received), else one all_reduce."""
        exchange = self.agreement_exchange()
        if exchange is not None:
            return exchange.start(stats)
        return dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.model_groups,
                               async_op=True)

    def finish_step(self, pending: "PendingStep", write_to: Sequence[nn.Parameter],
                    base: Sequence[nn.Parameter], lr: float, *,
                    decoupled_lr: Optional[float] = None) -> StepInfo:
        """Second half of ``step``: wait for the agreement, then skip or update.

        ``lr``: the rate of every parameter but the input and output layers under
        --decoupled-lr, whose rate is ``decoupled_lr`` (default: ask
        ``decoupled_lr_provider``)."""
        self.wait_gathers()  # the last step's weights are the base of this one
        self._check_buffers("write_to", write_to)
        self._check_buffers("base", base)
        if pending.late:
            raise RuntimeError(f"optimizer step: gradients {pending.late} were left out at "
                               "begin_step and never taken (take_late_grads)")
        grads, grads_from = pending.grads, pending.grads_from
        with torch.no_grad():
            if pending.work is not None:
                pending.work.wait()
            sq_norm, nonfinite, zeros, extra, weight_sq, tokens = pending.stats.tolist()
            replicas = 1
            if self.dp_group is not None:
                # the replicas must take or skip the step together (else their weights
                # part for good, and a distributed optimizer's replicas would wait for
                # each other's all-gathers): the gradients agree already, a replica's
                # own loss check (``extra``, >= 0: summed, it is > 0 where any is) need
                # not; per-token losses add the replicas' token counts in the same call
                both = torch.tensor([extra, tokens], dtype=torch.float64, device=self._device)
                dist.all_reduce(both, op=dist.ReduceOp.SUM, group=self.dp_group)
                extra, tokens = both.tolist()
                replicas = dist.get_world_size(self.dp_group)
            # per-token: the reduced gradients are the replicas' MEAN of their loss-sum
            # gradients, so the gradient of (all loss sums) / (all tokens) is this times
            # replicas / tokens (no token at all: nothing to follow, the gradient is 0)
            per_token = replicas / max(tokens, 1.0) if pending.per_token else 1.0
            sq_norm *= per_token * per_token
            grad_norm = math.sqrt(sq_norm) if sq_norm >= 0.0 else float("nan")
            found_inf = nonfinite > 0 or not math.isfinite(sq_norm)
            self.scaler.update(found_inf and self.skip_on_nonfinite)
            info = dict(grad_norm=grad_norm, loss_scale=self.scaler.scale,
                        num_zeros=int(zeros) if self.log_num_zeros else None,
                        num_nonfinite=int(nonfinite),
                        params_norm=math.sqrt(weight_sq) if self.log_params_norm else None)
            # Any non-finite gradient skips the step, whatever the precision: applying it
            # would write NaN into the weights (and, under 2BW, into both versions in
            # turn).  Only fp16 also backs off its loss scale (above).  ``extra`` carries
            # the caller's own findings, e.g. a non-finite loss on the last stage.
            if extra > 0 or found_inf:
                _copy_buffer(base, write_to)
                self._release_grads(grads_from)
                return StepInfo(skipped=True, **info)

            scale_grads_(grads, per_token * clip_coefficient(grad_norm, self.clip_grad))
            if self.dc_lambda:
                self._delay_compensate(grads, grads_from, base)
            lrs = (lr, self._decoupled_lr(lr, decoupled_lr))
            for group, flag in zip(self.optimizer.param_groups, self.layout.decoupled):
                group["lr"] = lrs[flag]
            wd = self.weight_decay_provider() if self.weight_decay_provider else None
            if wd is not None:  # --weight-decay-incr-style: this step's weight decay
                for group, mult in zip(self.optimizer.param_groups, self._wd_mults):
                    group["weight_decay"] = wd * mult
            if self.use_masters:
                self._step_masters(grads, write_to, lrs)
            else:
                self._step_in_buffer(grads, write_to, base, lrs)
            self._release_grads(grads_from)
        return StepInfo(skipped=False, **info)

    def _decoupled_lr(self, lr: float, given: Optional[float]) -> float:
        """The input and output layers' rate for this step (``lr`` if none is decoupled)."""
        if not self.layout.any_decoupled:
            return lr
        if given is not None:
            return float(given)
        if self.decoupled_lr_provider is None:
            raise RuntimeError("optimizer step: the stage has --decoupled-lr parameters but "
                               "no decoupled learning rate (set decoupled_lr_provider)")
        return float(self.decoupled_lr_provider())

    def _delay_compensate(self, grads: List[Optional[torch.Tensor]],
                          grads_from: Sequence[nn.Parameter],
                          base: Sequence[nn.Parameter]) -> None:
        # a gradient computed with the latest weights themselves needs no compensation
        same = [grads_from[i] is base[i] for i in self._unit_param]
        delay_compensate_([None if s else g for g, s in zip(grads, same)],
                          unit_weights(grads_from, self._pieces),
                          unit_weights(base, self._pieces),
                          self.dc_lambda)

    def _step_masters(self, grads: List[Optional[torch.Tensor]],
                      write_to: Sequence[nn.Parameter], lrs: Tuple[float, float]) -> None:
        main = self.main_params
        for m, g in zip(main, grads):
            m.grad = g
        self.optimizer.step()
        for m in main:
            m.grad = None
        if self.shard is not None:  # the new masters, cast, from every replica
            self.gather.start(write_to, [m.data for m in main])
        elif self.prediction is None:  # cast the new masters into the working buffer
            copy_all([m.data for m in main], [p.data for p in write_to])
        else:
            self.prediction.predict_(write_to, [m.data for m in main], *lrs)

    def _step_in_buffer(self, grads: List[Optional[torch.Tensor]],
                        write_to: Sequence[nn.Parameter], base: Sequence[nn.Parameter],
                        lrs: Tuple[float, float]) -> None:
        _copy_buffer(base, write_to)
        if self.prediction is not None:  # base holds P(W(t)): recover W(t)
            self.prediction.restore_(write_to)
        targets = unit_weights(write_to, self._pieces)
        for m, w, g in zip(self.main_params, targets, grads):
            m.data = w
            m.grad = g
        self.optimizer.step()
        for m in self.main_params:
            m.grad = None
        if self.prediction is not None:
            self.prediction.predict_(write_to, [p.data for p in write_to], *lrs)
        if self.shard is not None:
            self.gather.start(write_to, targets)

    def wait_gathers(self) -> None:
        """Finish the distributed optimizer's weight all-gathers still in flight
        (``--overlap-param-gather``; ``WeightGather.wait``)."""
        if self.gather is not None:
            self.gather.wait()

    def _release_grads(self, grads_from: Sequence[nn.Parameter]) -> None:
        self.zero_grad(grads_from)

    def _check_buffers(self, what: str, buf: Sequence[nn.Parameter]) -> None:
        if len(buf) != len(self._shapes):
            raise ValueError(f"optimizer step: {what} has {len(buf)} parameters, the optimizer "
                             f"was built for {len(self._shapes)}")
        # three times a step over every parameter: compare whole lists first (torch.Size
        # equals the tuple), name the first mismatch only when there is one
        if [p.shape for p in buf] == self._shapes and [p.dtype for p in buf] == self._dtypes:
            return
        for i, (p, shape, dtype) in enumerate(zip(buf, self._shapes, self._dtypes)):
            if tuple(p.shape) != shape or p.dtype != dtype:
                raise ValueError(f"optimizer step: {what}[{i}] is {tuple(p.shape)} {p.dtype}, "
                                 f"expected {shape} {dtype}")

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Moments, fp32 masters (if any), scaler state and a description to check on load.
        With the distributed optimizer: collective over the data-parallel group, and the
        whole state in the unsharded format on every rank."""
        torch_state, masters = self.optimizer.state_dict(), (
            [m.data for m in self.main_params] if self.use_masters else None)
        if self.shard is not None:
            torch_state, masters = self._format.gather(torch_state, masters)
        torch_state = self.layout.to_saved(torch_state)  # the (decay, no-decay) groups
        return {
            "meta": {"optimizer": self.name, "num_params": len(self._shapes),
                     "shapes": list(self._shapes), "fp32_masters": self.use_masters},
            "optimizer": torch_state,
            "fp32_masters": masters,
            "grad_scaler": self.scaler.state_dict(),
            "weight_prediction": (self.prediction.state_dict()
                                  if self.prediction is not None else None),
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore ``state_dict()``; raises on a different optimizer or parameter layout."""
        self.wait_gathers()  # none may land on the weights after this
        check_saved_meta(sd, self.name, self._shapes, self.use_masters)
        torch_state = self.layout.from_saved(sd["optimizer"])
        check_saved_tensors(torch_state, sd.get("fp32_masters") if self.use_masters else None,
                            self.layout.members, self._shapes)
        ours = group_flag_values(self.optimizer.param_groups)
        self.optimizer.load_state_dict(self._format.local(torch_state)
                                       if self._format is not None else torch_state)
        self.load_notes = kept_from_checkpoint(ours,
                                               group_flag_values(self.optimizer.param_groups))
        if self.use_masters:
            with torch.no_grad():
                saved = sd["fp32_masters"]
                for main, i, pc in zip(self.main_params, self._unit_param,
                                       self._pieces or [None] * len(self.main_params)):
                    main.data.copy_(saved[i] if pc is None
                                    else saved[i].reshape(-1)[pc.start:pc.stop])
        self.scaler.load_state_dict(sd["grad_scaler"])
        if self.prediction is not None:
            self.prediction.load_state_dict(sd.get("weight_prediction"))

    def reload_model_params(self, params: Sequence[nn.Parameter]) -> None:
        """Make the main parameters match ``params`` (the buffer holding the latest weights)."""
        self.wait_gathers()
        self._check_buffers("params", params)
        with torch.no_grad():
            for main, w in zip(self.main_params, unit_weights(params, self._pieces)):
                if self.use_masters:
                    main.data.copy_(w)
                else:
                    main.data = w


def _copy_buffer(src: Sequence[nn.Parameter], dst: Sequence[nn.Parameter]) -> None:
    pairs = [(s.data, d.data) for s, d in zip(src, dst) if s is not d]
    if pairs:
        copy_all([s for s, _ in pairs], [d for _, d in pairs])

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
replicas of a stage split the optimizer state by whole parameters (``shard_owners``:
largest first, each to the least-loaded rank).  A rank keeps the Adam moments (or SGD
momentum) and, with mixed precision, the fp32 master weights of the parameters it owns
only: 12 (1 - 1/w) bytes per parameter less for Adam with masters over w replicas.  The
gradients are reduced to their owners (the trainer's ``GradientReduction`` buckets one
owner's parameters and ``dist.reduce``s them) instead of all-reduced; each gradient's
norm comes from its owner through one small sum over the replicas (``local_grad_stats``),
so every rank forms the same global norm and overflow verdict.  Each rank updates its own
parameters, then every owner broadcasts its new weights, in the working dtype, to the
other replicas: a reduce and a broadcast move what one all-reduce moves, the traffic of
plain data parallelism (Megatron-LM reduce-scatters and all-gathers flat buffers, the
same volume).  The update of every parameter is the same arithmetic as without
sharding, so the weights are the same bits.  Checkpoints hold the whole state,
in the unsharded format: ``state_dict`` gathers it (collective over the data-parallel
group) and ``load_state_dict`` keeps this rank's share, so a run may resume with or
without the flag, or with another data-parallel size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.exchange import ExchangeSum, exchange_pays
from megatron.optimizer.clip_grads import (clip_coefficient, local_grad_stats, local_weight_sq,
                                           norm_mask, scale_grads_)
from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from megatron.optimizer.staleness import (WeightPrediction, delay_compensate_, true_weights,
                                          use_foreach)

OPTIMIZERS = ("adam", "sgd")
_NUM_STATS = 6  # the agreement: sum of squares, non-finite tensors, zeros, extra flag,
# the weights' sum of squares (--log-params-norm) and the tokens the loss summed over
# (--calculate-per-token-loss)
_HALF = (torch.float16, torch.bfloat16)


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


def shard_owners(numels: Sequence[int], world: int) -> List[int]:
    """The data-parallel rank that owns each parameter's optimizer state: parameters
    largest first, each to the rank with the fewest elements so far (the lowest such
    rank on ties).  The same answer on every rank, and no rank more than one largest
    parameter above an even split."""
    if world < 1:
        raise ValueError(f"shard_owners: world must be >= 1, got {world}")
    load = [0] * world
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-int(numels[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += int(numels[i])
    return owners


@dataclass(frozen=True)
class OptimizerShard:
    """Where the distributed optimizer's state lives: ``owners[i]`` is the data-parallel
    rank holding parameter i's state; ``group`` the data-parallel process group (None in
    one process, where ``size`` is 1)."""

    rank: int
    size: int
    owners: Tuple[int, ...]
    group: Any = None

    def owned_by(self, r: int) -> List[int]:
        return [i for i, o in enumerate(self.owners) if o == r]

    @property
    def by_rank(self) -> List[List[int]]:
        """``owned_by(r)`` for every rank r."""
        return [self.owned_by(r) for r in range(self.size)]

    @property
    def owned(self) -> List[int]:
        return self.owned_by(self.rank)

    def global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r


@dataclass
class PendingStep:
    """A step whose agreement all-reduce is in flight (see ``begin_step``)."""

    grads_from: List[nn.Parameter]
    grads: List[Optional[torch.Tensor]]
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
                 full_order: Optional[List[List[int]]] = None, dp_group: Any = None) -> None:
        self.optimizer = optimizer
        self.main_params = main_params
        """One per model parameter; None for a parameter another data-parallel rank owns
        (``shard``)."""
        self.shard = shard if shard is not None and shard.size > 1 else None
        # the stage's data-parallel group (None: one replica): the replicas' own findings
        # (``extra_found_inf``, a replica's loss check) are agreed over it at each step
        self.dp_group = dp_group
        self._owned = (self.shard.owned if self.shard is not None
                       else list(range(len(main_params))))
        self._by_rank = self.shard.by_rank if self.shard is not None else []
        owned_set = set(self._owned)
        self._owned_mask = [i in owned_set for i in range(len(main_params))]
        # torch's parameter numbering without sharding: the main-parameter index of each
        # member of each param group, in order (decay group, then no-decay)
        self._full_order = full_order if full_order is not None else [
            [next(i for i, m in enumerate(main_params) if m is p) for p in g["params"]]
            for g in optimizer.param_groups]
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
        # Attributes (shared, tensor_model_parallel) are read once, from the first buffer.
        self._mask = norm_mask(params, tp_rank)
        # the last stage's copy of the tied word embedding (see ``late_grad_indices``)
        self._shared = tuple(i for i, p in enumerate(params) if getattr(p, "shared", False))
        # 2BW staleness mitigations (megatron.optimizer.staleness), off by default.
        self.prediction: Optional[WeightPrediction] = None
        self.dc_lambda = 0.0
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
            self.prediction = WeightPrediction(self.optimizer, self.main_params)
        elif mitigation == "dc":
            self.dc_lambda = float(dc_lambda)

    def true_weights(self, latest: Sequence[nn.Parameter]):
        """Context in which ``latest`` holds the un-predicted latest weights."""
        return true_weights(self.prediction, latest,
                            self.main_params if self.use_masters else None)

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
             extra_found_inf: bool = False, grad_scale: Optional[float] = None) -> StepInfo:
        """Compute W(t+1) from ``base`` (= W(t)) and ``grads_from[i].grad``; write it into
        ``write_to``.  Collective over ``model_groups``: every rank of the replica must call
        it once per batch.

        ``grad_scale``: the loss scale the gradients were computed with, when the caller
        tracks it per batch (under 2BW a batch's backward passes may run before the
        previous batch's step has updated the scaler); default: the current scale."""
        pending = self.begin_step(grads_from, extra_found_inf=extra_found_inf,
                                  grad_scale=grad_scale)
        return self.finish_step(pending, write_to, base, lr)

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
            grads = self._unscaled_grads(grads_from, inv, skip=late)
            stats = torch.zeros(_NUM_STATS, dtype=torch.float64, device=self._device)
            counted = [None if i in late else g for i, g in enumerate(grads)] if late else grads
            sharded = ({"owned": self._owned_mask, "group": self.shard.group}
                       if self.shard is not None else {})
            stats[:3] = local_grad_stats(counted, self._mask, self._device, self.log_num_zeros,
                                         **sharded)
            # a tensor flag (the last stage's loss check) joins the agreement on the device,
            # without a device-to-host sync here
            stats[3] = (extra_found_inf.to(stats.dtype) if torch.is_tensor(extra_found_inf)
                        else (1.0 if extra_found_inf else 0.0))
            if num_tokens is not None:
                stats[5] = (num_tokens.to(stats.dtype) if torch.is_tensor(num_tokens)
                            else float(num_tokens))
            if self.log_params_norm:
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
            for i in pending.late:
                p = pending.grads_from[i]
                if p.grad is None:
                    pending.grads[i] = None
                elif self.use_masters:
                    pending.grads[i] = (p.grad if p.grad.dtype == torch.float32
                                        else p.grad.to(torch.float32, copy=True))
                else:
                    pending.grads[i] = p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
            scale_grads_([pending.grads[i] for i in pending.late], pending.inv_scale)
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
                    base: Sequence[nn.Parameter], lr: float) -> StepInfo:
        """Second half of ``step``: wait for the agreement, then skip or update."""
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
                # part for good, and a distributed optimizer's owners would wait for
                # each other's broadcasts): the gradients agree already, a replica's
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
                delay_compensate_(grads, grads_from, base, self.dc_lambda)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.use_masters:
                self._step_masters(grads, write_to)
            else:
                self._step_in_buffer(grads, write_to, base)
            self._release_grads(grads_from)
        return StepInfo(skipped=False, **info)

    def _unscaled_grads(self, grads_from: Sequence[nn.Parameter], inv: float,
                        skip: Tuple[int, ...] = ()) -> List[Optional[torch.Tensor]]:
        """Gradients times ``inv`` (1 / the loss scale): for masters in float32 (fp32
        gradients in place, others as fp32 copies), else in place in the weights' dtype.
        ``skip``: indices left untouched (None in the list)."""
        if self.use_masters:
            # Gradients already in float32 (accumulated so, --accumulate-allreduce-grads-
            # in-fp32) are used as they are: the step releases them anyway.  Others are
            # copied: on an accelerator into views of one float32 allocation, filled by
            # one multi-tensor copy (a cast per parameter was hundreds of launches per
            # step); on the CPU a cast per parameter is cheaper than making the views.
            out: List[Optional[torch.Tensor]] = [None] * len(grads_from)
            take = []
            for i, p in enumerate(grads_from):
                if p.grad is None or i in skip:
                    continue
                if p.grad.dtype == torch.float32:
                    out[i] = p.grad
                else:
                    take.append(i)
            if take and not use_foreach([grads_from[take[0]].grad]):
                for i in take:
                    out[i] = grads_from[i].grad.to(torch.float32, copy=True)
            elif take:
                src = [grads_from[i].grad for i in take]
                flat = torch.empty(sum(g.numel() for g in src), dtype=torch.float32,
                                   device=src[0].device)
                views, at = [], 0
                for g in src:
                    views.append(flat[at:at + g.numel()].view(g.shape))
                    at += g.numel()
                _copy_all(src, views)
                for i, v in zip(take, views):
                    out[i] = v
            scale_grads_(out, inv)
            return out
        # the update runs in the weights' dtype: a gradient accumulated in another
        # (fp32 gradients of bf16 weights without masters) is cast to it
        grads = [None if i in skip or p.grad is None
                 else p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype)
                 for i, p in enumerate(grads_from)]
        scale_grads_(grads, inv)
        return grads

    def _step_masters(self, grads: List[Optional[torch.Tensor]],
                      write_to: Sequence[nn.Parameter]) -> None:
        owned, main = self._owned, self.main_params
        for i in owned:
            main[i].grad = grads[i]
        self.optimizer.step()
        for i in owned:
            main[i].grad = None
        if self.prediction is None:  # cast the new masters into the working buffer
            _copy_all([main[i].data for i in owned], [write_to[i].data for i in owned])
        if self.prediction is not None:
            self.prediction.predict_(write_to, [m.data for m in main],
                                     self.optimizer.param_groups[0]["lr"])
        self._share_weights(write_to)

    def _step_in_buffer(self, grads: List[Optional[torch.Tensor]],
                        write_to: Sequence[nn.Parameter], base: Sequence[nn.Parameter]) -> None:
        _copy_buffer(base, write_to)
        if self.prediction is not None:  # base holds P(W(t)): recover W(t)
            self.prediction.restore_(write_to)
        for i in self._owned:
            self.main_params[i].data = write_to[i].data
            self.main_params[i].grad = grads[i]
        self.optimizer.step()
        for i in self._owned:
            self.main_params[i].grad = None
        if self.prediction is not None:
            self.prediction.predict_(write_to, [p.data for p in write_to],
                                     self.optimizer.param_groups[0]["lr"])
        self._share_weights(write_to)

    def _share_weights(self, write_to: Sequence[nn.Parameter]) -> None:
        """Distributed optimizer: every owner broadcasts the new weights of its parameters
        (one flat tensor per owner and dtype) to the other data-parallel replicas."""
        sh = self.shard
        if sh is None:
            return
        for r, owned in enumerate(self._by_rank):
            by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
            for i in owned:
                by_dtype.setdefault(write_to[i].dtype, []).append(write_to[i].data)
            for dtype, tensors in by_dtype.items():
                if r == sh.rank:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype,
                                       device=tensors[0].device)
                dist.broadcast(flat, src=sh.global_rank(r), group=sh.group)
                if r != sh.rank:
                    at = 0
                    for t in tensors:
                        t.copy_(flat[at:at + t.numel()].view_as(t))
                        at += t.numel()

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
            [None if m is None else m.data for m in self.main_params]
            if self.use_masters else None)
        if self.shard is not None:
            torch_state, masters = self._gather_state(torch_state, masters)
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
        meta = sd.get("meta")
        if meta is None:
            raise ValueError("optimizer checkpoint state has no 'meta' entry (not written by "
                             "MegatronOptimizer.state_dict)")
        if meta["optimizer"] != self.name:
            raise ValueError(f"optimizer checkpoint was saved with --optimizer "
                             f"{meta['optimizer']}, this run uses {self.name}")
        shapes = [tuple(s) for s in meta["shapes"]]
        if shapes != self._shapes:
            raise ValueError(f"optimizer checkpoint holds {len(shapes)} parameters "
                             f"{_first_difference(shapes, self._shapes)}; this stage has "
                             f"{len(self._shapes)}: is the parallel layout (tensor/pipeline "
                             f"sizes) or model shape different?")
        if self.use_masters and sd.get("fp32_masters") is None:
            raise ValueError("optimizer checkpoint has no fp32 master weights (saved without "
                             "mixed precision): load with --no-load-optim, or call "
                             "reload_model_params after loading the model weights")
        self.optimizer.load_state_dict(self._local_state(sd["optimizer"])
                                       if self.shard is not None else sd["optimizer"])
        if self.use_masters:
            with torch.no_grad():
                for main, saved in zip(self.main_params, sd["fp32_masters"]):
                    if main is not None:
                        main.data.copy_(saved)
        self.scaler.load_state_dict(sd["grad_scaler"])
        if self.prediction is not None:
            self.prediction.load_state_dict(sd.get("weight_prediction"))

    # -- the distributed optimizer's state in the unsharded format --------------------
    def _local_order(self) -> List[List[int]]:
        """Main-parameter indices of this rank's torch param groups, in order."""
        owned = set(self._owned)
        return [[i for i in group if i in owned] for group in self._full_order]

    def _gather_state(self, torch_state: Dict[str, Any], masters: Optional[List[Any]]):
        """This rank's torch state and masters -> everyone's, numbered as the unsharded
        optimizer numbers them (collective over the data-parallel group)."""
        local = [i for group in self._local_order() for i in group]
        mine = {"state": {local[j]: {k: (v.cpu() if torch.is_tensor(v) else v)
                                     for k, v in st.items()}
                          for j, st in torch_state["state"].items()},
                "masters": ({i: masters[i].cpu() for i in self._owned}
                            if masters is not None else None)}
        parts: List[Any] = [None] * self.shard.size
        dist.all_gather_object(parts, mine, group=self.shard.group)
        by_main: Dict[int, Any] = {}
        all_masters: Dict[int, Any] = {}
        for part in parts:
            by_main.update(part["state"])
            all_masters.update(part["masters"] or {})
        full_ids = {i: k for k, i in enumerate(i for g in self._full_order for i in g)}
        groups = []
        for saved, members in zip(torch_state["param_groups"], self._full_order):
            groups.append({**saved, "params": [full_ids[i] for i in members]})
        state = {full_ids[i]: st for i, st in sorted(by_main.items(), key=lambda x: full_ids[x[0]])}
        full_masters = ([all_masters[i] for i in range(len(self._shapes))]
                        if masters is not None else None)
        return {"state": state, "param_groups": groups}, full_masters

    def _local_state(self, full: Dict[str, Any]) -> Dict[str, Any]:
        """An unsharded torch state dict -> this rank's share, in its own numbering."""
        groups = full.get("param_groups", [])
        if len(groups) != len(self._full_order) or any(
                len(g["params"]) != len(members) for g, members in zip(groups, self._full_order)):
            raise ValueError("optimizer checkpoint: its parameter groups do not match this "
                             "stage's (decay, no-decay) groups")
        local, local_groups, j = {}, [], 0
        for saved, members, mine in zip(groups, self._full_order, self._local_order()):
            by_main = dict(zip(members, saved["params"]))
            ids = []
            for i in mine:
                if by_main[i] in full["state"]:
                    local[j] = full["state"][by_main[i]]
                ids.append(j)
                j += 1
            local_groups.append({**saved, "params": ids})
        return {"state": local, "param_groups": local_groups}

    def reload_model_params(self, params: Sequence[nn.Parameter]) -> None:
        """Make the main parameters match ``params`` (the buffer holding the latest weights)."""
        self._check_buffers("params", params)
        with torch.no_grad():
            for main, p in zip(self.main_params, params):
                if main is None:
                    continue
                if self.use_masters:
                    main.data.copy_(p.data)
                else:
                    main.data = p.data


def _copy_buffer(src: Sequence[nn.Parameter], dst: Sequence[nn.Parameter]) -> None:
    pairs = [(s.data, d.data) for s, d in zip(src, dst) if s is not d]
    if pairs:
        _copy_all([s for s, _ in pairs], [d for _, d in pairs])


def _copy_all(src: List[torch.Tensor], dst: List[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i (casting): one multi-tensor copy on an accelerator
    (a copy per parameter was hundreds of launches per step), a loop on the CPU."""
    if use_foreach(dst):
        torch._foreach_copy_(dst, src)
    else:
        for s, d in zip(src, dst):
            d.copy_(s)


def _first_difference(saved: List[tuple], ours: List[tuple]) -> str:
    for i, (a, b) in enumerate(zip(saved, ours)):
        if a != b:
            return f"(parameter {i}: saved {a}, here {b})"
    return ""


def get_megatron_optimizer(opt_cfg: Any, prec_cfg: Any, params: Sequence[nn.Parameter],
                           model_groups: Any = None, tp_rank: int = 0, *,
                           log_num_zeros: bool = False,
                           grads_to_none: bool = True,
                           log_params_norm: bool = False,
                           dp_group: Any = None) -> MegatronOptimizer:
    """Build the optimizer for one stage; ``params`` is the stage's (first) weight buffer.

    ``model_groups``: process group over the tensor x pipeline ranks of one model replica
    (None in a single process).  ``tp_rank`` decides who counts replicated parameters.
    ``dp_group``: the stage's data-parallel group (None: one replica), over which the
    replicas agree to skip a step and ``opt_cfg.use_distributed_optimizer`` shards the
    state.
    """
    params = list(params)
    if not params:
        raise ValueError("get_megatron_optimizer: the stage has no parameters")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("get_megatron_optimizer: a parameter appears twice in params")
    if opt_cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, "
                         f"got {opt_cfg.optimizer!r}")
    if prec_cfg.fp16 and prec_cfg.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    use_masters = prec_cfg.fp32_master_weights and any(p.dtype in _HALF for p in params)
    shard = None
    if getattr(opt_cfg, "use_distributed_optimizer", False):
        size = dist.get_world_size(dp_group) if dp_group is not None else 1
        rank = dist.get_rank(dp_group) if dp_group is not None else 0
        shard = OptimizerShard(rank=rank, size=size, group=dp_group,
                               owners=tuple(shard_owners([p.numel() for p in params], size)))
    owned = set(shard.owned) if shard is not None else set(range(len(params)))
    if use_masters:
        main: List[Optional[nn.Parameter]] = [
            nn.Parameter(p.detach().to(torch.float32, copy=True)) if i in owned else None
            for i, p in enumerate(params)]
    else:
        # p.data, not p.detach(): a detached tensor shares p's autograd version counter,
        # so updates that _step_in_buffer writes into ANOTHER buffer (main.data is
        # re-pointed under 2BW) would bump this buffer's version and fail the saved-
        # tensor check of a microbatch in flight on it.
        main = [nn.Parameter(p.data) if i in owned else None for i, p in enumerate(params)]

    # Decay matrices only: biases and LayerNorm weights (1-D) are not decayed.  The
    # groups are those of the whole stage; a distributed optimizer's hold its own share.
    decay_ids = [i for i, p in enumerate(params) if p.ndim >= 2]
    no_decay_ids = [i for i, p in enumerate(params) if p.ndim < 2]
    kept = [(ids, wd) for ids, wd in ((decay_ids, opt_cfg.weight_decay), (no_decay_ids, 0.0))
            if ids]
    full_order = [ids for ids, _ in kept]
    groups = [{"params": [main[i] for i in ids if i in owned], "weight_decay": wd}
              for ids, wd in kept]
    if opt_cfg.optimizer == "adam":
        # torch's fused kernel, on CUDA and on the CPU alike: one call for all tensors.
        # On the CPU a one-off timing of the 32 tensors of a small GPT stage gave 0.50 ms
        # per step against 1.40 ms for the default per-tensor loop (its effect on a whole
        # step is in bench/pipeline_schedules.py).  It agrees with the loop to rounding
        # (tests/unit/test_optimizer.py::test_fused_adam_agrees_with_torch_default_loop).
        kwargs = {"fused": True}
        torch_opt: torch.optim.Optimizer = torch.optim.AdamW(
            groups, lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
            eps=opt_cfg.adam_eps, **kwargs)
    else:
        torch_opt = torch.optim.SGD(groups, lr=opt_cfg.lr, momentum=opt_cfg.sgd_momentum)

    if prec_cfg.fp16 and prec_cfg.loss_scale is None:
        scaler: GradScaler = DynamicGradScaler(
            prec_cfg.initial_loss_scale, prec_cfg.min_loss_scale, growth_factor=2.0,
            backoff_factor=0.5, growth_interval=prec_cfg.loss_scale_window,
            hysteresis=prec_cfg.hysteresis)
    elif (prec_cfg.fp16 or prec_cfg.bf16) and prec_cfg.loss_scale is not None:
        # Megatron-LM: --loss-scale is a constant scale under --bf16 as well (bf16 needs
        # none by default); an fp32 run has no scaler (arguments warn)
        scaler = ConstantGradScaler(prec_cfg.loss_scale)
    else:
        scaler = ConstantGradScaler(1.0)
    return MegatronOptimizer(torch_opt, main, params, scaler=scaler, use_masters=use_masters,
                             skip_on_nonfinite=bool(prec_cfg.fp16), clip_grad=opt_cfg.clip_grad,
                             model_groups=model_groups, tp_rank=tp_rank,
                             log_num_zeros=log_num_zeros, grads_to_none=grads_to_none,
                             name=opt_cfg.optimizer, log_params_norm=log_params_norm,
                             shard=shard, full_order=full_order, dp_group=dp_group)

"""The update half of the executor: each batch's gradient sums and optimizer step.

REDUCE_GRADS starts batch t's data-parallel gradient reduction (``GradientReduction``)
and, on first and last stage, the sum of the tied word-embedding gradient.  STEP waits
for them, sums the sequence-parallel gradients over the tensor ranks and starts the
optimizer's agreement all-reduce, which is left in flight until the new weights are
first needed (``Updater.finish_steps``).  The per-batch loss scales, the gloo exchanges'
posted receives and the data-parallel means of the reported losses live here too.
``megatron.pipeline.engine`` owns one ``Updater`` and calls it from its handlers.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.exchange import ExchangeSum, exchange_pays
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.grad_reduction import GradientReduction
from megatron.pipeline.weights import WeightBuffers, grad_dtype_of, zero_grad_like

if TYPE_CHECKING:
    from megatron.pipeline.engine import _Segment


@dataclass
class StepReport:
    """What one optimizer step (one batch) produced on this rank."""

    iteration: int
    """Global index t of the batch that was just applied (0-based)."""
    skipped: bool
    grad_norm: float
    loss_scale: float
    lr: float
    weight_version: int
    """Version of the weights batch t's forward and backward passes used."""
    losses: Optional[Dict[str, float]] = None
    """Mean over the batch's microbatches and data-parallel replicas (last stage only)."""
    grad_scale: float = 1.0
    """Loss scale batch t's backward passes used (and its gradients were unscaled by)."""
    num_zeros: Optional[int] = None
    """Zero gradient elements over the model replica (--log-num-zeros-in-grad only)."""
    params_norm: Optional[float] = None
    """L2 norm of the weights batch t was computed with (--log-params-norm only)."""


class Updater:
    """Gradient sums and optimizer steps of one pipeline stage's batches."""

    def __init__(self, *, weights: WeightBuffers, optimizer, groups: ParallelGroups,
                 device: torch.device, num_microbatches: int,
                 buffer_for: Callable[[int], int], schedule_at: Callable[[int], str],
                 version: Callable[[int], int], prefetch: Callable[[Any], None],
                 on_finished: Callable[["_Segment", StepReport], None],
                 per_token_loss: bool = False,
                 fault_injection: Optional[Callable[[int, int], bool]] = None,
                 overlap_grad_reduce: bool = True,
                 grad_bucket_elements: Optional[int] = None) -> None:
        """``buffer_for``, ``schedule_at`` and ``version``: the executor's weight buffer,
        schedule and weight version of batch t.  ``prefetch(work)`` reads data while
        ``work`` is in flight; ``on_finished(seg, report)`` follows every finished step."""
        self.weights = weights
        self.optimizer = optimizer
        self.groups = groups
        self.device = device
        self.num_microbatches = num_microbatches
        self.stage = groups.pp_rank
        self.is_last = groups.is_last_stage
        self.per_token_loss = per_token_loss
        self.fault_injection = fault_injection
        self.buffer_for = buffer_for
        self.schedule_at = schedule_at
        self._version = version
        self._prefetch_during = prefetch
        self._on_finished = on_finished
        # The tied word embedding of first and last stage: its sum between the two
        # stages starts at REDUCE_GRADS; its data-parallel average follows at STEP.
        # (an untied output layer, --untie-embeddings-and-output-weights, shares nothing)
        self._tied = any(getattr(p, "shared_embedding", False) for p in weights.params(0))
        self._tied_early = (groups.in_embedding_group and groups.embedding is not None
                            and self._tied)
        # one gradient reducer per weight buffer (its hooks sit on that buffer's params)
        # per weight buffer, the weights whose gradients are summed over the tensor ranks
        # at each step (sequence parallelism: ``_sum_sequence_parallel_grads``)
        self._sequence_parallel_params = [
            [p for p in weights.params(j)
             if getattr(p, "sequence_parallel", False) and p.requires_grad]
            if groups.tp_size > 1 and groups.tensor is not None else []
            for j in range(weights.num_buffers)]
        self._reducers = [GradientReduction(
            weights.params(j), groups.data, groups.dp_size, num_microbatches,
            overlap=overlap_grad_reduce, bucket_elements=grad_bucket_elements,
            exclude=tuple(p for p in weights.params(j)
                          if self._tied_early and getattr(p, "shared_embedding", False)),
            shard=getattr(optimizer, "shard", None))
            for j in range(weights.num_buffers)]
        self._reductions: Dict[int, GradientReduction] = {}
        self._embedding_work: Dict[int, Any] = {}
        # On gloo the tied-embedding sum is an ExchangeSum (None: not built yet, False:
        # all_reduce), as is the optimizer's agreement (``agreement_exchange``).  Their
        # receives are posted ahead (``_post_sum_receives``), only for rounds the current
        # segment will still start (counted here), so none is left over.
        self._embedding_exchange: Union[None, bool, ExchangeSum] = None
        self._embedding_unstarted = 0
        self._agreement_unstarted = 0
        self.pending_steps: List[tuple] = []
        # Loss scale each batch's backward passes use.  A batch may start its backward
        # before the previous batch's STEP updated the scaler (2BW), so the scale of
        # batch t is fixed as the one in force after STEP(t - lag): lag 2 under 2BW
        # (STEP(t-2) precedes all of batch t), 1 otherwise.  Identical on every stage.
        self._scale_lag = 2 if self.schedule_at(0) == "2bw" else 1
        self.batch_scales: Dict[int, float] = {}
        self.seed_batch_scales(0)
        self.lr_provider: Callable[[], float] = lambda: 0.0

    # -- segments --------------------------------------------------------------------------
    def seed_batch_scales(self, iteration: int) -> None:
        for t in range(iteration, iteration + self._scale_lag):
            self.batch_scales.setdefault(t, self.optimizer.loss_scale)

    def start_schedule(self, name: str, iteration: int) -> None:
        """The next batches, from ``iteration`` on, run under schedule ``name``."""
        self._scale_lag = 2 if name == "2bw" else 1
        self.seed_batch_scales(iteration)

    def set_num_microbatches(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        for reducer in self._reducers:
            reducer.microbatches = num_microbatches

    def expect_rounds(self, num_reduce_grads: int, num_steps: int) -> None:
        """A segment starts with this many REDUCE_GRADS and STEP actions on this stage."""
        self._embedding_unstarted = num_reduce_grads if self._tied_early else 0
        self._agreement_unstarted = num_steps

    # -- REDUCE_GRADS and STEP --------------------------------------------------------------
    def reduce_grads(self, t: int) -> None:
        """Batch t's backward passes on this stage are done: buckets whose gradients
        were final early are already in flight (hooks); start the rest now."""
        j = self.buffer_for(t)
        for p in self.weights.params(j):
            if p.requires_grad and p.grad is None:
                p.grad = zero_grad_like(p)
        reducer = self._reducers[j]
        reducer.launch_remaining()
        self._reductions[t] = reducer
        if self._tied_early:
            self._post_sum_receives(self._embedding_exchange, self._embedding_unstarted)
            # Start the tied-embedding sum now, not at STEP: the last stage finishes batch
            # t's backward passes long before the first stage does, so by the first
            # stage's STEP(t) its half is already posted and neither end waits for the
            # other (under 2BW, STEP(t) of first and last stage need not coincide).  The
            # sum and the data-parallel average are linear, so their order is free; the
            # average of this one tensor follows at STEP, among replicas of this stage.
            self._embedding_work[t] = self._start_embedding_sum(self.weights.params(j))

    def step(self, t: int, seg: _Segment) -> None:
        """Start the update of batch t: data-parallel and tied-embedding gradient sums,
        then the optimizer's agreement all-reduce, which is left in flight.  The update
        itself is finished by ``finish_steps`` when the new weights are first needed:
        before batch t+1 starts (flush/gpipe/none: at once) or before batch t+2 starts
        (2BW), so under 2BW stages do not wait for each other at every step.  The first
        stage under 2BW begins there too (below)."""
        if self.stage == 0 and self.schedule_at(t) == "2bw":
            # The first stage ends batch t's backward passes last, so its data-parallel
            # all-reduce would be waited on here, exposed, at every step.  Its update
            # begins when the new weights are first needed instead (``finish_steps``,
            # before batch t+2), and the all-reduce runs beside the m - d + 1 forward/
            # backward pairs between.  Safe: every other stage needs this step's
            # agreement only before its own batch t+2, which starts after the first
            # stage's; decided by stage, so all of the stage's tensor and data-parallel
            # peers issue their collectives in the same order.
            self.pending_steps.append((t, None, None))
            return
        pending, grad_scale = self._begin_update(t, seg)
        self.pending_steps.append((t, pending, grad_scale))
        if self.schedule_at(t) != "2bw":
            self.finish_steps(seg, before_batch=t + 1)

    def _begin_update(self, t: int, seg: _Segment) -> Tuple[Any, float]:
        """Wait for batch t's gradient sums and start the optimizer's agreement:
        (pending update, the batch's gradient scale)."""
        params = self.weights.params(self.buffer_for(t))
        self._post_sum_receives(self._agreement_exchange(), self._agreement_unstarted)
        reduction = self._reductions.pop(t, None)
        if reduction is not None:
            reduction.finish()
        self._sum_sequence_parallel_grads(self._sequence_parallel_params[self.buffer_for(t)])
        grad_scale = self.batch_scales.pop(t)
        # The last stage's copy of the tied embedding counts in no statistic (the first
        # stage counts the sum), so the agreement starts before that sum is complete:
        # the first stage, last to finish a flushed batch, then finds it received.
        late = getattr(self.optimizer, "late_grad_indices", ()) if self._tied_early else ()
        pending = None
        if late:
            pending = self._begin_step(params, grad_scale, seg, t, late)
        if t in self._embedding_work:
            work = self._embedding_work.pop(t)
            if work is not None:
                self._prefetch_during(work)  # the other end may still be in its backward
                work.wait()
            if self.groups.data is not None and self.groups.dp_size > 1:
                shared = next(p for p in params if getattr(p, "shared_embedding", False))
                shared.grad.div_(self.groups.dp_size)
                dist.all_reduce(shared.grad, group=self.groups.data)
        else:
            self._allreduce_embedding_grads(params)
        if pending is None:
            pending = self._begin_step(params, grad_scale, seg, t)
        else:
            self.optimizer.take_late_grads(pending)
        return pending, grad_scale

    def _sum_sequence_parallel_grads(self, chosen: List[nn.Parameter]) -> None:
        """Sequence parallelism: the replicated weights that act on s/t positions per
        tensor rank (norms, the row-parallel biases) hold partial gradients; sum them
        over the tensor group -- one flat all-reduce per gradient dtype, once per step,
        as Megatron-LM does -- so every tensor rank holds the whole, equal gradient."""
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = defaultdict(list)
        for p in chosen:
            if p.grad is None:  # no microbatch reached it: its share is zero
                p.grad = zero_grad_like(p)
            by_dtype[p.grad.dtype].append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            dist.all_reduce(flat, group=self.groups.tensor)
            offset = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

    def _begin_step(self, params: List[nn.Parameter], grad_scale: float, seg: _Segment,
                    t: int, late: Sequence[int] = ()) -> Any:
        if self.fault_injection and self.fault_injection(t, self.stage):
            with torch.no_grad():  # into a gradient that is final and counted here
                next(p for i, p in enumerate(params) if p.grad is not None and i not in late
                     ).grad.view(-1)[0] = float("inf")
        self._agreement_unstarted -= 1
        tokens = None
        if self.per_token_loss:
            # the last stage's count, from one tensor rank (the agreement sums the replica)
            tokens = (seg.token_sums.get(t, 0.0)
                      if self.is_last and self.groups.tp_rank == 0 else 0.0)
        return self.optimizer.begin_step(params, grad_scale=grad_scale, late=late,
                                         extra_found_inf=self._loss_nonfinite(seg, t),
                                         num_tokens=tokens)

    def _loss_nonfinite(self, seg: _Segment, t: int) -> Union[bool, torch.Tensor]:
        """Last stage: whether batch t's reported loss is inf/nan, as a device tensor (no
        sync).  Fed into the optimizer's agreement so every stage skips the step: a loss
        like ``l + nan`` leaves the gradients finite, so the gradient check alone would
        apply the step."""
        sums = seg.loss_sums.get(t, {}) if self.is_last else {}
        if not sums:
            return False
        vec = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device)
                           for v in sums.values()])
        return (~torch.isfinite(vec)).any()

    def finish_steps(self, seg: _Segment, before_batch: Optional[int] = None) -> None:
        """Finish pending updates that batch ``before_batch`` needs (all when None)."""
        while self.pending_steps:
            t, pending, grad_scale = self.pending_steps[0]
            if before_batch is not None and t + self._scale_lag > before_batch:
                return
            self.pending_steps.pop(0)
            if pending is None:  # the first stage's 2BW step, begun only now (``step``)
                pending, grad_scale = self._begin_update(t, seg)
            # Losses first: reading them waits for batch t's backward, as the optimizer's
            # agreement does anyway; read after the update they would also wait for the
            # optimizer's kernels, and the CPU could not queue the next batch meanwhile.
            losses = None
            if self.is_last:
                sums = seg.loss_sums.pop(t, {})
                if self.per_token_loss:
                    losses = self.dp_per_token(sums, seg.token_sums.pop(t, None))
                else:
                    losses = self.dp_mean({k: v / self.num_microbatches
                                           for k, v in sums.items()})
            if pending.work is not None:
                self._prefetch_during(pending.work)
            lr = self.lr_provider()
            # base: the buffer holding W(t) (a flush step, warm-up included, updates in place)
            base = self.buffer_for(t + 1 if self.schedule_at(t) == "2bw" else t)
            info = self.optimizer.finish_step(pending, self.weights.params(self.buffer_for(t)),
                                              self.weights.params(base), lr)
            self.batch_scales[t + self._scale_lag] = self.optimizer.loss_scale
            report = StepReport(iteration=t, skipped=info.skipped, grad_norm=info.grad_norm,
                                loss_scale=info.loss_scale, lr=lr,
                                weight_version=self._version(t),
                                losses=losses, grad_scale=grad_scale, num_zeros=info.num_zeros,
                                params_norm=info.params_norm)
            self._on_finished(seg, report)

    # -- the tied word embedding --------------------------------------------------------------
    def _start_embedding_sum(self, params: List[nn.Parameter]) -> Any:
        """Start the tied word-embedding gradient sum of first and last stage: on gloo
        by direct exchange (``megatron.exchange``), else an async all_reduce."""
        self._embedding_unstarted -= 1
        if self._embedding_exchange is None:
            self._embedding_exchange = False
            if exchange_pays(self.groups.embedding):
                p = self._shared_embedding(params)
                self._embedding_exchange = ExchangeSum(self.groups.embedding, p.shape,
                                                       grad_dtype_of(p), p.device)
        if not self._embedding_exchange:
            return self._allreduce_embedding_grads(params, async_op=True)
        p = self._shared_embedding(params)
        if p.grad is None:
            p.grad = zero_grad_like(p)
        return self._embedding_exchange.start(p.grad)

    def _shared_embedding(self, params: List[nn.Parameter]) -> nn.Parameter:
        shared = [p for p in params if getattr(p, "shared_embedding", False)]
        if len(shared) != 1:
            raise RuntimeError(f"stage {self.stage} should hold exactly one tied word-embedding "
                               f"parameter, found {len(shared)}")
        return shared[0]

    def _allreduce_embedding_grads(self, params: List[nn.Parameter], async_op: bool = False):
        """Sum the tied word-embedding gradient of the first and last stage (returns the
        pending work with ``async_op``, else None)."""
        if not self.groups.in_embedding_group or self.groups.embedding is None \
                or not self._tied:
            return None
        p = self._shared_embedding(params)
        if p.grad is None:
            p.grad = zero_grad_like(p)
        return dist.all_reduce(p.grad, group=self.groups.embedding, async_op=async_op)

    # -- the gloo exchanges -------------------------------------------------------------------
    def check_sums(self) -> None:
        """End of a segment: no exchange has a receive left posted.  Their last sends
        are not waited on here: segments can be one batch long, and the first stage,
        whose sends go last, would wait for every one of them to land on the critical
        path (about 1.2 ms a batch on the small GPT when flush segments were always one
        batch, by a bench/step_chain.py run of that version, not kept).  The next
        round's start waits for them, and ``finish_sums`` at the end of training."""
        for what, exchange in (("tied-embedding", self._embedding_exchange),
                               ("optimizer agreement", self._agreement_exchange())):
            if exchange and exchange.num_posted:
                raise RuntimeError(f"stage {self.stage}: {exchange.num_posted} "
                                   f"{what} receive(s) posted ahead were never used")

    def finish_sums(self) -> None:
        """Wait for the exchanges' sends still in flight (end of training, before the
        process groups go).  Their receivers have posted every receive they match, so
        this only waits for the data to land."""
        for exchange in (self._embedding_exchange, self._agreement_exchange()):
            if exchange:
                exchange.drain()

    def _agreement_exchange(self) -> Optional[ExchangeSum]:
        get = getattr(self.optimizer, "agreement_exchange", None)
        return get() if get is not None else None

    def _post_sum_receives(self, exchange: Union[None, bool, ExchangeSum],
                           unstarted: int) -> None:
        """Post ``exchange``'s receives for its current round and the next one (of those
        this segment will still start; see ``megatron.exchange``).  Called just before the
        round starts -- the tied embedding's at REDUCE_GRADS, the agreement's at STEP --
        before the stage waits on anything: never right after a wait returned, where
        posting blocked for milliseconds now and then, as in ``P2PCommunicator``."""
        while exchange and exchange.num_posted < min(unstarted, 2):
            exchange.post_receives()

    # -- reported losses ----------------------------------------------------------------------
    def dp_mean(self, values: Dict[str, torch.Tensor]) -> Dict[str, float]:
        if not values:
            return {}
        keys = sorted(values)
        # one stacked tensor and ONE device-to-host copy per step (the only sync here)
        vec = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=self.device)
                           for k in keys])
        if self.groups.data is not None and self.groups.dp_size > 1:
            dist.all_reduce(vec, group=self.groups.data)
            vec = vec / self.groups.dp_size
        return dict(zip(keys, vec.tolist()))

    def dp_per_token(self, sums: Dict[str, torch.Tensor],
                     tokens: Optional[torch.Tensor]) -> Dict[str, float]:
        """Per-token losses: every reported sum over the data-parallel replicas, divided
        by their tokens.  The ratio of the replicas' means is that of their sums, so
        ``dp_mean``'s one all-reduce carries the token count along."""
        if not sums:
            return {}
        means = self.dp_mean({**sums, " tokens": 0.0 if tokens is None else tokens})
        count = means.pop(" tokens")
        return {k: v / count if count > 0 else v for k, v in means.items()}

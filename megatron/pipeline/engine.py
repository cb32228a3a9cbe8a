"""The executor: runs one rank's action list on real process groups.

The schedule (``megatron.pipeline.schedules.build_schedule``, this stage's list of each
segment shape built once by ``megatron.pipeline.stage_plan``) says what this stage does
and in which order; the engine only dispatches each action to a small handler.  It is
model-agnostic: a microbatch is processed by the trainer's
``forward_step(data_iterator, model) -> (output, loss_fn)``; on the last stage
``loss_fn(output) -> (loss, {name: value})``.

Weight versions follow ``megatron.pipeline.weights``: one buffer for none/gpipe/flush,
two for 2BW.  Gradients of a batch accumulate in the ``.grad`` of the buffer the batch
ran on; at the batch's STEP they are all-reduced across data-parallel replicas, the tied
embedding gradient is summed between first and last stage, and the optimizer agrees
with every other stage on overflow and on the global norm before writing the new
version: that update half is ``megatron.pipeline.update``'s ``Updater``, which the engine
owns and calls from its REDUCE_GRADS and STEP handlers.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.errors import UserError
from megatron.parallel_state import ParallelGroups
from megatron.pipeline.actions import Action, Op
from megatron.pipeline.memory import StashTracker, tensor_bytes
from megatron.pipeline.p2p import P2PCommunicator, available_cores, prepost_pays
from megatron.pipeline.param_gather import gather_hooks
from megatron.pipeline.stage_plan import PlanKey, StagePlan, StagePlans
from megatron.pipeline.update import StepReport, Updater
from megatron.pipeline.weights import WeightBuffers

ForwardStep = Callable[[Iterator[Any], nn.Module], Any]


class PipelineError(RuntimeError):
    """An action failed; the message holds the schedule grid with the failing step marked."""


@dataclass
class _Segment:
    """Per-segment scratch state of the executor."""

    start_iteration: int
    data_iterator: Optional[Iterator[Any]]
    train: bool
    inputs: Dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: Dict[int, Any] = field(default_factory=dict)
    out_grads: Dict[int, torch.Tensor] = field(default_factory=dict)
    in_grads: Dict[int, torch.Tensor] = field(default_factory=dict)
    stash: Dict[int, tuple] = field(default_factory=dict)
    loss_sums: Dict[int, Dict[str, torch.Tensor]] = field(default_factory=dict)
    token_sums: Dict[int, torch.Tensor] = field(default_factory=dict)
    """Per-token losses: the tokens each batch's loss sums ran over (last stage)."""
    reports: List[StepReport] = field(default_factory=list)
    prefetched: Deque[Any] = field(default_factory=deque)
    """Microbatches read ahead of their forward while this stage waited (FIFO)."""
    fetches_left: int = 0
    """Microbatches this stage's schedule still reads in the segment (prefetched or not)."""


class PipelineEngine:
    """Runs the training and evaluation schedules of one pipeline stage."""

    def __init__(self, *, model: nn.Module, optimizer, groups: ParallelGroups, schedule: str,
                 num_microbatches: int, micro_batch_size: int, forward_step: ForwardStep,
                 device: torch.device, activation_dtype: torch.dtype,
                 stage_recompute: bool = False, trace: bool = False,
                 overlap_grad_reduce: bool = True,
                 get_rng_state: Optional[Callable[[], Any]] = None,
                 set_rng_state: Optional[Callable[[Any], None]] = None,
                 fault_injection: Optional[Callable[[int, int], bool]] = None,
                 memory_count_interval: int = 0, flush_warmup_iters: int = 0,
                 prepost_receives: Optional[bool] = None,
                 grad_dtype: Optional[torch.dtype] = None,
                 per_token_loss: bool = False,
                 grad_bucket_elements: Optional[int] = None) -> None:
        """``prepost_receives``: post each receive ahead of its action (see
        ``megatron.pipeline.p2p``); default: on gloo when this node's ranks have a core
        per compute thread (``prepost_pays``).  ``grad_dtype``: dtype the gradients of
        weights of another dtype accumulate, are averaged and summed in (float32 for
        --accumulate-allreduce-grads-in-fp32); None: the weights' own.

        ``per_token_loss`` (--calculate-per-token-loss): the last stage's ``loss_fn``
        returns ``(loss_sum, num_tokens, {name: sum})`` instead of ``(loss, {name:
        mean})``; the backward passes run on the sums, the optimizer divides the
        gradients by the tokens of the whole global batch, and the reported values are
        sums over the batch divided by its tokens (Megatron-LM's convention): a
        microbatch with more unmasked tokens weighs more, instead of each weighing 1/m.

        ``grad_bucket_elements`` (--ddp-bucket-size): parameters per gradient bucket of
        plain data parallelism (None: 32 MiB of gradients; the distributed optimizer's
        buckets are its own, planned with the same size)."""
        self.model = model
        self.optimizer = optimizer
        self.groups = groups
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        """Microbatches per training batch; changed between segments under a batch-size
        ramp-up (``set_num_microbatches``)."""
        self.eval_microbatches = num_microbatches
        """Microbatches per evaluation batch: always those of the full batch."""
        self.micro_batch_size = micro_batch_size
        self.forward_step = forward_step
        self.device = device
        self.stage_recompute = stage_recompute
        self.per_token_loss = per_token_loss
        self.fault_injection = fault_injection
        self.stage = groups.pp_rank
        self.plans = StagePlans(self.stage)
        """This stage's action lists of the segment shapes last run (built once each)."""
        self.num_stages = groups.pp_size
        self.is_first = groups.is_first_stage
        self.is_last = groups.is_last_stage
        self.iteration = 0
        # --2bw-mitigation warmup: batches t < flush_warmup_iters run under flush
        # semantics on buffer 0, later ones under 2BW (see ``schedule_at``).
        self.flush_warmup_iters = flush_warmup_iters if schedule == "2bw" else 0
        self._init_weights(grad_dtype)
        # Saved-tensor hooks run on the first batch this engine trains, and on
        # every batch t with t % memory_count_interval == 0 when it is > 0 (1: always);
        # other batches replay the bytes counted for the same microbatch position.
        self.memory_count_interval = memory_count_interval
        self.trace_enabled = trace
        self.trace_events: List[dict] = []
        self.clock_origin = time.perf_counter()
        self._get_rng_state = get_rng_state
        self._set_rng_state = set_rng_state
        self.p2p = self._build_p2p(activation_dtype, prepost_receives)
        # Waits (a receive in flight, the optimizer's agreement) read the segment's next
        # microbatches, at most one batch ahead: data loading leaves the critical path.
        self._seg: Optional[_Segment] = None
        self.p2p.on_idle = self._prefetch_during
        self._handlers = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
            Op.SEND_ACT: self._send_act, Op.RECV_ACT: self._recv_act,
            Op.SEND_GRAD: self._send_grad, Op.RECV_GRAD: self._recv_grad,
            Op.REDUCE_GRADS: self._reduce_grads, Op.STEP: self._step,
        }
        # REDUCE_GRADS and STEP: gradient sums, optimizer steps and per-batch loss scales
        self.updater = Updater(
            weights=self.weights, optimizer=optimizer, groups=groups, device=device,
            num_microbatches=num_microbatches, buffer_for=self.buffer_for,
            schedule_at=self.schedule_at, version=self._version,
            prefetch=self._prefetch_during, on_finished=self._step_finished,
            per_token_loss=per_token_loss, fault_injection=fault_injection,
            overlap_grad_reduce=overlap_grad_reduce, grad_bucket_elements=grad_bucket_elements)
        # --overlap-param-gather: a step's weight all-gathers stay in flight into the next
        # forward pass, whose layers wait for their own buckets (None: waited at the step)
        self._gather_hooks = gather_hooks(model, self.weights, optimizer)
        self._on_step: Optional[Callable[[StepReport], None]] = None

    def _init_weights(self, grad_dtype: Optional[torch.dtype]) -> None:
        """The stage's weight buffers (two for 2BW) and the tracker that counts their
        versions among the stashed bytes."""
        self.weights = WeightBuffers(self.model, 2 if self.schedule_name == "2bw" else 1)
        if grad_dtype is not None:
            self.weights.set_grad_dtype(grad_dtype)
        self.tracker = StashTracker(self.weights.storage_ptrs())
        self.tracker.note_weight_versions(1, self.weights.bytes_per_buffer())

    def _build_p2p(self, activation_dtype: torch.dtype,
                   prepost_receives: Optional[bool]) -> P2PCommunicator:
        """The communicator with the neighbouring stages (``prepost_receives`` None: on
        where ``prepost_pays``)."""
        shape = (self.model.stage_input_shape(self.micro_batch_size)
                 if self.num_stages > 1 else (1,))
        if prepost_receives is None:
            prepost_receives = self.num_stages > 1 and dist.is_initialized() and prepost_pays(
                dist.get_backend(),
                int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
                torch.get_num_threads(), available_cores())
        return P2PCommunicator(self.groups.prev_rank, self.groups.next_rank, shape,
                               activation_dtype, self.device,
                               prepost_receives=prepost_receives,
                               max_pending_sends=2 * self.num_stages)

    # -- buffers -----------------------------------------------------------------------
    def buffer_for(self, t: int) -> int:
        """Weight buffer used by global batch t."""
        return t % 2 if self.weights.num_buffers == 2 and t >= self.flush_warmup_iters else 0

    def schedule_at(self, t: int) -> str:
        """Schedule batch t runs under (flush during a 2BW run's flush warm-up)."""
        return "flush" if t < self.flush_warmup_iters else self.schedule_name

    def _version(self, t: int) -> int:
        """Weight version batch t uses; after a warm-up of N batches 2BW restarts from
        W(N) (batches N and N+1 both use it, as batches 0 and 1 use W(0))."""
        if self.schedule_at(t) != "2bw":
            return t
        return max(self.version_for(t, "2bw"), self.flush_warmup_iters)

    @property
    def latest_buffer(self) -> int:
        """Buffer that holds the newest weights W(iteration)."""
        return self.buffer_for(self.iteration - 1) if self.iteration > 0 else 0

    @property
    def shadow_buffer(self) -> int:
        """Buffer the next batch will use (2BW: W(iteration - 1))."""
        return self.buffer_for(self.iteration)

    @staticmethod
    def version_for(t: int, schedule: str) -> int:
        return max(t - 1, 0) if schedule == "2bw" else t

    def install_latest(self) -> None:
        self.weights.install(self.latest_buffer)

    def state_dict(self) -> dict:
        """Executor state a checkpoint must carry (per-batch loss scales in flight)."""
        return {"iteration": self.iteration, "batch_scales": dict(self.updater.batch_scales)}

    def load_state_dict(self, sd: dict) -> None:
        self.iteration = sd["iteration"]
        self.updater.batch_scales = {int(k): float(v)
                                     for k, v in sd.get("batch_scales", {}).items()}
        self.updater.seed_batch_scales(self.iteration)

    def set_iteration(self, iteration: int) -> None:
        """Resume at ``iteration`` without executor state (older checkpoints)."""
        self.iteration = iteration
        self.updater.batch_scales = {}
        self.updater.seed_batch_scales(self.iteration)

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """Train the next segments with batches of ``num_microbatches`` (a batch-size
        ramp-up).  Only between segments: the schedule of a segment is built for one m,
        and every step of the last segment has finished."""
        if num_microbatches == self.num_microbatches:
            return
        if self._seg is not None or self.updater.pending_steps:
            raise RuntimeError("set_num_microbatches inside a training segment")
        if num_microbatches < 1 or (self.schedule_name == "2bw"
                                    and num_microbatches < self.num_stages):
            raise ValueError(f"{num_microbatches} microbatches per batch: the schedule "
                             f"{self.schedule_name} at depth {self.num_stages} needs at least "
                             f"{self.num_stages if self.schedule_name == '2bw' else 1}")
        self.num_microbatches = num_microbatches
        self.updater.set_num_microbatches(num_microbatches)

    # -- public entry points ------------------------------------------------------------
    def train_batches(self, data_iterator: Iterator[Any], num_batches: int,
                      lr_provider: Callable[[], float],
                      on_step: Optional[Callable[[StepReport], None]] = None) -> List[StepReport]:
        """Run ``num_batches`` optimizer steps and drain the pipeline at the end."""
        self.updater.lr_provider = lr_provider
        self._on_step = on_step
        reports: List[StepReport] = []
        end = self.iteration + num_batches
        while self.iteration < end:  # two parts when the flush warm-up ends inside
            name = self.schedule_at(self.iteration)
            warm = self.iteration < self.flush_warmup_iters
            stop = min(end, self.flush_warmup_iters) if warm else end
            if self.flush_warmup_iters and self.iteration == self.flush_warmup_iters:
                # the copy reads every weight: --overlap-param-gather may still have the
                # last warm-up step's all-gathers in flight (the other replicas' pieces)
                self.optimizer.wait_gathers()
                self.weights.sync_all_from(self.latest_buffer)  # 2BW starts from W(N)
            self.updater.start_schedule(name, self.iteration)
            plan = self.plans.get(name, self.num_stages, self.num_microbatches,
                                  stop - self.iteration)
            seg = _Segment(start_iteration=self.iteration, data_iterator=data_iterator,
                           train=True)
            self.model.train()
            # The stash pattern is kept across segments: a microbatch's shapes are fixed
            # by --micro-batch-size and --seq-length, and the training loop may run
            # short segments (down to one batch as a streak of skipped steps nears its
            # limit, see training.SkipMonitor.batches_before_verdict), which would
            # otherwise count every batch.
            self._run(plan, seg)
            reports += seg.reports
        self.optimizer.wait_gathers()  # checkpoints and evaluation read every weight
        self.install_latest()
        return reports

    @torch.no_grad()
    def evaluate(self, data_iterator: Iterator[Any], num_batches: int) -> Optional[Dict[str, float]]:
        """Forward-only passes with the newest weights; mean losses on the last stage."""
        plan = self.plans.get(self.schedule_name, self.num_stages, self.eval_microbatches,
                              num_batches, forward_only=True)
        seg = _Segment(start_iteration=self.iteration, data_iterator=data_iterator, train=False)
        self.model.eval()
        self.install_latest()
        true_weights = getattr(self.optimizer, "true_weights", None)
        try:
            with (true_weights(self.weights.params(self.latest_buffer)) if true_weights
                  else contextlib.nullcontext()):
                self._run(plan, seg)
        finally:
            self.model.train()
        if not self.is_last:
            return None
        totals: Dict[str, torch.Tensor] = {}
        for sums in seg.loss_sums.values():
            for k, v in sums.items():
                totals[k] = totals.get(k, 0) + v
        if self.per_token_loss:
            return self.updater.dp_per_token(totals, seg.token_sums.get(0))
        count = num_batches * self.eval_microbatches
        return self.updater.dp_mean({k: v / count for k, v in totals.items()})

    def memory_stats(self) -> dict:
        return self.tracker.stats.as_dict()

    # -- the dispatch loop ---------------------------------------------------------------
    def _run(self, plan: StagePlan, seg: _Segment) -> None:
        seg.fetches_left = plan.forwards
        self.updater.expect_rounds(plan.reduces, plan.steps)
        self.p2p.expect_receives(plan.act_receives, plan.grad_receives)
        self._seg = seg
        try:
            self._run_actions(plan, seg)
        finally:
            self._seg = None

    def _run_actions(self, plan: StagePlan, seg: _Segment) -> None:
        for index, action in enumerate(plan.actions):
            start = time.perf_counter()
            # this thread's CPU time: wall minus CPU of a compute action is time the
            # stage was descheduled (CPU contention), not work
            cpu_start = time.thread_time() if self.trace_enabled else 0.0
            try:
                handler = self._handlers[action.op]
            except KeyError:
                raise RuntimeError(f"stage {self.stage}: unknown pipeline action {action}") from None
            try:
                handler(action, seg)
            except (PipelineError, UserError):
                raise  # a bad token id or file is the user's to fix: no schedule grid
            except Exception as exc:
                raise PipelineError(self._report_failure(plan.full_schedule(), index, action,
                                                         exc, plan.key)) from exc
            if self.trace_enabled:
                self._trace(action, seg, start, time.perf_counter(),
                            time.thread_time() - cpu_start)
        self.updater.finish_steps(seg)
        self.p2p.wait_all()
        self.updater.check_sums()
        if self.p2p.num_posted_receives:  # the schedule's receives were counted at start
            raise RuntimeError(f"stage {self.stage}: {self.p2p.num_posted_receives} "
                               "receive(s) posted ahead were never used")

    def finish_sums(self) -> None:
        """Wait for the exchanges' sends still in flight (end of training, before the
        process groups go): ``Updater.finish_sums``."""
        self.updater.finish_sums()

    def _report_failure(self, actions, index: int, action: Action, exc: Exception,
                        key: Optional[PlanKey] = None) -> str:
        """``key``: the failing segment's shape, which the header names (the flush
        warm-up of --2bw-mitigation warmup, and an evaluation's microbatches, differ from
        the run's schedule and its training m)."""
        name, m, what = self.schedule_name, self.num_microbatches, ""
        if key is not None:
            name, _, m, _, forward_only = key
            what = ", forward only" if forward_only else ""
        try:
            from megatron.pipeline.schedules import format_grid
            # A window of 12 time units either side of the failing action: the full grid
            # of a long segment is tens of kilobytes per stage line, printed by every
            # failing rank.
            grid = format_grid(actions, mark=(self.stage, index), window=12)
        except Exception as grid_exc:  # noqa: BLE001 - the original error matters more
            grid = f"(could not draw the schedule grid: {grid_exc})"
        # a send or receive failed: name the global rank at its other end (after a
        # kill that rank prints nothing itself)
        p2p = getattr(self, "p2p", None)  # this report must not fail in its turn
        peer = None if p2p is None else {
            Op.SEND_ACT: p2p.next_rank, Op.RECV_GRAD: p2p.next_rank,
            Op.RECV_ACT: p2p.prev_rank, Op.SEND_GRAD: p2p.prev_rank}.get(action.op)
        msg = (f"[rank {self.groups.rank}] pipeline stage {self.stage} failed at action "
               f"#{index} {action}{'' if peer is None else f' (with rank {peer})'} "
               f"({name}{what}, d={self.num_stages}, m={m}, iteration {self.iteration}): "
               f"{type(exc).__name__}: {exc}\n{grid}")
        print(msg, file=sys.stderr, flush=True)
        return msg

    def _trace(self, action: Action, seg: _Segment, start: float, end: float,
               cpu: float) -> None:
        batch = None if action.batch is None else seg.start_iteration + action.batch
        self.trace_events.append({
            "rank": self.groups.rank, "stage": self.stage, "action": str(action),
            "op": action.op.value, "microbatch": action.microbatch, "batch": batch,
            "start": start, "end": end, "cpu": cpu, "train": seg.train,
            "version": (self._version(batch)
                        if batch is not None and action.op in (Op.FORWARD, Op.BACKWARD) else None)})

    # -- compute -------------------------------------------------------------------------
    def _global_batch(self, action: Action, seg: _Segment) -> int:
        return seg.start_iteration + action.batch

    def _next_data(self, seg: _Segment) -> Any:
        if seg.data_iterator is None:
            return None
        seg.fetches_left -= 1
        if seg.prefetched:
            return seg.prefetched.popleft()
        return self._read(seg)

    def _prefetch_during(self, work: Any) -> None:
        """While ``work`` is in flight, read the segment's upcoming microbatches (at most
        one batch ahead), so a forward finds its data loaded: on a stage that waits for a
        neighbour (pipeline fill and drain, the step's agreement) data loading then costs
        nothing.  Only microbatches the schedule reads anyway are read, in the same order,
        so the data stream and its position in a checkpoint are unchanged."""
        seg = self._seg
        if seg is None or seg.data_iterator is None:
            return
        ahead = self.num_microbatches if seg.train else self.eval_microbatches
        while (len(seg.prefetched) < min(seg.fetches_left, ahead)
               and not work.is_completed()):
            seg.prefetched.append(self._read(seg))

    def _read(self, seg: _Segment) -> Any:
        try:
            return next(seg.data_iterator)
        except StopIteration:
            raise RuntimeError("the data iterator ran out of microbatches before the schedule "
                               "finished (increase --train-samples/--eval-iters data or check "
                               "the dataset size)") from None

    def _run_forward(self, data: Any, input_tensor: Optional[torch.Tensor], mb: int,
                     seg: _Segment, batch_t: int) -> Any:
        """One microbatch through this stage; returns the tensor to send, or the loss."""
        if self._gather_hooks is not None:
            self._gather_hooks.wait_outside()
        if not self.is_first:
            self.model.set_input_tensor(input_tensor)
        output, loss_fn = self.forward_step(iter([data]), self.model)
        if not self.is_last:
            return output
        if self.per_token_loss:
            result = loss_fn(output)
            if not (isinstance(result, tuple) and len(result) == 3):
                raise RuntimeError("--calculate-per-token-loss: the loss function must return "
                                   "(loss_sum, num_tokens, {name: sum}), got "
                                   f"{type(result).__name__} {result!r:.80}")
            loss, tokens, reported = result
            key = batch_t if seg.train else 0
            tokens = torch.as_tensor(tokens).detach().to(torch.float64, copy=True)
            if key in seg.token_sums:
                seg.token_sums[key].add_(tokens)
            else:
                seg.token_sums[key] = tokens
        else:
            loss, reported = loss_fn(output)
        # evaluation sums every batch of the segment into one set of tensors, in place: a
        # new small tensor kept per microbatch pins the allocator's heap above each
        # forward's freed activations, and the process grew by about that much per
        # microbatch (hundreds of MB over --eval-iters 400)
        sums = seg.loss_sums.setdefault(batch_t if seg.train else 0, {})
        for k, v in reported.items():
            v = (v.detach().to(torch.float64, copy=True) if torch.is_tensor(v)
                 else torch.tensor(float(v), dtype=torch.float64))
            if k in sums:
                sums[k].add_(v)
            else:
                sums[k] = v
        return loss

    def _forward(self, a: Action, seg: _Segment) -> None:
        mb = a.microbatch
        t = self._global_batch(a, seg)
        if seg.train and self.updater.pending_steps:
            self.updater.finish_steps(seg, before_batch=t)
        if seg.train:
            self.weights.install(self.buffer_for(t))
        # evaluation: every batch on the newest weights, installed by evaluate().  Picking
        # the buffer by t, as training does, alternated W(i) and W(i-1) under 2BW, and at
        # the end of a flush warm-up the unsynchronised second buffer (still W(0)).
        data = self._next_data(seg)
        x = seg.inputs.pop(mb, None)
        if not seg.train:
            out = self._run_forward(data, x, mb, seg, t)
            seg.outputs[mb] = None if self.is_last else out
            return
        if self.stage_recompute:
            rng = self._get_rng_state() if self._get_rng_state else None
            with torch.no_grad():
                out = self._run_forward(data, x, mb, seg, t)
            seg.stash[mb] = (x, data, rng)
            self.tracker.add(mb, (tensor_bytes(x) if x is not None else 0) + _data_bytes(data))
        else:
            if x is not None:
                x.requires_grad_(True)
            key = mb % self.num_microbatches
            if self._count_memory(t) or not self.tracker.knows(key):
                with self.tracker.counting(mb, key):
                    out = self._run_forward(data, x, mb, seg, t)
            else:
                out = self._run_forward(data, x, mb, seg, t)
                self.tracker.replay(mb, key)
            seg.stash[mb] = (x, None, None)
        seg.outputs[mb] = out
        self._note_versions(seg)

    def _count_memory(self, t: int) -> bool:
        """Count batch t's stash with hooks (besides the first batch of the run)?"""
        n = self.memory_count_interval
        return n > 0 and t % n == 0

    def _backward(self, a: Action, seg: _Segment) -> None:
        mb = a.microbatch
        t = self._global_batch(a, seg)
        x, data, rng = seg.stash.pop(mb)
        out = seg.outputs.pop(mb)
        # The module must hold this batch's weights again: under 2BW a forward of the
        # next batch (the other buffer) may have run since this microbatch's forward,
        # and recomputation -- the whole stage here, or checkpointed layers
        # (--recompute-method) inside autograd's backward -- rebuilds activations from
        # the parameters installed now.
        self.weights.install(self.buffer_for(t))
        if self.stage_recompute:
            saved = self._get_rng_state() if self._get_rng_state else None
            if rng is not None:
                self._set_rng_state(rng)
            if x is not None:
                x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                scratch = _Segment(start_iteration=0, data_iterator=None, train=True)
                out = self._run_forward(data, x, mb, scratch, t)
            if saved is not None:
                self._set_rng_state(saved)
        if self.is_last:
            if self.per_token_loss:  # the sum, divided at the step by the batch's tokens
                loss = out * self.updater.batch_scales[t]
            else:
                loss = out / self.num_microbatches * self.updater.batch_scales[t]
            torch.autograd.backward(loss)
        else:
            torch.autograd.backward(out, grad_tensors=seg.out_grads.pop(mb))
        if not self.is_first:
            if x.grad is None:
                raise RuntimeError("the stage input received no gradient: does the model use "
                                   "the tensor passed to set_input_tensor?")
            seg.in_grads[mb] = x.grad
        self.tracker.release(mb)

    # -- communication -------------------------------------------------------------------
    def _send_act(self, a: Action, seg: _Segment) -> None:
        self.p2p.send_forward(seg.outputs[a.microbatch])
        if not seg.train or self.stage_recompute:
            seg.outputs[a.microbatch] = None  # backward recomputes it (or there is none)

    def _recv_act(self, a: Action, seg: _Segment) -> None:
        seg.inputs[a.microbatch] = self.p2p.recv_forward()

    def _send_grad(self, a: Action, seg: _Segment) -> None:
        self.p2p.send_backward(seg.in_grads.pop(a.microbatch))

    def _recv_grad(self, a: Action, seg: _Segment) -> None:
        seg.out_grads[a.microbatch] = self.p2p.recv_backward()

    # -- gradient reduction and the optimizer step ----------------------------------------------
    def _reduce_grads(self, a: Action, seg: _Segment) -> None:
        """Start batch t's gradient sums (``Updater.reduce_grads``)."""
        self.updater.reduce_grads(self._global_batch(a, seg))

    def _step(self, a: Action, seg: _Segment) -> None:
        """Start batch t's update, finished when the new weights are first needed
        (``Updater.step``)."""
        self.updater.step(self._global_batch(a, seg), seg)

    def _step_finished(self, seg: _Segment, report: StepReport) -> None:
        """Batch t's update is applied: the newest weights are W(t + 1)."""
        self.iteration = report.iteration + 1
        seg.reports.append(report)
        self._note_versions(seg)
        if self._on_step is not None:
            self._on_step(report)

    def _note_versions(self, seg: _Segment) -> None:
        """Count weight versions live now: the newest, plus any used by in-flight work."""
        live = {self.latest_buffer}
        for mb in seg.stash:
            live.add(self.buffer_for(seg.start_iteration + mb // self.num_microbatches))
        self.tracker.note_weight_versions(len(live), self.weights.bytes_per_buffer())


def _data_bytes(data: Any) -> int:
    if torch.is_tensor(data):
        return tensor_bytes(data)
    if isinstance(data, dict):
        return sum(_data_bytes(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(_data_bytes(v) for v in data)
    return 0
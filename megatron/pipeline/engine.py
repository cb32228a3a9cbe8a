"""The executor: runs one rank's action list on real process groups.

The schedule (``megatron.pipeline.schedules.build_schedule``) says what this stage does
and in which order; the engine only dispatches each action to a small handler.  It is
model-agnostic: a microbatch is processed by the trainer's
``forward_step(data_iterator, model) -> (output, loss_fn)``; on the last stage
``loss_fn(output) -> (loss, {name: value})``.

Weight versions follow ``megatron.pipeline.weights``: one buffer for none/gpipe/flush,
two for 2BW.  Gradients of a batch accumulate in the ``.grad`` of the buffer the batch
ran on; at the batch's STEP they are all-reduced across data-parallel replicas, the tied
embedding gradient is summed between first and last stage, and the optimizer agrees
with every other stage on overflow and on the global norm before writing the new
version.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron.parallel_state import ParallelGroups
from megatron.pipeline.actions import Action, Op
from megatron.pipeline.memory import StashTracker, tensor_bytes
from megatron.pipeline.p2p import P2PCommunicator
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.weights import WeightBuffers

ForwardStep = Callable[[Iterator[Any], nn.Module], Any]


class PipelineError(RuntimeError):
    """An action failed; the message holds the schedule grid with the failing step marked."""


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
    reports: List[StepReport] = field(default_factory=list)


class GradientReduction:
    """Average gradients over the data-parallel group in flat buckets, asynchronously.

    ``launch`` starts every bucket's all-reduce and returns at once; ``finish`` waits and
    copies the averages back.  The engine launches at REDUCE_GRADS(t) and finishes at
    STEP(t); under 2BW the schedule places STEP(t) after some work of batch t+1 (which
    runs on the other weight buffer), so the reduction overlaps that computation.
    """

    def __init__(self, params: List[nn.Parameter], group, world: int,
                 bucket_bytes: int = 32 * 2 ** 20) -> None:
        self._pending = []
        if group is None or world == 1:
            return
        bucket: List[torch.Tensor] = []
        size = 0
        for p in params:
            g = p.grad
            if bucket and (g.dtype != bucket[0].dtype or size + tensor_bytes(g) > bucket_bytes):
                self._launch(bucket, group, world)
                bucket, size = [], 0
            bucket.append(g)
            size += tensor_bytes(g)
        if bucket:
            self._launch(bucket, group, world)

    def _launch(self, grads: List[torch.Tensor], group, world: int) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(world)
        self._pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, grads))

    def finish(self) -> None:
        for work, flat, grads in self._pending:
            work.wait()
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n
        self._pending.clear()


class PipelineEngine:
    """Runs the training and evaluation schedules of one pipeline stage."""

    def __init__(self, *, model: nn.Module, optimizer, groups: ParallelGroups, schedule: str,
                 num_microbatches: int, micro_batch_size: int, forward_step: ForwardStep,
                 device: torch.device, activation_dtype: torch.dtype,
                 stage_recompute: bool = False, trace: bool = False,
                 get_rng_state: Optional[Callable[[], Any]] = None,
                 set_rng_state: Optional[Callable[[Any], None]] = None,
                 fault_injection: Optional[Callable[[int, int], bool]] = None,
                 flush_warmup_iters: int = 0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.groups = groups
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self.micro_batch_size = micro_batch_size
        self.forward_step = forward_step
        self.device = device
        self.stage_recompute = stage_recompute
        self.fault_injection = fault_injection
        self.stage = groups.pp_rank
        self.num_stages = groups.pp_size
        self.is_first = groups.is_first_stage
        self.is_last = groups.is_last_stage
        self.iteration = 0
        # --2bw-mitigation warmup: batches t < flush_warmup_iters run under flush
        # semantics on buffer 0, later ones under 2BW (see ``schedule_at``).
        self.flush_warmup_iters = flush_warmup_iters if schedule == "2bw" else 0
        self.weights = WeightBuffers(model, 2 if schedule == "2bw" else 1)
        self.tracker = StashTracker(self.weights.storage_ptrs())
        self.tracker.note_weight_versions(1, self.weights.bytes_per_buffer())
        self.trace_enabled = trace
        self.trace_events: List[dict] = []
        self.clock_origin = time.perf_counter()
        self._get_rng_state = get_rng_state
        self._set_rng_state = set_rng_state
        shape = model.stage_input_shape(micro_batch_size) if self.num_stages > 1 else (1,)
        self.p2p = P2PCommunicator(groups.prev_rank, groups.next_rank, shape,
                                   activation_dtype, device)
        self._handlers = {
            Op.FORWARD: self._forward, Op.BACKWARD: self._backward,
            Op.SEND_ACT: self._send_act, Op.RECV_ACT: self._recv_act,
            Op.SEND_GRAD: self._send_grad, Op.RECV_GRAD: self._recv_grad,
            Op.REDUCE_GRADS: self._reduce_grads, Op.STEP: self._step,
        }
        self._reductions: Dict[int, GradientReduction] = {}
        self._pending_steps: List[tuple] = []
        # Loss scale each batch's backward passes use.  A batch may start its backward
        # before the previous batch's STEP updated the scaler (2BW), so the scale of
        # batch t is fixed as the one in force after STEP(t - lag): lag 2 under 2BW
        # (STEP(t-2) precedes all of batch t), 1 otherwise.  Identical on every stage.
        self._scale_lag = 2 if self.schedule_at(0) == "2bw" else 1
        self._batch_scales: Dict[int, float] = {}
        self._seed_batch_scales()
        self._lr_provider: Callable[[], float] = lambda: 0.0
        self._on_step: Optional[Callable[[StepReport], None]] = None

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

    def _seed_batch_scales(self) -> None:
        for t in range(self.iteration, self.iteration + self._scale_lag):
            self._batch_scales.setdefault(t, self.optimizer.loss_scale)

    def state_dict(self) -> dict:
        """Executor state a checkpoint must carry (per-batch loss scales in flight)."""
        return {"iteration": self.iteration, "batch_scales": dict(self._batch_scales)}

    def load_state_dict(self, sd: dict) -> None:
        self.iteration = sd["iteration"]
        self._batch_scales = {int(k): float(v) for k, v in sd.get("batch_scales", {}).items()}
        self._seed_batch_scales()

    def set_iteration(self, iteration: int) -> None:
        """Resume at ``iteration`` without executor state (older checkpoints)."""
        self.iteration = iteration
        self._batch_scales = {}
        self._seed_batch_scales()

    # -- public entry points ------------------------------------------------------------
    def train_batches(self, data_iterator: Iterator[Any], num_batches: int,
                      lr_provider: Callable[[], float],
                      on_step: Optional[Callable[[StepReport], None]] = None) -> List[StepReport]:
        """Run ``num_batches`` optimizer steps and drain the pipeline at the end."""
        self._lr_provider = lr_provider
        self._on_step = on_step
        reports: List[StepReport] = []
        end = self.iteration + num_batches
        while self.iteration < end:  # two parts when the flush warm-up ends inside
            name = self.schedule_at(self.iteration)
            warm = self.iteration < self.flush_warmup_iters
            stop = min(end, self.flush_warmup_iters) if warm else end
            if self.flush_warmup_iters and self.iteration == self.flush_warmup_iters:
                self.weights.sync_all_from(self.latest_buffer)  # 2BW starts from W(N)
            self._scale_lag = 2 if name == "2bw" else 1
            self._seed_batch_scales()
            actions = build_schedule(name, self.num_stages, self.num_microbatches,
                                     stop - self.iteration)
            seg = _Segment(start_iteration=self.iteration, data_iterator=data_iterator,
                           train=True)
            self.model.train()
            self._run(actions, seg)
            reports += seg.reports
        self.install_latest()
        return reports

    @torch.no_grad()
    def evaluate(self, data_iterator: Iterator[Any], num_batches: int) -> Optional[Dict[str, float]]:
        """Forward-only passes with the newest weights; mean losses on the last stage."""
        actions = build_schedule(self.schedule_name, self.num_stages, self.num_microbatches,
                                 num_batches, forward_only=True)
        seg = _Segment(start_iteration=self.iteration, data_iterator=data_iterator, train=False)
        self.model.eval()
        self.install_latest()
        true_weights = getattr(self.optimizer, "true_weights", None)
        try:
            with (true_weights(self.weights.params(self.latest_buffer)) if true_weights
                  else contextlib.nullcontext()):
                self._run(actions, seg)
        finally:
            self.model.train()
        if not self.is_last:
            return None
        totals: Dict[str, torch.Tensor] = {}
        for sums in seg.loss_sums.values():
            for k, v in sums.items():
                totals[k] = totals.get(k, 0) + v
        count = num_batches * self.num_microbatches
        return self._dp_mean({k: v / count for k, v in totals.items()})

    def memory_stats(self) -> dict:
        return self.tracker.stats.as_dict()

    # -- the dispatch loop ---------------------------------------------------------------
    def _run(self, actions: List[List[Action]], seg: _Segment) -> None:
        mine = actions[self.stage]
        for index, action in enumerate(mine):
            start = time.perf_counter()
            try:
                handler = self._handlers[action.op]
            except KeyError:
                raise RuntimeError(f"stage {self.stage}: unknown pipeline action {action}") from None
            try:
                handler(action, seg)
            except PipelineError:
                raise
            except Exception as exc:
                raise PipelineError(self._report_failure(actions, index, action, exc)) from exc
            if self.trace_enabled:
                self._trace(action, seg, start, time.perf_counter())
        self._finish_steps(seg)
        self.p2p.wait_all()

    def _report_failure(self, actions, index: int, action: Action, exc: Exception) -> str:
        try:
            from megatron.pipeline.schedules import format_grid
            grid = format_grid(actions, mark=(self.stage, index))
        except Exception as grid_exc:  # noqa: BLE001 - the original error matters more
            grid = f"(could not draw the schedule grid: {grid_exc})"
        msg = (f"[rank {self.groups.rank}] pipeline stage {self.stage} failed at action "
               f"#{index} {action} ({self.schedule_name}, d={self.num_stages}, "
               f"m={self.num_microbatches}, iteration {self.iteration}): "
               f"{type(exc).__name__}: {exc}\n{grid}")
        print(msg, file=sys.stderr, flush=True)
        return msg

    def _trace(self, action: Action, seg: _Segment, start: float, end: float) -> None:
        batch = None if action.batch is None else seg.start_iteration + action.batch
        self.trace_events.append({
            "rank": self.groups.rank, "stage": self.stage, "action": str(action),
            "op": action.op.value, "microbatch": action.microbatch, "batch": batch,
            "start": start, "end": end, "train": seg.train,
            "version": (self._version(batch)
                        if batch is not None and action.op in (Op.FORWARD, Op.BACKWARD) else None)})

    # -- compute -------------------------------------------------------------------------
    def _global_batch(self, action: Action, seg: _Segment) -> int:
        return seg.start_iteration + action.batch

    def _next_data(self, seg: _Segment) -> Any:
        if seg.data_iterator is None:
            return None
        try:
            return next(seg.data_iterator)
        except StopIteration:
            raise RuntimeError("the data iterator ran out of microbatches before the schedule "
                               "finished (increase --train-samples/--eval-iters data or check "
                               "the dataset size)") from None

    def _run_forward(self, data: Any, input_tensor: Optional[torch.Tensor], mb: int,
                     seg: _Segment, batch_t: int) -> Any:
        """One microbatch through this stage; returns the tensor to send, or the loss."""
        if not self.is_first:
            self.model.set_input_tensor(input_tensor)
        output, loss_fn = self.forward_step(iter([data]), self.model)
        if not self.is_last:
            return output
        loss, reported = loss_fn(output)
        sums = seg.loss_sums.setdefault(batch_t, {})
        for k, v in reported.items():
            v = (v.detach().to(torch.float64) if torch.is_tensor(v)
                 else torch.tensor(float(v), dtype=torch.float64))
            sums[k] = sums.get(k, 0) + v
        return loss

    def _forward(self, a: Action, seg: _Segment) -> None:
        mb = a.microbatch
        t = self._global_batch(a, seg)
        if seg.train and self._pending_steps:
            self._finish_steps(seg, before_batch=t)
        self.weights.install(self.buffer_for(t))
        data = self._next_data(seg)
        x = seg.inputs.pop(mb, None)
        if not seg.train:
            seg.outputs[mb] = self._run_forward(data, x, mb, seg, t)
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
            with self.tracker.counting(mb):
                out = self._run_forward(data, x, mb, seg, t)
            seg.stash[mb] = (x, None, None)
        seg.outputs[mb] = out
        self._note_versions(seg)

    def _backward(self, a: Action, seg: _Segment) -> None:
        mb = a.microbatch
        t = self._global_batch(a, seg)
        x, data, rng = seg.stash.pop(mb)
        out = seg.outputs.pop(mb)
        if self.stage_recompute:
            self.weights.install(self.buffer_for(t))
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
            loss = out / self.num_microbatches * self._batch_scales[t]
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
        params = self.weights.params(self.buffer_for(self._global_batch(a, seg)))
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        t = self._global_batch(a, seg)
        self._reductions[t] = GradientReduction([p for p in params if p.requires_grad],
                                                self.groups.data, self.groups.dp_size)

    def _step(self, a: Action, seg: _Segment) -> None:
        """Start the update of batch t: data-parallel and tied-embedding gradient sums,
        then the optimizer's agreement all-reduce, which is left in flight.  The update
        itself is finished by ``_finish_steps`` when the new weights are first needed:
        before batch t+1 starts (flush/gpipe/none: at once) or before batch t+2 starts
        (2BW), so under 2BW stages do not wait for each other at every step."""
        t = self._global_batch(a, seg)
        params = self.weights.params(self.buffer_for(t))
        reduction = self._reductions.pop(t, None)
        if reduction is not None:
            reduction.finish()
        self._allreduce_embedding_grads(params)
        if self.fault_injection and self.fault_injection(t, self.stage):
            with torch.no_grad():
                next(p for p in params if p.grad is not None).grad.view(-1)[0] = float("inf")
        grad_scale = self._batch_scales.pop(t)
        pending = self.optimizer.begin_step(params, grad_scale=grad_scale)
        self._pending_steps.append((t, pending, grad_scale))
        if self.schedule_at(t) != "2bw":
            self._finish_steps(seg, before_batch=t + 1)

    def _finish_steps(self, seg: _Segment, before_batch: Optional[int] = None) -> None:
        """Finish pending updates that batch ``before_batch`` needs (all when None)."""
        while self._pending_steps:
            t, pending, grad_scale = self._pending_steps[0]
            if before_batch is not None and t + self._scale_lag > before_batch:
                return
            self._pending_steps.pop(0)
            lr = self._lr_provider()
            # base: the buffer holding W(t) (a flush step, warm-up included, updates in place)
            base = self.buffer_for(t + 1 if self.schedule_at(t) == "2bw" else t)
            info = self.optimizer.finish_step(pending, self.weights.params(self.buffer_for(t)),
                                              self.weights.params(base), lr)
            self._batch_scales[t + self._scale_lag] = self.optimizer.loss_scale
            self.iteration = t + 1
            losses = None
            if self.is_last:
                sums = seg.loss_sums.pop(t, {})
                losses = self._dp_mean({k: v / self.num_microbatches for k, v in sums.items()})
            report = StepReport(iteration=t, skipped=info.skipped, grad_norm=info.grad_norm,
                                loss_scale=info.loss_scale, lr=lr,
                                weight_version=self._version(t),
                                losses=losses, grad_scale=grad_scale)
            seg.reports.append(report)
            self._note_versions(seg)
            if self._on_step is not None:
                self._on_step(report)

    def _allreduce_embedding_grads(self, params: List[nn.Parameter]) -> None:
        """Sum the tied word-embedding gradient of the first and last stage."""
        if not self.groups.in_embedding_group or self.groups.embedding is None:
            return
        shared = [p for p in params if getattr(p, "shared_embedding", False)]
        if len(shared) != 1:
            raise RuntimeError(f"stage {self.stage} should hold exactly one tied word-embedding "
                               f"parameter, found {len(shared)}")
        p = shared[0]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=self.groups.embedding)

    def _dp_mean(self, values: Dict[str, torch.Tensor]) -> Dict[str, float]:
        if not values:
            return {}
        keys = sorted(values)
        vec = torch.stack([torch.as_tensor(values[k], dtype=torch.float64) for k in keys])
        if self.groups.data is not None and self.groups.dp_size > 1:
            vec = vec.to(self.device)
            dist.all_reduce(vec, group=self.groups.data)
            vec = vec / self.groups.dp_size
        return {k: float(v) for k, v in zip(keys, vec.cpu())}

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

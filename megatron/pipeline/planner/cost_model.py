"""Closed-form THROUGHPUT(.) and MEMORY(.) cost functions (paper, Appendix A).

Per pipeline stage i of a configuration (w pipelines x d stages x t tensor ranks,
microbatch b, m microbatches per pipeline per batch):

* compute: forward FLOPs / (t x rate(b)) plus the elementwise work tensor parallelism
  replicates (bytes / memory bandwidth), backward = 2 x forward; with activation
  recomputation the stage's compute is multiplied by c_extra (default 4/3, Appendix A)
  and the tensor-parallel all-reduces of the forward pass are repeated.
* tensor parallelism (Megatron): per layer two all-reduces of s b h fp16 values in the
  forward pass and two in the backward pass, inside the tensor group.  With sequence
  parallelism (``ModelSpec.sequence_parallel``, t > 1) each is an all-gather and a
  reduce-scatter of the same s b h values: the same bytes, the same time (activations'
  docstring).
* inter-stage traffic (Appendix A, T^comm_{i->j} = 2 |A^{inp.+out.}(b)| I(d > 1) /
  bwdth_depth(d)): per microbatch, each boundary a stage touches carries one activation
  and one gradient of s b h fp16 values over the link that boundary crosses (with
  sequence parallelism each tensor rank sends its s / t positions: s b h / t values;
  float32 values with ``ModelSpec.fp32_residual_connection``).
* data parallelism: ring all-reduce of the stage's fp16 gradients among its w replicas,
  2 (w - 1) / w x bytes / bwdth_width(w), in the executor's buckets
  (``CostModel.bucket_counts``; --ddp-bucket-size sets their size); plus, for d > 1,
  the tied word-embedding gradient between first and last stage (none with an untied
  output layer: the first stage then holds the only word embedding and the last stage
  its own output layer).
  With the distributed optimizer the gradient buckets are reduce-scattered (half of
  that) and the new weights all-gathered after the step (the other half, in the step).

Time of one batch (one optimizer step) per pipeline, with slot_i the per-microbatch
time of stage i (compute + tensor-parallel + inter-stage communication), T = max slot_i:

* 2bw:   max(m T + exposed, max_i AR_i).  Appendix A's pipelined THROUGHPUT expression
         (max over stages of max(compute + comm, T^comm_i / m), times m) assumes the
         weight all-reduce hides behind the next batch whatever its length; the executor
         hides it where it has time (``exposed_allreduce_2bw``): the first stage, last to
         end a batch, begins its update only before batch t+2 (m - d + 1 slots later),
         the others at a STEP placed one slot before that.
         ``CostOptions.appendix_a_2bw`` gives the paper's expression instead.
* flush, gpipe: (m - 1) T + sum_i slot_i + exposed all-reduce.  For equal stages this is
         (m + d - 1) T: Appendix A has no flush term, so we add the GPipe/1F1B fill and
         drain explicitly.  The all-reduce after the flush is exposed, less the time by
         which later stages finish their last backward before stage 0.
* none:  m sum_i slot_i + exposed all-reduce (one microbatch at a time through all stages;
         Appendix A's "without pipelining" expression).

MEMORY(.) per GPU (Appendix A, "memory(.) cost function"), maximised over stages:
    versions x |W_i| + |O_i| + activations (+ the explicit softmax's [s, s] causal mask,
    one per stage whatever is in flight: ``StageCost.shared_bytes``)
where |W_i| is one fp16 copy of stage i's weights (2 versions for 2bw, 1 otherwise),
|O_i| the optimizer state the paper folds into |W| (fp16 grads + fp32 master + Adam
moments = 14 bytes/param by default: one version costs 16 bytes/param in all), and
    no recompute: n_i (|A_i(b)| + |A_input(b)|)      recompute: |A_i(b)| + n_i |A_input(b)|
with n_i microbatches in flight on stage i: 1 (none), m (gpipe), min(d - i, m) (flush,
2bw).  For 2bw with recompute on a middle stage this is the paper's
2|W|/d + |A_total(b)|/d + d |A_input(b)| (plus the optimizer state we make explicit).
With sequence parallelism |A_input(b)| and the replicated parts of |A_i(b)| are divided
by t (``ModelSpec``'s activation methods).

Profile-based costs (``CostModel(..., profile=Profile.load(path))``, see ``profile.py``):
forward/backward times and per-microbatch stash bytes come from measurements of one
block, the embedding and the head; the recompute overhead is the measured forward; the
optimizer step of each stage (``StageCost.step_s``, a barrier across stages) is added
to the batch time.  Without a profile ``step_s`` is 0, as in the paper's closed forms.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Tuple

from megatron.optimizer.sharding import plan_buckets

from .hardware import HardwareSpec, Links, links_for, ring_allreduce_time
from .model_spec import ModelSpec

if TYPE_CHECKING:
    from .profile import Profile

__all__ = ["SCHEDULES", "Config", "CostOptions", "StageCost", "Estimate", "CostModel",
           "ModelSpec", "in_flight"]

SCHEDULES = ("none", "gpipe", "flush", "2bw")


@dataclass(frozen=True)
class Config:
    """One candidate: w pipelines of d stages of t tensor ranks, microbatch b, m per batch."""

    w: int
    d: int
    t: int = 1
    b: int = 1
    m: int = 1
    """Microbatches per pipeline per batch (the paper's m = d g with g the degree of
    gradient accumulation); the global batch is w b m."""
    recompute: bool = False
    schedule: str = "2bw"
    first_layers: Optional[int] = None
    """Layers of the first stage (--decoder-first-pipeline-num-layers); None: equal split."""
    last_layers: Optional[int] = None
    """Layers of the last stage (--decoder-last-pipeline-num-layers); None: equal split."""
    recompute_method: Optional[str] = None
    """Layer-level recomputation inside each stage (--recompute-granularity full
    --recompute-method uniform|block --recompute-num-layers N); exclusive with the
    stage-level ``recompute``."""
    recompute_num_layers: int = 0
    selective_recompute: bool = False
    """--recompute-granularity selective: every layer's core attention (softmax and its
    two matmuls) is checkpointed, so its s x s tensors -- or, with the fused kernels, the
    log-sum-exp -- are not kept (``ModelSpec.score_bytes``) and its forward runs again
    in the backward pass (``ModelSpec.core_attention_flops``).  Exclusive with the other
    two kinds of recomputation, as in the trainer."""
    distributed_optimizer: bool = False
    """--use-distributed-optimizer: the optimizer state beyond the gradients (master
    weights and moments, ``optimizer_bytes_per_param - grad_bytes_per_param``) is split
    evenly over the w replicas of a stage (equal segments of every flat bucket), each
    updates its share (the step's time / w), the gradients are reduce-scattered (half a
    ring all-reduce) and the new weights then all-gathered (after the step: the other
    half)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule {self.schedule!r}: expected one of {SCHEDULES}")
        if self.recompute_method is not None:
            if self.recompute_method not in ("uniform", "block"):
                raise ValueError(f"--recompute-method {self.recompute_method!r}: expected "
                                 f"uniform or block")
            if self.recompute or self.recompute_num_layers < 1:
                raise ValueError("layer-level recomputation needs recompute=False (that is "
                                 "the stage-level scheme) and recompute_num_layers >= 1")
        if self.selective_recompute and (self.recompute or self.recompute_method is not None):
            raise ValueError("selective recomputation (--recompute-granularity selective) "
                             "excludes the stage-level and the layer-level schemes")
        for attr in ("w", "d", "t", "b", "m"):
            if getattr(self, attr) < 1:
                raise ValueError(f"config: {attr} must be >= 1, got {getattr(self, attr)}")

    @property
    def num_gpus(self) -> int:
        return self.w * self.d * self.t

    @property
    def global_batch(self) -> int:
        return self.w * self.b * self.m

    def describe(self) -> str:
        rc = " +recompute" if self.recompute else ""
        if self.recompute_method is not None:
            rc = f" +recompute {self.recompute_method} {self.recompute_num_layers}"
        if self.selective_recompute:
            rc = " +selective recompute"
        split = ""
        if self.first_layers is not None or self.last_layers is not None:
            split = f" layers first={self.first_layers} last={self.last_layers}"
        dopt = " +distributed optimizer" if self.distributed_optimizer else ""
        return (f"{self.schedule:5s} w={self.w} d={self.d} t={self.t} b={self.b} "
                f"m={self.m}{rc}{split}{dopt}")

    def layer_counts(self, num_layers: int) -> List[int]:
        """Layers of each stage (ValueError when the split does not fit the model)."""
        from megatron.model.utils import stage_layer_counts

        return stage_layer_counts(num_layers, self.d, self.first_layers, self.last_layers)

    def layer_recompute(self, layers: int) -> Tuple[int, int, int]:
        """(checkpointed layers, kept chunk inputs, layers rebuilt at once) of a stage of
        ``layers`` layers under layer-level recomputation (zeros without it).

        uniform N: every layer, in chunks of N, each chunk keeping only its input;
        block N: the first N layers, each its own chunk (the rest keep everything)."""
        if self.recompute_method is None:
            return 0, 0, 0
        n = self.recompute_num_layers
        if self.recompute_method == "uniform":
            return layers, -(-layers // n), min(n, layers)
        k = min(n, layers)
        return k, k, 1 if k else 0


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model that are assumptions rather than facts."""

    c_extra: float = 4.0 / 3.0
    """Compute multiplier with activation recomputation (Appendix A)."""
    weight_bytes_per_param: float = 2.0
    """One weight version (fp16 copy): the paper's |W| per parameter."""
    optimizer_bytes_per_param: float = 14.0
    """fp16 grads (2) + fp32 master (4) + Adam moments (8); one version totals 16."""
    grad_bytes_per_param: float = 2.0
    """Bytes per parameter in the data-parallel all-reduce."""
    overlap_grad_reduce_2bw: bool = True
    """2bw hides the all-reduce behind the next batch's compute, as far as the executor's
    schedule leaves time for it (``CostModel.exposed_allreduce_2bw``); False: it is
    waited on at each STEP, as after a flush."""
    appendix_a_2bw: bool = False
    """With ``overlap_grad_reduce_2bw``: hide all of it whatever its length against the
    compute, as the paper's Appendix A does (``bench/paper_reproduction.py``)."""
    overlap_grad_reduce: bool = True
    """The executor starts each gradient bucket's data-parallel all-reduce as soon as the
    batch's last backward pass has finished its gradients (post-accumulate-grad hooks),
    so under flush/gpipe/none most of it hides behind that backward pass."""
    grad_bucket_bytes: float = 32 * 2 ** 20
    """Bucket size of the executor's gradient all-reduce (``GradientReduction``) without
    ``grad_bucket_elements``: gradient bytes."""
    grad_bucket_elements: Optional[int] = None
    """--ddp-bucket-size N: parameters per bucket instead (the gradient reduction's and
    the distributed optimizer's, whose buckets the weight all-gathers follow).  Either
    way the buckets are counted as the executor builds them (``CostModel.bucket_counts``)."""
    overlap_param_gather: bool = True
    """With the distributed optimizer, the printed command passes --overlap-param-gather:
    the new weights' all-gathers run into the next forward pass, each layer waiting for
    its own buckets, so all but about one bucket's gather hides behind a microbatch's
    forward on the stage."""

    def __post_init__(self) -> None:
        if self.grad_bucket_elements is not None and self.grad_bucket_elements < 1:
            raise ValueError(f"--ddp-bucket-size must be a positive number of parameters, "
                             f"got {self.grad_bucket_elements}")


@lru_cache(maxsize=4096)
def _bucket_counts(model: ModelSpec, layers: int, first: bool, last: bool, t: int,
                   tied_apart: bool, limit: float, itemsize: float,
                   distributed: bool) -> Tuple[int, int]:
    """``CostModel.bucket_counts`` of one kind of stage (cached: the search prices the
    same kinds of stage over and over, and a deep model has thousands of parameters)."""
    params = model.stage_parameters(layers, first, last, t)
    if not distributed:
        kept = [n for n, tied in params if not (tied and tied_apart)]
        return len(plan_buckets(kept, [None] * len(kept), 1, limit, [itemsize] * len(kept))), 0
    numels = [n for n, _ in params]
    tied = [flag for _, flag in params]
    buckets = plan_buckets(numels, [None] * len(numels), 1, limit, [itemsize] * len(numels),
                           alone=tied)
    return len(buckets) - (sum(tied) if tied_apart else 0), len(buckets)


def in_flight(schedule: str, stage: int, d: int, m: int) -> int:
    """Microbatches whose activations stage `stage` holds at its worst moment."""
    if schedule == "none":
        return 1
    if schedule == "gpipe":
        return m
    return max(1, min(d - stage, m))


@dataclass(frozen=True)
class StageCost:
    """Per-microbatch times and per-GPU memory of one pipeline stage."""

    stage: int
    num_layers: int
    params: float
    """Parameters held per GPU (already divided by t)."""
    forward_s: float
    backward_s: float
    """Includes recomputation when enabled."""
    p2p_s: float
    allreduce_s: float
    """Once per batch: data-parallel + tied-embedding all-reduce."""
    weights_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    stash_bytes: float
    in_flight: int
    activation_per_microbatch_bytes: float
    """|A_i(b)|: everything one microbatch keeps on this stage without recompute."""
    input_bytes: float
    """|A_input(b)|: the stage input stashed per in-flight microbatch."""
    step_s: float = 0.0
    """Optimizer step of the stage, once per batch (profile-based costs only)."""
    transient_bytes: float = 0.0
    """Layer-level recomputation: activations of the chunk being rebuilt (one at a time)."""
    dp_allreduce_s: float = 0.0
    """The data-parallel part of ``allreduce_s`` (the rest is the tied-embedding sum)."""
    dp_exposed_s: float = 0.0
    """What of ``dp_allreduce_s`` is left after the stage's last backward pass: the last
    bucket can only start when the backward ends, the rest overlaps it."""
    shared_bytes: float = 0.0
    """What the stage makes once and keeps for all its microbatches, however many are in
    flight: the explicit softmax's causal mask (``ModelSpec.causal_mask_bytes``) and, in a
    profile of a RoPE model, its measured cos/sin table (``Profile.shared_bytes``); the
    executor's counter charges them once too (``StashTracker.shared``)."""
    dp_buckets: int = 1
    """Buckets of the stage's data-parallel gradient reduction (with w > 1)."""
    gather_buckets: int = 0
    """Buckets of the distributed optimizer's weight all-gather (with w > 1; 0 without)."""

    def with_in_flight(self, n: int, recompute: bool) -> "StageCost":
        """The same stage holding n microbatches (memory changes, times do not)."""
        acts = self.activation_per_microbatch_bytes
        return replace(self, in_flight=n,
                       activation_bytes=acts if recompute else n * acts + self.transient_bytes,
                       stash_bytes=n * self.input_bytes)

    @property
    def slot_s(self) -> float:
        return self.forward_s + self.backward_s + self.p2p_s

    @property
    def memory_bytes(self) -> float:
        return (self.weights_bytes + self.optimizer_bytes + self.activation_bytes
                + self.stash_bytes + self.shared_bytes)


class _StageWork(NamedTuple):
    """One microbatch on a stage before its communication, from the closed forms or a
    profile: compute seconds (``recompute_s``: the extra backward of stage-level
    recomputation; ``step_s``: the optimizer step), what one tensor-parallel collective
    moves, |A_i(b)| and |A_input(b)|, and one layer's forward seconds and activations."""

    forward_s: float
    backward_s: float
    recompute_s: float
    step_s: float
    hidden_bytes: float
    activation_bytes: float
    input_bytes: float
    layer_forward_s: float
    layer_activation_bytes: float


class _GradientReduction(NamedTuple):
    """A stage's gradient traffic per batch: the ``StageCost`` fields of the same names."""

    allreduce_s: float
    dp_allreduce_s: float
    dp_exposed_s: float
    dp_buckets: int
    gather_buckets: int


@dataclass(frozen=True)
class Estimate:
    """THROUGHPUT(.) and MEMORY(.) of one configuration."""

    config: Config
    stages: Tuple[StageCost, ...]
    batch_time_s: float
    samples_per_s: float
    memory_per_gpu_bytes: float
    bubble_fraction: float
    links: Links = field(repr=False)


@dataclass(frozen=True)
class CostModel:
    """Closed-form (or, given a ``profile``, measured) costs of ``model`` on ``hardware``."""

    model: ModelSpec
    hardware: HardwareSpec
    options: CostOptions = CostOptions()
    profile: Optional["Profile"] = None
    """Measured costs (tools/profile_model.py) replacing the closed-form compute and
    activation sizes; None uses the closed forms."""

    def __post_init__(self) -> None:
        if self.profile is not None:
            self.profile.check_model(self.model)

    def check(self, config: Config) -> None:
        """Raise ValueError when the model cannot be split as the config says."""
        if config.first_layers is None and config.last_layers is None:
            if self.model.num_layers % config.d:
                raise ValueError(f"--pipeline-model-parallel-size {config.d} must divide "
                                 f"--num-layers {self.model.num_layers}")
        else:
            config.layer_counts(self.model.num_layers)
        if self.model.num_attention_heads % config.t:
            raise ValueError(f"--tensor-model-parallel-size {config.t} must divide "
                             f"--num-attention-heads {self.model.num_attention_heads}")
        if self.model.num_query_groups % config.t:
            raise ValueError(f"--tensor-model-parallel-size {config.t} must divide "
                             f"--num-query-groups {self.model.num_query_groups}")
        if self.splits_sequence(config) and self.model.seq_length % config.t:
            raise ValueError(f"--sequence-parallel splits each sequence over the {config.t} "
                             f"tensor ranks: --seq-length {self.model.seq_length} must be "
                             f"divisible by --tensor-model-parallel-size {config.t}")

    def splits_sequence(self, config: Config) -> bool:
        """Sequence parallelism is in effect: the model asks for it and the config has
        more than one tensor rank to split over (with t = 1 the trainer, as Megatron-LM,
        turns it off)."""
        return self.model.sequence_parallel and config.t > 1

    def boundary_bytes(self, config: Config) -> float:
        """Bytes of one activation (or its gradient) crossing a stage boundary, per tensor
        rank, which is also what a stage keeps of each microbatch's input: the measured
        [s, b, h] stage input with a profile, else the closed form; each rank's s / t
        positions of it with sequence parallelism."""
        if self.profile is not None:
            whole = float(self.profile.stage_input_bytes(config.b))
            return whole / config.t if self.splits_sequence(config) else whole
        return self.model.input_activation_bytes(config.b, config.t)

    def stage_params(self, stage: int, d: int, layers: Optional[int] = None) -> float:
        """Logical parameters of a stage: its layers, the embedding on the first, the
        final norm and output layer on the last (an untied one is in ``head_params``; a
        tied one is the first stage's word embedding, of which the last of d > 1 stages
        keeps a copy).  ``layers``: the stage's layer count (default: an equal share)."""
        mdl = self.model
        if layers is None:
            layers = mdl.num_layers // d
        p = layers * mdl.params_per_layer
        if stage == 0:
            p += mdl.embedding_params
        if stage == d - 1:
            p += mdl.head_params
            if d > 1 and mdl.tied_output:
                p += mdl.vocab_size * mdl.hidden_size
        return float(p)

    def stage_costs(self, config: Config) -> List[StageCost]:
        """Costs of every stage, in pipeline order."""
        kinds, order = self._stage_kinds(config)
        return [replace(kinds[k], stage=i).with_in_flight(
                    in_flight(config.schedule, i, config.d, config.m), config.recompute)
                for i, k in enumerate(order)]

    def _stage_kinds(self, config: Config) -> Tuple[Dict[tuple, StageCost], List[tuple]]:
        """Distinct stage costs (key: first?, last?, links) and each stage's key.

        Middle stages differ only in their links and in-flight count, so each kind is
        priced once (holding the most in-flight microbatches of its stages, its worst
        memory), which keeps deep pipelines (d ~ 1000) cheap for the search."""
        self.check(config)
        links = links_for(self.hardware, config.t, config.w, config.d)
        d = config.d
        kinds: Dict[tuple, StageCost] = {}
        order: List[tuple] = []
        for i in range(d):
            key = (i == 0, i == d - 1, links.boundary[i - 1] if i > 0 else None,
                   links.boundary[i] if i < d - 1 else None)
            if key not in kinds:
                # Stages are visited in order and in-flight counts only fall with i,
                # so the first stage of each kind is its worst case for memory.
                kinds[key] = self._stage(config, i, links)
            order.append(key)
        return kinds, order

    def _stage(self, c: Config, i: int, links: Links) -> StageCost:
        mdl, opt = self.model, self.options
        d, t, b = c.d, c.t, c.b
        first, last = i == 0, i == d - 1
        layers = c.layer_counts(mdl.num_layers)[i]
        rate = self.hardware.flops_rate(b * mdl.seq_length)
        # What crosses a stage boundary and is kept of a stage's input per microbatch (a
        # rank's s / t positions with sequence parallelism).
        act = self.boundary_bytes(c)
        work = (self._closed_form_work(c, layers, last, rate, act) if self.profile is None
                else self._profiled_work(c, layers, first, last))
        act_stage, layer_act = work.activation_bytes, work.layer_activation_bytes
        if c.selective_recompute:  # the core attention's own tensors are not kept
            scores = mdl.score_bytes(b) / t
            act_stage -= layers * scores
            layer_act -= scores
        # Megatron's f/g operators: 2 all-reduces per layer each way, plus the
        # vocab-parallel embedding (forward) and the output layer's input grad (backward);
        # with sequence parallelism an all-gather + reduce-scatter each, the same bytes.
        ar = ring_allreduce_time(work.hidden_bytes, t, links.tensor)
        tp_f = (2 * layers + (1 if first else 0)) * ar
        tp_b = (2 * layers + (1 if last else 0)) * ar
        forward = work.forward_s + tp_f
        backward = work.backward_s + tp_b
        if c.selective_recompute:
            backward += layers * mdl.core_attention_flops(b) / t / rate
        if c.recompute:
            backward += work.recompute_s + tp_f
        # layer-level recomputation: the checkpointed layers' forward runs again in the
        # backward pass; a microbatch keeps one hidden state per chunk instead of their
        # activations, and one chunk's activations exist while it is rebuilt
        k, chunks, rebuilt = c.layer_recompute(layers)
        transient = 0.0
        if k:
            backward += k * (work.layer_forward_s + 2 * ar)
            act_stage = act_stage - k * layer_act + chunks * act
            transient = rebuilt * layer_act
        p2p = 0.0
        if not first:
            p2p += 2.0 * act / links.boundary[i - 1]
        if not last:
            p2p += 2.0 * act / links.boundary[i]
        params = self.stage_params(i, d, layers) / t
        grads = self._gradient_reduction(c, i, params, backward, links)
        n = in_flight(c.schedule, i, d, c.m)
        versions = 2 if c.schedule == "2bw" else 1
        activations = act_stage if c.recompute else n * act_stage + transient
        optimizer_bytes, step = self._optimizer_state(c, params, work.step_s, forward,
                                                      grads.gather_buckets, links)
        shared = (float(self.profile.shared_bytes(layers)) if self.profile is not None
                  else mdl.causal_mask_bytes())
        return StageCost(
            stage=i, num_layers=layers, params=params, forward_s=forward, backward_s=backward,
            p2p_s=p2p, allreduce_s=grads.allreduce_s,
            weights_bytes=versions * params * opt.weight_bytes_per_param,
            optimizer_bytes=optimizer_bytes,
            activation_bytes=activations, stash_bytes=n * work.input_bytes, in_flight=n,
            activation_per_microbatch_bytes=act_stage, input_bytes=work.input_bytes,
            step_s=step, dp_allreduce_s=grads.dp_allreduce_s, dp_exposed_s=grads.dp_exposed_s,
            transient_bytes=transient, shared_bytes=shared, dp_buckets=grads.dp_buckets,
            gather_buckets=grads.gather_buckets)

    def _closed_form_work(self, c: Config, layers: int, last: bool, rate: float,
                          act: float) -> _StageWork:
        """A stage's compute and activations from the closed forms (``act``: its input)."""
        mdl, hw, t, b = self.model, self.hardware, c.t, c.b
        flops = layers * mdl.layer_forward_flops(b) + (mdl.head_forward_flops(b) if last else 0.0)
        comp_f = flops / t / rate
        # LayerNorm/dropout/residual work: replicated on every tensor rank, or split
        # over them along the sequence with sequence parallelism.
        elementwise = mdl.layer_elementwise_bytes(b, t)
        if hw.memory_bandwidth > 0:
            comp_f += layers * elementwise / hw.memory_bandwidth
        comp_b = 2.0 * comp_f
        comp_f_layer = mdl.layer_forward_flops(b) / t / rate + (
            elementwise / hw.memory_bandwidth if hw.memory_bandwidth > 0 else 0.0)
        act_stage = layers * mdl.layer_activation_bytes(b, t) + mdl.stage_mask_bytes(b)
        if last:
            act_stage += mdl.head_activation_bytes(b, t)
        # What one tensor-parallel collective moves: the whole sequence's s b h values,
        # with or without sequence parallelism.
        return _StageWork(forward_s=comp_f, backward_s=comp_b,
                          recompute_s=(self.options.c_extra - 1.0) * (comp_f + comp_b),
                          step_s=0.0, hidden_bytes=mdl.tensor_parallel_bytes(b),
                          activation_bytes=act_stage, input_bytes=act,
                          layer_forward_s=comp_f_layer,
                          layer_activation_bytes=mdl.layer_activation_bytes(b, t))

    def _profiled_work(self, c: Config, layers: int, first: bool, last: bool) -> _StageWork:
        """A stage's compute and activations as the profile measured them."""
        mdl, profile, b, t = self.model, self.profile, c.b, c.t
        ps = profile.stage(layers, first, last, b, c.d, t,
                           sequence_parallel=self.splits_sequence(c))
        # input_bytes = what a microbatch stashes under recompute; the rest of the
        # no-recompute count is |A_i(b)|, so n (|A_i| + |A_input|) is the exact count.
        stash_one = float(ps.recompute_stash_bytes)
        act_stage = float(ps.stash_bytes) - stash_one
        if mdl.kind == "gpt":  # a stage's document mask, left out of the pieces
            # as measured by a --reset-attention-mask profile; for a causal profile the
            # closed form, in the profile's dtype (the fused kernels' additive mask)
            mask = float(profile.attention_mask_bytes(b))
            if not mask:
                mask = mdl.stage_mask_bytes(b) * (
                    1.0 if mdl.keeps_scores else profile.model.get("dtype_bytes", 2) / 2.0)
            act_stage += mask
        block = profile.piece("block", b)
        return _StageWork(forward_s=ps.forward_s, backward_s=ps.backward_s,
                          recompute_s=ps.recompute_s, step_s=ps.step_s,
                          hidden_bytes=float(profile.stage_input_bytes(b)),
                          activation_bytes=act_stage, input_bytes=stash_one,
                          layer_forward_s=block.forward_s / t,
                          layer_activation_bytes=float(block.stash_bytes) / t)

    def _gradient_reduction(self, c: Config, i: int, params: float, backward: float,
                            links: Links) -> _GradientReduction:
        """Stage i's gradient traffic once per batch (``params`` per GPU, ``backward`` its
        backward pass per microbatch): the data-parallel all-reduce, what of it that
        backward leaves exposed, and the tied word embedding's sum."""
        mdl, opt, d, t = self.model, self.options, c.d, c.t
        first, last = i == 0, i == d - 1
        grad_bytes = params * opt.grad_bytes_per_param
        allreduce = ring_allreduce_time(grad_bytes, c.w, links.data)
        if c.distributed_optimizer and c.w > 1:
            # each bucket is reduce-scattered (a rank receives the average of its own
            # 1/w segment only): half a ring all-reduce's bytes; the all-gather of the
            # new weights after the step (``_optimizer_state``) is the other half.
            allreduce *= 0.5
            if d > 1 and (first or last) and mdl.tied_output:
                # ...but the tied word embedding, averaged apart after its sum between
                # first and last stage, is still all-reduced in full: its other half
                emb = mdl.vocab_size * mdl.hidden_size / t * opt.grad_bytes_per_param
                allreduce += 0.5 * ring_allreduce_time(emb, c.w, links.data)
        dp_allreduce = allreduce
        dp_buckets, gather_buckets = self.bucket_counts(c, i) if c.w > 1 else (1, 0)
        if opt.overlap_grad_reduce and c.w > 1:
            dp_exposed = max(dp_allreduce / dp_buckets, dp_allreduce - backward)
        else:
            dp_exposed = dp_allreduce
        if d > 1 and (first or last) and mdl.tied_output:
            emb = mdl.vocab_size * mdl.hidden_size / t * opt.grad_bytes_per_param
            allreduce += ring_allreduce_time(emb, 2, links.embedding)
        return _GradientReduction(allreduce, dp_allreduce, dp_exposed, dp_buckets,
                                  gather_buckets)

    def _optimizer_state(self, c: Config, params: float, step: float, forward: float,
                         gather_buckets: int, links: Links) -> Tuple[float, float]:
        """(optimizer state bytes, step seconds) of a stage of ``params`` per GPU whose
        optimizer step takes ``step`` and forward pass ``forward`` per microbatch."""
        opt = self.options
        optimizer_bytes = params * opt.optimizer_bytes_per_param
        if c.distributed_optimizer and c.w > 1:
            # every rank owns one equal segment of each bucket: state / w, whatever
            # the largest parameter (a bucket's padding, < w elements, is ignored)
            state = opt.optimizer_bytes_per_param - opt.grad_bytes_per_param
            optimizer_bytes = params * (opt.grad_bytes_per_param + state / c.w)
            # a ring all-gather moves half a ring all-reduce's bytes
            gather = 0.5 * ring_allreduce_time(params * opt.weight_bytes_per_param, c.w,
                                               links.data)
            if opt.overlap_param_gather:
                gather = max(gather / gather_buckets, gather - forward)
            step = step / c.w + gather
        return optimizer_bytes, step

    def bucket_counts(self, config: Config, stage: int) -> Tuple[int, int]:
        """(buckets of the stage's data-parallel gradient reduction, buckets of its weight
        all-gather: 0 without the distributed optimizer) for w > 1, as the executor
        builds them: whole parameters in reverse order (``ModelSpec.stage_parameters``),
        a bucket closing before the parameter that would take it past
        ``grad_bucket_bytes`` of gradients, or ``grad_bucket_elements`` parameters with
        --ddp-bucket-size (``megatron.optimizer.sharding.plan_buckets``, the rule of
        ``GradientReduction`` too).  The distributed optimizer gives the tied word
        embedding a bucket of its own, which all-gathers with the others; a pipeline of
        d > 1 averages that embedding apart, after its sum between first and last stage,
        so it is in none of the reduction's buckets."""
        opt = self.options
        if opt.grad_bucket_elements is not None:
            limit, itemsize = float(opt.grad_bucket_elements), 1.0
        else:
            limit, itemsize = opt.grad_bucket_bytes, opt.grad_bytes_per_param
        layers = config.layer_counts(self.model.num_layers)[stage]
        return _bucket_counts(self.model, layers, stage == 0, stage == config.d - 1, config.t,
                              config.d > 1, limit, itemsize, config.distributed_optimizer)

    def estimate(self, config: Config, keep_stages: bool = True) -> Estimate:
        """Throughput, memory per GPU and bubble fraction of one configuration
        (``keep_stages=False`` skips building the per-stage list: faster for search)."""
        kinds, order = self._stage_kinds(config)
        stages = [kinds[k] for k in order]
        m, d = config.m, config.d
        slots = [s.slot_s for s in stages]
        slowest = max(slots)
        if config.schedule == "2bw" and self.options.overlap_grad_reduce_2bw:
            exposed = 0.0 if self.options.appendix_a_2bw else \
                self.exposed_allreduce_2bw(stages, m)
            batch = max(m * slowest + exposed, max(s.allreduce_s for s in kinds.values()))
        else:
            if config.schedule == "2bw":
                pipe = m * slowest
            elif config.schedule == "none":
                pipe = m * sum(slots)
            else:
                pipe = (m - 1) * slowest + sum(slots)
            batch = pipe + self.exposed_allreduce(stages)
        # STEP is a barrier: every stage waits for the slowest optimizer update.
        batch += max(s.step_s for s in kinds.values())
        busy = m * sum(slots)
        return Estimate(
            config=config, stages=tuple(self.stage_costs(config)) if keep_stages else (),
            batch_time_s=batch, samples_per_s=config.global_batch / batch,
            memory_per_gpu_bytes=max(s.memory_bytes for s in kinds.values()),
            bubble_fraction=max(0.0, 1.0 - busy / (d * batch)),
            links=links_for(self.hardware, config.t, config.w, config.d))

    @staticmethod
    def exposed_allreduce(stages: List[StageCost]) -> float:
        """All-reduce time left after the flush: stage i ends its last backward
        sum_{j<i} backward_j before stage 0 does, which hides that much of its reduce."""
        exposed, head_start = 0.0, 0.0
        for s in stages:
            # the data-parallel part also overlaps the stage's own last backward (bucket
            # hooks, ``StageCost.dp_exposed_s``); the tied-embedding sum runs after it
            own = s.dp_exposed_s + (s.allreduce_s - s.dp_allreduce_s)
            exposed = max(exposed, own - head_start)
            head_start += s.backward_s
        return exposed

    @staticmethod
    def exposed_allreduce_2bw(stages: List[StageCost], m: int) -> float:
        """What of 2BW's gradient all-reduces the executor waits for, per batch.

        The first stage (``PipelineEngine._step``) begins batch t's update just before
        batch t+2's first forward: its reduction runs beside the m - d + 1 forward/
        backward pairs in between.  Stage i > 0 waits at STEP(t), which the aligned
        placement puts one pair earlier (``schedules._align_steps``): sum_{j<i}
        backward_j after its own last backward, as after a flush
        (``exposed_allreduce``), plus the first stage's m - d pairs."""
        def own(s: StageCost) -> float:  # left after the stage's last backward
            return s.dp_exposed_s + (s.allreduce_s - s.dp_allreduce_s)

        first = stages[0]
        d = len(stages)
        exposed = max(0.0, own(first) - (m - d + 1) * first.slot_s)
        head_start = first.backward_s + max(0, m - d) * first.slot_s
        for s in stages[1:]:
            exposed = max(exposed, own(s) - head_start)
            head_start += s.backward_s
        return exposed

    def fits(self, estimate: Estimate) -> bool:
        return estimate.memory_per_gpu_bytes <= self.hardware.usable_memory_bytes

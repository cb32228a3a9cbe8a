"""Algorithm 1 of the paper (Appendix A): sweep parallel-pipeline shapes, keep the fastest
configuration that fits in memory, and print the command that runs it.

For every (w, d) with w d = N (and every t with t w d = N when tensor parallelism is
searched too), every requested schedule, and activation recomputation off and on, the
inner SEARCH(w, d, B) tries microbatch sizes b = 1, 2, 4, ... and, per b, the largest
number of microbatches m with global batch w b m <= B (2bw also needs m >= d; GPipe,
whose stash grows with m, backs off to the largest m that fits).  Of the b that fit it
keeps the highest predicted throughput; the paper's "largest b that fits" is usually
that b, but with a fixed batch a larger b also means fewer microbatches and a larger
flush bubble, so we compare throughputs instead of assuming.
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Iterable, List, Optional, Sequence, Union

from .cost_model import SCHEDULES, Config, CostModel, CostOptions, Estimate
from .hardware import GiB, HardwareSpec
from .model_spec import ModelSpec

# The 2BW staleness mitigation the convergence benches recommend (docs/pipeline.md,
# "Staleness mitigations"; one of megatron.optimizer.staleness.MITIGATIONS).  A planned
# 2BW command line passes it, so a user who copies the command gets it.  The Flush
# warm-up over half the run (the trainer's default length) is the one variant within 1%
# of Flush's loss at equal iterations on every CPU bench, and, at the per-iteration
# times the simulator projects for a processor per stage, it reaches Flush's final GPT
# loss 1.28-1.32x sooner at both learning rates (bench/results/projected/equal_time.json);
# prediction is faster at lr 3e-4 (1.77x) but never reaches it at 1e-3 (+2.6%).
RECOMMENDED_2BW_MITIGATION = "warmup"

if TYPE_CHECKING:
    from .profile import Profile


class PlanningError(ValueError):
    """No configuration can run (bad input, or the model fits nowhere)."""


@dataclass(frozen=True)
class PlanRow:
    """One candidate (w, d, t, schedule, recompute) with its best b and m."""

    config: Config
    predicted_samples_per_s: float
    memory_per_gpu_bytes: float
    bubble_fraction: float
    fits: bool
    reason_rejected: Optional[str] = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["global_batch"] = self.config.global_batch
        return out


def divisors(n: int) -> List[int]:
    """Divisors of n in increasing order (O(sqrt n))."""
    small, large = [], []
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


def _tensor_sizes(n: int, tensor_parallel: bool, max_tensor: Optional[int]) -> List[int]:
    """The tensor-parallel sizes t the search tries on n GPUs."""
    return [t for t in (divisors(n) if tensor_parallel else [1])
            if max_tensor is None or t <= max_tensor]


SHAPE_REASONS = ("d=", "t=")
"""How the reasons of ``_shapes`` start (a shape that cannot split the model)."""


def _shapes(model: ModelSpec, n: int, tensor_parallel: bool, max_tensor: Optional[int]):
    """(t, w, d) triples, plus why a triple cannot split this model (or None); each reason
    starts with one of ``SHAPE_REASONS``."""
    for t in _tensor_sizes(n, tensor_parallel, max_tensor):
        for d in divisors(n // t):
            w = n // (t * d)
            why = None
            if model.num_layers % d:
                why = f"d={d} does not divide {model.num_layers} layers"
            elif model.num_attention_heads % t:
                why = f"t={t} does not divide {model.num_attention_heads} heads"
            elif model.num_query_groups % t:
                # each tensor rank holds whole key/value heads
                why = f"t={t} does not divide {model.num_query_groups} query groups"
            elif model.sequence_parallel and t > 1 and model.seq_length % t:
                # each tensor rank holds s / t positions: the trainer refuses the rest
                why = (f"t={t} does not divide --seq-length {model.seq_length} "
                       f"(--sequence-parallel)")
            yield t, w, d, why


def _gpipe_backoff(cm: CostModel, cfg: Config) -> Optional[Estimate]:
    """Largest m (< cfg.m) whose GPipe stash fits; memory grows with m."""
    lo, hi, best = 1, cfg.m - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        est = cm.estimate(replace(cfg, m=mid), keep_stages=False)
        if cm.fits(est):
            best, lo = est, mid + 1
        else:
            hi = mid - 1
    return best


def recompute_fields(recompute: Union[bool, str]) -> dict:
    """Config fields of a recompute choice: False (none), True (stage-level, the paper's
    scheme), "uniform" (layer-level, uniform chunks of one layer) or "selective" (each
    layer's core attention: --recompute-granularity selective)."""
    if recompute == "uniform":
        return {"recompute": False, "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute": False, "selective_recompute": True}
    return {"recompute": bool(recompute)}


def search_microbatch(cm: CostModel, t: int, w: int, d: int, schedule: str,
                      recompute: Union[bool, str],
                      max_batch: int, max_microbatch: int = 64,
                      exact_batch: bool = False, balance: bool = False,
                      distributed_optimizer: bool = False) -> PlanRow:
    """SEARCH(w, d, B) for one shape, schedule and recompute choice: the best (b, m).

    Rejected (fits=False, with the reason) when no b fits in memory or no b meets the
    batch constraints.  ``balance``: then pick the stage split (``balance_stages``)."""
    best: Optional[Estimate] = None
    reason, smallest = None, None
    b = 1
    while b <= max_microbatch:
        m = max_batch // (w * b)
        if m < 1:
            reason = reason or f"w*b = {w * b} exceeds the batch size {max_batch}"
            break
        if exact_batch and w * b * m != max_batch:
            reason = reason or f"batch {max_batch} is not a multiple of w*b = {w * b}"
            b *= 2
            continue
        if schedule == "2bw" and m < d:
            reason = reason or f"2bw needs m >= d: m = {m} < d = {d} at b = {b}"
            break
        cfg = Config(w=w, d=d, t=t, b=b, m=m, schedule=schedule,
                     distributed_optimizer=distributed_optimizer, **recompute_fields(recompute))
        est = cm.estimate(cfg, keep_stages=False)
        if smallest is None:
            smallest = est
        if not cm.fits(est):
            backed = _gpipe_backoff(cm, cfg) if schedule == "gpipe" and not exact_batch else None
            if backed is None:
                usable = cm.hardware.usable_memory_bytes / GiB
                reason = reason if best else (
                    f"out of memory: {est.memory_per_gpu_bytes / GiB:.1f} GiB at b={b} "
                    f"> {usable:.1f} GiB usable")
                break
            est = backed
        if best is None or est.samples_per_s > best.samples_per_s:
            best = est
        b *= 2
    if best is not None and balance and d > 1:
        best = balance_stages(cm, best.config)
    if best is not None:
        return PlanRow(best.config, best.samples_per_s, best.memory_per_gpu_bytes,
                       best.bubble_fraction, True, None)
    cfg = smallest.config if smallest else Config(w=w, d=d, t=t, b=1, m=max(1, max_batch // w),
                                                  schedule=schedule,
                                                  distributed_optimizer=distributed_optimizer,
                                                  **recompute_fields(recompute))
    return PlanRow(cfg, 0.0, smallest.memory_per_gpu_bytes if smallest else 0.0,
                   smallest.bubble_fraction if smallest else 0.0, False,
                   reason or "no microbatch size fits")


def layer_splits(num_layers: int, d: int) -> List[tuple]:
    """Every (first, last) stage layer count that splits ``num_layers`` over ``d`` stages
    with an even middle (Megatron's --decoder-first/last-pipeline-num-layers), the even
    split as (None, None) first."""
    out: List[tuple] = [(None, None)] if num_layers % d == 0 else []
    if d < 2:
        return out
    even = num_layers // d if num_layers % d == 0 else None
    middles = [0] if d == 2 else range(1, num_layers // (d - 2) + 1)
    for k in middles:
        rest = num_layers - k * (d - 2)
        for first in range(1, rest):
            last = rest - first
            if first == last == k == even or (d == 2 and first == last == even):
                continue  # that is the even split
            out.append((first, last))
    return out


def balance_stages(cm: CostModel, cfg: Config) -> Estimate:
    """The stage split (first/last stage layer counts) with the shortest predicted batch
    time for ``cfg``, among those that fit in memory; the even split wins ties.

    The first stage also runs the embedding, the last the LM head and the loss, so with
    measured costs (a profile) fewer layers on them often balance the pipeline."""
    best = None
    for first, last in layer_splits(cm.model.num_layers, cfg.d):
        est = cm.estimate(replace(cfg, first_layers=first, last_layers=last), keep_stages=False)
        if not cm.fits(est):
            continue
        if best is None or est.batch_time_s < best.batch_time_s * (1 - 1e-9):
            best = est
    return best if best is not None else cm.estimate(cfg, keep_stages=False)


def _check_inputs(model: ModelSpec, num_gpus: int, max_batch_size: int,
                  schedules: Sequence[str]) -> None:
    if num_gpus < 1:
        raise PlanningError(f"--num-gpus must be >= 1, got {num_gpus}")
    if max_batch_size < 1:
        raise PlanningError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise PlanningError(f"--schedules {','.join(schedules)!r}: expected a comma list "
                            f"of {', '.join(SCHEDULES)}")


def _check_sequence_parallel(model: ModelSpec, num_gpus: int, tensor_parallel: bool,
                             max_tensor: Optional[int]) -> None:
    """A model with ``sequence_parallel`` planned where it could never apply is an error
    rather than a silent no-op: it needs tensor parallelism, and at least one tried
    t > 1 that divides the sequence (with one GPU, or max_tensor 1, there is no t > 1 to
    try: then the plan simply has none, as with tensor_parallel alone)."""
    if not tensor_parallel:
        raise PlanningError("--sequence-parallel needs --tensor-parallel: it splits each "
                            "sequence over the tensor ranks, and without --tensor-parallel "
                            "every plan has one (t = 1)")
    sizes = [t for t in _tensor_sizes(num_gpus, True, max_tensor) if t > 1]
    if sizes and all(model.seq_length % t for t in sizes):
        raise PlanningError(f"--sequence-parallel splits each sequence over the t tensor "
                            f"ranks: --seq-length {model.seq_length} is divisible by none of "
                            f"the tensor-parallel sizes t = {', '.join(map(str, sizes))} "
                            f"that {num_gpus} GPUs allow")


def search(model: ModelSpec, hardware: HardwareSpec, num_gpus: int, max_batch_size: int, *,
           schedules: Iterable[str] = SCHEDULES, tensor_parallel: bool = False,
           max_tensor: Optional[int] = None, max_microbatch_size: int = 64,
           recompute: Sequence[Union[bool, str]] = (False, True), exact_batch: bool = False,
           options: CostOptions = CostOptions(),
           profile: Optional["Profile"] = None,
           balance_stages_: bool = True,
           distributed_optimizer: Sequence[bool] = (False,)) -> List[PlanRow]:
    """Ranked candidates: those that fit by predicted throughput, then the rejected.

    With a ``profile`` each candidate's stage split is chosen from the measured costs
    (``balance_stages``; off with ``balance_stages_=False``): the embedding and the LM
    head make the first and last stage heavier than the middle ones.

    ``exact_batch`` keeps only (b, m) with w b m == B (the paper's fixed-batch
    comparisons) instead of w b m <= B.  ``distributed_optimizer``: the choices to try
    for --use-distributed-optimizer, (False, True) to let the search decide (True only
    where w > 1: with one replica there is nothing to split).  ``profile`` (``planner.profile.Profile``)
    prices compute and activations from measurements instead of the closed forms.

    A model with ``sequence_parallel`` (needs ``tensor_parallel``) runs it at every
    t > 1, and a t that does not divide the sequence is rejected.  It is not a choice
    to try both ways like the distributed optimizer: it saves activation memory and
    elementwise time for the same communication, so a plan never loses by it.
    """
    schedules = list(schedules)
    _check_inputs(model, num_gpus, max_batch_size, schedules)
    if model.sequence_parallel:
        _check_sequence_parallel(model, num_gpus, tensor_parallel, max_tensor)
    schedules = [s for s in SCHEDULES if s in schedules]  # canonical order: none wins ties
    cm = CostModel(model, hardware, options, profile)
    rows: List[PlanRow] = []
    for t, w, d, why in _shapes(model, num_gpus, tensor_parallel, max_tensor):
        for schedule in schedules:
            for rc in recompute:
                if why:
                    cfg = Config(w=w, d=d, t=t, b=1, m=1, schedule=schedule,
                                 **recompute_fields(rc))
                    rows.append(PlanRow(cfg, 0.0, 0.0, 0.0, False, why))
                    continue
                for dopt in distributed_optimizer:
                    if dopt and w == 1 and False in distributed_optimizer:
                        continue  # the same candidate as without it
                    rows.append(search_microbatch(
                        cm, t, w, d, schedule, rc, max_batch_size, max_microbatch_size,
                        exact_batch, balance=balance_stages_ if profile is not None else False,
                        distributed_optimizer=bool(dopt)))
    fitting = sorted((r for r in rows if r.fits), key=lambda r: -r.predicted_samples_per_s)
    rejected = [r for r in rows if not r.fits]
    return fitting + rejected


def best_plan(model: ModelSpec, hardware: HardwareSpec, num_gpus: int, max_batch_size: int,
              **kwargs) -> PlanRow:
    """Highest-throughput configuration that fits; PlanningError when none does."""
    rows = search(model, hardware, num_gpus, max_batch_size, **kwargs)
    if not rows or not rows[0].fits:
        oom = [r for r in rows if r.reason_rejected and r.reason_rejected.startswith("out of")]
        # the shapes that could split the model first (what stopped them: the batch, 2BW's
        # m >= d), smallest numbers first; then the shapes that cannot (SHAPE_REASONS)
        other = sorted({r.reason_rejected for r in rows
                        if r.reason_rejected and r not in oom},
                       key=lambda why: (why.startswith(SHAPE_REASONS),
                                        [int(x) if x.isdigit() else x
                                         for x in re.split(r"(\d+)", why)]))
        why = []
        if oom:
            r = min(oom, key=lambda r: r.memory_per_gpu_bytes)
            why.append(f"the smallest footprint ({r.config.describe().strip()}) needs "
                       f"{r.memory_per_gpu_bytes / GiB:.1f} GiB per GPU, "
                       f"{hardware.usable_memory_bytes / GiB:.1f} GiB usable")
        why += other[:3]
        raise PlanningError(
            f"no configuration of {model.describe()} fits on {num_gpus} {hardware.name} "
            f"GPUs with global batch <= {max_batch_size}: " + "; ".join(why))
    return rows[0]


def command_line(plan: Union[PlanRow, Config], model: ModelSpec,
                 base_script: Optional[str] = None, gpus_per_server: int = 8,
                 extra_args: Sequence[str] = (), precision: str = "fp16") -> str:
    """The torchrun + pretrain_{gpt,bert}.py command that runs ``plan`` (Megatron flags,
    the model's Llama-style options and attention backend included:
    ``ModelSpec.llama_options``, ``ModelSpec.backend_options``; --sequence-parallel
    where the model asks for it and the plan has t > 1 to split sequences over;
    --reset-attention-mask and --fp32-residual-connection where the model has them).
    ``precision``: fp16 (the paper's V100 runs), bf16, or fp32/fp64 (no flag, e.g. a CPU)."""
    if precision not in PRECISIONS:
        raise PlanningError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    cfg = plan.config if isinstance(plan, PlanRow) else plan
    script = base_script or f"pretrain_{model.kind}.py"
    n = cfg.num_gpus
    nproc = min(n, gpus_per_server)
    if n % nproc:
        raise PlanningError(f"{n} GPUs do not fill whole servers of {gpus_per_server}")
    nnodes = n // nproc
    launch = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}"]
    if nnodes > 1:
        launch += ["--node-rank=$NODE_RANK", "--master-addr=$MASTER_ADDR", "--master-port=6000"]
    args = [
        "--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
        "--ffn-hidden-size", model.ffn, "--num-attention-heads", model.num_attention_heads,
        "--seq-length", model.seq_length, "--max-position-embeddings", model.seq_length,
        "--micro-batch-size", cfg.b, "--global-batch-size", cfg.global_batch,
        "--tensor-model-parallel-size", cfg.t, "--pipeline-model-parallel-size", cfg.d,
        "--pipeline-schedule", cfg.schedule,
    ]
    if model.sequence_parallel and cfg.t > 1:  # with t = 1 the trainer would ignore it
        args.append("--sequence-parallel")
    if model.reset_attention_mask:
        args.append("--reset-attention-mask")
    args += model.llama_options() + model.backend_options()
    if cfg.first_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", cfg.first_layers]
    if cfg.last_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", cfg.last_layers]
    if cfg.schedule == "2bw" and RECOMMENDED_2BW_MITIGATION != "none":
        args += ["--2bw-mitigation", RECOMMENDED_2BW_MITIGATION]
    if cfg.distributed_optimizer:
        # the cost model hides the weights' all-gather behind the next forward pass
        # (``CostOptions.overlap_param_gather``)
        args += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if cfg.recompute:
        args.append("--recompute-activations")
    elif cfg.recompute_method is not None:
        args += ["--recompute-granularity", "full", "--recompute-method", cfg.recompute_method,
                 "--recompute-num-layers", cfg.recompute_num_layers]
    elif cfg.selective_recompute:
        args += ["--recompute-granularity", "selective"]
    if precision in ("fp16", "bf16", "fp64"):
        args.append(f"--{precision}")
    if model.fp32_residual_connection:  # (a note, no effect, in fp32/fp64)
        args.append("--fp32-residual-connection")
    args += list(extra_args)
    # $VARS stay unquoted so the shell expands them on each node.
    return " ".join(launch + [script] + [shlex.quote(str(a)) for a in args])


PRECISIONS = ("fp16", "bf16", "fp32", "fp64")


def planned_precision(hardware_name: str, profile_dtype: Optional[str] = None,
                      bf16: bool = False) -> str:
    """The precision a planned command runs in: a profile's own dtype, else fp32 on a CPU
    (half precision is emulated there, 4.4 s against 10 ms an iteration on a small GPT:
    bench/cpu_precision.py), else bf16 where the accelerator has it at full rate
    (``HardwareSpec.bf16``: A100, H100; no loss scaling to tune), else fp16 as the
    paper's V100 runs."""
    if profile_dtype:
        return profile_dtype
    if hardware_name == "cpu":
        return "fp32"
    return "bf16" if bf16 else "fp16"


def _recompute_label(c: Config) -> str:
    if c.recompute_method is not None:
        return f"{c.recompute_method[:3]}{c.recompute_num_layers}"
    if c.selective_recompute:
        return "sel"
    return "yes" if c.recompute else "no"


def format_table(rows: Sequence[PlanRow], limit: Optional[int] = None) -> str:
    """Fixed-width ranked table (rank, config, samples/s, memory GiB, bubble, status)."""
    head = (f"{'#':>3}  {'schedule':8} {'w':>4} {'d':>4} {'t':>3} {'b':>3} {'m':>5} "
            f"{'recomp':6} {'batch':>6} {'samples/s':>10} {'mem GiB':>7} {'bubble':>7}  status")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows[:limit] if limit else rows, 1):
        c = r.config
        status = "ok" if r.fits else f"rejected: {r.reason_rejected}"
        if c.distributed_optimizer:
            status += " (distributed optimizer)"
        tput = f"{r.predicted_samples_per_s:10.2f}" if r.fits else f"{'-':>10}"
        mem = f"{r.memory_per_gpu_bytes / GiB:7.2f}" if r.memory_per_gpu_bytes else f"{'-':>7}"
        lines.append(f"{i:>3}  {c.schedule:8} {c.w:>4} {c.d:>4} {c.t:>3} {c.b:>3} {c.m:>5} "
                     f"{_recompute_label(c):6} {c.global_batch:>6} {tput} {mem} "
                     f"{100 * r.bubble_fraction:6.1f}%  {status}")
    return "\n".join(lines)

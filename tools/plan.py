#!/usr/bin/env python
"""PipeDream-2BW planner CLI: which (w, d, t, b, m, recompute, schedule) to run.

    python tools/plan.py --model gpt-2.2b --cluster p3.16xlarge --num-gpus 64 \\
        --max-batch-size 512
    python tools/plan.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 512 --num-gpus 16 --gpus-per-server 8 --gpu-memory-gb 16 \\
        --intra-server-bandwidth 150 --inter-server-bandwidth 3.125 --max-batch-size 256 \\
        --schedules 2bw,flush --tensor-parallel --json plan.json
    python tools/plan.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --ffn-hidden-size 14336 --seq-length 8192 --vocab-size 128256 \\
        --normalization RMSNorm --position-embedding-type rope --swiglu \\
        --group-query-attention --num-query-groups 8 --disable-bias-linear \\
        --untie-embeddings-and-output-weights --cluster dgx-a100 --num-gpus 64 \\
        --max-batch-size 512 --tensor-parallel

Prints a ranked table (predicted samples/s, memory per GPU, bubble, why rejected) and
the torchrun command of the best configuration.  Predictions come from the closed-form
cost model of the paper's Appendix A (megatron/pipeline/planner/cost_model.py), or, with
``--profile profile.json`` (written by tools/profile_model.py), from measured per-block
compute times and activation sizes (megatron/pipeline/planner/profile.py); model flags
left out are then taken from the profile.  The Llama-style block options are the
trainer's flags (--normalization, --position-embedding-type, --swiglu,
--group-query-attention --num-query-groups, --disable-bias-linear, --add-qkv-bias,
--untie-embeddings-and-output-weights, --qk-layernorm, --use-rope-scaling
--rope-scaling-factor, --kv-channels); the planned command passes them on.
``--tensor-parallel --sequence-parallel`` plans every t > 1 with the trainer's sequence
parallelism (the activations tensor parallelism replicates split along the sequence)
and passes --sequence-parallel on.  ``--ddp-bucket-size N`` (the trainer's flag) prices
the data-parallel buckets the executor builds of that size and passes it on.  With
``--json`` the file holds every row, the best plan, its command and the profile's
notes (``profile_notes``: what its costs leave out for the planned model).

    python tools/plan.py --model qwen3-0.6b --cluster h100-sxm --num-gpus 8 --max-batch-size 64
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.pipeline.planner import (CostOptions, HardwareSpec, ModelSpec,  # noqa: E402
                                       PlanningError, SCHEDULES, best_plan, command_line,
                                       format_table, get_hardware, get_model, search)
from megatron.pipeline.planner.hardware import GB, GiB, describe_links, links_for  # noqa: E402
from megatron.pipeline.planner.model_spec import (ATTENTION_BACKENDS, NORMALIZATIONS,  # noqa: E402
                                                  POSITION_EMBEDDING_TYPES)
from megatron.pipeline.planner.presets import HARDWARE_PRESETS, MODEL_PRESETS  # noqa: E402
from megatron.arguments import OneLineParser  # noqa: E402
from megatron.pipeline.planner.profile import ARCH_FIELDS, Profile  # noqa: E402
from megatron.pipeline.planner.search import planned_precision  # noqa: E402
from megatron.pipeline.planner.search import RECOMMENDED_2BW_MITIGATION  # noqa: E402

# share of --train-iters the trainer's default --2bw-flush-warmup-iters runs under Flush
WARMUP_SHARE = 0.5


def run_rate(row, model: ModelSpec, hw: HardwareSpec, options: CostOptions,
             profile: Optional[Profile]) -> Optional[dict]:
    """For a 2BW row whose command runs the recommended Flush warm-up: the same
    configuration's predicted samples/s under Flush (the first half of the run) and over
    the whole run (samples / time: the harmonic mean of the two halves' rates); else None."""
    from dataclasses import replace

    from megatron.pipeline.planner import CostModel

    c = row.config
    if c.schedule != "2bw" or RECOMMENDED_2BW_MITIGATION != "warmup":
        return None
    flush = CostModel(model, hw, options, profile).estimate(replace(c, schedule="flush"))
    tbw = row.predicted_samples_per_s
    run = 1.0 / (WARMUP_SHARE / flush.samples_per_s + (1.0 - WARMUP_SHARE) / tbw)
    return {"warmup_share": WARMUP_SHARE, "flush_samples_per_s": flush.samples_per_s,
            "2bw_samples_per_s": tbw, "run_samples_per_s": run}


STALENESS_MARGIN = 0.02
"""2BW is chosen only when its rate over the run beats the best schedule without weight
staleness by more than this: with the Flush warm-up its validation loss still ended
0.1-0.6% above Flush's at equal iterations (docs/pipeline.md), which a gain of a fraction
of a percent (e.g. at d = 1, where there is no bubble to remove) does not buy back."""


def choose_for_run(rows, model: ModelSpec, hw: HardwareSpec, options: CostOptions,
                   profile: Optional[Profile]):
    """(row, its run_rate or None, (2BW row, its rate over the run) passed over or None):
    the fitting configuration with the most samples/s over the whole run its command
    starts -- 2BW rows at their rate with the Flush warm-up the command adds, the others
    at their predicted rate (search() ranks by steady rates) -- where 2BW must win by
    more than ``STALENESS_MARGIN``."""
    best = {True: (None, -1.0, None), False: (None, -1.0, None)}  # keyed by "is 2BW"
    for r in rows:
        if not r.fits:
            continue
        info = run_rate(r, model, hw, options, profile)
        rate = info["run_samples_per_s"] if info is not None else r.predicted_samples_per_s
        stale = r.config.schedule == "2bw"
        if rate > best[stale][1]:
            best[stale] = (r, rate, info)
    tbw, fresh = best[True], best[False]
    if tbw[0] is not None and (fresh[0] is None or tbw[1] > (1 + STALENESS_MARGIN) * fresh[1]):
        return tbw[0], tbw[2], None
    passed = (tbw[0], tbw[1]) if tbw[0] is not None and tbw[1] > fresh[1] else None
    return fresh[0], fresh[2], passed


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(p.add_argument_group("model (a preset, or Megatron's flags)"))
    _add_cluster_flags(p.add_argument_group("cluster (a preset, overridable field by field)"))
    _add_search_flags(p.add_argument_group("search"))
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=20, help="rows to print (0 = all)")
    o.add_argument("--json", metavar="PATH", help="write all rows and the best plan as JSON")
    return p


def _add_model_flags(g: argparse._ArgumentGroup) -> None:
    """The model: a preset, or Megatron's shape and block flags (a preset's or a profile's
    own where left out)."""
    g.add_argument("--model", choices=sorted(MODEL_PRESETS), help="named model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4 x hidden size")
    g.add_argument("--vocab-size", type=int, help="padded vocabulary (default 50304 GPT, 30592 BERT)")
    g.add_argument("--model-type", choices=("gpt", "bert"), help="default gpt")
    # the trainer's Llama-style block options (megatron/arguments.py); left out: a
    # preset's or a profile's own, else a GPT-2 block (default None = not given)
    g.add_argument("--normalization", choices=NORMALIZATIONS,
                   help="default LayerNorm (RMSNorm: weight only)")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
                   help="default learned_absolute (rope: rotary, no position table)")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type",
                   action="store_const", const="rope",
                   help="Megatron-LM's older switch for --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, help="RoPE's base (default 10000)")
    g.add_argument("--rotary-percent", type=float,
                   help="share of each head RoPE rotates (default 1.0)")
    g.add_argument("--use-rope-scaling", dest="rope_scaling", action="store_true",
                   default=None,
                   help="Llama 3.1's RoPE frequencies (no cost; passed on to the command)")
    g.add_argument("--rope-scaling-factor", type=float,
                   help="with --use-rope-scaling (default 8.0)")
    g.add_argument("--swiglu", action="store_true", default=None,
                   help="SwiGLU MLP: 3 matrices, the first h -> 2 x ffn")
    g.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="query and key norms over each head (Qwen3): 2 head_dim-wide norms "
                        "per layer")
    g.add_argument("--kv-channels", type=int,
                   help="size of one attention head (default --hidden-size / "
                        "--num-attention-heads): queries heads x this wide, keys and values "
                        "query groups x this")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="grouped-query attention with --num-query-groups key/value heads")
    g.add_argument("--num-query-groups", type=int,
                   help="key/value heads with --group-query-attention (default 1, as the "
                        "trainer's)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   default=None, help="no biases on a block's four linear layers")
    g.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="keep the QKV projection's bias with --disable-bias-linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="GPT's output layer gets a vocab x hidden weight of its own")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="default auto (torch's fused attention: no seq x seq scores kept); "
                        "unfused, local: the explicit softmax, 5 bytes per score and head "
                        "(the paper's Megatron)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="GPT: the trainer's --reset-attention-mask (attention inside each "
                        "document): every stage keeps a [b, s, s] mask per microbatch")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="the trainer's --fp32-residual-connection: the residual stream "
                        "(stage inputs and outputs, the norms' inputs) in float32, 4 bytes "
                        "a value where the counts have 2")


def _add_cluster_flags(c: argparse._ArgumentGroup) -> None:
    """The cluster: a preset, overridable field by field."""
    c.add_argument("--cluster", default="p3.16xlarge", choices=sorted(HARDWARE_PRESETS))
    c.add_argument("--num-gpus", type=int, required=True, help="N: GPUs to plan for")
    c.add_argument("--gpus-per-server", type=int)
    c.add_argument("--gpu-memory-gb", type=float, help="GiB per GPU")
    c.add_argument("--intra-server-bandwidth", type=float, help="GB/s between GPUs of a server")
    c.add_argument("--inter-server-bandwidth", type=float,
                   help="GB/s out of one server (25 Gbit/s = 3.125)")
    c.add_argument("--achieved-tflops", type=float, help="sustained TFLOP/s per GPU")


def _add_search_flags(s: argparse._ArgumentGroup) -> None:
    """What to search (Algorithm 1's bounds, the schedules, recomputation, the
    optimizer) and the cost model's inputs (--c-extra, a profile)."""
    s.add_argument("--max-batch-size", type=int, required=True,
                   help="B: largest global batch known to converge well")
    s.add_argument("--schedules", default=",".join(SCHEDULES),
                   help=f"comma list of {','.join(SCHEDULES)} (default all)")
    s.add_argument("--tensor-parallel", action="store_true",
                   help="also search the tensor-parallel size t (t w d = N)")
    s.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-parallel: plan every t > 1 with the trainer's "
                        "--sequence-parallel (norms, residual dropout, the linear layers' "
                        "inputs and the tensors between stages split along the sequence, "
                        "1/t of their memory, the same communication); t must divide "
                        "--seq-length")
    s.add_argument("--max-microbatch-size", type=int, default=64)
    s.add_argument("--recompute", choices=("auto", "on", "off", "layer", "selective", "all"),
                   default="auto",
                   help="activation recomputation: try none and stage-level (auto), always "
                        "stage-level (on), never (off), layer-level uniform chunks of one "
                        "layer (layer: --recompute-method uniform --recompute-num-layers 1), "
                        "each layer's core attention (selective: --recompute-granularity "
                        "selective; it pays with --attention-backend local/unfused), or all "
                        "four (all)")
    s.add_argument("--use-distributed-optimizer", nargs="?", const="on", choices=("on", "auto"),
                   help="plan (and print) the trainer's distributed optimizer: the master "
                        "weights and moments split over each stage's data-parallel "
                        "replicas; 'auto': try each configuration with and without it")
    s.add_argument("--ddp-bucket-size", type=int, metavar="N",
                   help="the trainer's --ddp-bucket-size: parameters per data-parallel "
                        "gradient bucket, and with --use-distributed-optimizer per weight "
                        "all-gather bucket of --overlap-param-gather (default: 32 MiB of "
                        "gradients).  The cost model counts the buckets the executor builds "
                        "of each stage (more buckets hide more of the all-reduce behind the "
                        "last backward and of the gather behind the next forward); the "
                        "command passes it on")
    s.add_argument("--c-extra", type=float, default=4.0 / 3.0,
                   help="compute multiplier of activation recomputation (Appendix A)")
    s.add_argument("--profile", metavar="PATH",
                   help="JSON profile from tools/profile_model.py: measured compute and "
                        "activation costs instead of the closed forms")
    s.add_argument("--profile-clock", choices=("wall", "cpu"), default="wall",
                   help="profile times to use: elapsed (default) or the profiling thread's "
                        "CPU time (CPU profiles taken on a machine shared with others)")


def arch_from_args(args: argparse.Namespace) -> dict:
    """The block options given on the command line (ModelSpec field -> value).

    As in the trainer, --num-query-groups counts only with --group-query-attention,
    which without it means one key/value head (Megatron-LM's default); a count given
    without the switch is an error rather than silently ignored."""
    if args.num_query_groups is not None and not args.group_query_attention:
        raise PlanningError(f"--num-query-groups {args.num_query_groups} needs "
                            f"--group-query-attention (without it the trainer ignores it)")
    given = {k: getattr(args, k) for k in ARCH_FIELDS
             if k != "num_query_groups" and getattr(args, k) is not None}
    if args.group_query_attention:
        given["num_query_groups"] = (args.num_query_groups
                                     if args.num_query_groups is not None else 1)
    return given


def model_from_args(args: argparse.Namespace, profile: Optional[Profile] = None) -> ModelSpec:
    """The planned model: a preset, a profile's shape or the flags, with the flags given
    on top.  A --rope-scaling-factor that the model would not use (no
    --use-rope-scaling, its own or its preset's or profile's) is an error, as
    --num-query-groups without --group-query-attention.  --sequence-parallel,
    --reset-attention-mask and --fp32-residual-connection are set here whatever the
    source: presets do not carry them, nor profiles --sequence-parallel (taken at t =
    1); a profile taken with --reset-attention-mask or --fp32-residual-connection gives
    its flag to a model from its shape.  A profile whose costs cannot price the model is
    refused here (``Profile.check_model``)."""
    model = _model_from_args(args, profile)
    if args.rope_scaling_factor is not None and not model.rope_scaling:
        raise PlanningError(f"--rope-scaling-factor {args.rope_scaling_factor:g} needs "
                            f"--use-rope-scaling (without it the trainer ignores it)")
    from dataclasses import replace

    if args.sequence_parallel:
        model = replace(model, sequence_parallel=True)
    if args.reset_attention_mask:
        if model.kind != "gpt":
            raise PlanningError("--reset-attention-mask applies to GPT models only (BERT "
                                "has its padding mask)")
        model = replace(model, reset_attention_mask=True)
    if args.fp32_residual_connection:
        model = replace(model, fp32_residual_connection=True)
    if profile is not None:
        profile.check_model(model)  # a refusal before the notes of a plan it makes
    return model


def _model_from_args(args: argparse.Namespace, profile: Optional[Profile] = None) -> ModelSpec:
    shape = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    arch = arch_from_args(args)
    if profile is not None and not args.model:
        # Flags left out come from the profiled shape (a different depth is allowed).
        for k in shape + ("ffn_hidden_size", "vocab_size"):
            if getattr(args, k) is None:
                setattr(args, k, profile.model[k])
        arch = {**{k: profile.model[k] for k in ARCH_FIELDS}, **arch}
        # the run options it was taken with (model_from_args sets what the flags give)
        for k in ("reset_attention_mask", "fp32_residual_connection"):
            if profile.model.get(k):
                setattr(args, k, True)
        if args.kv_channels is None and \
                profile.model["kv_channels"] * profile.model["num_attention_heads"] == \
                profile.model["hidden_size"]:
            arch["kv_channels"] = None  # h / a of the planned shape, as the trainer's default
    if args.model:
        base = get_model(args.model)
        over = {k: getattr(args, k) for k in shape + ("ffn_hidden_size", "vocab_size")
                if getattr(args, k) is not None}
        over.update(arch)
        if args.model_type:
            over["kind"] = args.model_type
        if not over:
            return base
        fields = {k: getattr(base, k)
                  for k in shape + ("ffn_hidden_size", "vocab_size", "kind") + ARCH_FIELDS}
        if not base.grouped_query:
            fields["num_query_groups"] = None  # multi-head, whatever the head count
        if not base.custom_head_dim:
            fields["kv_channels"] = None  # h / a of the new shape (a preset's own d stays)
        fields.update(over)
        resized = "hidden_size" in over or over.get("swiglu", base.swiglu) != base.swiglu
        if resized and "ffn_hidden_size" not in over:
            fields["ffn_hidden_size"] = None  # the default width of the new shape
        return ModelSpec(**fields, name=f"{args.model} (modified)")
    missing = [f"--{k.replace('_', '-')}" for k in shape if getattr(args, k) is None]
    if missing:
        raise PlanningError(f"give --model or all of {', '.join(missing)}")
    kind = args.model_type or "gpt"
    vocab = args.vocab_size or (50304 if kind == "gpt" else 30592)
    return ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                     ffn_hidden_size=args.ffn_hidden_size, vocab_size=vocab, kind=kind, **arch)


POSITIVE_FLOATS = ("gpu_memory_gb", "intra_server_bandwidth", "inter_server_bandwidth",
                   "achieved_tflops")
"""Cluster flags that must be finite and > 0 (a nan or inf would price every plan)."""


def check_flag_values(args: argparse.Namespace) -> None:
    """Refuse the numeric flags whose values argparse's types let through but no plan can
    use, naming the flag: a cluster's sizes and rates must be finite and > 0,
    recomputation cannot cost less than the forward it skips (--c-extra >= 1), and the
    counts must be at least 1 (--top: 0 prints all)."""
    for key in POSITIVE_FLOATS:
        value = getattr(args, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise PlanningError(f"--{key.replace('_', '-')} {value:g}: expected a finite "
                                f"number > 0")
    if not (math.isfinite(args.c_extra) and args.c_extra >= 1):
        raise PlanningError(f"--c-extra {args.c_extra:g}: expected a finite number >= 1 (the "
                            f"compute of a recomputed step over one without; 4/3 in Appendix A)")
    for key, least in (("gpus_per_server", 1), ("max_microbatch_size", 1), ("top", 0)):
        value = getattr(args, key)
        if value is not None and value < least:
            raise PlanningError(f"--{key.replace('_', '-')} {value}: expected an integer "
                                f">= {least}")


def hardware_from_args(args: argparse.Namespace) -> HardwareSpec:
    hw = get_hardware(args.cluster)
    if args.gpu_memory_gb is not None and args.gpu_memory_gb * GiB <= hw.reserved_memory_bytes:
        raise PlanningError(f"--gpu-memory-gb {args.gpu_memory_gb:g}: expected more than the "
                            f"{hw.reserved_memory_bytes / GiB:g} GiB {hw.name} reserves per GPU "
                            f"(CUDA context, fragmentation), which leaves nothing to plan with")
    over = {}
    if args.gpus_per_server is not None:
        over["gpus_per_server"] = args.gpus_per_server
    if args.gpu_memory_gb is not None:
        over["gpu_memory_bytes"] = args.gpu_memory_gb * GiB
    if args.intra_server_bandwidth is not None:
        over["intra_server_bandwidth"] = args.intra_server_bandwidth * GB
    if args.inter_server_bandwidth is not None:
        over["inter_server_bandwidth"] = args.inter_server_bandwidth * GB
    if args.achieved_tflops is not None:
        over["achieved_flops"] = args.achieved_tflops * 1e12
    if over:
        hw = hw.with_overrides(name=f"{hw.name} (modified)", **over)
    return hw


def check_gpus(num_gpus: int, hw: HardwareSpec) -> None:
    if num_gpus < 1:
        raise PlanningError(f"--num-gpus must be >= 1, got {num_gpus}")
    g = hw.gpus_per_server
    if num_gpus > g and num_gpus % g:
        raise PlanningError(f"--num-gpus {num_gpus} must be at most --gpus-per-server {g} or "
                            f"a multiple of it (whole servers)")


def run(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_flag_values(args)
        profile = Profile.load(args.profile, args.profile_clock) if args.profile else None
        model = model_from_args(args, profile)
        # what the profile's costs leave out for this model: printed, and in --json
        notes = profile.notes(model) if profile is not None else []
        for note in notes:
            print(f"note:    {note}")
        hw = hardware_from_args(args)
        check_gpus(args.num_gpus, hw)
        schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
        # (a size below 1 is refused there, in the trainer's words)
        base_options = CostOptions(c_extra=args.c_extra,
                                   grad_bucket_elements=args.ddp_bucket_size)
        recompute = {"auto": (False, True), "on": (True,), "off": (False,),
                     "layer": ("uniform",), "selective": ("selective",),
                     "all": (False, True, "uniform", "selective")}[args.recompute]
        kwargs = dict(schedules=schedules, tensor_parallel=args.tensor_parallel,
                      max_microbatch_size=args.max_microbatch_size, recompute=recompute,
                      options=(profile.cost_options(base_options) if profile else base_options),
                      distributed_optimizer={None: (False,), "on": (True,),
                                             "auto": (False, True)}[args.use_distributed_optimizer],
                      profile=profile)
        rows = search(model, hw, args.num_gpus, args.max_batch_size, **kwargs)
        fastest = best_plan(model, hw, args.num_gpus, args.max_batch_size, **kwargs)
        best, warmup, passed = choose_for_run(rows, model, hw, kwargs["options"], profile)
        # a profile of the fused loss was timed with it: the command must run it too
        fused = bool(profile and profile.model.get("cross_entropy_loss_fusion"))
        extra = ["--cross-entropy-loss-fusion"] if fused else []
        if args.ddp_bucket_size is not None:  # the buckets the plan was priced with
            extra += ["--ddp-bucket-size", str(args.ddp_bucket_size)]
        cmd = command_line(best, model, gpus_per_server=hw.gpus_per_server, extra_args=extra,
                           precision=planned_precision(
                               hw.name, profile.model.get("dtype") if profile else None,
                               bf16=hw.bf16))
    except (PlanningError, ValueError) as exc:
        print(f"plan.py: error: {exc}", file=sys.stderr)
        return 2
    fitting = sum(r.fits for r in rows)
    print(f"model:   {model.describe()}")
    print(f"cluster: {args.num_gpus} x {hw.name}, {hw.gpus_per_server} per server, "
          f"{hw.gpu_memory_bytes / GiB:.0f} GiB ({hw.usable_memory_bytes / GiB:.1f} usable), "
          f"{hw.achieved_flops / 1e12:.1f} TFLOP/s sustained, intra {hw.intra_server_bandwidth / GB:.1f} "
          f"GB/s, inter {hw.inter_server_bandwidth / GB:.3f} GB/s per server")
    if profile is not None:
        print(f"costs:   {profile.describe()}")
    print(f"search:  B <= {args.max_batch_size}, schedules {','.join(schedules)}, "
          f"{len(rows)} candidates, {fitting} fit\n")
    print(format_table(rows, args.top or None))
    if args.top and len(rows) > args.top:
        print(f"... {len(rows) - args.top} more rows (--top 0 prints all)")
    c = best.config
    print(f"\nbest: {c.describe()}  global batch {c.global_batch}: "
          f"{best.predicted_samples_per_s:.2f} samples/s, "
          f"{best.memory_per_gpu_bytes / GiB:.2f} GiB/GPU, bubble {100 * best.bubble_fraction:.1f}%")
    print(f"links: {describe_links(links_for(hw, c.t, c.w, c.d), c.t, c.w, c.d)}")
    if warmup is not None:
        print(f"warm-up: the command adds --2bw-mitigation {RECOMMENDED_2BW_MITIGATION}: Flush "
              f"semantics for the first half of --train-iters ({warmup['flush_samples_per_s']:.2f} "
              f"samples/s), then 2BW; {warmup['run_samples_per_s']:.2f} samples/s over the "
              f"whole run (docs/pipeline.md, \"Staleness mitigations\")")
    if passed is not None:
        row, rate = passed
        print(f"note:    {row.config.describe()} would run {rate:.2f} samples/s over the run, "
              f"{100 * (rate / best.predicted_samples_per_s - 1):.1f}% more, but 2BW must "
              f"gain more than {100 * STALENESS_MARGIN:.0f}% to pay for its stale weights")
    elif best.config != fastest.config:
        print(f"note:    chosen for the whole run's rate: the fastest steady state, "
              f"{fastest.config.describe()} at {fastest.predicted_samples_per_s:.2f} samples/s, "
              f"gives less over a run that starts with the Flush warm-up")
    print(cmd)
    if args.json:
        out = {"model": model.__dict__, "hardware": hw.__dict__, "num_gpus": args.num_gpus,
               "max_batch_size": args.max_batch_size, "best": best.to_dict(),
               "command": cmd, "rows": [r.to_dict() for r in rows],
               "profile": args.profile, "profile_notes": notes,
               "ddp_bucket_size": args.ddp_bucket_size, "warmup": warmup,
               "fastest_steady_state": fastest.to_dict(),
               "passed_over_2bw": passed[0].to_dict() if passed is not None else None}
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1))
        except OSError as exc:
            print(f"plan.py: error: --json {args.json}: cannot write it "
                  f"({exc.strerror or exc})", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(run)

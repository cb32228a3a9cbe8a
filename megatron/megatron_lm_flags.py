"""Flags of Megatron-LM's scripts that this trainer does not take under that name.

Megatron-LM's example and users' scripts (2020 to now) pass flags this parser renamed,
flags that only pick a kernel, a launcher detail or a log line, and flags of features
not built here.  A script run as it is either trains the model it describes, with a
note of what was read differently, or stops before any rank waits with one line naming
every flag it cannot honour and why -- never argparse's "unrecognized arguments".

* ``RENAMED``: an older Megatron-LM name of one of our flags, same value and meaning.
  The command line is rewritten before parsing (``rewrite_argv``).
  ``--checkpoint-activations`` (Megatron-LM's 2020-2021 switch: every transformer
  layer recomputed in the backward, ``--checkpoint-num-layers`` at a time) becomes
  ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``.
* ``IGNORED``: accepted and changes nothing here, because it is already how this
  trainer works, or it only picks a kernel, a launcher detail or a log destination.
* ``REFUSED``: a feature not built here that changes the model, the data, the
  optimizer's arithmetic or what fits in memory.  Running without it would train
  something else than the script asks for, so the run stops.

Some value flags are ignored for the value that is this trainer's behaviour and
refused for the others (``--data-impl mmap`` against ``--data-impl lazy``).

``python -m megatron.megatron_lm_flags`` prints the tables as Markdown
(docs/megatron_lm_flags.md is that output; a test keeps them equal).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

RENAMED: Dict[str, str] = {
    "--model-parallel-size": "--tensor-model-parallel-size",
    "--override-lr-scheduler": "--override-opt_param-scheduler",
    "--use-checkpoint-lr-scheduler": "--use-checkpoint-opt_param-scheduler",
    "--min-scale": "--min-loss-scale",
    "--batch-size": "--micro-batch-size",
    "--warmup": "--lr-warmup-fraction",
    "--encoder-seq-length": "--seq-length",
    "--checkpoint-num-layers": "--recompute-num-layers",
    "--activations-checkpoint-method": "--recompute-method",
    "--activations-checkpoint-num-layers": "--recompute-num-layers",
}
"""Megatron-LM's older name -> this parser's name (same value, same meaning)."""

CHECKPOINT_ACTIVATIONS = "--checkpoint-activations"
LAUNCHER_FLAGS = ("--local-rank", "--local_rank")
"""Added by ``python -m torch.distributed.launch`` (without --use-env); the rank is read
from the environment (LOCAL_RANK), which the launcher sets as well."""


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron-LM flag this parser accepts only to ignore or refuse it.

    ``nargs``: 0 for a switch, None for one value, else argparse's nargs.
    ``ok_values``: for a value flag, the values that are this trainer's behaviour
    (ignored); any other value is refused with ``refused_why``.  Empty: every value
    is ``kind``."""

    name: str
    kind: str  # "ignored" or "refused"
    why: str
    nargs: Optional[object] = 0
    ok_values: Tuple[str, ...] = ()
    refused_why: str = ""

    @property
    def dest(self) -> str:
        return "megatron_lm_" + self.name.lstrip("-").replace("-", "_").lower()

    def verdict(self, value) -> Tuple[str, str]:
        """(kind, reason) for this flag given ``value``."""
        if self.ok_values:
            text = value if isinstance(value, str) else " ".join(map(str, value))
            if text in self.ok_values:
                return "ignored", self.why
            return "refused", self.refused_why
        return self.kind, self.why


_FUSION = "picks a fused kernel of Megatron-LM: none here, the arithmetic is the same"
_GELU_FUSION = ("Megatron-LM's fused bias-GeLU (on by default there) computes the tanh "
                "approximation; the MLP here computes exact GeLU unless --openai-gelu "
                "(the tanh form): add --openai-gelu for Megatron-LM's default arithmetic "
                "(activations differ by at most 4.7e-4)")

FLAGS: Tuple[CompatFlag, ...] = (
    # ---- already how this trainer works
    CompatFlag("--data-impl", "ignored", "datasets are Megatron's mmap format (the only one read)",
               nargs=None, ok_values=("mmap", "infer"),
               refused_why="the old lazy/cached IndexedDataset format is not read, "
                           "preprocess again with tools/preprocess_data.py (mmap format)"),
    CompatFlag("--DDP-impl", "ignored", "gradients are all-reduced by this trainer's own "
               "bucketed, backward-overlapped reduction", nargs=None),
    CompatFlag("--overlap-grad-reduce", "ignored",
               "data-parallel gradient all-reduce already overlaps the backward pass"),
    CompatFlag("--attention-softmax-in-fp32", "ignored", "the attention softmax is always fp32"),
    CompatFlag("--apply-query-key-layer-scaling", "ignored",
               "an fp16 overflow guard, and the softmax here is fp32, so the result is the same"),
    CompatFlag("--no-query-key-layer-scaling", "ignored", "no query-key layer scaling is done"),
    CompatFlag("--check-for-nan-in-loss-and-grad", "ignored",
               "non-finite losses and gradients are always checked (--max-consecutive-skipped-steps)"),
    CompatFlag("--log-throughput", "ignored",
               "Megatron-LM's throughput per GPU (TFLOP/s/GPU) is in every log line"),
    CompatFlag("--fp16-lm-cross-entropy", "ignored",
               "the language-model loss is computed in fp32 (slightly more accurate)"),
    CompatFlag("--use-cpu-initialization", "ignored",
               "weights are always drawn whole and then sliced, so they are the same for "
               "every tensor-parallel size (what this flag gives in Megatron-LM)"),
    CompatFlag("--apply-layernorm-1p", "refused",
               "zero-centred LayerNorm weights (weight + 1) are not built here"),
    CompatFlag("--no-save-rng", "ignored", "RNG states are always saved"),
    CompatFlag("--async-save", "ignored", "checkpoints are written synchronously"),
    CompatFlag("--dataloader-type", "ignored", "the sampler is Megatron's 'single' one",
               nargs=None, ok_values=("single",),
               refused_why="only the 'single' (sequential) pretraining sampler is built"),
    CompatFlag("--context-parallel-size", "ignored", "no context parallelism is the default",
               nargs=None, ok_values=("1",), refused_why="context parallelism is not built"),
    CompatFlag("--expert-model-parallel-size", "ignored", "no expert parallelism is the default",
               nargs=None, ok_values=("1",),
               refused_why="mixture-of-experts models are not built"),
    CompatFlag("--vocab-extra-ids", "ignored", "no extra ids is the default", nargs=None,
               ok_values=("0",), refused_why="extra sentinel ids (T5) are not built"),
    # ---- kernels, implementations, memory housekeeping
    CompatFlag("--no-masked-softmax-fusion", "ignored", _FUSION),
    CompatFlag("--no-bias-gelu-fusion", "ignored",
               "Megatron-LM's unfused GeLU is erf's exact GeLU, which the MLP here computes "
               "unless --openai-gelu"),
    CompatFlag("--no-bias-dropout-fusion", "ignored", _FUSION),
    CompatFlag("--no-bias-swiglu-fusion", "ignored", _FUSION),
    CompatFlag("--no-rope-fusion", "ignored", _FUSION),
    CompatFlag("--no-gradient-accumulation-fusion", "ignored", _FUSION),
    CompatFlag("--no-persist-layer-norm", "ignored", _FUSION),
    CompatFlag("--no-async-tensor-model-parallel-allreduce", "ignored", _FUSION),
    CompatFlag("--masked-softmax-fusion", "ignored", _FUSION),
    CompatFlag("--scaled-masked-softmax-fusion", "ignored", _FUSION),
    CompatFlag("--scaled-upper-triang-masked-softmax-fusion", "ignored", _FUSION),
    CompatFlag("--bias-gelu-fusion", "ignored", _GELU_FUSION),
    CompatFlag("--bias-dropout-fusion", "ignored", _FUSION),
    CompatFlag("--use-flash-attn", "ignored",
               "attention is torch's scaled_dot_product_attention, which picks flash "
               "attention where the device has it"),
    CompatFlag("--transformer-impl", "ignored",
               "this trainer's own transformer layers are used", nargs=None),
    CompatFlag("--use-mcore-models", "ignored", "this trainer's own model classes are used"),
    CompatFlag("--use-legacy-models", "ignored", "this trainer's own model classes are used"),
    CompatFlag("--empty-unused-memory-level", "ignored",
               "torch's caching allocator is left alone", nargs=None),
    CompatFlag("--mmap-warmup", "ignored", "dataset files are memory-mapped, not read ahead"),
    CompatFlag("--no-mmap-bin-files", "ignored", "dataset .bin files are always memory-mapped"),
    CompatFlag("--recompute-modules", "ignored",
               "core_attn is what --recompute-granularity selective recomputes here",
               nargs="+", ok_values=("core_attn",),
               refused_why="selective recomputation here checkpoints the core attention only "
                           "(core_attn)"),
    CompatFlag("--distribute-saved-activations", "ignored",
               "not built, so recomputation checkpoints are not split across tensor-parallel "
               "ranks (more memory per rank, same results)"),
    CompatFlag("--distribute-checkpointed-activations", "ignored",
               "not built, so recomputation checkpoints are not split across tensor-parallel "
               "ranks (more memory per rank, same results)"),
    # ---- logging this trainer does not do
    CompatFlag("--timing-log-level", "ignored",
               "per-phase timers are not printed in the log; --log-timers-to-tensorboard "
               "writes every phase the executor times (--timeline-file traces every "
               "pipeline action)", nargs=None),
    CompatFlag("--timing-log-option", "ignored",
               "per-phase timers are not printed in the log; --log-timers-to-tensorboard "
               "writes the logging rank's own times", nargs=None),
    CompatFlag("--wandb-project", "ignored",
               "Weights & Biases logging is not built (use --tensorboard-dir)", nargs=None),
    CompatFlag("--wandb-exp-name", "ignored",
               "Weights & Biases logging is not built (use --tensorboard-dir)", nargs=None),
    CompatFlag("--wandb-save-dir", "ignored",
               "Weights & Biases logging is not built (use --tensorboard-dir)", nargs=None),
    # ---- features not built here
    CompatFlag("--num-layers-per-virtual-pipeline-stage", "refused",
               "the interleaved schedule is not built, use --pipeline-schedule flush "
               "(1F1B) or 2bw", nargs=None),
    CompatFlag("--num-virtual-stages-per-pipeline-rank", "refused",
               "the interleaved schedule is not built, use --pipeline-schedule flush "
               "(1F1B) or 2bw", nargs=None),
    CompatFlag("--num-experts", "refused", "mixture-of-experts models are not built", nargs=None),
    CompatFlag("--fp8-format", "refused", "fp8 training is not built (--bf16, --fp16)",
               nargs=None),
    CompatFlag("--use-dist-ckpt", "refused",
               "torch_dist checkpoints are not written, tools/checkpoint_util.py converts "
               "this trainer's checkpoints (docs/checkpoint_conversion.md)"),
    CompatFlag("--ckpt-format", "refused",
               "torch_dist checkpoints are not written, tools/checkpoint_util.py converts "
               "this trainer's checkpoints (docs/checkpoint_conversion.md)", nargs=None),
    CompatFlag("--use-torch-fsdp2", "refused", "FSDP is not built"),
    CompatFlag("--tp-comm-overlap", "refused", "Transformer Engine's communication overlap "
               "is not built"),
    CompatFlag("--adlr-autoresume", "refused",
               "NVIDIA's ADLR autoresume is not built, --exit-signal-handler or "
               "--exit-duration-in-mins save and exit before a scheduler's time limit"),
    CompatFlag("--adlr-autoresume-interval", "refused",
               "NVIDIA's ADLR autoresume is not built, --exit-signal-handler or "
               "--exit-duration-in-mins save and exit before a scheduler's time limit",
               nargs=None),
    CompatFlag("--keep-last", "ignored",
               "read by finetuning only (tasks/main.py keeps each epoch's last incomplete "
               "batch); pretraining has no epochs to cut"),
)

TENSORBOARD_FLAGS: Tuple[Tuple[str, str, str], ...] = (
    ("--tensorboard-log-interval N", "1",
     "the per-iteration scalars are written on iterations divisible by N; "
     "`iteration-time` and `throughput` follow `--log-interval`, the validation scalars "
     "each evaluation; must be >= 1"),
    ("--tensorboard-queue-size N", "1000",
     "SummaryWriter's `max_queue`: events queued before an add flushes to disk; must be >= 1"),
    ("--no-log-learning-rate-to-tensorboard", "written",
     "no `learning-rate` (nor `decoupled-learning-rate`); Megatron-LM's own spelling "
     "`--no-log-learnig-rate-to-tensorboard` is accepted too"),
    ("--no-log-loss-scale-to-tensorboard", "written", "no `loss-scale`"),
    ("--log-batch-size-to-tensorboard", "not written", "`batch-size`: the iteration's "
     "global batch (it changes under a batch ramp-up)"),
    ("--log-world-size-to-tensorboard", "not written", "`world-size`: the number of ranks"),
    ("--log-validation-ppl-to-tensorboard", "not written",
     "`lm loss validation ppl` (exp of the loss, capped at exp(20)) at each evaluation"),
    ("--log-memory-to-tensorboard", "not written",
     "`mem-reserved-bytes`, `mem-allocated-bytes`, `mem-max-allocated-bytes`, "
     "`mem-allocated-count` of the logging rank's CUDA device (torch.cuda.memory_stats); "
     "a CPU run writes none and prints one warning"),
    ("--log-timers-to-tensorboard", "not written",
     "`iteration-time` and `throughput` at each log line, and per-phase seconds per "
     "iteration since the last log line: `forward-compute-time`, `backward-compute-time`, "
     "`forward-send-time`, `forward-recv-time`, `backward-send-time`, `backward-recv-time`, "
     "`all-grads-sync-time` (the gradient reduction action), `optimizer-time` (the step "
     "action) and `forward-backward-time` (all but the step): the wall time of the last "
     "rank's own pipeline actions, not Megatron-LM's maximum over ranks; pretraining only"),
)
"""Megatron-LM's TensorBoard selection flags, which this parser honours: (flag, default,
effect) for docs/megatron_lm_flags.md."""

PROFILE_FLAGS: Tuple[Tuple[str, str, str], ...] = (
    ("--profile", "off",
     "profile batches `--profile-step-start` <= t < `--profile-step-end` (the log's 0-based "
     "iterations) on `--profile-ranks`; the window's edges are optimizer steps, so no "
     "pipeline drains for it"),
    ("--use-pytorch-profiler", "off",
     "torch.profiler (CPU, and CUDA on a CUDA device; shapes and stacks) writes "
     "`<host>_rank<R>.<ns>.pt.trace.json` under `--tensorboard-dir`, or under this "
     "trainer's `--profile-dir` (no tensorboard package needed); without it the window is "
     "`cudaProfilerStart`/`Stop` with NVTX ranges for `nsys profile "
     "--capture-range=cudaProfilerApi`, refused on CPU ranks"),
    ("--profile-step-start N", "10", "first profiled batch; must be below `--train-iters`"),
    ("--profile-step-end N", "12", "profiling stops once this many batches are done "
     "(exclusive); must exceed `--profile-step-start`"),
    ("--profile-ranks R ...", "0", "global ranks that profile; each must be a rank of the "
     "run"),
)
"""Megatron-LM's profiler flags, which this parser honours (``megatron/profiling.py``):
(flag, default, effect) for docs/megatron_lm_flags.md."""

GC_FLAGS: Tuple[Tuple[str, str, str], ...] = (
    ("--manual-gc", "off",
     "Python's automatic garbage collection is off while the run trains (restored after); "
     "every rank collects after the same iterations instead (each stage after its own "
     "step of that iteration: under 2BW, which does not drain, the stages' pauses "
     "overlap only in part), not whenever its own allocation counters say"),
    ("--manual-gc-interval N", "0", "with `--manual-gc`: a full collection after every N "
     "iterations (0: none between evaluations); must be >= 0"),
    ("--no-manual-gc-eval", "collects", "with `--manual-gc`: no full collection before each "
     "evaluation and young-generation one after it"),
)
"""Megatron-LM's manual garbage-collection flags, which this parser honours
(``megatron.training_loop``): (flag, default, effect) for docs/megatron_lm_flags.md."""

_BY_NAME = {f.name: f for f in FLAGS}
assert len(_BY_NAME) == len(FLAGS), "a Megatron-LM flag is listed twice"
assert not set(_BY_NAME) & set(RENAMED), "a flag is both renamed and ignored/refused"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the ignored/refused flags and the launcher's --local-rank, hidden from
    --help (the parser's epilog names docs/megatron_lm_flags.md).  A name the parser
    already has (an entry point that implements one of them) is left to it."""
    own = {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001
    g = parser.add_argument_group(
        "Megatron-LM compatibility",
        "flags of Megatron-LM's scripts read only to ignore or refuse them "
        "(docs/megatron_lm_flags.md)")
    for f in FLAGS:
        if f.name in own:
            continue
        if f.nargs == 0:
            g.add_argument(f.name, dest=f.dest, action="store_true", help=argparse.SUPPRESS)
        else:
            g.add_argument(f.name, dest=f.dest, nargs=f.nargs, default=None,
                           help=argparse.SUPPRESS)
    launcher = [n for n in LAUNCHER_FLAGS if n not in own]
    if launcher:
        g.add_argument(*launcher, dest="launcher_local_rank", type=int, default=None,
                       help=argparse.SUPPRESS)


def _given(argv: Sequence[str], name: str) -> bool:
    return any(tok == name or tok.startswith(name + "=") for tok in argv)


def _value(argv: Sequence[str], name: str) -> Optional[str]:
    """The (last) value of ``name`` in ``argv``, either form."""
    found = None
    for i, tok in enumerate(argv):
        if tok == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif tok.startswith(name + "="):
            found = tok.split("=", 1)[1]
    return found


def rewrite_argv(argv: Sequence[str], own: Sequence[str] = ()
                 ) -> Tuple[List[str], List[str], List[str]]:
    """(argv with RENAMED names replaced and --checkpoint-activations expanded, notes on
    what was read under another name, conflicts).  Values are never touched: a token is
    renamed only if it is the flag itself or ``--flag=value``.  ``own``: the parser's
    flags; an old name the parser defines itself is not renamed.

    Recomputation follows Megatron-LM's old semantics: ``--checkpoint-num-layers`` (or
    ``--activations-checkpoint-num-layers``) only sizes the chunks of
    ``--checkpoint-activations`` / ``--activations-checkpoint-method`` and is dropped
    without them; either of those defaults the chunk to 1 layer."""
    renames = {old: new for old, new in RENAMED.items() if old not in own}
    names = [tok.partition("=")[0] for tok in argv if tok.startswith("--")]
    conflicts: List[str] = []
    for new in dict.fromkeys(renames[n] for n in names if n in renames):
        olds = list(dict.fromkeys(n for n in names if renames.get(n) == new))
        direct = new in names
        if direct or len(olds) > 1:
            conflicts.append(" and ".join(olds + ([new] if direct else []))
                             + f" all mean {new} (keep one)")
    expand = CHECKPOINT_ACTIVATIONS not in own and CHECKPOINT_ACTIVATIONS in names
    method = "--recompute-method" in names or (
        "--activations-checkpoint-method" in renames and "--activations-checkpoint-method" in names)
    out: List[str] = []
    notes: List[str] = []
    skip_value = False
    for tok in argv:
        if skip_value:
            skip_value = False
            continue
        name, eq, value = tok.partition("=")
        if tok.startswith("--") and name in renames:
            if renames[name] == "--recompute-num-layers" and not (expand or method):
                notes.append(f"{name} dropped (Megatron-LM reads it only with "
                             f"{CHECKPOINT_ACTIVATIONS} or a recompute method)")
                skip_value = not eq
                continue
            out.append(renames[name] + eq + value)
            notes.append(f"{name} as {renames[name]}")
        elif tok == CHECKPOINT_ACTIVATIONS and expand:
            continue
        else:
            out.append(tok)
    if expand or (method and "--activations-checkpoint-method" in names):
        if expand and _value(out, "--recompute-granularity") == "selective":
            conflicts.append(f"{CHECKPOINT_ACTIVATIONS} (full recomputation) and "
                             "--recompute-granularity selective")
        added = []
        wanted = [("--recompute-granularity", "full")]
        wanted += [("--recompute-method", "uniform")] if expand else []
        wanted += [("--recompute-num-layers", "1")]
        for flag, value in wanted:
            if not _given(out, flag):
                out += [flag, value]
                added.append(f"{flag} {value}")
        what = CHECKPOINT_ACTIVATIONS if expand else "--activations-checkpoint-method"
        if added:
            notes.append(f"{what} adds {' '.join(added)}")
    return out, notes, conflicts


def verdicts(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """(ignored, refused): one 'flag [value] (reason)' text per flag given."""
    ignored, refused = [], []
    for f in FLAGS:
        value = getattr(args, f.dest, None)
        if value in (None, False):
            continue
        kind, why = f.verdict(value)
        shown = f.name if value is True else f"{f.name} {value if isinstance(value, str) else ' '.join(map(str, value))}"
        (ignored if kind == "ignored" else refused).append(f"{shown.strip()}: {why}")
    return ignored, refused


def _honoured_table(title: str, intro: str,
                    rows: Tuple[Tuple[str, str, str], ...]) -> List[str]:
    """A section of Megatron-LM flags this parser honours: (flag, default, effect) rows."""
    return (["", f"## {title}", "", intro, "", "| flag | default | effect |", "|---|---|---|"]
            + [f"| `{flag}` | {default} | {effect} |" for flag, default, effect in rows])


def markdown() -> str:
    """The tables of docs/megatron_lm_flags.md."""
    lines = ["# Megatron-LM flags in this trainer", "",
             "Generated by `python -m megatron.megatron_lm_flags` from "
             "`megatron/megatron_lm_flags.py`; a test keeps this file equal to its output.",
             "", "Every flag of `pretrain_gpt.py --help` that Megatron-LM also has keeps "
             "its name and meaning, with two exceptions: `--recompute-activations`, the "
             "paper's whole-stage recomputation here and selective recomputation in "
             "Megatron-LM (a run given it says so in a note), and `--log-params-norm`, the "
             "norm of the weights the step's gradient used here and of the updated ones in "
             "Megatron-LM. The others are this trainer's own (`--pipeline-schedule`, "
             "`--2bw-mitigation`, `--timeline-file`, ...; the README lists them). Scripts "
             "written for Megatron-LM may also pass the flags "
             "below. Rank 0 prints a `note:` line for the renamed flags and one for the "
             "ignored flags it was given. A refused flag stops the run with one `error:` "
             "line naming every refused flag, before any rank waits on another; so do two "
             "names given for one flag. A flag in none of these lists is an unknown flag: "
             "the error names it and the closest known flag.", "",
             "## Read under this trainer's name", "",
             "| Megatron-LM flag | read as |", "|---|---|"]
    for old, new in RENAMED.items():
        lines.append(f"| `{old}` | `{new}` |")
    lines.append(f"| `{CHECKPOINT_ACTIVATIONS}` | `--recompute-granularity full "
                 "--recompute-method uniform --recompute-num-layers 1` (each flag unless "
                 "given; with `--recompute-granularity selective` it is a conflict) |")
    lines.append("| `--activations-checkpoint-method` alone | also adds `--recompute-granularity "
                 "full` and `--recompute-num-layers 1` unless given, as Megatron-LM's default |")
    lines.append("| `--checkpoint-num-layers` / `--activations-checkpoint-num-layers` without "
                 f"`{CHECKPOINT_ACTIVATIONS}` or a method | dropped with a note (Megatron-LM "
                 "reads them only with one) |")
    lines.append(f"| `{' / '.join(LAUNCHER_FLAGS)}` | accepted from `torch.distributed.launch`; "
                 "the rank comes from `LOCAL_RANK` |")
    lines += _honoured_table(
        "TensorBoard scalars (as Megatron-LM selects them)",
        "These are flags of this parser with Megatron-LM's meaning and defaults "
        "(`megatron/training_log.py`). Always written with `--tensorboard-dir`: the "
        "losses (`lm loss`), `grad-norm` (none for a skipped iteration, as Megatron-LM's "
        "optimizer returns none), `num-zeros` and `params-norm` with their flags, "
        "`weight-decay` when it ramps, each with its ` vs samples` twin, and "
        "`lm loss validation` at each evaluation.", TENSORBOARD_FLAGS)
    lines += _honoured_table(
        "Profiling (as Megatron-LM)",
        "Flags of this parser with Megatron-LM's meaning and defaults "
        "(`megatron/profiling.py`). The window flags without `--profile` are an error "
        "(they would do nothing). A resumed run profiles what is left of the window; "
        "its trace's `ProfilerStep#k` count from the resumed run's first batch. A run "
        "that stops inside the window (--train-iters, --exit-interval, SIGTERM) ends its "
        "trace with its last trained batch, before the stop's checkpoint save. "
        "Finetuning (tasks/main.py) profiles one window across its epochs: one trace "
        "per profiled rank, the scores between epochs in it.", PROFILE_FLAGS)
    lines += _honoured_table(
        "Garbage collection (as Megatron-LM)",
        "Flags of this parser with Megatron-LM's meaning and defaults. The training "
        "steps themselves leave no cyclic garbage here, so a run with "
        "`--manual-gc-interval 0` does not grow. Finetuning keeps the collector off "
        "across its epochs and treats each epoch's score as an evaluation.", GC_FLAGS)
    for kind, title in (("ignored", "Accepted, no effect here"),
                        ("refused", "Refused: not built here")):
        lines += ["", f"## {title}", "", "| flag | values | why |", "|---|---|---|"]
        for f in FLAGS:
            if f.kind == kind:
                values = ("switch" if f.nargs == 0 else
                          f"{', '.join(f.ok_values)}; other values refused: {f.refused_why}"
                          if f.ok_values else "any")
                lines.append(f"| `{f.name}` | {values} | {f.why} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

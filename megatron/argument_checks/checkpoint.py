"""Checks of checkpoints, output directories and logging intervals: --use-checkpoint-args
(the model's shape and tokenizer taken from the --load checkpoint), a writable --save
that holds no other run's checkpoints, --tensorboard-dir, and the save, log, eval and
exit intervals.  Run by ``megatron.argument_checks.validate_args``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket

from megatron.argument_checks.errors import ArgumentError, flag_of, require


CHECKPOINT_ARGS = (
    ("model", "num_layers"), ("model", "hidden_size"), ("model", "num_attention_heads"),
    ("model", "ffn_hidden_size"), ("model", "seq_length"), ("model", "max_position_embeddings"),
    ("model", "layernorm_epsilon"), ("model", "openai_gelu"),
    ("model", "normalization"), ("model", "position_embedding_type"), ("model", "rotary_base"),
    ("model", "rotary_percent"), ("model", "rope_scaling"), ("model", "rope_scaling_factor"),
    ("model", "rotary_interleaved"), ("model", "rotary_seq_len_interpolation_factor"),
    ("model", "swiglu"), ("model", "squared_relu"),
    ("model", "apply_residual_connection_post_layernorm"),
    ("model", "qk_layernorm"), ("model", "add_qkv_bias"),
    ("model", "kv_channels"),
    ("model", "untie_embeddings_and_output_weights"),
    ("data", "tokenizer_type"), ("data", "vocab_file"), ("data", "merge_file"),
    ("data", "tokenizer_model"), ("data", "vocab_size"), ("data", "make_vocab_size_divisible_by"),
)
"""(config section, flag dest) that --use-checkpoint-args reads from the checkpoint, as
Megatron-LM's load_args_from_checkpoint: the model's shape and its tokenizer.  Not the
precision flags (--bf16, --fp32-residual-connection): they change no weight, and a run
may resume a checkpoint in another precision."""


_PATH_ARGS = ("vocab_file", "merge_file", "tokenizer_model")


def apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: each CHECKPOINT_ARGS flag the command line did not give
    takes the --load checkpoint's recorded value (the command line wins where given).

    As Megatron-LM: without --load, or with no checkpoint there yet (the first run of a
    restart loop), the command line's flags are used, with a note.  A recorded vocabulary
    or tokenizer file that is not on this machine is not taken (the note says so)."""
    if not getattr(args, "use_checkpoint_args", False):
        return
    from megatron.checkpoint_discovery import find_checkpoint, read_saved_config
    from megatron.errors import CheckpointError

    notes = args.megatron_lm_notes = getattr(args, "megatron_lm_notes", [])
    head = "note: --use-checkpoint-args: "
    try:
        if args.load is None or find_checkpoint(args.load).iteration is None:
            notes.append(head + ("no --load" if args.load is None else
                                 f"no checkpoint in --load {args.load} yet")
                         + "; using the command line's flags")
            return
        iteration, config = read_saved_config(args.load)
    except CheckpointError as exc:
        raise ArgumentError(f"--use-checkpoint-args: {exc}") from None
    taken, left = [], []
    given = getattr(args, "flags_given", set())
    for section, dest in CHECKPOINT_ARGS:
        saved = (config.get(section) or {}).get(dest)
        flag = flag_of(dest)
        if saved is None or flag in given or getattr(args, dest, None) == saved:
            continue
        if dest in _PATH_ARGS and not os.path.exists(str(saved)):
            left.append(f"{flag} {saved} (not on this machine)")
            continue
        setattr(args, dest, saved)
        taken.append(flag if saved is True else f"{flag} {saved}")
    model = config.get("model") or {}
    # two fields whose flags are not their names: a recorded GQA and a model without biases
    groups, heads = model.get("num_query_groups"), model.get("num_attention_heads")
    if (isinstance(groups, int) and groups != heads and not given & {
            "--group-query-attention", "--num-query-groups"}):
        args.group_query_attention, args.num_query_groups = True, groups
        taken.append(f"--group-query-attention --num-query-groups {groups}")
    if model.get("add_bias_linear") is False and "--disable-bias-linear" not in given \
            and args.add_bias_linear:
        args.add_bias_linear = False
        taken.append("--disable-bias-linear")
    notes.append(head + f"from --load {args.load} (iteration {iteration}): "
                 + (", ".join(taken) if taken else "nothing the command line did not already say")
                 + (f"; not taken: {', '.join(left)}" if left else ""))


def check_writable_dir(flag: str, path: str) -> None:
    """An unwritable --save is found now rather than after hours of training: a probe
    file is written (then deleted) in ``path``, or, when ``path`` does not exist yet, in
    the nearest directory above it that does (the run creates ``path`` when it starts
    training).  Validation leaves nothing behind, so a command line that fails a later
    check does not leave an empty directory."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == os.path.abspath(path) else f"is under the file {existing}"
        raise ArgumentError(f"{flag} {path} is not a writable directory (it {what})")
    probe = os.path.join(existing, f".write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        where = "" if existing == os.path.abspath(path) else f": cannot create it in {existing}"
        raise ArgumentError(f"{flag} {path} is not a writable directory ({reason}{where})"
                            ) from None


def _check_save_holds_no_other_run(args: argparse.Namespace) -> None:
    """A run that trains into a --save directory holding checkpoints must resume from
    them: a fresh run would replace their iterations one by one and move the tracker
    file back to its own (worse) ones."""
    from megatron.checkpoint_discovery import existing_checkpoints, newest_iteration

    resumes = (args.load is not None
               and os.path.realpath(args.load) == os.path.realpath(args.save))
    if args.skip_train or (resumes and not args.finetune):
        return
    if resumes:  # --finetune starts again at iteration 0 from --load's weights
        newest = newest_iteration(args.save)
        require(not newest, f"--finetune with --load and --save both {args.save}: a "
                f"finetuning run counts again from iteration 0 and would overwrite the "
                f"checkpoints there (up to iteration {newest}); choose another --save "
                f"directory")
        return  # an imported checkpoint (iteration 0 only) keeps its directory
    found = existing_checkpoints(args.save)
    if found is not None:
        raise ArgumentError(
            f"--save {args.save} already holds checkpoints ({found}) and this run does not "
            f"resume from them (--load {args.load or 'not given'}); a new run would overwrite "
            f"them: pass --load {args.save} to continue from the latest, or choose an empty "
            f"--save directory")


def check_checkpoint_and_logging(args: argparse.Namespace) -> None:
    if args.save is not None:
        check_writable_dir("--save", args.save)
        _check_save_holds_no_other_run(args)
    if args.tensorboard_dir is not None:
        check_writable_dir("--tensorboard-dir", args.tensorboard_dir)
        require(importlib.util.find_spec("tensorboard") is not None,
                f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard package, "
                "which is not installed: pip install tensorboard (or drop the flag"
                + ("; --use-pytorch-profiler writes its traces to --profile-dir without it)"
                   if getattr(args, "use_pytorch_profiler", False) else ")"))
    require(args.max_consecutive_skipped_steps >= 0,
            f"--max-consecutive-skipped-steps must be >= 0 (0 disables the limit), got "
            f"{args.max_consecutive_skipped_steps}")
    if args.save_interval is not None:
        require(args.save is not None, "--save-interval needs --save (a checkpoint directory)")
        require(args.save_interval > 0, f"--save-interval must be positive, got {args.save_interval}")
    for dest in ("tensorboard_log_interval", "tensorboard_queue_size"):
        v = getattr(args, dest, None)
        if v is not None:  # an entry point's own parser may lack them
            require(v >= 1, f"{flag_of(dest)} must be >= 1, got {v}")
    for dest in ("log_interval", "eval_interval"):
        v = getattr(args, dest)
        require(v > 0, f"{flag_of(dest)} must be positive, got {v}")
    require(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.exit_interval is not None:
        require(args.exit_interval > 0, f"--exit-interval must be positive, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None:
        require(args.exit_duration_in_mins > 0,
                f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    if args.exit_on_missing_checkpoint:
        require(args.load is not None, "--exit-on-missing-checkpoint needs --load")
        from megatron.checkpoint_discovery import existing_checkpoints

        require(os.path.isdir(args.load) and existing_checkpoints(args.load) is not None,
                f"--exit-on-missing-checkpoint: --load {args.load} holds no checkpoint "
                f"({'not a directory' if not os.path.isdir(args.load) else 'no iter_* directory or tracker file'})")

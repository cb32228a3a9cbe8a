"""Validation of the parsed command line (``megatron.arguments`` parses it and turns it
into configs).

``validate_args`` runs before ``torch.distributed`` is initialised, identically on every
rank, so a bad command line makes every rank exit at once with the same one-line
message (an ``ArgumentError`` naming the flags) instead of leaving some ranks waiting in
a collective.  It also fills the values derived from others (data-parallel size, global
batch, iterations from samples, a checkpoint's recorded arguments).

This module holds the entry point and the run-wide checks (required flags, finite
floats, Megatron-LM flags); the checks of each concern are its submodules: ``model``
(shape, block options, recomputation), ``parallel`` (parallel layout, batch sizes),
``optimizer`` (precision, optimizer, LR schedule), ``data`` (data, tokenizer) and
``checkpoint`` (checkpoints, output directories, logging); ``errors`` holds
``ArgumentError`` and the helpers they raise it through.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from megatron import megatron_lm_flags
from megatron.argument_checks.checkpoint import (
    apply_checkpoint_args, check_checkpoint_and_logging)
from megatron.argument_checks.data import check_data, check_tokenizer
from megatron.argument_checks.model import check_model, check_recompute
from megatron.argument_checks.optimizer import check_optimizer, check_precision
from megatron.argument_checks.parallel import check_batches, check_parallel
from megatron.argument_checks.profiling import check_manual_gc, check_profile
from megatron.argument_checks.errors import ArgumentError, flag_of, require, require_positive


def _check_required(args: argparse.Namespace) -> None:
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        require(getattr(args, dest) is not None, f"{flag_of(dest)} is required")
    require_positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "global_batch_size", "ffn_hidden_size",
                     "max_position_embeddings", "make_vocab_size_divisible_by",
                     "init_method_std", "layernorm_epsilon", "train_iters", "train_samples")
    require(not (args.train_iters is not None and args.train_samples is not None),
            "--train-iters and --train-samples are mutually exclusive; give one")
    if not args.skip_train:
        require(args.train_iters is not None or args.train_samples is not None,
                "exactly one of --train-iters or --train-samples is required (or --skip-train)")
        require(args.lr is not None, "--lr is required for training (or --skip-train)")


def _check_finite_floats(args: argparse.Namespace) -> None:
    """No float flag may be inf or nan (``--lr inf`` parses as a float and would train
    straight to NaN weights).  Covers entry-point flags too: every float in ``args``."""
    for dest, value in sorted(vars(args).items()):
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise ArgumentError(f"{flag_of(dest)} must be a finite number, got {v}")


def _check_megatron_lm_flags(args: argparse.Namespace) -> None:
    """Megatron-LM flags given under two names, or of features not built here, stop the
    run (every refused flag in one line); the ignored and renamed ones become one note
    (``args.megatron_lm_notes``, printed by rank 0 once the command line is valid)."""
    conflicts = getattr(args, "megatron_lm_conflicts", [])
    require(not conflicts, "conflicting Megatron-LM flags: " + "; ".join(conflicts))
    ignored, refused = megatron_lm_flags.verdicts(args)
    require(not refused, ("a Megatron-LM flag" if len(refused) == 1 else "Megatron-LM flags")
            + " this trainer does not implement (remove or change; docs/megatron_lm_flags.md): "
            + "; ".join(refused))
    if getattr(args, "launcher_local_rank", None) is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.launcher_local_rank)  # a launcher of old
    notes = getattr(args, "megatron_lm_notes", [])
    if ignored:
        notes.append("note: Megatron-LM flags accepted with no effect here: " + "; ".join(ignored))
    if getattr(args, "recompute_activations", False):
        notes.append("note: --recompute-activations is the paper's whole-stage recomputation "
                     "here; Megatron-LM's means --recompute-granularity selective")
    args.megatron_lm_notes = notes


# Each validator checks one concern, fills the derived values it owns, and raises
# ArgumentError on the first problem.  Their order matters: later ones use values
# derived by earlier ones (data-parallel size, global batch, train iterations).

def validate_args(args: argparse.Namespace, world_size: int,
                  default_tokenizer: Optional[str] = None) -> argparse.Namespace:
    """Check ``args`` for a run on ``world_size`` ranks and fill the derived values.

    ``default_tokenizer``: the entry point's --tokenizer-type when the flag is absent but
    a vocabulary is given (Megatron-LM's ``args_defaults`` of pretrain_gpt.py and
    pretrain_bert.py).

    Derived (set on ``args``): world_size, data_parallel_size, num_microbatches,
    ffn_hidden_size, max_position_embeddings, global_batch_size, train_iters (from
    --train-samples), lr_decay_iters, lr_warmup_iters, recompute_granularity,
    tokenizer_type (NullTokenizer for a bare --vocab-size), params_dtype.
    Raises ``ArgumentError`` naming the flag(s) on the first inconsistency.
    """
    apply_checkpoint_args(args)
    _check_megatron_lm_flags(args)
    _check_required(args)
    _check_finite_floats(args)
    check_model(args)
    check_parallel(args, world_size)
    check_batches(args)
    check_precision(args)
    check_optimizer(args)
    check_data(args)
    check_tokenizer(args, default_tokenizer)
    check_recompute(args)
    check_checkpoint_and_logging(args)
    check_profile(args, world_size)
    check_manual_gc(args)
    return args

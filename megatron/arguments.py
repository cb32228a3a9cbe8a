"""Command-line flags (Megatron's names), their validation (``megatron.argument_checks``),
and translation to configs.

With ``megatron.argument_checks`` it is the only code that knows about argparse.  Entry
points call ``parse_and_validate()`` once; it returns the raw namespace (for
entry-point specific flags) and a typed ``MegatronConfig`` that core code receives
explicitly.  This module holds the parser and that entry point; the flags themselves
are ``megatron.argument_flags``, and the builder of each config section is
``megatron.argument_configs``.

Validation runs before ``torch.distributed`` is initialised, identically on every rank,
so a bad command line makes every rank exit at once with the same one-line message
instead of leaving some ranks waiting in a collective.
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Callable, List, Optional, Sequence, Tuple

from megatron import argument_flags, megatron_lm_flags
from megatron.argument_configs import (
    data_config, model_config, optimizer_config, parallel_config, precision_config,
    training_config)
from megatron.argument_checks import validate_args  # the validation half
from megatron.argument_checks.errors import ArgumentError, require
from megatron.config import MegatronConfig
from megatron.errors import exit_once_per_node

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


# --------------------------------------------------------------------------- parsing

def _on_rank_zero() -> bool:
    """Rank 0 of a launch (or no launcher): the rank that prints what every rank would."""
    return os.environ.get("RANK", "0") == "0"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``error:`` line (with the closest known flag for
    an unknown one) printed by rank 0, not the whole usage text on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            message += _closest_flags(message.split(":", 1)[1].split(), self)
        exit_once_per_node(f"error: {message}; all flags: {self.prog} --help")


def _closest_flags(tokens: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """' (did you mean --x for --y, ...?)' for the unknown flags among ``tokens``."""
    known = [s for a in parser._actions for s in a.option_strings  # noqa: SLF001
             if a.help != argparse.SUPPRESS]
    hints = []
    for tok in tokens:
        name = tok.split("=", 1)[0]
        if name.startswith("--"):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            if close:
                hints.append(f"{close[0]} for {name}")
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def build_parser(extra_args_provider: Optional[ExtraArgsProvider] = None) -> argparse.ArgumentParser:
    """The full parser; ``extra_args_provider(parser) -> parser`` adds entry-point groups."""
    parser = OneLineParser(description="Megatron-style GPT/BERT training with PipeDream-2BW "
                                 "pipelines",
                     epilog="Scripts written for Megatron-LM may pass older names of these "
                            "flags and flags this trainer ignores or refuses: "
                            "docs/megatron_lm_flags.md lists them.", allow_abbrev=False)
    argument_flags.add_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    # last, so an entry point's own flag of the same name (a provider implementing one of
    # them) takes precedence over the compatibility entry
    megatron_lm_flags.add_arguments(parser)
    return parser


def parse_args(argv: Optional[List[str]] = None,
               extra_args_provider: Optional[ExtraArgsProvider] = None,
               ignore_unknown_args: bool = False) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``); no validation (see ``validate_args``).

    Megatron-LM's older flag names are read under ours first
    (``megatron_lm_flags.rewrite_argv``); a note in ``args.megatron_lm_notes`` lists
    them, and ``args.megatron_lm_conflicts`` any flag given under two names."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(extra_args_provider)
    own = {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001
    rewritten, renamed, conflicts = megatron_lm_flags.rewrite_argv(argv, own)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(rewritten)
    else:
        args = parser.parse_args(rewritten)
    args.megatron_lm_conflicts = conflicts
    for action in parser._actions:  # noqa: SLF001 - our flags first, then the compat ones
        long_names = [o for o in action.option_strings if o.startswith("--")]
        if long_names:
            _FLAG_NAMES.setdefault(action.dest, long_names[0])
            for option in action.option_strings:
                _OPTION_NAMES.setdefault(option, _FLAG_NAMES[action.dest])
    args.megatron_lm_notes = (["note: Megatron-LM's older flag names read as: "
                               + "; ".join(renamed)] if renamed else [])
    given = {t.split("=", 1)[0] for t in rewritten if t.startswith("--")}
    # a flag given under any of its names (--norm-epsilon) or through another flag with
    # the same destination (--use-rotary-position-embeddings) counts for all of them
    dests = {a.dest for a in parser._actions if given & set(a.option_strings)}  # noqa: SLF001
    args.flags_given = given | {s for a in parser._actions  # noqa: SLF001
                                if a.dest in dests for s in a.option_strings}
    return args


# ----------------------------------------------------------------------- translation

def build_config(args: argparse.Namespace) -> MegatronConfig:
    """Translate validated ``args`` into typed configs.

    ``model.padded_vocab_size`` stays 0: the trainer fills it once the tokenizer exists.
    Entry-point flags (e.g. BERT's ``num_tokentypes``) are picked up when present.
    """
    model = model_config(args)
    parallel = parallel_config(args)
    precision = precision_config(args)
    optimizer = optimizer_config(args)
    data = data_config(args)
    training = training_config(args)
    # what initialize_distributed compares across ranks
    parallel.command_line = command_line_values(args)
    return MegatronConfig(model=model, parallel=parallel, precision=precision,
                          optimizer=optimizer, data=data, training=training)


def _world_size_from_env() -> int:
    """torchrun's WORLD_SIZE.  The rest of its variables (RANK, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) are checked by ``initialize_distributed``, still before any rank waits."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ArgumentError(f"environment variable WORLD_SIZE must be an integer, got '{raw}'") from None


PER_RANK_DESTS = frozenset({"launcher_local_rank", "debug", "flags_given",
                            "megatron_lm_notes", "megatron_lm_conflicts", "data_cache_path"})
"""What may differ between the ranks of one job: the legacy launcher's --local-rank,
--debug, the parser's bookkeeping, and --data-cache-path (every rank builds or reads the
index caches itself, so a node may keep them on its own disk under its own path)."""

_FLAG_NAMES: dict = {}
"""dest -> the flag that sets it (its first --long name), filled by every parse_args."""
_OPTION_NAMES: dict = {}
"""each option string (--norm-epsilon) -> that name of its dest's flag (--layernorm-epsilon)."""


def command_line_values(args: argparse.Namespace) -> dict:
    """What every rank of a job must agree on: each validated value (the flags and what
    was derived from them, a checkpoint's --use-checkpoint-args values included) by its
    flag's name, as text, and the flags this rank's command line gave.  Compared across
    ranks at start-up (``megatron.initialize.check_same_command_line``)."""
    values = {}
    for dest, value in vars(args).items():
        if dest in PER_RANK_DESTS:
            continue
        name = _FLAG_NAMES.get(dest, f"{dest} (derived)")
        text = value if isinstance(value, str) else repr(value)
        # an object without a value repr (<... at 0x7f...>) differs on every rank
        values[name] = type(value).__name__ if " at 0x" in text else text
    given = sorted({_OPTION_NAMES.get(a, a) for a in getattr(args, "flags_given", ())})
    return {"values": values, "given": given}


def parse_and_validate(argv: Optional[List[str]] = None,
                       extra_args_provider: Optional[ExtraArgsProvider] = None,
                       world_size: Optional[int] = None,
                       default_tokenizer: Optional[str] = None,
                       per_token_loss: bool = False,
                       ) -> Tuple[argparse.Namespace, MegatronConfig]:
    """Parse, validate and translate; on a bad command line print one line and exit(2).

    Runs before any process group exists, identically on every rank, so every rank
    of a bad launch stops at once.  ``world_size`` defaults to torchrun's WORLD_SIZE.
    ``per_token_loss``: the entry point's loss function can report loss sums and token
    counts (--calculate-per-token-loss; refused elsewhere).
    """
    args = parse_args(argv, extra_args_provider)
    try:
        if world_size is None:
            world_size = _world_size_from_env()
        require(per_token_loss or not args.calculate_per_token_loss,
                "--calculate-per-token-loss is built for pretrain_gpt.py only: this entry "
                "point's loss is a mean per microbatch")
        validate_args(args, world_size, default_tokenizer)
        config = build_config(args)
    except ArgumentError as err:
        from megatron.entry import debug_requested

        if args.debug or debug_requested([]):
            import traceback

            traceback.print_exc()
        # every rank's verdict: one line a node, not one a rank; with the notes that say
        # where --use-checkpoint-args took values from
        exit_once_per_node(*[note for note in getattr(args, "megatron_lm_notes", [])
                             if note.startswith("note: --use-checkpoint-args:")],
                           f"error: {err}")
    if _on_rank_zero():
        for note in getattr(args, "megatron_lm_notes", []):
            print(note, file=sys.stderr)
    return args, config

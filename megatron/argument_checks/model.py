"""Checks of the model's shape and block options (RoPE, GQA, the MLP activation) and of
activation recomputation; they fill the derived ffn_hidden_size, max_position_embeddings,
query_groups and recompute_granularity.  Run by ``megatron.argument_checks.validate_args``.
"""
from __future__ import annotations

import argparse
import math

from megatron.argument_checks.errors import flag_of, require


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default MLP width: 4h, or with SwiGLU (three matrices instead of
    two) 2/3 of that, rounded down to a multiple of 64, for about the same parameters."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


def check_model(args: argparse.Namespace) -> None:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    require(args.seq_length <= args.max_position_embeddings,
            f"--seq-length ({args.seq_length}) must be <= --max-position-embeddings "
            f"({args.max_position_embeddings})")
    if args.kv_channels is None:
        require(args.hidden_size % args.num_attention_heads == 0,
                f"--hidden-size ({args.hidden_size}) must be divisible by "
                f"--num-attention-heads ({args.num_attention_heads}), or give --kv-channels")
    else:
        require(args.kv_channels >= 1, f"--kv-channels must be >= 1, got {args.kv_channels}")
    for dest in ("hidden_dropout", "attention_dropout"):
        p = getattr(args, dest)
        require(0.0 <= p < 1.0, f"{flag_of(dest)} must be in [0, 1), got {p}")
    _check_architecture(args)


def _check_architecture(args: argparse.Namespace) -> None:
    """The Llama-style block options (RoPE, GQA, ...) and what they need."""
    rope = args.position_embedding_type == "rope"
    require(rope or not args.no_position_embedding,
            "--no-position-embedding: a model without any position information is not "
            "built here; use --position-embedding-type rope (which has no position table)")
    if args.group_query_attention:
        g, a = args.num_query_groups, args.num_attention_heads
        require(g >= 1 and a % g == 0,
                f"--num-query-groups ({g}) must divide --num-attention-heads ({a})")
        args.query_groups = g
    else:
        args.query_groups = args.num_attention_heads
    if rope:
        require(0.0 < args.rotary_percent <= 1.0,
                f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
        head = args.kv_channels or args.hidden_size // args.num_attention_heads
        require(int(head * args.rotary_percent) >= 2,
                f"--rotary-percent {args.rotary_percent} of the head size {head} "
                f"(--kv-channels, or --hidden-size / --num-attention-heads) leaves fewer "
                f"than 2 dimensions to rotate")
        require(args.rotary_base > 0, f"--rotary-base must be positive, got {args.rotary_base}")
    if args.rope_scaling:
        require(rope, "--use-rope-scaling needs --position-embedding-type rope")
        require(args.rope_scaling_factor >= 1.0,
                f"--rope-scaling-factor must be >= 1, got {args.rope_scaling_factor}")
    require(rope or not args.rotary_interleaved,
            "--rotary-interleaved needs --position-embedding-type rope")
    factor = args.rotary_seq_len_interpolation_factor
    if factor is not None:
        require(rope, "--rotary-seq-len-interpolation-factor needs "
                       "--position-embedding-type rope")
        require(math.isfinite(factor) and factor >= 1.0,
                f"--rotary-seq-len-interpolation-factor must be >= 1 (how many times "
                f"longer the context is stretched), got {factor}")
    given = [flag for flag, on in (("--squared-relu", args.squared_relu),
                                   ("--swiglu", args.swiglu),
                                   ("--openai-gelu", args.openai_gelu)) if on]
    require(len(given) < 2,
            f"{' and '.join(given)} are {'two' if len(given) == 2 else 'three'} MLP "
            f"activations: give one of them")


def check_recompute(args: argparse.Namespace) -> None:
    if args.recompute_activations:
        require(args.recompute_granularity in (None, "full"),
                "--recompute-activations means --recompute-granularity full; it conflicts "
                f"with --recompute-granularity {args.recompute_granularity}")
        require(args.recompute_method is None,
                "--recompute-activations (whole-stage recomputation here) cannot be combined "
                f"with --recompute-method {args.recompute_method} (layer checkpointing, which "
                "--checkpoint-activations also asks for): keep one of them")
        args.recompute_granularity = "full"
    method, n = args.recompute_method, args.recompute_num_layers
    if args.recompute_granularity == "selective":
        require(method is None, "--recompute-granularity selective cannot be combined with "
                "--recompute-method (layer checkpointing needs --recompute-granularity full)")
    if method is not None:
        require(args.recompute_granularity == "full",
                f"--recompute-method {method} needs --recompute-granularity full")
        require(n is not None, f"--recompute-method {method} needs --recompute-num-layers")
    if n is not None:
        require(method is not None, "--recompute-num-layers needs --recompute-method (uniform or block)")
        per_stage = max(args.stage_layer_counts)
        require(1 <= n <= per_stage,
                f"--recompute-num-layers ({n}) must be between 1 and the layers of the "
                f"largest pipeline stage ({per_stage})")

#!/usr/bin/env python
"""Profile one GPT transformer block, the embedding and the head on this device.

    PYTHONPATH=. python tools/profile_model.py --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --seq-length 64 --vocab-size 500 \\
        --micro-batch-sizes 1 2 4 8 --threads 1 --output profile.json
    python tools/plan.py --profile profile.json --num-gpus 4 --cluster cpu --max-batch-size 32

For each microbatch size b the three pieces a pipeline stage is made of are run as the
trainer runs them (``pretrain_gpt.get_batch`` and ``pretrain_gpt.loss_func``, the
model's own modules, the executor's ``StashTracker`` counting saved tensors), with
warm-up runs first and the median of the timed runs kept:

* ``block``: a ``ParallelTransformerLayer`` on an [s, b, h] input (the residual stream:
  float32 with --fp32-residual-connection under --fp16/--bf16, as a stage's layers take
  and return it, with a float32 gradient), timed as a chain of ``--chain-blocks``
  distinct layers (default min(num_layers, 4)) run back to back as a stage runs them,
  divided by their number.  On this project's 2-core CPU one layer
  timed alone on an input it had just seen ran 4% (the profiler's own runs) to 11% (a
  separate experiment) faster per layer than four chained ones, and the trainer's stages
  were slower still (bench/planner_validation.py);
* ``embedding`` (first stage): word + position embeddings (no position table with
  RoPE), tokens -> [s, b, h] (cast to the stream's dtype, as the model's);
* ``head`` (last stage): final norm (reading the stream: in float32 with a float32
  stream, its output cast to the weights' dtype, as ``ParallelTransformer``'s), logits
  against the word embedding (an untied output layer: its own weight), the
  vocab-parallel cross-entropy and the masked mean loss.

The model flags are the trainer's, the Llama-style block options included
(--normalization, --position-embedding-type, --swiglu, --group-query-attention
--num-query-groups, --disable-bias-linear, --add-qkv-bias,
--untie-embeddings-and-output-weights, --qk-layernorm, --use-rope-scaling
--rope-scaling-factor, --kv-channels), and --fp32-residual-connection (with --fp16/--bf16;
without them it changes nothing and is only recorded).
With RoPE the layers of a stage share one cos/sin table (``RotaryEmbedding``'s cache):
the block count leaves it out (it would otherwise be charged once per chained layer)
and ``rotary_table_bytes`` records it, charged once per stage (as the executor's
counter charges it: ``StashTracker.shared``).  The causal mask of
``--attention-backend unfused/local`` (one [s, s] bool tensor per stage, shared by its
microbatches) is left out of the block count the same way and not recorded: the planner
charges its s^2 bytes once per stage (``ModelSpec.causal_mask_bytes``), and each timed
stage below counts it once.

``--reset-attention-mask`` (GPT's document masks): every sample is cut into documents by
a few end-of-document ids (``EOD``, every quarter of a sample), ``pretrain_gpt.get_batch``
builds the [b, 1, s, s] document mask of each microbatch with
``ltor_masks_and_position_ids`` (``GPTTask`` set as the trainer sets it for the flag alone:
positions and loss mask unchanged), and the chain runs with it in the form its kernel reads
(``prepare_mask``: additive in the weights' dtype for the fused kernels, which on a GPU
then cannot use flash attention, or bool for the explicit softmax), made once per
microbatch as a stage makes it.  The mask is left out of the block count like the causal
one and recorded as ``attention_mask_bytes``, which the planner charges once per stage.  (--reset-position-ids is not taken: it would add only the
position ids the embedding keeps, (b - 1) s int64 values.)

Then, per stage kind (``whole``: embedding and head, d = 1; ``first``; ``middle``;
``last``), a ``GPTModel`` stage of ``--chain-blocks`` layers is run through
``pretrain_gpt.forward_step`` and its loss function, as the executor runs a microbatch
(``stages``; ``--no-stages`` skips it), with the flags above (a float32 stage input and
gradient, the document masks; ``GPTTask`` is restored afterwards).  What it takes beyond
the pieces it is made of (``Profile`` subtracts them) is the trainer's own work per
microbatch: building the batch (and its document mask), the model's wrappers and
transposes, the loss mask.  On this project's 2-core CPU
the pieces alone under-predicted a trainer's forward by about 12% at d = 1
(bench/planner_validation.py); on a GPU at b = 1 it is the host's launch work.

Measured per component: forward and backward seconds, as wall-clock time and as the
CPU time of the profiling thread (on a CPU shared with other processes the CPU time is
what the work costs when it has a core to itself; on CUDA use the wall clock, the CPU
only launches kernels); ``stash_bytes``, the bytes
autograd keeps for the backward pass (distinct storages, weights left out: exactly what
the pipeline executor counts per microbatch); on CUDA also the allocator's
``cuda_forward_peak_bytes`` (max_memory_allocated during the forward minus the memory
before it) and ``cuda_retained_bytes`` (allocated after the forward minus before:
saved tensors plus the output).  Plus the weight bytes of each component and the
optimizer step time over its parameters (the trainer's optimizer, fake gradients).

JSON schema (``megatron.pipeline.planner.profile.Profile.load`` reads it)::

    {"schema": "megatron-pipedream-profile/1",
     "device": {"type": "cpu"|"cuda", "name": str, "torch": str, "threads": int},
     "settings": {"warmup": int, "repeat": int, "statistic": "median", "seed": int,
                  "runs_per_sync": int, "chain_blocks": int},
     "model": {"kind": "gpt", "num_layers", "hidden_size", "num_attention_heads",
               "seq_length", "ffn_hidden_size", "vocab_size" (padded), "dtype",
               "dtype_bytes", "hidden_dropout", "attention_dropout", "optimizer",
               "cross_entropy_loss_fusion",
               "grad_bytes",  # 4 under bf16: the trainer accumulates gradients in fp32
               "normalization", "position_embedding_type", "rotary_base",
               "rotary_percent", "rope_scaling", "rope_scaling_factor", "swiglu",
               "qk_layernorm", "kv_channels", "num_query_groups", "add_bias_linear",
               "add_qkv_bias", "untie_embeddings_and_output_weights",
               "attention_backend",
               "fp32_residual_connection", "reset_attention_mask"},
               # ModelConfig's values (older profiles: absent, meaning the defaults;
               # kv_channels: the head size, h / a unless --kv-channels gave another);
               # the last two: the flags the profile ran with (older: absent, False)
     "weights": {"block_params", "block_bytes", "embedding_params", "embedding_bytes",
                 "head_params", "head_bytes",  # an untied output layer is the head's
                 "tied_embedding_params", "tied_embedding_bytes"},
                 # the last stage's copy of the word embedding when d > 1 (0 untied)
     "optimizer_step_s": {"fixed", "block", "embedding", "head", "tied_embedding"},
         # one step of a stage = fixed + its pieces' marginal costs (see below)
     "optimizer_step_cpu_s": {...the same, thread CPU time},
     "optimizer_step_calls_s": {"block", "blocks", "embedding", "head", "tied_embedding"},
         # the measured steps each piece's parameters alone ("blocks": the chain)
     "microbatches": [{"micro_batch_size": b,
                       "stage_input_bytes": s*b*h*stream_bytes,  # 4 with a float32
                                                                 # stream, else dtype_bytes
                       "data_bytes": b*(s+1)*8,   # int64 token ids of one microbatch
                       "rotary_table_bytes"?: 2*s*rotary_dim*dtype_bytes,  # RoPE only
                       "attention_mask_bytes"?: b*s*s*(dtype_bytes, 1 for bool),
                           # the document mask, with reset_attention_mask only
                       "block" | "embedding" | "head": {
                           "forward_s", "backward_s",            # wall clock
                           "forward_cpu_s", "backward_cpu_s",    # this thread's CPU time
                           "stash_bytes",
                           "forward_samples_s": [...], "backward_samples_s": [...],
                           "cuda_forward_peak_bytes"?, "cuda_retained_bytes"?},
                       "stages"?: {"whole" | "first" | "middle" | "last": {
                           "layers": int, ...the same timing and byte fields}}}, ...]}
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from megatron.config import ModelConfig  # noqa: E402
from megatron.model.transformer import ATTENTION_BACKENDS  # noqa: E402
from megatron.arguments import OneLineParser  # noqa: E402
from megatron.pipeline.planner.profile import ARCH_FIELDS, PIECES, SCHEMA  # noqa: E402
from megatron.pipeline.planner.measure import (optimizer_step_model,  # noqa: E402
                                               optimizer_step_time, param_count,
                                               trainer_grad_dtype, widen_grads)
from tools.profile_pieces import (STAGE_KINDS, EmbeddingPiece, HeadPiece,  # noqa: E402
                                  document_task, profile_pieces, profile_stages)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp64": torch.float64}


def block_params(config: ModelConfig) -> int:
    """Parameters of one transformer layer of ``config`` (the planner's closed form)."""
    from megatron.pipeline.planner.model_spec import ModelSpec
    return ModelSpec(num_layers=1, hidden_size=config.hidden_size,
                     num_attention_heads=config.num_attention_heads, seq_length=1,
                     vocab_size=1, ffn_hidden_size=config.ffn_hidden_size,
                     normalization=config.normalization, swiglu=config.swiglu,
                     qk_layernorm=config.qk_layernorm, kv_channels=config.kv_channels,
                     num_query_groups=config.num_query_groups,
                     add_bias_linear=config.add_bias_linear,
                     add_qkv_bias=config.add_qkv_bias).params_per_layer


def default_chain_blocks(config: ModelConfig, device: torch.device,
                         free_bytes: Optional[int] = None) -> int:
    """min(num_layers, 4) distinct layers, fewer on a GPU whose free memory (``free_bytes``,
    default: the device's) could not hold four layers' weights in a quarter of it: a
    model whose one layer barely fits on a small card still profiles."""
    chain = max(1, min(config.num_layers, 4))
    if device.type == "cuda" or free_bytes is not None:
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(device)
        dtype_bytes = torch.empty((), dtype=config.params_dtype).element_size()
        layer_bytes = block_params(config) * dtype_bytes
        chain = max(1, min(chain, int(0.25 * free_bytes) // max(1, layer_bytes)))
    return chain


def profile_model(config: ModelConfig, micro_batch_sizes: Sequence[int], *,
                  device: Optional[torch.device] = None, warmup: int = 2, repeat: int = 5,
                  seed: int = 1234, optimizer: str = "adam",
                  runs_per_sync: Optional[int] = None,
                  chain_blocks: Optional[int] = None, stages: bool = True,
                  reset_attention_mask: bool = False) -> Dict[str, Any]:
    """The profile (schema in the module docstring) of ``config`` on ``device``.

    ``runs_per_sync``: forwards (then backwards) queued per synchronisation in a timed
    sample (default 8 on CUDA, where the host runs ahead of the GPU, 1 on the CPU).
    ``chain_blocks``: distinct transformer layers timed back to back for the per-block
    cost (default min(num_layers, 4)).  ``stages``: also time whole stages of that many
    layers (the trainer's per-microbatch work beyond the pieces).
    ``reset_attention_mask``: run the blocks and stages with the trainer's document
    mask (--reset-attention-mask) instead of causal attention."""
    from megatron.model.transformer import ParallelTransformerLayer
    from megatron.tensor_parallel import TPInfo, model_parallel_seed

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    per_sync = (runs_per_sync if runs_per_sync is not None
                else 8 if device.type == "cuda" else 1)
    if per_sync < 1:
        raise ValueError(f"--runs-per-sync {per_sync}: expected at least 1")
    if not micro_batch_sizes or min(micro_batch_sizes) < 1:
        raise ValueError(f"--micro-batch-sizes {list(micro_batch_sizes)}: expected positive sizes")
    if warmup < 0 or repeat < 1:
        raise ValueError(f"--warmup {warmup} / --repeat {repeat}: need warmup >= 0, repeat >= 1")
    chain = default_chain_blocks(config, device) if chain_blocks is None else chain_blocks
    if chain < 1:
        raise ValueError(f"--chain-blocks {chain}: expected at least 1")
    if device.type == "cpu":
        from megatron.initialize import tune_host_malloc
        tune_host_malloc()  # as the trainer's CPU ranks run (process-wide)
    model_parallel_seed(seed, 0, device)
    blocks = nn.ModuleList(ParallelTransformerLayer(config, TPInfo.single(), i, seed=seed)
                           for i in range(chain)).to(device)
    block = blocks[0]
    embedding = EmbeddingPiece(config, seed).to(device)
    head = HeadPiece(config, seed).to(device)
    for m in (blocks, embedding, head):
        m.train()
        widen_grads(m, trainer_grad_dtype(config))
    with document_task(reset_attention_mask):
        rows = profile_pieces(config, blocks, embedding, head, micro_batch_sizes, device,
                              warmup, repeat, per_sync, seed)
        if stages:
            profile_stages(config, rows, chain, device, warmup, repeat, per_sync, seed)
    dtype, s, h = config.params_dtype, config.seq_length, config.hidden_size
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    bp, bb = param_count(block)
    ep, eb = param_count(embedding)
    hp = sum(p.numel() for p in head.own_parameters())
    word = embedding.embedding.word_embeddings.weight
    tied = not config.untie_embeddings_and_output_weights
    calls, steps = _optimizer_steps(config, blocks, embedding, head, chain, optimizer,
                                    warmup, repeat, device)
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    return {
        "schema": SCHEMA,
        "device": {"type": device.type, "name": device_name(device), "torch": torch.__version__,
                   "threads": torch.get_num_threads()},
        "settings": {"warmup": warmup, "repeat": repeat, "statistic": "median", "seed": seed,
                     "runs_per_sync": per_sync, "chain_blocks": chain},
        "model": {"kind": "gpt", "num_layers": config.num_layers, "hidden_size": h,
                  "num_attention_heads": config.num_attention_heads, "seq_length": s,
                  "ffn_hidden_size": config.ffn_hidden_size,
                  "vocab_size": config.padded_vocab_size, "dtype": dtype_name,
                  "dtype_bytes": dtype_bytes, "hidden_dropout": config.hidden_dropout,
                  "attention_dropout": config.attention_dropout, "optimizer": optimizer,
                  "grad_bytes": (trainer_grad_dtype(config) or dtype).itemsize,
                  "cross_entropy_loss_fusion": config.cross_entropy_loss_fusion,
                  **{k: getattr(config, k) for k in ARCH_FIELDS},
                  "fp32_residual_connection": config.fp32_residual_connection,
                  "reset_attention_mask": reset_attention_mask},
        "weights": {"block_params": bp, "block_bytes": bb, "embedding_params": ep,
                    "embedding_bytes": eb, "head_params": hp, "head_bytes": hp * dtype_bytes,
                    "tied_embedding_params": word.numel() if tied else 0,
                    "tied_embedding_bytes": word.numel() * dtype_bytes if tied else 0},
        "optimizer_step_s": steps[0],
        "optimizer_step_cpu_s": steps[1],
        "optimizer_step_calls_s": {k: v[0] for k, v in calls.items()},
        "microbatches": rows,
    }


def _optimizer_steps(config: ModelConfig, blocks: nn.ModuleList, embedding: EmbeddingPiece,
                     head: HeadPiece, chain: int, optimizer: str, warmup: int, repeat: int,
                     device: torch.device
                     ) -> Tuple[Dict[str, Tuple[float, float]], Dict[int, Dict[str, float]]]:
    """The trainer's optimizer step timed over each piece's parameters alone (the tied
    word embedding's copy, the chain of ``chain`` blocks), as (wall, CPU) seconds, and
    the stage's step those give per clock (0: wall, 1: CPU; ``optimizer_step_model``)."""
    tied = not config.untie_embeddings_and_output_weights
    pieces = {"block": list(blocks[0].parameters()), "embedding": list(embedding.parameters()),
              "head": head.own_parameters()}
    if tied:
        pieces["tied_embedding"] = [embedding.embedding.word_embeddings.weight]
    if chain > 1:
        pieces["blocks"] = list(blocks.parameters())
    calls = {k: optimizer_step_time(v, config, optimizer, warmup, repeat, device)
             for k, v in pieces.items()}
    if not tied:  # no last-stage copy of the word embedding to update
        calls["tied_embedding"] = (0.0, 0.0)
    steps = {clock: optimizer_step_model({k: v[clock] for k, v in calls.items()}, chain)
             for clock in (0, 1)}
    return calls, steps


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (Megatron's flags)")
    g.add_argument("--num-layers", type=int, required=True,
                   help="recorded; the profile is per block (sets --chain-blocks' default)")
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, required=True, help="before padding")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type",
                   action="store_const", const="rope",
                   help="Megatron-LM's older switch for --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", dest="rope_scaling", action="store_true",
                   help="Llama 3.1's RoPE frequencies (recorded; changes no cost)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="query and key norms over each head, before RoPE (Qwen3)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="size of one attention head (default --hidden-size / "
                        "--num-attention-heads; Qwen3-0.6B: 128 with 1024 / 16)")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default 1, as the "
                        "trainer's)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   default="auto", help="as the trainer's flag (recorded in the profile)")
    d = g.add_mutually_exclusive_group()
    for name in DTYPES:
        d.add_argument(f"--{name}", dest="dtype", action="store_const", const=name)
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="profile the head with the fused loss, as the trainer's flag runs it "
                        "(recorded; tools/plan.py's command then passes the flag)")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="the trainer's flag: with --fp16/--bf16 the residual stream (the "
                        "blocks' inputs and outputs, the stage input, the final norm's "
                        "input) in float32 (recorded; plans then take it)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="the trainer's flag: attention inside each document, a mask per "
                        "microbatch built from a few end-of-document ids (recorded; plans "
                        "then take it)")
    m = p.add_argument_group("measurement")
    m.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--repeat", type=int, default=5)
    m.add_argument("--runs-per-sync", type=int, default=None,
                   help="forwards (then backwards) queued per synchronisation in a timed "
                        "sample, as the trainer queues layers (default 8 on CUDA, 1 on CPU)")
    m.add_argument("--chain-blocks", type=int, default=None,
                   help="distinct transformer layers timed back to back for the per-block "
                        "cost, as a stage runs them (default min(--num-layers, 4))")
    m.add_argument("--no-stages", dest="stages", action="store_false",
                   help="skip timing whole GPTModel stages (the trainer's per-microbatch "
                        "work beyond the pieces is then taken as zero)")
    m.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (match the threads of one training rank)")
    m.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if present)")
    m.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output", default="profile.json", help="where to write the JSON profile")
    return p


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    from megatron.tokenizer import vocab_size_with_padding
    if args.num_attention_heads < 1:
        raise ValueError(f"--num-attention-heads must be >= 1, got {args.num_attention_heads}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} must be divisible by "
                         f"--num-attention-heads {args.num_attention_heads}, or give "
                         f"--kv-channels")
    if args.kv_channels is not None and args.kv_channels < 1:
        raise ValueError(f"--kv-channels must be >= 1, got {args.kv_channels}")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError(f"--num-query-groups {args.num_query_groups} needs "
                         f"--group-query-attention (without it the trainer ignores it)")
    groups = (args.num_query_groups or 1) if args.group_query_attention else None
    config = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        padded_vocab_size=vocab_size_with_padding(args.vocab_size,
                                                  args.make_vocab_size_divisible_by, 1),
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        params_dtype=DTYPES[args.dtype or "fp32"],
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        fp32_residual_connection=args.fp32_residual_connection,
        normalization=args.normalization, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        rope_scaling=args.rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        swiglu=args.swiglu, qk_layernorm=args.qk_layernorm, kv_channels=args.kv_channels,
        num_query_groups=groups, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        attention_backend=args.attention_backend)
    from megatron.model.transformer import check_architecture
    from megatron.tensor_parallel import TPInfo
    check_architecture(config, TPInfo.single())  # the flags' errors before any work
    return config


def summary(profile: Dict[str, Any]) -> str:
    """A short table of the profile."""
    lines = [f"device {profile['device']['name']} ({profile['device']['type']}, "
             f"{profile['device']['threads']} threads), torch {profile['device']['torch']}",
             f"{'b':>4} {'piece':10} {'fwd ms':>9} {'bwd ms':>9} {'stash MiB':>10}"]
    for row in profile["microbatches"]:
        for name in PIECES:
            c = row[name]
            lines.append(f"{row['micro_batch_size']:>4} {name:10} {1e3 * c['forward_s']:9.3f} "
                         f"{1e3 * c['backward_s']:9.3f} {c['stash_bytes'] / 2 ** 20:10.3f}")
    from megatron.pipeline.planner.profile import Profile
    prof = Profile(profile)
    if prof.has_overhead:
        lines.append(f"trainer work per microbatch beyond the pieces (stage timed through "
                     f"forward_step, {profile['settings']['chain_blocks']} layers):")
        for b in prof.micro_batch_sizes:
            parts = [f"{kind} {1e3 * f:+.3f}/{1e3 * bw:+.3f}"
                     for kind, (first, last) in STAGE_KINDS.items()
                     for f, bw in [prof.overhead(first, last, b)]]
            lines.append(f"{b:>4} fwd/bwd ms: " + ", ".join(parts))
    w = profile["weights"]
    lines.append(f"weights: block {w['block_bytes']} B, embedding {w['embedding_bytes']} B, "
                 f"head {w['head_bytes']} B")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if config.fp32_residual_connection and config.residual_dtype == config.params_dtype:
            print("note: --fp32-residual-connection changes nothing without --fp16/--bf16 "
                  "(the stream is in the weights' dtype already); recorded", file=sys.stderr)
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        device = torch.device(args.device) if args.device else None
        profile = profile_model(config, args.micro_batch_sizes, device=device,
                                warmup=args.warmup, repeat=args.repeat,
                                runs_per_sync=args.runs_per_sync, seed=args.seed,
                                optimizer=args.optimizer, chain_blocks=args.chain_blocks,
                                stages=args.stages,
                                reset_attention_mask=args.reset_attention_mask)
    except ValueError as exc:
        print(f"profile_model.py: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1))
    print(summary(profile))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

"""Reshard a checkpoint to another (t, d, w) layout, or move it to/from Hugging Face.

Five workflows (``python tools/checkpoint_util.py --help``)::

    # 1. reshard the FULL training state and resume at another layout
    python tools/checkpoint_util.py --load ckpt_t1_d2 --save ckpt_t2_d1 \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1 \\
        --target-data-parallel-size 2
    # 2. export to a transformers model directory (GPT-2, Llama, Qwen2/3 or Megatron-BERT)
    python tools/checkpoint_util.py --load ckpt --to-hf hf_model
    # 3. import a transformers GPT-2 / Llama / Qwen2 / Qwen3 directory, then train with
    #    --load OUT [--finetune] and the model flags the script prints
    python tools/checkpoint_util.py --from-hf gpt2_dir --save ckpt_gpt2 \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # 4. import a Megatron-LM (legacy torch.save) GPT or BERT checkpoint; its files are
    #    pickles, so reading them needs --allow-unsafe-checkpoint (weights-only unpickler)
    python tools/checkpoint_util.py --from-megatron megatron_run --save ckpt_mlm \\
        --allow-unsafe-checkpoint
    # 5. export to a Megatron-LM legacy checkpoint (release, weights only) for its
    #    --use-legacy-models --ckpt-format torch --load OUT, at tensor size T, P stages
    python tools/checkpoint_util.py --load ckpt --to-megatron megatron_out \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

Resharding carries the whole training state: iteration, consumed samples, model and
2BW shadow weights, Adam moments and fp32 masters (split and merged like their
parameters), LR scheduler, grad scaler, the engine's per-batch loss scales; the
vocabulary is re-padded when t changes its padded size (keep the size, and exact losses,
with ``--make-vocab-size-divisible-by`` halved when t doubles).  RNG files travel only
where the (t, d) grid is unchanged; elsewhere ranks use the streams ``--seed`` gives.
The output is written into a staging directory and renamed into place; ``--save`` may
not be ``--load`` or inside it, nor a directory that already holds checkpoints (a new or
empty one), and ``--to-hf`` must be a new or empty directory.

The work is done by ``megatron.checkpoint_merge`` (weights of any layout -> one full
state dict -> any stage), ``megatron.checkpoint_convert`` (the full training state),
``megatron.hf_interop`` and ``megatron.hf_import`` (transformers, both ways),
``megatron.megatron_lm_import`` and ``megatron.megatron_lm_export`` (Megatron-LM's own
checkpoints, both ways); this script
is their command line, and re-exports their functions for older imports (``from
tools.checkpoint_util import load_into_stage``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# imports after the sys.path line; names re-exported for older imports
from megatron.checkpoint_convert import (FullOptimizer, FullState,  # noqa: E402,F401
                                         check_save_path, convert, read_full_state,
                                         target_padded_vocab, true_vocab_size, write_layout)
from megatron.checkpoint_merge import (CheckpointShards, LoadReport,  # noqa: E402,F401
                                       load_into_stage, merge_checkpoint, merge_shards,
                                       module_targets, partition_dim_by_name, rank_dirs,
                                       read_checkpoint, split_for_stage, to_global, to_local)
from megatron.entry import exit_with_user_error  # noqa: E402
from megatron.errors import UserError  # noqa: E402
from megatron.arguments import OneLineParser  # noqa: E402


# ---------------------------------------------------------------------------- the script
_EPILOG = """workflows:
  reshard   --load CKPT --save OUT --target-tensor-parallel-size T
            --target-pipeline-parallel-size D [--target-data-parallel-size W]
            [--target-decoder-first/last-pipeline-num-layers N]  (an uneven stage split)
  export    --load CKPT --to-hf HF_DIR          (GPT-2, Llama, Qwen2/3 or Megatron-BERT)
  import    --from-hf HF_DIR --save OUT --target-tensor-parallel-size T
            --target-pipeline-parallel-size D   (then train with --load OUT [--finetune])
  megatron  --from-megatron MLM_DIR --save OUT --allow-unsafe-checkpoint
            [--target-tensor-parallel-size T --target-pipeline-parallel-size D]
            (a Megatron-LM legacy GPT/BERT checkpoint; then --load OUT --finetune)
  to-mlm    --load CKPT --to-megatron MLM_DIR [--target-tensor-parallel-size T
            --target-pipeline-parallel-size D]  (a Megatron-LM legacy release checkpoint)
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="checkpoint_util.py", description=__doc__.split("\n\n")[0],
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help="checkpoint directory written by --save (reshard, export)")
    p.add_argument("--save", help="where to write the converted checkpoint (reshard, import): "
                                  "a new or empty directory, not --load or inside it")
    p.add_argument("--to-hf", metavar="DIR", help="export --load as a Hugging Face "
                   "transformers model directory (safetensors, config.json, tokenizer files); "
                   "a new or empty directory, written in place only when complete")
    p.add_argument("--from-hf", metavar="DIR", help="import a Hugging Face GPT-2, Llama, "
                   "Qwen2 or Qwen3 directory (model.safetensors + config.json) into a checkpoint at "
                   "--save")
    p.add_argument("--from-megatron", metavar="DIR", help="import a checkpoint written by "
                   "NVIDIA Megatron-LM's legacy GPT/BERT models (its --save directory, an "
                   "iter_N/release directory or one model_optim_rng.pt) into a checkpoint at "
                   "--save; its files are pickles: needs --allow-unsafe-checkpoint")
    p.add_argument("--to-megatron", metavar="DIR", help="export --load as a Megatron-LM "
                   "legacy checkpoint (release/mp_rank_*/model_optim_rng.pt, checkpoint_version "
                   "3.0, model weights only) for Megatron-LM's --use-legacy-models --ckpt-format "
                   "torch --load DIR; a new or empty directory, written in place only when "
                   "complete")
    p.add_argument("--num-attention-heads", type=int, default=None, metavar="N",
                   help="--from-megatron: the heads of a checkpoint that records no args "
                        "(early releases; GPT-345M and BERT-345M have 16)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None, metavar="T",
                   help="t of the written checkpoint (default: the source's; 1 for import)")
    p.add_argument("--target-pipeline-parallel-size", type=int, default=None, metavar="D",
                   help="d of the written checkpoint (default: the source's; 1 for import)")
    p.add_argument("--target-data-parallel-size", type=int, default=None, metavar="W",
                   help="w the resumed run will use (default: the source's); decides which "
                        "RNG files are carried over")
    p.add_argument("--target-decoder-first-pipeline-num-layers", type=int, default=None,
                   metavar="N", help="transformer layers of the first stage of the written "
                   "checkpoint, as the resumed run's --decoder-first-pipeline-num-layers "
                   "(default: the source's split when d is unchanged, else an even one)")
    p.add_argument("--target-decoder-last-pipeline-num-layers", type=int, default=None,
                   metavar="N", help="transformer layers of its last stage, as "
                   "--decoder-last-pipeline-num-layers")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--true-vocab-size", type=int, default=None, metavar="N",
                   help="unpadded vocabulary size, when the tokenizer files recorded in the "
                        "checkpoint are not on this machine (needed to re-pad for a new t)")
    p.add_argument("--allow-unsafe-checkpoint", action="store_true",
                   help="read an old pickle (.pt) checkpoint, a --from-hf "
                        "pytorch_model.bin or a --from-megatron checkpoint; unpickling can run "
                        "code, so only for files you trust (read with a weights-only "
                        "unpickler); the output is written in the current format")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                   help="the vocabulary padding unit the resumed/finetuning run will use "
                        "(default: the source checkpoint's; 128 for --from-hf; for "
                        "--from-megatron the one keeping its padded rows).  The padded "
                        "size is a multiple of N x t: halve N when doubling t to keep it, "
                        "and with it the exact losses")
    return p


def _refuse_unread(args: argparse.Namespace, mode: str, flags: Dict[str, str],
                   why: str = "") -> None:
    """One UserError for the first of ``flags`` (flag -> the workflows that read it) given
    to workflow ``mode``, which does not read it: a flag that would silently do nothing."""
    for flag, where in flags.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise UserError(f"{flag} applies to {where}, not {mode}{why}")


def _workflow(args: argparse.Namespace) -> str:
    """Check the flags of the chosen workflow (one UserError naming the flags the user
    gave) and say which: "import" (--from-hf), "megatron" (--from-megatron), "export"
    (--to-hf), "to-megatron" (--to-megatron) or "reshard"."""
    for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                 "target_data_parallel_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    imports = args.from_hf or args.from_megatron
    modes = [m for m, on in (("--to-hf", args.to_hf), ("--to-megatron", args.to_megatron),
                             ("--from-hf", args.from_hf),
                             ("--from-megatron", args.from_megatron),
                             ("--save", args.save and not imports)) if on]
    if len(modes) != 1:
        raise UserError("choose one workflow: --load X --save Y (reshard), --load X --to-hf Y "
                        "(export), --load X --to-megatron Y (Megatron-LM export), --from-hf X "
                        "--save Y (import) or --from-megatron X --save Y (Megatron-LM import)")
    if args.num_attention_heads is not None and not args.from_megatron:
        raise UserError("--num-attention-heads applies to --from-megatron only")
    for flag, source, what, workflow in (
            ("--from-megatron", args.from_megatron, "Megatron-LM checkpoint", "megatron"),
            ("--from-hf", args.from_hf, "Hugging Face directory", "import")):
        if source:
            if not args.save:
                raise UserError(f"{flag} needs --save (where to write the checkpoint)")
            if args.load:
                raise UserError(f"--load applies to resharding, --to-hf and --to-megatron; "
                                f"{flag} reads the "
                                f"{what} it names")
            if workflow == "import":  # config.json says the vocabulary; no RNG is written
                _refuse_unread(args, "--from-hf", {
                    "--iteration": "resharding, --to-hf and --from-megatron",
                    "--true-vocab-size": "resharding, --to-hf and --from-megatron",
                    "--target-data-parallel-size": "resharding (it picks the RNG files "
                                                   "carried over)"})
            return workflow
    if not args.load:
        raise UserError(f"{modes[0]} needs --load CHECKPOINT")
    if args.to_hf:
        split = [f for f in ("--target-decoder-first-pipeline-num-layers",
                             "--target-decoder-last-pipeline-num-layers")
                 if getattr(args, f[2:].replace("-", "_")) is not None]
        if split:
            raise UserError(f"{split[0]} applies to resharding and --from-hf, not --to-hf (a "
                            "transformers model has no pipeline stages)")
        _refuse_unread(args, "--to-hf", {
            "--target-tensor-parallel-size": "resharding and the imports",
            "--target-pipeline-parallel-size": "resharding and the imports",
            "--target-data-parallel-size": "resharding",
            "--make-vocab-size-divisible-by": "resharding and the imports"},
            " (a transformers model has one layout and no padding rows)")
        return "export"
    if args.to_megatron:
        _refuse_unread(args, "--to-megatron", {
            "--target-data-parallel-size": "resharding",
            "--target-decoder-first-pipeline-num-layers": "resharding and the imports",
            "--target-decoder-last-pipeline-num-layers": "resharding and the imports"},
            " (Megatron-LM's legacy models give every stage num_layers / P layers and "
            "its checkpoint holds no data-parallel state)")
        return "to-megatron"
    return "reshard"


def main(argv: Optional[Iterable[str]] = None) -> str:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        workflow = _workflow(args)
        if workflow == "import":
            from megatron.hf_import import import_hf
            check_save_path(args.from_hf, args.save, load_flag="--from-hf")
            out = import_hf(args.from_hf, args.save, tp=args.target_tensor_parallel_size or 1,
                            pp=args.target_pipeline_parallel_size or 1,
                            divisible_by=args.make_vocab_size_divisible_by or 128,
                            allow_unsafe=args.allow_unsafe_checkpoint,
                            first=args.target_decoder_first_pipeline_num_layers,
                            last=args.target_decoder_last_pipeline_num_layers)
        elif workflow == "megatron":
            from megatron.megatron_lm_import import import_megatron_lm
            check_save_path(args.from_megatron, args.save, load_flag="--from-megatron")
            out = import_megatron_lm(args.from_megatron, args.save,
                                     tp=args.target_tensor_parallel_size or 1,
                                     pp=args.target_pipeline_parallel_size or 1,
                                     divisible_by=args.make_vocab_size_divisible_by,
                                     allow_unsafe=args.allow_unsafe_checkpoint,
                                     iteration=args.iteration,
                                     true_vocab=args.true_vocab_size,
                                     num_attention_heads=args.num_attention_heads,
                                     first=args.target_decoder_first_pipeline_num_layers,
                                     last=args.target_decoder_last_pipeline_num_layers)
        elif workflow == "to-megatron":
            from megatron.megatron_lm_export import check_export_path as check_mlm_path
            from megatron.megatron_lm_export import export_megatron_lm
            check_mlm_path(args.load, args.to_megatron)
            out = export_megatron_lm(args.load, args.to_megatron,
                                     tp=args.target_tensor_parallel_size,
                                     pp=args.target_pipeline_parallel_size,
                                     iteration=args.iteration,
                                     true_vocab=args.true_vocab_size,
                                     divisible_by=args.make_vocab_size_divisible_by,
                                     allow_unsafe=args.allow_unsafe_checkpoint,
                                     vocab_flag="--true-vocab-size")
        elif workflow == "export":
            from megatron.export_output import check_export_path
            from megatron.hf_interop import export_hf
            check_export_path(args.load, args.to_hf)
            out = export_hf(args.load, args.to_hf, iteration=args.iteration,
                            true_vocab=args.true_vocab_size,
                            allow_unsafe=args.allow_unsafe_checkpoint,
                            vocab_flag="--true-vocab-size")
        else:
            check_save_path(args.load, args.save)
            state = read_full_state(args.load, args.iteration,
                                    allow_unsafe=args.allow_unsafe_checkpoint)
            tp = args.target_tensor_parallel_size or state.layout[0]
            pp = args.target_pipeline_parallel_size or state.layout[1]
            out = write_layout(state, args.save, tp, pp, args.target_data_parallel_size,
                               true_vocab=args.true_vocab_size,
                               source=os.path.abspath(args.load),
                               allow_unsafe=args.allow_unsafe_checkpoint,
                               divisible_by=args.make_vocab_size_divisible_by,
                               first=args.target_decoder_first_pipeline_num_layers,
                               last=args.target_decoder_last_pipeline_num_layers,
                               vocab_flag="--true-vocab-size")
    except UserError as exc:
        exit_with_user_error(exc)  # as run_entry_point would: callers of main() exit too
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

"""Sample text from a GPT checkpoint written by pretrain_gpt.py (any t, d layout).

    python tools/generate_samples_gpt.py --load demo/checkpoints --prompt "The module"
    python tools/generate_samples_gpt.py --load ckpt --sample-input-file prompts.txt \\
        --sample-output-file samples.jsonl --top-p 0.9 --tokens-to-generate 128
    python tools/generate_samples_gpt.py --load ckpt --num-samples 4   # unconditional

The checkpoint is exported as with ``tools/checkpoint_util.py --to-hf`` (into a temporary
directory) and decoded by transformers' ``generate`` with a KV cache; text goes through
the tokenizer the checkpoint was trained with (``megatron/text_generation.py``).  Samples
print to stdout; ``--sample-output-file`` also writes them as JSON lines
(``{"prompt", "text", "tokens", "finished"}``) into a new file.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.arguments import OneLineParser  # noqa: E402
from megatron.errors import UserError, check_parents_are_directories  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="generate_samples_gpt.py", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory written by --save")
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt; repeat for several ('' = unconditional)")
    p.add_argument("--sample-input-file", default=None, metavar="FILE",
                   help="prompts, one per line (UTF-8)")
    p.add_argument("--sample-output-file", default=None, metavar="FILE",
                   help="also write the samples here as JSON lines (a new file)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="samples per prompt; without prompts, N unconditional samples "
                        "(default 1)")
    p.add_argument("--tokens-to-generate", type=int, default=64, metavar="N",
                   help="at most N new tokens per sample (default 64); fewer at the "
                        "end-of-document token or the model's last position")
    p.add_argument("--greedy", action="store_true", help="take the most likely token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=0.0, help="0 = off (default)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="default: cuda when visible")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="default: the checkpoint's on a GPU, fp32 on a CPU")
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        p.add_argument(flag, default=None, metavar="FILE",
                       help=f"the tokenizer's {flag[2:]} when the one the checkpoint "
                            f"recorded is not at that path")
    p.add_argument("--allow-unsafe-checkpoint", action="store_true",
                   help="read an old pickle (.pt) checkpoint; unpickling can run code, so "
                        "only for files you trust")
    return p


def _prompts(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """The prompts, and what names each in an error (its flag, or its file and line)."""
    prompts = list(args.prompt or [])
    sources = ["--prompt"] * len(prompts)
    if args.sample_input_file:
        try:  # utf-8-sig: a byte order mark (Windows editors) is not part of the prompt
            with open(args.sample_input_file, encoding="utf-8-sig") as fh:
                lines = [(n, line.rstrip("\n")) for n, line in enumerate(fh, 1)]
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--sample-input-file {args.sample_input_file}: cannot read it "
                            f"({getattr(exc, 'strerror', None) or exc}); expected a UTF-8 "
                            f"text file, one prompt per line") from None
        lines = [(n, line) for n, line in lines if line.strip()]
        if not lines:
            raise UserError(f"--sample-input-file {args.sample_input_file}: no prompts in it; "
                            f"expected one prompt per line")
        prompts += [line for _, line in lines]
        sources += [f"--sample-input-file {args.sample_input_file} line {n}" for n, _ in lines]
    return (prompts, sources) if prompts else ([""], ["--prompt"])


def _check_output(path: Optional[str]) -> None:
    if path is None:
        return
    if os.path.exists(path):
        raise UserError(f"--sample-output-file {path}: exists; expected a new file (samples "
                        f"never replace a file)")
    check_parents_are_directories("--sample-output-file", path)
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the directories not made yet are made at the end
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--sample-output-file {path}: {parent} is not writable; expected a "
                        f"directory you can write to")


def main(argv: Optional[Iterable[str]] = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    from megatron.text_generation import (Generator, SamplingParams, check_sampling,
                                          generate_samples, print_samples, write_jsonl)

    params = SamplingParams(tokens_to_generate=args.tokens_to_generate, greedy=args.greedy,
                            temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    check_sampling(params)
    if args.num_samples < 1:
        raise UserError(f"--num-samples {args.num_samples}: expected a positive number")
    prompts, sources = _prompts(args)
    _check_output(args.sample_output_file)
    import transformers

    transformers.logging.set_verbosity_error()  # generation-config chatter
    transformers.logging.disable_progress_bar()  # "Loading weights" bars
    generator = Generator(args.load, iteration=args.iteration, device=args.device,
                          dtype=args.dtype, allow_unsafe=args.allow_unsafe_checkpoint,
                          tokenizer_files={"vocab_file": args.vocab_file,
                                           "merge_file": args.merge_file,
                                           "tokenizer_model": args.tokenizer_model})
    samples = generate_samples(generator, prompts, args.num_samples, params, sources)
    try:
        print_samples(samples)
    except BrokenPipeError:  # stdout closed early (| head): still write the file, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if args.sample_output_file:
        _check_output(args.sample_output_file)  # again: sampling took a while
        write_jsonl(args.sample_output_file, samples)
        print(f"wrote {len(samples)} samples to {args.sample_output_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

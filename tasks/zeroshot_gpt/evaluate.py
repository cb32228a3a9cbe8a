"""--task WIKITEXT103: zero-shot perplexity of a GPT checkpoint on a text file.

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens \\
        --load gpt_checkpoint --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --num-layers 24 --hidden-size 1024 \\
        --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8 --overlapping-eval 32

The checkpoint (``--load``, or ``--pretrained-checkpoint``) may have any tensor/pipeline
layout.  Reported, as Megatron does:

* token perplexity  ``exp(L / (T - 1))``: L = summed loss over all T - 1 targets;
* adjusted (word-level) perplexity ``exp(L / (W - 1))`` = ``exp(avg loss * ratio)`` with
  ratio = (T - 1) / (W - 1), W the words of the original file as Megatron counts them
  (its space-separated pieces, line ends included: ``count_words``), so models with
  different tokenizers are comparable, with each other and with Megatron-LM's numbers.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, List, Optional, Sequence

import torch

from tasks.arguments import add_task_args
from tasks.data_utils import (TaskDataError, fail, refuse_corpus_flags,
                              warn_ignored_task_flags)
from tasks.zeroshot_gpt.datasets import (LMWindowDataset, PaddingWindows, count_words,
                                         read_wikitext, wikitext_detokenize)


@dataclass
class PerplexityResult:
    total_loss: float
    num_targets: int
    num_tokens: int
    num_words: int
    avg_loss: float
    ppl: float
    adjusted_ppl: float
    token_ratio: float


def _loss_fn(loss_mask: torch.Tensor, losses: torch.Tensor):
    if losses.dtype in (torch.float16, torch.bfloat16):
        losses = losses.float()
    mask = loss_mask.to(losses.dtype)
    total = (losses * mask).sum()
    count = mask.sum()
    return total / count.clamp(min=1.0), {"loss_sum": total.detach(), "targets": count.detach()}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
    device = next(model.parameters()).device
    data = next(data_iterator)
    text = data["text"].long().to(device)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    pos = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    losses = model(tokens, pos, None, labels=labels)
    return losses, partial(_loss_fn, data["loss_mask"].to(device))


def perplexity(total_loss: float, num_tokens: int, num_words: int) -> PerplexityResult:
    """Megatron's token and word-adjusted perplexities from a summed loss."""
    targets = num_tokens - 1
    avg = total_loss / targets
    ratio = targets / max(num_words - 1, 1)
    return PerplexityResult(total_loss=total_loss, num_targets=targets, num_tokens=num_tokens,
                            num_words=num_words, avg_loss=avg, ppl=math.exp(min(avg, 700.0)),
                            adjusted_ppl=math.exp(min(avg * ratio, 700.0)), token_ratio=ratio)


def _setup(argv: List[str]):
    from megatron.arguments import parse_and_validate, parse_args

    raw = parse_args(argv, extra_args_provider=add_task_args)
    refuse_corpus_flags(raw, "WIKITEXT103")
    warn_ignored_task_flags(raw, "WIKITEXT103", ("--train-data", "--epochs", "--keep-last"))
    if not raw.valid_data:
        fail("--task WIKITEXT103 needs --valid-data (the WikiText test file)")
    if not (raw.load or raw.pretrained_checkpoint):
        fail("--task WIKITEXT103 needs --load (or --pretrained-checkpoint): the GPT "
             "checkpoint to evaluate")
    if not raw.skip_train:
        argv = argv + ["--skip-train"]  # evaluation only: no data corpus, lr or iterations
    if raw.train_iters is None and raw.lr_decay_iters is None and raw.lr_decay_samples is None:
        # The (unused) learning-rate schedule would otherwise need a decay length.
        argv = argv + ["--lr-decay-style", "constant"]
    args, cfg = parse_and_validate(argv, extra_args_provider=add_task_args)
    problem = overlapping_eval_error(args.overlapping_eval, cfg.model.seq_length)
    if problem:  # now, not after the model and checkpoint are loaded
        fail(problem)
    return args, cfg


def overlapping_eval_error(stride: Optional[int], seq_length: int) -> Optional[str]:
    """Why ``--overlapping-eval stride`` cannot be used with ``--seq-length``, or None.

    Window k starts at token k * stride and scores the targets no earlier window did
    (``LMWindowDataset``): a stride of 0 never advances, and one beyond the window would
    skip the targets between windows."""
    if stride is None or 1 <= stride <= seq_length:
        return None
    return (f"--overlapping-eval {stride}: expected a window stride in [1, --seq-length "
            f"{seq_length}] (tokens each evaluation window moves on; omit it for "
            f"--seq-length, non-overlapping windows)")


def evaluate(argv: Optional[Sequence[str]] = None) -> Optional[PerplexityResult]:
    """Run the evaluation; the last pipeline stage returns the result, others None."""
    from megatron.training import initialize_megatron

    args, cfg = _setup(list(argv if argv is not None else sys.argv[1:]))
    original = read_wikitext(args.valid_data)  # before any process group: fails on every rank
    tokenizer, groups, device = initialize_megatron(args, cfg)
    result = _evaluate(args, cfg, original, tokenizer, groups, device)
    groups.destroy()  # the process groups (megatron.training.pretrain says why not on errors)
    return result


def _evaluate(args, cfg, original: str, tokenizer, groups, device):
    import pretrain_gpt
    from megatron.training import setup_model_and_optimizer
    from megatron.training_log import print_rank_last
    from tasks.finetune_utils import load_pretrained, microbatches

    tokens = tokenizer.tokenize(wikitext_detokenize(original))
    if len(tokens) < 2:
        raise TaskDataError(f"--valid-data {' '.join(args.valid_data)}: {len(tokens)} tokens; "
                            f"expected text with at least two tokens to score")
    _, optimizer, _, engine = setup_model_and_optimizer(
        cfg, groups, device, pretrain_gpt.model_provider, forward_step)
    load_pretrained(engine, optimizer, args.load or args.pretrained_checkpoint, groups, (),
                    vocab_size=tokenizer.vocab_size,
                    flag="--load" if args.load else "--pretrained-checkpoint",
                    allow_unsafe=args.allow_unsafe_checkpoint)

    seq = cfg.model.seq_length
    stride = seq if args.overlapping_eval is None else args.overlapping_eval
    windows = LMWindowDataset(tokens, seq, stride, pad_id=tokenizer.eod)
    gbs = cfg.training.global_batch_size
    num_batches = max(1, math.ceil(len(windows) / gbs))
    padded = PaddingWindows(windows, num_batches * gbs)
    it = microbatches(padded, range(len(padded)), cfg.training.micro_batch_size,
                      groups.dp_rank, groups.dp_size)
    out = engine.evaluate(it, num_batches)
    if out is None:
        return None
    # evaluate() averages per microbatch and replica; the ratio of the two averages is
    # the exact mean over targets, and the target count is known exactly.
    avg = out["loss_sum"] / out["targets"]
    result = perplexity(avg * (len(tokens) - 1), len(tokens), count_words(original))
    print_rank_last(
        f"{'-' * 80}\n WIKITEXT103 | {', '.join(args.valid_data)} | windows {len(windows)} "
        f"(seq {seq}, stride {stride})\n avg loss: {result.avg_loss:.4E} | ppl: "
        f"{result.ppl:.4E} | adjusted ppl: {result.adjusted_ppl:.4E} | token ratio: "
        f"{result.token_ratio:.4f} ({result.num_tokens} tokens, {result.num_words} words)"
        f"\n{'-' * 80}")
    return result


def main(argv: Optional[List[str]] = None):
    return evaluate(argv)

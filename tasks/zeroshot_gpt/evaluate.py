"""--task WIKITEXT103 / LAMBADA: zero-shot evaluation of a GPT checkpoint.

WIKITEXT103: perplexity on a WikiText text file; LAMBADA: last-word accuracy on a
JSON-lines file of passages (``--strict-lambada``: the whole last word must be predicted,
not only its last token), as Megatron-LM's tasks/zeroshot_gpt.

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
  different tokenizers are comparable, with each other and with Megatron-LM's numbers
  (the text is detokenized by Megatron-LM's rules, ``wikitext_detokenize``);
* LAMBADA: number correct / total examples; a passage counts when every target token is
  the model's top prediction (argmax over the whole vocabulary, with teacher forcing).

Output lines as Megatron-LM's: ``> working on iteration: N`` every --log-interval global
batches, `` validation results on TASK | ...`` between dash lines.
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
from tasks.zeroshot_gpt.datasets import (LambadaDataset, LMWindowDataset, PaddingSamples,
                                         check_words, count_words,
                                         lambada_samples, read_lambada, read_wikitext,
                                         wikitext_detokenize)


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


@dataclass
class LambadaResult:
    correct: int
    total: int
    accuracy: float
    strict: bool


def _accuracy_fn(labels: torch.Tensor, loss_mask: torch.Tensor, tp, logits: torch.Tensor):
    """A sample is correct when the argmax over the whole (gathered) vocabulary is the
    label at every masked position; all-masked padding samples are not counted."""
    from megatron.tensor_parallel import gather_from_tp_region

    with torch.no_grad():
        pred = gather_from_tp_region(logits, tp).argmax(dim=-1)
        mask = loss_mask.bool()
        real = mask.any(dim=-1)
        wrong = ((pred != labels) & mask).any(dim=-1)
        correct = (real & ~wrong).sum().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)
    return zero, {"correct": correct, "count": real.sum().to(torch.float64)}


def lambada_forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
    device = next(model.parameters()).device
    data = next(data_iterator)
    text = data["text"].long().to(device)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    pos = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, pos, None)  # the last stage: [b, s, V/t]
    return logits, partial(_accuracy_fn, labels, data["loss_mask"].to(device), model.tp)


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
    task = raw.task or "WIKITEXT103"
    refuse_corpus_flags(raw, task)
    ignored = ("--train-data", "--epochs", "--keep-last") + (
        ("--strict-lambada",) if task == "WIKITEXT103" else ("--overlapping-eval",))
    warn_ignored_task_flags(raw, task, ignored)
    if not raw.valid_data:
        fail(f"--task {task} needs --valid-data (" + (
            "the WikiText test file)" if task == "WIKITEXT103" else
            "the LAMBADA test file, JSON lines: {\"text\": ...} a line)"))
    if not (raw.load or raw.pretrained_checkpoint):
        fail(f"--task {task} needs --load (or --pretrained-checkpoint): the GPT "
             "checkpoint to evaluate")
    if not raw.skip_train:
        argv = argv + ["--skip-train"]  # evaluation only: no data corpus, lr or iterations
    if raw.train_iters is None and raw.lr_decay_iters is None and raw.lr_decay_samples is None:
        # The (unused) learning-rate schedule would otherwise need a decay length.
        argv = argv + ["--lr-decay-style", "constant"]
    args, cfg = parse_and_validate(argv, extra_args_provider=add_task_args)
    problem = (overlapping_eval_error(args.overlapping_eval, cfg.model.seq_length)
               if task == "WIKITEXT103" else None)
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


def evaluate(argv: Optional[Sequence[str]] = None):
    """Run the evaluation; the last pipeline stage returns the result (a
    PerplexityResult or a LambadaResult), others None."""
    from megatron.training import initialize_megatron

    args, cfg = _setup(list(argv if argv is not None else sys.argv[1:]))
    # the files are read before any process group: a bad one fails on every rank alike
    if args.task == "LAMBADA":
        data = read_lambada(args.valid_data)
    else:
        data = read_wikitext(args.valid_data)
        check_words(count_words(data), args.valid_data)
    tokenizer, groups, device = initialize_megatron(args, cfg)
    run = _evaluate_lambada if args.task == "LAMBADA" else _evaluate
    result = run(args, cfg, data, tokenizer, groups, device)
    groups.destroy()  # the process groups (megatron.training.pretrain says why not on errors)
    return result


def _load_model(args, cfg, tokenizer, groups, device, step):
    import pretrain_gpt
    from megatron.training import setup_model_and_optimizer
    from tasks.finetune_utils import load_pretrained

    _, optimizer, _, engine = setup_model_and_optimizer(
        cfg, groups, device, pretrain_gpt.model_provider, step)
    load_pretrained(engine, optimizer, args.load or args.pretrained_checkpoint, groups, (),
                    vocab_size=tokenizer.vocab_size,
                    flag="--load" if args.load else "--pretrained-checkpoint",
                    allow_unsafe=args.allow_unsafe_checkpoint)
    return engine


def _run_batches(engine, dataset, padding, args, cfg, groups):
    """Every sample of ``dataset`` once, a global batch at a time (the last filled with
    ``padding``'s all-masked samples); '> working on iteration: i' every --log-interval
    batches.  The sums of the per-batch means (same divisor each batch) on the last
    stage, else None."""
    from megatron.training_log import print_rank_last
    from tasks.finetune_utils import microbatches

    gbs = cfg.training.global_batch_size
    num_batches = max(1, math.ceil(len(dataset) / gbs))
    padded = padding(dataset, num_batches * gbs)
    it = microbatches(padded, range(len(padded)), cfg.training.micro_batch_size,
                      groups.dp_rank, groups.dp_size)
    interval = max(1, args.log_interval or 1)
    totals = None
    for i in range(num_batches):
        if i % interval == 0:
            print_rank_last(f"> working on iteration: {i}")
        out = engine.evaluate(it, 1)
        if out is not None:
            totals = {k: (totals or {}).get(k, 0.0) + v for k, v in out.items()}
    return totals


def _print_results(task: str, fields: str) -> None:
    from megatron.training_log import print_rank_last

    line = f" validation results on {task} | {fields}"
    print_rank_last(f"{'-' * (len(line) + 1)}\n{line}\n{'-' * (len(line) + 1)}")


def _evaluate(args, cfg, original: str, tokenizer, groups, device):
    from megatron.training_log import print_rank_last

    tokens = tokenizer.tokenize(wikitext_detokenize(original))
    if len(tokens) < 2:
        raise TaskDataError(f"--valid-data {' '.join(args.valid_data)}: {len(tokens)} tokens; "
                            f"expected text with at least two tokens to score")
    num_words = count_words(original)
    print_rank_last(f" > number of original tokens: {num_words}, number of detokenized "
                    f"tokens: {len(tokens)}")
    engine = _load_model(args, cfg, tokenizer, groups, device, forward_step)
    seq = cfg.model.seq_length
    stride = seq if args.overlapping_eval is None else args.overlapping_eval
    windows = LMWindowDataset(tokens, seq, stride, pad_id=tokenizer.eod)
    print_rank_last(f" > {', '.join(args.valid_data)}: {len(windows)} windows of "
                    f"{seq} tokens, stride {stride}")
    out = _run_batches(engine, windows, PaddingSamples, args, cfg, groups)
    if out is None:
        return None
    # evaluate() averages per microbatch and replica; the ratio of the two averages is
    # the exact mean over targets, and the target count is known exactly.
    avg = out["loss_sum"] / out["targets"]
    result = perplexity(avg * (len(tokens) - 1), len(tokens), num_words)
    _print_results("WIKITEXT103", f"avg loss: {result.avg_loss:.4E} | ppl: {result.ppl:.4E} | "
                                  f"adjusted ppl: {result.adjusted_ppl:.4E} | token ratio: "
                                  f"{result.token_ratio} |")
    print_rank_last("done :-)")
    return result


def _evaluate_lambada(args, cfg, passages, tokenizer, groups, device):
    from megatron.training_log import print_rank_last

    seq = cfg.model.seq_length
    samples = lambada_samples(passages, tokenizer, bool(args.strict_lambada), seq)
    dataset = LambadaDataset(samples, seq, pad_id=tokenizer.eod)
    print_rank_last(f" > found {len(dataset)} samples." + (
        f" ({dataset.truncated} longer than --seq-length {seq} + 1 tokens: their context "
        f"is cut from the left)" if dataset.truncated else ""))
    engine = _load_model(args, cfg, tokenizer, groups, device, lambada_forward_step)
    out = _run_batches(engine, dataset, PaddingSamples, args, cfg, groups)
    if out is None:
        return None
    n = len(dataset)
    correct = round(out["correct"] / max(out["count"], 1e-12) * n)
    result = LambadaResult(correct=correct, total=n, accuracy=correct / n,
                           strict=bool(args.strict_lambada))
    _print_results("LAMBADA", f"number correct: {correct:.4E} | total examples: {n:.4E} | "
                              f"avg accuracy: {result.accuracy:.4E}")
    print_rank_last("done :-)")
    return result


def main(argv: Optional[List[str]] = None):
    return evaluate(argv)

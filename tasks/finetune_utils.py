"""Finetuning loop shared by MNLI and RACE, built from the trainer's pieces.

Same flags, process groups, pipeline engine, optimizer, checkpoints and logging as
pretraining; what differs: the data are labelled examples read from --train-data and
--valid-data, training runs for --epochs passes over a shuffled training set, and after
every epoch each validation set is scored by a forward-only pass of the engine whose
loss function reports the number of correct answers.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from tasks.arguments import add_task_args
from tasks.data_utils import (ReadReport, TaskDataError, fail, refuse_corpus_flags,
                              special_ids, warn_ignored_task_flags)


@dataclass
class FinetuneTask:
    """What a task contributes: reading, dataset building and the model."""

    name: str
    read: Callable[[Sequence[str]], Tuple[List[Any], ReadReport]]
    build: Callable[[str, Sequence[Any], Any, int], torch.utils.data.Dataset]
    model_provider: Callable
    head_prefixes: Tuple[str, ...]
    """Parameters a pretraining checkpoint may lack (the new task head), initialised then."""


@dataclass
class FinetuneResult:
    accuracy: Dict[int, Dict[str, float]] = field(default_factory=dict)
    """epoch (1-based; 0 = before training) -> {validation set: accuracy} (last stage).
    An evaluation-only run without --train-data does not know how many iterations an
    epoch had: it keys (and prints) the checkpoint's iteration instead."""
    reports: Dict[str, ReadReport] = field(default_factory=dict)
    training: Any = None
    iteration: int = 0


def finetune_args(parser):
    """Task flags, plus BERT's token-type embeddings (sentence A / B)."""
    add_task_args(parser)
    parser.set_defaults(num_tokentypes=2)
    return parser


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _fail(message: str) -> None:
    fail(message)


# ------------------------------------------------------------------------ forward step
def _loss_fn(label: torch.Tensor, weight: torch.Tensor, training: bool, logits: torch.Tensor):
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    ce = F.cross_entropy(logits, label, reduction="none")
    w = weight.to(ce.dtype)
    count = w.sum()
    correct = ((logits.argmax(dim=-1) == label).to(ce.dtype) * w).sum()
    if training:
        # Divided by the microbatch's size, not by its weights: a full batch's weights
        # are 1 (the same mean), and --keep-last's incomplete batch weighs its real
        # examples gbs/R (_Padded), so its gradient and logged loss/accuracy are the
        # means over its R real examples, not diluted by the weight-0 padding.
        size = float(label.numel())
        loss = (ce * w).sum() / size
        return loss, {"loss": loss.detach(), "accuracy": (correct / size).detach()}
    loss = (ce * w).sum() / count.clamp(min=1.0)
    # Sums, so that padded evaluation microbatches (weight 0) do not skew the ratios.
    return loss, {"loss_sum": (ce * w).sum().detach(), "correct": correct.detach(),
                  "count": count.detach()}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
    device = next(model.parameters()).device
    data = {k: v.to(device) for k, v in next(data_iterator).items()}
    logits = model(data["text"], data["padding_mask"], data["types"])
    return logits, partial(_loss_fn, data["label"], data["weight"], model.training)


# ------------------------------------------------------------------------------ data
class _Padded(torch.utils.data.Dataset):
    """``dataset`` extended to ``size`` with weight-0 copies of its first sample; the
    examples ``scaled`` (the real ones of --keep-last's incomplete batch) weigh
    ``scale`` (gbs / their number, so the batch's loss is their mean)."""

    def __init__(self, dataset, size: int, scaled: Sequence[int] = (),
                 scale: float = 1.0) -> None:
        self.dataset, self.size = dataset, size
        self.pad = dict(dataset[0], weight=0)
        self.scaled, self.scale = {int(i) for i in scaled}, float(scale)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        if i >= len(self.dataset):
            return self.pad
        if i in self.scaled:
            return dict(self.dataset[i], weight=self.scale)
        return self.dataset[i]


def epoch_order(n: int, per_epoch: int, gbs: int, micro_batch_size: int,
                seed: int) -> np.ndarray:
    """The example order of one training epoch of ``per_epoch`` global batches: a
    permutation of the ``n`` examples (seeded by ``seed``), cut to ``per_epoch * gbs``.
    Where the epoch is longer than the examples (--keep-last), the last batch's missing
    places hold indices >= n (weight-0 padding, ``_Padded``), and its real examples are
    dealt round-robin over its microbatches (of every data-parallel rank), so a
    microbatch is all padding only where the batch has fewer examples than
    microbatches."""
    order = np.random.RandomState(seed).permutation(n)[:per_epoch * gbs]
    missing = per_epoch * gbs - len(order)
    if missing <= 0:
        return order
    last = len(order) - (gbs - missing)        # where the incomplete batch starts
    real = order[last:]
    slices = gbs // micro_batch_size
    tail = np.arange(n, n + gbs)               # padding everywhere, then the examples
    j = np.arange(len(real))
    tail[(j % slices) * micro_batch_size + j // slices] = real
    return np.concatenate([order[:last], tail])


def microbatches(dataset, order: Sequence[int], micro_batch_size: int, dp_rank: int,
                 dp_size: int) -> Iterator[Dict[str, torch.Tensor]]:
    """This data-parallel rank's microbatches over ``order`` (cut as the trainer does:
    groups of micro_batch_size * dp_size, rank r taking the r-th slice)."""
    from megatron.data.samplers import collate_samples

    group = micro_batch_size * dp_size
    for g0 in range(0, len(order) - group + 1, group):
        idx = order[g0 + dp_rank * micro_batch_size: g0 + (dp_rank + 1) * micro_batch_size]
        samples = [dataset[int(i)] for i in idx]
        batch = collate_samples(samples)
        if "weight" in batch:  # float: --keep-last's weights gbs/R (collate makes ints)
            batch["weight"] = torch.tensor([float(s["weight"]) for s in samples],
                                           dtype=torch.float64)
        yield batch


def evaluate_accuracy(engine, dataset, cfg, groups) -> Optional[Dict[str, float]]:
    """{accuracy, loss, correct, count} over the whole dataset (last stage; else None)."""
    gbs = cfg.training.global_batch_size
    n = len(dataset)
    num_batches = max(1, math.ceil(n / gbs))
    padded = _Padded(dataset, num_batches * gbs)
    it = microbatches(padded, range(len(padded)), cfg.training.micro_batch_size,
                      groups.dp_rank, groups.dp_size)
    out = engine.evaluate(it, num_batches)
    if out is None:
        return None
    count = max(out["count"], 1e-12)
    return {"accuracy": out["correct"] / count, "loss": out["loss_sum"] / count,
            "correct": round(out["correct"] / count * n), "count": n}


# ------------------------------------------------------------------------- set-up
def _read_all(task: FinetuneTask, raw) -> Tuple[List[Any], List[Tuple[str, List[Any]]],
                                                Dict[str, ReadReport]]:
    def read(flag: str, paths: Sequence[str]) -> Tuple[List[Any], ReadReport]:
        try:
            return task.read(paths)
        except (ValueError, OSError) as exc:  # the reader names the file and what it expected
            raise TaskDataError(f"{flag}: {exc}") from None

    reports: Dict[str, ReadReport] = {}
    train: List[Any] = []
    if raw.train_data:
        train, reports["train"] = read("--train-data", raw.train_data)
        if not train:  # not 'fewer than one global batch ... a smaller batch': none at all
            rep = reports["train"]
            why = f" (first problem: {rep.malformed[0]})" if rep.malformed else ""
            _fail(f"--train-data {' '.join(raw.train_data)}: no usable {task.name} "
                  f"examples{why}")
    valid = []
    for path in raw.valid_data or []:
        examples, rep = read("--valid-data", [path])
        if not examples:
            why = f" (first problem: {rep.malformed[0]})" if rep.malformed else ""
            _fail(f"--valid-data {path}: no usable {task.name} examples{why}")
        valid.append((path, examples))
        reports[path] = rep
    if _is_rank0():
        for rep in reports.values():
            rep.print()
    return train, valid, reports


def _iterations_argv(argv: List[str], raw, n_train: int) -> Tuple[List[str], int]:
    """Add --train-iters from --epochs; returns (argv, iterations per epoch)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = raw.tensor_model_parallel_size * raw.pipeline_model_parallel_size
    dp = world // model_parallel if model_parallel and world % model_parallel == 0 else 1
    gbs = raw.global_batch_size or (raw.micro_batch_size or 1) * dp
    per_epoch = -(-n_train // gbs) if raw.keep_last else n_train // gbs
    if raw.skip_train or raw.epochs == 0:
        return argv + ([] if raw.skip_train else ["--skip-train"]), max(per_epoch, 1)
    if per_epoch == 0:
        _fail(f"--train-data holds {n_train} examples, fewer than one global batch "
              f"(--global-batch-size {gbs}); use more data or a smaller batch")
    if raw.train_iters is None and raw.train_samples is None:
        if raw.epochs is None or raw.epochs < 0:
            _fail("finetuning needs --epochs N (or --train-iters)")
        argv = argv + ["--train-iters", str(raw.epochs * per_epoch)]
    return argv, per_epoch


def load_pretrained(engine, optimizer, path: str, groups, head_prefixes: Sequence[str], *,
                    vocab_size: Optional[int] = None,
                    flag: str = "--pretrained-checkpoint", allow_unsafe: bool = False) -> None:
    """Initialise the stage from any-layout checkpoint ``path`` (weights only).
    ``vocab_size``: this run's tokenizer vocabulary; a checkpoint of another one is refused.
    ``allow_unsafe``: --allow-unsafe-checkpoint (old pickle checkpoints)."""
    from megatron.training_log import print_rank_last
    from tools.checkpoint_util import load_into_stage

    engine.weights.install(engine.latest_buffer)
    model = engine.model
    report = load_into_stage(model, path, layer_offset=model.layer_numbers.start,
                             tp_rank=groups.tp_rank, tp_size=groups.tp_size,
                             allow_missing=head_prefixes, vocab_size=vocab_size, flag=flag,
                             allow_unsafe=allow_unsafe)
    engine.weights.sync_all_from(engine.latest_buffer)
    optimizer.reload_model_params(engine.weights.params(engine.latest_buffer))
    print_rank_last(f"loaded pretrained weights of iteration {report.iteration} from {path} "
                    f"(saved with tensor {report.source_layout[0]}, pipeline "
                    f"{report.source_layout[1]}); newly initialised: {report.missing or 'none'}")


def _setup(task: FinetuneTask, argv: List[str]):
    from megatron.arguments import parse_and_validate, parse_args
    from megatron.training import initialize_megatron

    raw = parse_args(argv, extra_args_provider=finetune_args)
    refuse_corpus_flags(raw, task.name)
    warn_ignored_task_flags(raw, task.name, ("--overlapping-eval", "--strict-lambada"))
    for flag, value in (("--rampup-batch-size", raw.rampup_batch_size),
                        ("--step-batch-size-schedule", raw.step_batch_size_schedule)):
        if value is not None:
            _fail(f"{flag} is for pretraining: finetuning trains whole epochs of "
                  "--global-batch-size batches")
    if not raw.train_data and not raw.skip_train and raw.epochs != 0:
        _fail(f"--task {task.name} needs --train-data (or --epochs 0 / --skip-train to only "
              f"evaluate)")
    if raw.tokenizer_type is None and raw.vocab_file is None:
        # the trainer's line would suggest GPT2BPETokenizer
        _fail(f"--task {task.name} needs --tokenizer-type BertWordPieceLowerCase (or "
              f"BertWordPieceCase) and --vocab-file")
    train, valid, reports = _read_all(task, raw)
    argv, per_epoch = _iterations_argv(argv, raw, len(train))
    # a bare --vocab-file: BertWordPieceLowerCase, as pretrain_bert.py (and Megatron-LM)
    args, cfg = parse_and_validate(argv, extra_args_provider=finetune_args,
                                   default_tokenizer="BertWordPieceLowerCase")
    tokenizer, groups, device = initialize_megatron(args, cfg)
    try:
        special_ids(tokenizer)  # same on every rank: one line, not a traceback per rank
    except ValueError as exc:
        _fail(str(exc))
    seq = cfg.model.seq_length
    train_ds = task.build("train", train, tokenizer, seq) if train else None
    valid_ds = [(path, task.build(path, ex, tokenizer, seq)) for path, ex in valid]
    return args, cfg, groups, device, train_ds, valid_ds, reports, per_epoch, tokenizer


def finetune(task: FinetuneTask, argv: Optional[Sequence[str]] = None) -> FinetuneResult:
    """Run a finetuning task end to end; returns this rank's result."""
    argv = list(argv if argv is not None else sys.argv[1:])
    from megatron.save_lock import release_save_dir

    setup = _setup(task, argv)
    try:
        result = _finetune(task, *setup)
        setup[2].destroy()  # process groups (megatron.training.pretrain says why not on errors)
    finally:
        if setup[1].training.save:  # the --save lock initialize_megatron took
            release_save_dir(setup[1].training.save)
    return result


def _finetune(task: FinetuneTask, args, cfg, groups, device, train_ds,
              valid_ds, reports, per_epoch, tokenizer) -> FinetuneResult:
    from megatron.checkpoint_discovery import find_checkpoint
    from megatron.errors import UserError, alike_on_every_rank
    from megatron.initialize import barrier_with_message
    from megatron.training_exits import ExitRequests, NonFiniteError
    from megatron.manual_gc import ManualGC
    from megatron.profiling import StepProfiler
    from megatron.training_loop import TrainingResult, _save_checked, profiled_run_end, train
    from megatron.training_setup import setup_model_and_optimizer
    from megatron.training_checkpoint import maybe_load
    from megatron.training_log import TrainingLogger, print_rank_last

    model, optimizer, scheduler, engine = setup_model_and_optimizer(
        cfg, groups, device, task.model_provider, forward_step)
    tr = cfg.training
    # find_checkpoint, not the tracker alone: without a tracker the newest complete
    # iteration is resumed rather than finetuning restarting over it
    if tr.load and find_checkpoint(tr.load).iteration is not None:
        state = maybe_load(cfg, groups, engine, optimizer, scheduler)
    else:
        from megatron.checkpointing import TrainState
        state = TrainState()
        if args.pretrained_checkpoint:
            load_pretrained(engine, optimizer, args.pretrained_checkpoint, groups,
                            task.head_prefixes, vocab_size=tokenizer.vocab_size,
                            allow_unsafe=args.allow_unsafe_checkpoint)
        else:
            print_rank_last(f"WARNING: no --pretrained-checkpoint: finetuning {task.name} from "
                            f"randomly initialised weights")
    total = tr.train_iters or 0
    if train_ds is not None and not tr.skip_train and total and state.iteration >= total:
        # as pretraining says it (megatron.training): not a silent re-save of the last one
        end = (f"the end of --epochs {args.epochs} ({per_epoch} iterations each); raise "
               f"--epochs" if args.epochs else f"--train-iters {total}; raise --train-iters")
        # same flags and checkpoint: one line per node
        raise alike_on_every_rank(UserError(
            f"nothing to train: the checkpoint in --load {tr.load} is at iteration "
            f"{state.iteration}, {end} to continue, or pass --epochs 0 to only evaluate"))
    logger = TrainingLogger(cfg, groups)
    logger.banner(engine, model)
    result = FinetuneResult(reports=reports, training=TrainingResult())
    with logger.paused():  # waiting for the slowest rank's set-up is no iteration's time
        barrier_with_message(f"start of {task.name} finetuning")

    # one profiler window and one --manual-gc setting over all the epochs (each epoch is
    # a train() call): a window across an epoch's end is one trace, and the scores
    # between epochs are evaluations, with --manual-gc's collections around them
    manual_gc = ManualGC(tr)

    def score(epoch: int, when: str = "") -> None:
        when = when or f"epoch {epoch}"
        with logger.paused(), manual_gc.around_evaluation():  # not training time
            _score(epoch, when)

    def _score(epoch: int, when: str) -> None:
        for name, ds in valid_ds:
            out = evaluate_accuracy(engine, ds, cfg, groups)
            if out is not None:
                result.accuracy.setdefault(epoch, {})[name] = out["accuracy"]
                print_rank_last(f" {task.name} {when} | validation {name} | accuracy "
                                f"{out['accuracy']:.4f} ({out['correct']}/{out['count']}) | "
                                f"loss {out['loss']:.6E}")

    if tr.skip_train or train_ds is None or total == 0:
        if train_ds is None and state.iteration > 0:
            # without --train-data the epoch length is unknown: iteration // 1 would be
            # printed as the epoch ('epoch 98' for a one-epoch RACE checkpoint)
            score(state.iteration, f"iteration {state.iteration}")
        else:
            score(state.iteration // per_epoch)
    else:
        epochs = math.ceil(total / per_epoch)
        gbs = tr.global_batch_size
        logger.total_iterations = total  # 'iteration i/N': the run's end, not the epoch's
        exits = ExitRequests(cfg)  # SIGTERM / --exit-duration-in-mins, as in pretraining
        exits.install()
        profiler = StepProfiler(tr.profile, groups.rank, state.iteration, device,
                                run_end=profiled_run_end(cfg, state.iteration, total))
        try:
            with profiler, manual_gc:  # (restored before the final save)
                for epoch in range(state.iteration // per_epoch, epochs):
                    skip = state.iteration - epoch * per_epoch
                    order = epoch_order(len(train_ds), per_epoch, gbs, tr.micro_batch_size,
                                        tr.seed + epoch)
                    epoch_ds = train_ds
                    if per_epoch * gbs > len(train_ds):   # --keep-last
                        last = order[(per_epoch - 1) * gbs:]
                        last = last[last < len(train_ds)]
                        epoch_ds = _Padded(train_ds, per_epoch * gbs, last, gbs / len(last))
                    order = order[skip * gbs:]
                    train_iter = microbatches(epoch_ds, order, tr.micro_batch_size,
                                              groups.dp_rank, groups.dp_size)
                    tr.train_iters = min((epoch + 1) * per_epoch, total)
                    train(cfg, groups, engine, optimizer, scheduler, state, train_iter, None,
                          logger, result.training, exits, profiler=profiler,
                          manual_gc=manual_gc)
                    if result.training.exited_early:
                        break
                    score(epoch + 1)
                    it = state.iteration
                    if tr.exit_interval and it % tr.exit_interval == 0 and it < total:
                        # train() acts on --exit-interval only before its end, the epoch's
                        # here: stop after the epoch's score, saved as train() saves
                        if (tr.save and result.training.nonfinite_ending is None
                                and not (tr.save_interval and it % tr.save_interval == 0)):
                            _save_checked(cfg, groups, engine, optimizer, scheduler, state)
                        print_rank_last(f"exiting at iteration {it} (--exit-interval "
                                        f"{tr.exit_interval})")
                        result.training.exited_early = True
                        break
            tr.train_iters = total
            if result.training.nonfinite_ending is not None:
                # the last epoch ended on steps skipped for inf/nan: fail, save nothing
                # (same verdict on every rank, as in pretraining)
                logger.close()
                raise NonFiniteError(result.training.nonfinite_ending)
            if tr.save and state.iteration > 0 and not result.training.exited_early and not (
                    tr.save_interval and state.iteration % tr.save_interval == 0):
                _save_checked(cfg, groups, engine, optimizer, scheduler, state)
        finally:
            # (after the final save: a SIGTERM during it lets it finish, as in pretraining)
            exits.restore()
            tr.train_iters = total
    result.iteration = state.iteration
    logger.close()
    return result

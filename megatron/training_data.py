"""The data a run reads: iterators over the datasets the entry point's
``datasets_provider`` builds for the training, validation and test splits, positioned
where a resumed run left them, and the checks that there is something to train on or
to evaluate (one line on every rank, before any collective of training).
"""
from __future__ import annotations

from typing import Any, Iterator, Tuple

from megatron.checkpointing import TrainState
from megatron.config import MegatronConfig
from megatron.errors import DataError, alike_on_every_rank
from megatron.parallel_state import ParallelGroups


def _cyclic(loader, first=None) -> Iterator[Any]:
    """``first`` (a loader starting later in the same data) once, then ``loader`` over
    and over."""
    if first is not None:
        yield from first
    while True:
        for item in loader:
            yield item


def _until_exhausted(iterator, start_iteration: int, start_samples: int, train_iters: int,
                     dataset_samples: int, samples_per_microbatch: int, tr) -> Iterator[Any]:
    """``iterator``'s items; when it runs out, a one-line DataError naming the iteration
    (the engine would fail with a traceback).  The trainer asks the datasets provider
    for every sample the run needs, so only a provider that returns fewer gets here."""
    read = 0
    for item in iterator:
        read += 1
        yield item
    samples = read * samples_per_microbatch
    batches = tr.batch_sizes()
    done = (batches.iterations(start_samples + samples, start_samples) if batches is not None
            else samples // tr.global_batch_size)
    needed = tr.samples_after(train_iters - start_iteration, start_samples)
    raise alike_on_every_rank(DataError(
        f"the training data ran out at iteration {start_iteration + done + 1} of "
        f"{train_iters}: the training dataset holds {dataset_samples} samples "
        f"and this run reads samples {start_samples} to {needed - 1} (the datasets provider "
        f"returned fewer samples than it was asked for); the last saved checkpoint stays "
        f"the latest"))


def build_data_iterators(cfg: MegatronConfig, groups: ParallelGroups, tokenizer,
                         datasets_provider, state: TrainState) -> Tuple[Any, Any, Any]:
    from megatron.data.samplers import build_pretraining_data_loader

    tr = cfg.training
    gbs = tr.global_batch_size
    train_iters = tr.train_iters or 0
    eval_runs = (train_iters // tr.eval_interval + 1) if tr.eval_interval else 1
    # a resumed run reads on from its consumed samples (more or fewer than
    # iteration x gbs when --global-batch-size changed)
    n_train = max(tr.samples_after(train_iters, 0),
                  tr.samples_after(train_iters - state.iteration, state.consumed_train_samples))
    n_valid = eval_runs * tr.eval_iters * gbs
    n_test = tr.eval_iters * gbs
    train_ds, valid_ds, test_ds = datasets_provider(cfg, tokenizer, (n_train, n_valid, n_test))

    def loader(ds, consumed):
        if ds is None or len(ds) == 0:
            return None
        return build_pretraining_data_loader(ds, consumed, tr.micro_batch_size, groups.dp_rank,
                                             groups.dp_size, cfg.data.num_workers)

    # Evaluation only: no train loader, whose position (consumed samples of a finished
    # run) may lie at the end of the training set.
    train = None if tr.skip_train else loader(train_ds, state.consumed_train_samples)
    valid = loader(valid_ds, 0)
    test = loader(test_ds, 0)
    if tr.eval_iters:
        # a split too small for one micro-batch yields nothing, and the cyclic reader
        # below would spin forever at the first evaluation
        for split, name, ld, ds in ((1, "validation", valid, valid_ds),
                                    (2, "test", test, test_ds)):
            if ld is not None and len(ld) == 0:
                n = len(ds)
                raise alike_on_every_rank(DataError(
                    f"the {name} split holds {n} sample{'s' if n != 1 else ''}, fewer than one "
                    f"micro-batch of --micro-batch-size {tr.micro_batch_size} x data-parallel "
                    f"size {groups.dp_size} ({cfg.data.describe_split(split)}); give it more "
                    f"data, or pass --eval-iters 0 to train without evaluating"))
    # validation reads on from where the checkpoint's run left it (Megatron-LM's
    # consumed_valid_samples), so a resumed run evaluates the batches an uninterrupted
    # one would; past the end it starts over from the first sample
    ahead = (loader(valid_ds, state.consumed_valid_samples % len(valid_ds))
             if valid is not None and state.consumed_valid_samples else None)
    if train is not None:
        train_iter = _until_exhausted(iter(train), state.iteration,
                                      state.consumed_train_samples, train_iters, len(train_ds),
                                      tr.micro_batch_size * groups.dp_size, tr)
    return (train_iter if train is not None else None,
            _cyclic(valid, first=ahead) if valid is not None else None,
            _cyclic(test) if test is not None else None)


def check_train_data(cfg: MegatronConfig, train_iter) -> None:
    """Training was asked for: there must be samples to train on (every rank builds the
    same datasets, so every rank raises)."""
    if not cfg.training.skip_train and train_iter is None:
        raise alike_on_every_rank(DataError(
            f"nothing to train on: the training split is empty ({cfg.data.describe_split(0)}); "
            f"give the training part a share of the data"))


def check_eval_data(cfg: MegatronConfig, valid_iter) -> None:
    """Evaluation only (--skip-train) was asked for: there must be something to
    evaluate, or the run would do nothing and exit 0 (every rank builds the same
    datasets, so every rank raises)."""
    from megatron.arguments import ArgumentError  # a verdict on flags: one line a node

    tr = cfg.training
    if not tr.skip_train:
        return
    if not tr.eval_iters:
        raise ArgumentError("nothing to do: --skip-train only evaluates, and --eval-iters 0 "
                            "evaluates nothing; give --eval-iters a positive number of "
                            "batches")
    if valid_iter is None:
        raise alike_on_every_rank(DataError(
            f"nothing to evaluate: --skip-train only evaluates, and the validation split is "
            f"empty ({cfg.data.describe_split(1)}); give the validation part a share of the "
            f"data" + (" (--valid-data-path)" if cfg.data.split_data_paths else "")))

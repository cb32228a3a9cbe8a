"""Megatron-LM's per-split datasets: --train-data-path, --valid-data-path, --test-data-path.

Each split reads only its own files (a prefix or a blend in --data-path's forms), each
used whole; --split plays no part (a note says so when given); a split without a path
has no dataset (no validation without --valid-data-path).  Every corpus below holds its
own token range, so a sample shows which file it came from."""
from __future__ import annotations

import contextlib
import io
from typing import Dict, Tuple

import numpy as np
import pytest

from megatron.arguments import ArgumentError, build_config, parse_args, validate_args
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.errors import DataError
from tests.distributed.gpt_harness import TINY

# token range [lo, hi) of each corpus (ids 0-3 stay free: BERT's [PAD] [CLS] [SEP] [MASK])
RANGES: Dict[str, Tuple[int, int]] = {"train": (4, 30), "train2": (30, 45),
                                      "valid": (50, 70), "test": (75, 95)}


def _corpus(prefix, lo: int, hi: int, docs: int = 12, sentences: int = 1) -> str:
    """``docs`` documents of ``sentences`` sequences of 6-14 ids in [lo, hi)."""
    rng = np.random.default_rng(lo)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for _ in range(docs):
        for _ in range(sentences):
            b.add_item(rng.integers(lo, hi, int(rng.integers(6, 15))))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture
def corpora(tmp_path) -> Dict[str, str]:
    return {name: _corpus(tmp_path / name, lo, hi) for name, (lo, hi) in RANGES.items()}


def _within(tokens: np.ndarray, name: str) -> bool:
    lo, hi = RANGES[name]
    return bool(tokens.size) and bool(np.all((tokens >= lo) & (tokens < hi)))


def _gpt_tokens(ds) -> np.ndarray:
    return np.concatenate([ds[i]["text"] for i in range(len(ds))])


def _no_data(argv):
    return [a for a in argv if a != "--mock-data"]


def _validate(argv):
    args = parse_args(argv)
    validate_args(args, 1)
    return args


# ------------------------------------------------------------------- dataset builders
def test_gpt_each_split_reads_only_its_own_file_whole(corpora, tmp_path):
    from megatron.data.gpt_dataset import build_split_path_datasets

    train, valid, test = build_split_path_datasets(
        ([corpora["train"]], [corpora["valid"]], [corpora["test"]]), (40, 10, 6), 8, 3,
        str(tmp_path / "cache"), vocab_size=96)
    assert (len(train), len(valid), len(test)) == (40, 10, 6)
    for ds, name in ((train, "train"), (valid, "valid"), (test, "test")):
        assert _within(_gpt_tokens(ds), name), name
        # used whole: every document of the file, no --split cut
        assert set(ds.doc_idx.tolist()) == set(range(len(ds.indexed_dataset)))
    # the same request again reads the cached indices
    again = build_split_path_datasets(([corpora["train"]], [], []), (40, 0, 0), 8, 3,
                                      str(tmp_path / "cache"), vocab_size=96)
    assert again[0].index_cache_hit and again[1] is None and again[2] is None
    assert np.array_equal(_gpt_tokens(again[0]), _gpt_tokens(train))


def test_gpt_weighted_and_unweighted_blend_on_one_split(corpora, tmp_path):
    from megatron.data.gpt_dataset import build_split_path_datasets

    cache = str(tmp_path / "cache")
    train, valid, test = build_split_path_datasets(
        (["0.75", corpora["train"], "0.25", corpora["train2"]], [corpora["valid"]], None),
        (40, 8, 8), 8, 3, cache)
    assert isinstance(train, BlendableDataset) and len(train) == 40
    assert np.bincount(train.dataset_index).tolist() == [30, 10]
    for i in range(len(train)):
        name = ("train", "train2")[int(train.dataset_index[i])]
        assert _within(train[i]["text"], name)
    assert _within(_gpt_tokens(valid), "valid") and test is None  # no --test-data-path
    # without weights: each prefix's share of the tokens (size_weights)
    from megatron.data.dataset_utils import size_weights

    blend = build_split_path_datasets(([corpora["train"], corpora["train2"]], None, None),
                                      (40, 0, 0), 8, 3, cache)[0]
    assert np.allclose(blend.weights, size_weights([corpora["train"], corpora["train2"]]))


def test_bert_each_split_reads_only_its_own_file(tmp_path):
    from megatron.data.bert_dataset import (BertVocabInfo, MaskingConfig,
                                            build_split_path_datasets)

    prefixes = {n: _corpus(tmp_path / n, *RANGES[n], docs=8, sentences=4)
                for n in ("train", "valid")}
    info = BertVocabInfo(cls=1, sep=2, mask=3, pad=0, vocab_size=96,
                         random_ids=np.arange(4, 96))
    train, valid, test = build_split_path_datasets(
        ([prefixes["train"]], [prefixes["valid"]], []), (12, 6, 6), 32, 1, info,
        MaskingConfig(), str(tmp_path / "cache"))
    assert test is None and (len(train), len(valid)) == (12, 6)
    for ds, name in ((train, "train"), (valid, "valid")):
        for i in range(len(ds)):
            s = ds[i]
            kept = s["text"][(s["loss_mask"] == 0) & (s["text"] > 3)]   # unmasked words
            predicted = s["labels"][s["loss_mask"] == 1]                # the masked words
            assert _within(np.concatenate([kept, predicted]), name), (name, i)


def test_builder_errors_name_the_flag(corpora, tmp_path):
    from megatron.data.gpt_dataset import build_split_path_datasets

    cache = str(tmp_path / "cache")
    with pytest.raises(DataError, match=r"^--valid-data-path: dataset prefix .*nope.* not "
                                        r"found") as info:
        build_split_path_datasets(([corpora["train"]], [str(tmp_path / "nope")], None),
                                  (8, 8, 0), 8, 1, cache)
    assert info.value.every_rank_alike  # one line a node
    with pytest.raises(DataError, match=r"^--test-data-path .*: expected a single prefix"):
        build_split_path_datasets(([corpora["train"]], None, ["0.5", corpora["test"], "1"]),
                                  (8, 0, 8), 8, 1, cache)
    empty = IndexedDatasetBuilder(str(tmp_path / "empty.bin"), np.int32)
    empty.finalize(str(tmp_path / "empty.idx"))
    with pytest.raises(DataError, match=r"^--train-data-path .*empty: the train split needs "
                                        r"8 samples .* holds no tokens"):
        build_split_path_datasets(([str(tmp_path / "empty")], None, None), (8, 0, 0), 8, 1,
                                  cache)


# ------------------------------------------------------------------------- arguments
def test_flags_reach_the_config_and_split_gets_a_note(corpora):
    argv = _no_data(TINY) + ["--train-data-path", "0.3", corpora["train"], "0.7",
                             corpora["train2"], "--valid-data-path", corpora["valid"]]
    args = _validate(argv)
    d = build_config(args).data
    assert d.train_data_path == ["0.3", corpora["train"], "0.7", corpora["train2"]]
    assert (d.valid_data_path, d.test_data_path, d.data_path) == ([corpora["valid"]], [], [])
    assert d.split_data_paths == (d.train_data_path, d.valid_data_path, [])
    assert not any("--split" in n for n in args.megatron_lm_notes)
    args = _validate(argv + ["--split", "949,50,1"])
    notes = [n for n in args.megatron_lm_notes if "--split" in n]
    assert notes == ["note: --split '949,50,1' is ignored with --train-data-path and "
                     "--valid-data-path: each split reads its own datasets whole (as in "
                     "Megatron-LM)"]
    # evaluation only needs no training split
    assert _validate(_no_data(TINY) + ["--skip-train", "--valid-data-path", corpora["valid"]])


@pytest.mark.parametrize("extra,expected", [
    (["--data-path", "{train}", "--train-data-path", "{train}"],
     "--data-path and --train-data-path are mutually exclusive"),
    (["--mock-data", "--valid-data-path", "{valid}", "--train-data-path", "{train}"],
     "--train-data-path and --mock-data are mutually exclusive"),
    (["--valid-data-path", "{valid}"], "training needs data: --valid-data-path without "
                                       "--train-data-path"),
    (["--train-data-path"], "--train-data-path was given without any prefix"),
    (["--train-data-path", "{train}", "--valid-data-path", "{missing}"],
     "--valid-data-path prefix '{missing}': file {missing}.bin does not exist"),
    (["--train-data-path", "{train}", "--test-data-path", "{onlybin}"],
     "--test-data-path prefix '{onlybin}': file {onlybin}.idx does not exist"),
    (["--train-data-path", "0.3", "{train}", "0.7"],
     "--train-data-path in weighted form must alternate weight and prefix"),
    (["--train-data-path", "{train}", "--valid-data-path", "-1", "{valid}", "1", "{test}"],
     "--valid-data-path weights must be positive"),
], ids=["with-data-path", "with-mock-data", "no-train", "empty", "missing-bin",
        "missing-idx", "odd-weighted", "negative-weight"])
def test_bad_command_lines_name_the_flag(corpora, tmp_path, extra, expected):
    onlybin = tmp_path / "onlybin"
    onlybin.with_suffix(".bin").write_bytes(b"")
    names = dict(corpora, missing=str(tmp_path / "missing"), onlybin=str(onlybin))
    argv = _no_data(TINY) + [a.format(**names) for a in extra]
    with pytest.raises(ArgumentError) as info:
        _validate(argv)
    assert expected.format(**names) in str(info.value)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------- training, in process
def _pretrain(argv):
    """A short in-process GPT run; also returns the datasets the provider built."""
    import pretrain_gpt
    from megatron.training import pretrain

    built = []

    def provider(cfg, tokenizer, num_samples):
        built.append(pretrain_gpt.datasets_provider(cfg, tokenizer, num_samples))
        return built[-1]

    with contextlib.redirect_stdout(io.StringIO()):
        result = pretrain(provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                          argv=argv)
    return result, built[0]


def test_gpt_training_reads_each_split_and_skips_validation_without_a_path(corpora,
                                                                           tmp_path):
    base = _no_data(TINY) + ["--train-iters", "2", "--eval-interval", "2",
                             "--data-cache-path", str(tmp_path / "cache"),
                             "--train-data-path", corpora["train"]]
    result, (train, valid, test) = _pretrain(base + ["--valid-data-path", corpora["valid"]])
    assert result.iteration == 2 and result.eval_losses  # evaluated on the valid file
    assert _within(_gpt_tokens(train), "train") and _within(_gpt_tokens(valid), "valid")
    assert test is None
    # eval_iters x global batch per evaluation: at iteration 2 and at the end
    assert len(valid) == 2 * 1 * 8
    assert not result.test_losses
    result, (train, valid, test) = _pretrain(base)
    assert result.iteration == 2 and not result.eval_losses
    assert valid is None and test is None
    # a test split is evaluated once, at the end of training, as Megatron-LM does
    result, (train, valid, test) = _pretrain(base + ["--test-data-path", corpora["test"]])
    assert valid is None and _within(_gpt_tokens(test), "test")
    assert not result.eval_losses and list(result.test_losses) == [2]
    assert set(result.test_losses[2]) == {"lm loss"}


def test_bert_provider_reads_the_split_paths(tmp_path):
    import pretrain_bert
    from megatron.tokenizer.tokenizer import NullTokenizer

    train = _corpus(tmp_path / "train", *RANGES["train"], docs=8, sentences=4)
    test = _corpus(tmp_path / "test", *RANGES["test"], docs=8, sentences=4)
    argv = _no_data(TINY) + ["--train-data-path", train, "--test-data-path", test,
                             "--seq-length", "32", "--max-position-embeddings", "32",
                             "--data-cache-path", str(tmp_path / "cache")]
    cfg = build_config(_validate(argv))
    ds = pretrain_bert.datasets_provider(cfg, NullTokenizer(96), (8, 8, 8))
    assert ds[1] is None  # no --valid-data-path
    for d, name in ((ds[0], "train"), (ds[2], "test")):
        s = d[0]
        assert _within(s["text"][(s["loss_mask"] == 0) & (s["text"] > 3)], name)

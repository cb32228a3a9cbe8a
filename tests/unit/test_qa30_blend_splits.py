"""A blend of --data-path prefixes with a zero --split share for valid/test (Megatron-LM's
common --split 100,0,0) skips that split, as one prefix does, instead of failing."""
from __future__ import annotations

import numpy as np
import pytest

from megatron.data.bert_dataset import MaskingConfig
from megatron.data.bert_dataset import build_train_valid_test_datasets as build_bert
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.gpt_dataset import build_train_valid_test_datasets as build_gpt
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.errors import DataError
from tests.unit.test_bert_dataset import _info, _sentence_corpus


def _corpus(prefix, n_docs, seed):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for _ in range(n_docs):
        b.add_item(rng.integers(4, 90, int(rng.integers(5, 30))))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.mark.parametrize("split", ["100,0,0", "98,2,0"])
def test_gpt_blend_skips_valid_and_test_splits_with_no_share(tmp_path, split):
    pa, pb = _corpus(tmp_path / "a", 40, 1), _corpus(tmp_path / "b", 30, 2)
    one = build_gpt([pa], split, (40, 8, 8), 8, 3, str(tmp_path / "cache"))
    blend = build_gpt(["0.7", pa, "0.3", pb], split, (40, 8, 8), 8, 3,
                      str(tmp_path / "cache"))
    assert isinstance(blend[0], BlendableDataset) and len(blend[0]) == 40
    assert blend[2] is None and one[2] is None  # test: no share, skipped like one prefix
    assert (blend[1] is None) == (one[1] is None) == (split == "100,0,0")


def test_bert_blend_skips_valid_and_test_splits_with_no_share(tmp_path):
    pa, pb = _sentence_corpus(tmp_path / "a", 90), _sentence_corpus(tmp_path / "b", 90)
    train, valid, test = build_bert(["0.5", pa, "0.5", pb], "100,0,0", (10, 4, 4), 32, 1,
                                    _info(100), MaskingConfig(), str(tmp_path / "cache"))
    assert isinstance(train, BlendableDataset) and len(train) == 10
    assert valid is None and test is None


def test_blend_whose_one_prefix_lacks_a_split_is_still_an_error(tmp_path):
    pa, pb = _corpus(tmp_path / "a", 40, 1), _corpus(tmp_path / "b", 1, 2)
    with pytest.raises(DataError, match=r"--split '90,10,0' with --data-path .*b: the valid"):
        build_gpt(["0.5", pa, "0.5", pb], "90,10,0", (10, 10, 0), 4, 1,
                  str(tmp_path / "cache"))


@pytest.mark.parametrize("build", [build_gpt, build_bert])
def test_dataset_build_errors_are_one_line_per_node(tmp_path, build):
    """Every rank builds its datasets from the same flags and files: a build error is
    printed by local rank 0 of each node, not once per rank (torchrun showed 2 copies
    of 'the train split has no document with 2 or more sentences' at w=2)."""
    args = ([str(tmp_path / "nope")], "1,0,0", (4, 0, 0), 8, 1)
    extra = (_info(100), MaskingConfig()) if build is build_bert else ()
    with pytest.raises(DataError, match="--data-path: dataset prefix") as info:
        build(*args, *extra)
    assert info.value.every_rank_alike

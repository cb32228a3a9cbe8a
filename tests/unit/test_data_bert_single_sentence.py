"""A sentence-level corpus whose documents hold one sentence each gets an error that
says so, rather than advice to split sentences (which it already is)."""
import numpy as np
import pytest

from megatron.data.bert_dataset import BertDataset, BertVocabInfo, MaskingConfig
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.errors import DataError


class _Tok:
    vocab_size = 64
    cls, sep, mask, pad = 1, 2, 3, 0
    inv_vocab = {i: f"t{i}" for i in range(64)}


def _corpus(prefix, sentences_per_doc):
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for n in sentences_per_doc:
        for _ in range(n):
            b.add_item(np.arange(4, 12))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def test_single_sentence_documents_of_a_sentence_corpus(tmp_path):
    # documents 0-3 hold one sentence each; document 4 (outside the split) holds three
    ds = _corpus(tmp_path / "s", [1, 1, 1, 1, 3])
    with pytest.raises(DataError) as info:
        BertDataset("train", ds, 0, 4, 10, 32, 1, BertVocabInfo.from_tokenizer(_Tok()),
                    MaskingConfig(), str(tmp_path / "cache"))
    msg = str(info.value)
    assert "\n" not in msg and "train split" in msg and "4 documents are too short" in msg
    assert "--split-sentences" not in msg


def test_document_level_corpus_still_points_at_split_sentences(tmp_path):
    ds = _corpus(tmp_path / "d", [1] * 5)
    with pytest.raises(DataError, match="--split-sentences"):
        BertDataset("train", ds, 0, 5, 10, 32, 1, BertVocabInfo.from_tokenizer(_Tok()),
                    MaskingConfig(), str(tmp_path / "cache"))

"""BERT pretraining data follows Megatron-LM's rules (QA pass 48).

* The sample mapping walks whole epochs and shuffles them together, so a run that
  needs fewer samples than an epoch draws them from every document of its split.
* A document's last run takes the sentences left (none is dropped), and documents with
  a sentence of more than 512 tokens are skipped.
* Masking is Megatron-LM's default: whole words, n-grams of up to 3 words (P(n) ~ 1/n),
  at most ``mask_prob * target length`` predictions.
"""
from __future__ import annotations

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.bert_dataset import (BertVocabInfo, MaskingConfig, build_bert_mapping_py,
                                        build_training_sample)


def _info(vocab: int = 1000, continuation=None) -> BertVocabInfo:
    return BertVocabInfo(cls=1, sep=2, mask=3, pad=0, vocab_size=vocab,
                         random_ids=np.arange(4, vocab), is_continuation=continuation)


def _mapping(*args, **kwargs) -> np.ndarray:
    got = helpers.build_bert_mapping(*args, **kwargs)
    np.testing.assert_array_equal(got, build_bert_mapping_py(*args, **kwargs))
    return got


# ------------------------------------------------------------------------------ mapping
def test_fewer_samples_than_an_epoch_come_from_every_document():
    # 60 documents of six 20-token sentences: two samples each at 45 tokens (120 an epoch)
    docs = np.arange(0, 361, 6, dtype=np.int64)
    sizes = np.full(360, 20, dtype=np.int32)
    mapping = _mapping(docs, sizes, 30, 45, 0.0, 11, 2)
    assert mapping.shape == (30, 3)
    doc_of = np.searchsorted(docs, mapping[:, 0], side="right") - 1
    # Truncating the first epoch after 30 samples would use documents 0-14 only.
    assert doc_of.max() >= 40 and len(set(doc_of.tolist())) > 20, sorted(doc_of.tolist())
    # Two whole epochs: every sample exactly twice.
    more = _mapping(docs, sizes, 240, 45, 0.0, 11, 2)
    runs, times = np.unique(more[:, :2], axis=0, return_counts=True)
    assert len(runs) == 120 and np.all(times == 2)


def test_no_sentence_of_a_document_is_left_over():
    sizes = np.array([30, 30, 5], dtype=np.int32)
    docs = np.array([0, 3], dtype=np.int64)
    # 30 + 30 reaches the target, but one sentence would be left: it joins the run.
    for min_num_sent in (2, 1):
        mapping = _mapping(docs, sizes, 1, 50, 0.0, 3, min_num_sent)
        assert mapping.tolist() == [[0, 3, 50]], (min_num_sent, mapping.tolist())
    # With two sentences left the document is cut there.
    sizes = np.array([30, 30, 5, 5], dtype=np.int32)
    mapping = _mapping(np.array([0, 4], dtype=np.int64), sizes, 2, 50, 0.0, 3, 2)
    assert sorted(mapping.tolist()) == [[0, 2, 50], [2, 4, 50]]


def test_documents_with_a_sentence_over_512_tokens_are_skipped():
    sizes = np.array([600, 10, 10, 10, 700], dtype=np.int32)
    docs = np.array([0, 2, 4, 5], dtype=np.int64)  # [600, 10], [10, 10], [700]
    mapping = _mapping(docs, sizes, 4, 100, 0.0, 5, 2)
    assert {tuple(r) for r in mapping[:, :2].tolist()} == {(2, 4)}
    # One-sentence documents are not checked (Megatron-LM tests documents of 2+ only).
    mapping = _mapping(docs, sizes, 6, 100, 0.0, 5, 1)
    assert {tuple(r) for r in mapping[:, :2].tolist()} == {(2, 4), (4, 5)}
    # 0 keeps every document
    mapping = _mapping(docs, sizes, 4, 100, 0.0, 5, 2, long_sentence_len=0)
    assert {tuple(r) for r in mapping[:, :2].tolist()} == {(0, 2), (2, 4)}
    with pytest.raises(RuntimeError, match="enough sentences"):
        helpers.build_bert_mapping(docs[:2], sizes, 4, 100, 0.0, 5, 2)


def test_cpp_equals_python_reference_with_long_sentences_and_leftovers():
    rng = np.random.RandomState(48)
    compared = 0
    for _ in range(30):
        counts = rng.randint(0, 9, size=rng.randint(1, 25))
        docs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        sizes = rng.randint(1, 60, size=int(docs[-1])).astype(np.int32)
        sizes[rng.rand(len(sizes)) < 0.05] = 530
        args = (docs, sizes, int(rng.randint(0, 120)), int(rng.randint(2, 90)),
                float(rng.choice([0.0, 0.1, 0.5])), int(rng.randint(0, 2 ** 62)),
                int(rng.randint(1, 3)))
        try:
            expected = build_bert_mapping_py(*args)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="enough sentences"):
                helpers.build_bert_mapping(*args)
            continue
        np.testing.assert_array_equal(helpers.build_bert_mapping(*args), expected)
        compared += 1
    assert compared >= 15


# ------------------------------------------------------------------------------ masking
def test_masking_defaults_are_megatron_lms():
    import pretrain_bert

    m = MaskingConfig()
    assert m.whole_word_masking and m.max_ngram == 3
    m = pretrain_bert.masking_from_args([])
    assert m.whole_word_masking and m.max_ngram == 3
    m = pretrain_bert.masking_from_args(["--no-whole-word-masking", "--masking-max-ngram", "1"])
    assert not m.whole_word_masking and m.max_ngram == 1


def _long_sentences(rng, n=4):
    return [rng.randint(4, 1000, size=200) for _ in range(n)]


@pytest.mark.parametrize("target,seq,most", [(125, 128, 18), (509, 512, 76), (40, 128, 6)])
def test_predictions_are_capped_at_mask_prob_times_target(target, seq, most):
    # Megatron-LM: min(mask_prob * target, max(1, round(mask_prob * tokens))) predictions
    rng = np.random.RandomState(0)
    counts = [int(build_training_sample(_long_sentences(rng), target, seq, _info(), 0.15,
                                        np.random.RandomState(i))["loss_mask"].sum())
              for i in range(40)]
    assert max(counts) == most and min(counts) >= most - 2, counts


def test_ngram_masking_masks_runs_of_words():
    def successor_rate(max_ngram: int) -> float:
        rng = np.random.RandomState(1)
        both = first = 0
        for i in range(150):
            s = build_training_sample(_long_sentences(rng, 2), 125, 128, _info(), 0.15,
                                      np.random.RandomState(i), max_ngram=max_ngram)
            sel = s["loss_mask"][1:int(s["padding_mask"].sum()) - 1] == 1
            first += int(sel[:-1].sum())
            both += int((sel[:-1] & sel[1:]).sum())
        return both / first

    # unigrams: the next token is predicted about 15% of the time; with 1-3-grams
    # (P = 6/11, 3/11, 2/11) about 40% of predicted words continue into the next one
    assert successor_rate(1) < 0.22
    assert successor_rate(3) > 0.33


def test_whole_word_masking_with_the_real_vocabulary():
    from pathlib import Path

    from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

    vocab = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "bert" / "vocab.txt"
    if not vocab.exists():
        pytest.skip("shared BERT vocabulary not available")
    tok = BertWordPieceTokenizer(str(vocab), lower_case=True)
    info = BertVocabInfo.from_tokenizer(tok)
    text = ("Unbelievably, the tokenization of antidisestablishmentarianism produces "
            "multiple wordpieces. Hyperparameters are notoriously uncharacteristically "
            "unpredictable. ") * 3
    sentences = [np.asarray(tok.tokenize(t), dtype=np.int64) for t in text.split(". ") if t]
    cont = info.is_continuation
    seen_words = 0
    for i in range(60):
        s = build_training_sample(sentences, 125, 128, info, 0.15, np.random.RandomState(i))
        sel = s["loss_mask"] == 1
        original = s["text"].copy()
        original[sel] = s["labels"][sel]
        for pos in range(2, int(s["padding_mask"].sum())):
            if cont[original[pos]] and original[pos - 1] not in (info.cls, info.sep):
                assert sel[pos] == sel[pos - 1], (i, pos)
                seen_words += int(sel[pos])
    assert seen_words > 20

"""QA pass 47: the end-of-document id of SentencePiece models, as Megatron-LM picks it.

* ``--tokenizer-type GPTSentencePieceTokenizer`` is Megatron-LM's type whose eod is the
  model's EOS id (``sp.eos_id()``).  Here it took a ``<eod>`` piece first, so a model
  from tools/train_tokenizer.py (which has both) gave a different eod than Megatron-LM
  writes for the same model and ``--append-eod``.
* A model whose EOS piece is not spelled ``</s>`` (Gemma's is ``<eos>``) was refused by
  both types ("no end-of-document piece") although it has an EOS id.
"""
from __future__ import annotations

from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")

from megatron.config import DataConfig  # noqa: E402
from megatron.tokenizer import SentencePieceTokenizer, build_tokenizer  # noqa: E402
from tests.unit.test_tokenizer_tools import _load_tool  # noqa: E402

SHAKESPEARE = Path(__file__).resolve().parents[3] / "shared" / "data" / "corpus" / "tinyshakespeare.txt"


def _text(tmp_path) -> Path:
    path = tmp_path / "t.txt"
    if SHAKESPEARE.exists():
        path.write_text("\n".join(SHAKESPEARE.read_text(encoding="utf-8").split("\n")[:3000]))
    else:  # the test needs some English text, not this file in particular
        path.write_text("\n".join(f"some words {i} here, and more words there" for i in range(500)))
    return path


def _build(kind: str, model: Path):
    return build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=str(model)))


def test_gpt_sentencepiece_eod_is_the_eos_id_as_megatron_lm(tmp_path):
    prefix = tmp_path / "demo"
    assert _load_tool("train_tokenizer").main([
        "--input", str(_text(tmp_path)), "--vocab-size", "200", "--no-byte-fallback",
        "--output-prefix", str(prefix)]) == 0
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    assert sp.id_to_piece(sp.eos_id()) == "</s>" and sp.piece_to_id("<eod>") != sp.unk_id()
    gpt = _build("GPTSentencePieceTokenizer", Path(f"{prefix}.model"))
    assert gpt.eod == sp.eos_id()
    # The project's own type keeps the <eod> piece tools/train_tokenizer.py adds.
    ours = _build("SentencePieceTokenizer", Path(f"{prefix}.model"))
    assert ours.inv_vocab[ours.eod] == "<eod>"
    # Both encode text alike (Megatron-LM: sp.encode_as_ids).
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert gpt.tokenize(text) == ours.tokenize(text) == sp.encode_as_ids(text)


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_eos_piece_of_another_name_is_the_eod(tmp_path, kind):
    spm.SentencePieceTrainer.train(
        input=str(_text(tmp_path)), model_prefix=str(tmp_path / "gemma_like"), vocab_size=120,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
        bos_piece="<bos>", unk_piece="<unk>", minloglevel=2, hard_vocab_limit=False)
    tok = _build(kind, tmp_path / "gemma_like.model")
    assert tok.eod == 1 and tok.inv_vocab[tok.eod] == "<eos>"


def test_model_without_any_eod_is_still_refused(tmp_path):
    spm.SentencePieceTrainer.train(input=str(_text(tmp_path)), model_prefix=str(tmp_path / "noeos"),
                                   vocab_size=120, eos_id=-1, minloglevel=2, hard_vocab_limit=False)
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        with pytest.raises(ValueError, match="--tokenizer-model.*end-of-document"):
            _build(kind, tmp_path / "noeos.model")
    with pytest.raises(ValueError, match="<eod>"):
        SentencePieceTokenizer(str(tmp_path / "noeos.model"))

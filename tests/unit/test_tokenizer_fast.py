"""The Hugging Face ``tokenizers`` backend gives exactly the pure-Python ids.

The pure-Python GPT-2 BPE and WordPiece are the reference; the fast backend is compared
with them on real corpora (tinyshakespeare, WikiText-2) and on the cases where
tokenizers tend to disagree: unicode, whitespace runs, ``<|endoftext|>`` as text,
lower-casing and accents, unknown words, very long words.
"""
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from megatron.tokenizer import BertWordPieceTokenizer, GPT2BPETokenizer  # noqa: E402
from megatron.tokenizer.fast import ENV_SWITCH  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
GPT2_FILES = (DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")
BERT_VOCAB = DATA / "bert" / "vocab.txt"
SHAKESPEARE = DATA / "corpus" / "tinyshakespeare.txt"
WIKITEXT_RAW = DATA / "wikitext" / "wikitext-2-raw" / "wiki.test.raw"
WIKITEXT = DATA / "wikitext" / "wikitext-2" / "wiki.test.tokens"

SPECIAL = [
    "", " ", "   ", "\n", "a  b   c\t\td\n\n\ne ", "  leading and trailing  ", "x \u00a0 y",
    "Hello<|endoftext|>world <|endoftext|> <|endoftext|>",
    "naïve café Ünïcödé ÀÉÎÕÜ façade Straße", "ΟΔΟΣ Σίσυφος ὅσος", "Ñandú İstanbul ǅemal",
    "日本語のテキスト 中文字符 한국어", "emoji 😀👍🏽 ❤️ ✓ ☃", "עברית العربية", "e\u0301 a\u0300",
    "zero\u200bwidth soft\u00adhyphen", "tab\tline\u2028para\u2029", "[UNK] [CLS] [SEP] [MASK]",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⅛ ½ ²³", "a" * 150, "supercalifragilistic" * 8, "x" * 5000, "1234567890" * 30,
    "don't can't we're I'll they've it's", "$%^&*()_+-=[]{}|;':\",./<>?`~",
    "\x00control\x07chars\x1f here", "private \ue000 use", "ﬁ ligature ﬀ",
]


def _need(*paths):
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        pytest.skip(f"shared data not found: {missing}")


def _lines(path, limit=None):
    text = path.read_text(encoding="utf-8")
    return text[:limit].split("\n") if limit else text.split("\n")


@pytest.fixture(scope="module")
def gpt2():
    _need(*GPT2_FILES)
    return GPT2BPETokenizer(*map(str, GPT2_FILES), fast=True), \
        GPT2BPETokenizer(*map(str, GPT2_FILES), fast=False)


@pytest.fixture(scope="module", params=[True, False], ids=["lower", "cased"])
def bert(request):
    _need(BERT_VOCAB)
    return (BertWordPieceTokenizer(str(BERT_VOCAB), request.param, fast=True),
            BertWordPieceTokenizer(str(BERT_VOCAB), request.param, fast=False))


def _assert_same(fast, slow, texts):
    assert fast.backend == "tokenizers" and slow.backend == "python"
    got = fast.tokenize_batch(texts)
    want = [slow.tokenize(t) for t in texts]
    bad = [i for i in range(len(texts)) if got[i] != want[i]]
    assert not bad, f"{len(bad)} texts differ, first: {texts[bad[0]][:80]!r}"


def test_gpt2_equal_on_tinyshakespeare_and_wikitext(gpt2):
    _need(SHAKESPEARE, WIKITEXT_RAW)
    _assert_same(*gpt2, _lines(SHAKESPEARE) + _lines(WIKITEXT_RAW))


def test_bert_equal_on_tinyshakespeare_and_wikitext(bert):
    _need(SHAKESPEARE, WIKITEXT)
    _assert_same(*bert, _lines(SHAKESPEARE, 300_000) + _lines(WIKITEXT, 400_000))


def test_gpt2_special_cases(gpt2):
    _assert_same(*gpt2, SPECIAL)
    fast, slow = gpt2
    for text in SPECIAL:  # the single-text path too
        assert fast.tokenize(text) == slow.tokenize(text)
    assert fast.detokenize(fast.tokenize(SPECIAL[7])) == SPECIAL[7]
    assert fast.eod not in fast.tokenize(SPECIAL[7])  # <|endoftext|> text is plain text


def test_bert_special_cases(bert):
    _assert_same(*bert, SPECIAL)
    fast, _ = bert
    assert fast.tokenize("a" * 150) == [fast.unk]  # longer than 100 characters
    assert fast.tokenize("☃") == [fast.unk]


def test_guard_sends_disagreeing_characters_to_python():
    """Rust's Unicode tables differ from Python's for e.g. private-use characters and
    final sigma; such text must be encoded by the Python path."""
    _need(BERT_VOCAB)
    fast = BertWordPieceTokenizer(str(BERT_VOCAB), True, fast=True)
    slow = BertWordPieceTokenizer(str(BERT_VOCAB), True, fast=False)
    texts = ["private \ue000 use", "ΟΔΟΣ"]
    raw = [e.ids for e in fast._fast._backend.encode_batch(texts, add_special_tokens=False)]
    want = [slow.tokenize(t) for t in texts]
    assert raw != want  # the unguarded backend really disagrees here
    assert not any(fast._fast.text_ok(t) for t in texts)
    assert fast.tokenize_batch(texts) == want
    assert [fast.tokenize(t) for t in texts] == want


def test_switches(monkeypatch):
    _need(*GPT2_FILES)
    assert GPT2BPETokenizer(*map(str, GPT2_FILES)).backend == "tokenizers"
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert GPT2BPETokenizer(*map(str, GPT2_FILES)).backend == "python"
    with pytest.raises(ValueError, match="tokenizers"):
        GPT2BPETokenizer(*map(str, GPT2_FILES), fast=True)


def test_preprocess_output_identical_with_and_without_fast_backend(tmp_path):
    _need(*GPT2_FILES, WIKITEXT_RAW)
    lines = [t for t in _lines(WIKITEXT_RAW, 60_000) if t.strip()]
    with open(tmp_path / "in.jsonl", "w", encoding="utf-8") as f:
        for t in lines:
            f.write(json.dumps({"text": t}) + "\n")
    spec = importlib.util.spec_from_file_location("preprocess_fast_under_test",
                                                  ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    common = ["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "GPT2BPETokenizer",
              "--vocab-file", str(GPT2_FILES[0]), "--merge-file", str(GPT2_FILES[1]),
              "--append-eod", "--chunk-size", "32"]
    module.main(common + ["--output-prefix", str(tmp_path / "fast")])
    module.main(common + ["--no-fast-tokenizer", "--output-prefix", str(tmp_path / "slow")])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"fast_text_document{ext}").read_bytes() == \
            (tmp_path / f"slow_text_document{ext}").read_bytes()


def test_unbuildable_backend_falls_back_to_python(tmp_path):
    """A merges file the Rust BPE rejects (merge result not in the vocabulary) leaves the
    Python path in charge, unless fast=True was asked for."""
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1, "<|endoftext|>": 2}))
    (tmp_path / "m.txt").write_text("#version: 0.2\na b\n")
    files = (str(tmp_path / "v.json"), str(tmp_path / "m.txt"))
    assert GPT2BPETokenizer(*files).backend == "python"
    with pytest.raises(ValueError, match="could not be built"):
        GPT2BPETokenizer(*files, fast=True)

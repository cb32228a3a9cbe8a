"""tools/preprocess_data.py on awkward input: each problem is one error line naming
--input and the line, with either tokenizer backend and any number of workers."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from megatron.config import DataConfig
from megatron.data.indexed_dataset import IndexedDataset
from megatron.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "preprocess_data.py"
DATA = ROOT.parent / "shared" / "data"
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(DATA / "gpt2" / "encoder.json"),
        "--merge-file", str(DATA / "gpt2" / "vocab.bpe")]
BERT = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
        str(DATA / "bert" / "vocab.txt")]


def _load_module():
    spec = importlib.util.spec_from_file_location("preprocess_data_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pool workers unpickle its functions by name
    spec.loader.exec_module(module)
    return module


def _need_vocab():
    if not (DATA / "gpt2" / "encoder.json").exists() or not (DATA / "bert" / "vocab.txt").exists():
        pytest.skip(f"shared vocabularies not found under {DATA}")


@pytest.mark.parametrize("tok", ["gpt2", "bert"])
@pytest.mark.parametrize("extra", [[], ["--no-fast-tokenizer"], ["--workers", "2"],
                                   ["--split-sentences"]])
def test_lone_surrogate_is_one_error_naming_the_line(tmp_path, capsys, tok, extra):
    """JSON may escape half of a surrogate pair ("\\ud800"), which json.loads accepts
    but no UTF-8 tokenizer can encode."""
    _need_vocab()
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n{"text": "abc \\ud800 def"}\n')
    with pytest.raises(SystemExit) as info:
        _load_module().main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                             str(tmp_path / "o")] + (GPT2 if tok == "gpt2" else BERT) + extra)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --input")
    assert "line 2" in err and "'text'" in err and "surrogate" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_escaped_surrogate_pair_is_one_character(tmp_path):
    _need_vocab()
    (tmp_path / "in.jsonl").write_text('{"text": "smile \\ud83d\\ude00 ok"}\n')
    _load_module().main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                         str(tmp_path / "o")] + GPT2)
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer",
                                     vocab_file=GPT2[3], merge_file=GPT2[5]))
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert tok.detokenize(ds[0].tolist()) == "smile \U0001F600 ok"


@pytest.mark.parametrize("line,found", [('"just text"', "str"), ("[1, 2]", "list"),
                                        ("3", "int")])
def test_line_that_is_not_an_object_says_so(tmp_path, capsys, line, found):
    (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(SystemExit):
        _load_module().main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type",
                             "CharTokenizer", "--output-prefix", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--input" in err and "line 2" in err
    assert "expected a JSON object" in err and found in err


def test_non_utf8_error_names_the_line(tmp_path, capsys):
    with open(tmp_path / "in.jsonl", "wb") as f:
        f.write(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(SystemExit) as info:
        _load_module().main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type",
                             "CharTokenizer", "--workers", "2", "--output-prefix",
                             str(tmp_path / "o")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --input")
    assert "line 3" in err and "UTF-8" in err and "\\xe9" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


def test_windows_line_endings_are_read(tmp_path):
    texts = ["first doc", "second doc"]
    (tmp_path / "in.jsonl").write_bytes(
        b"".join(json.dumps({"text": t}).encode() + b"\r\n" for t in texts) + b"\r\n")
    _load_module().main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type",
                         "CharTokenizer", "--output-prefix", str(tmp_path / "o")])
    tok = build_tokenizer(DataConfig(tokenizer_type="CharTokenizer"))
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [tok.detokenize(ds[i].tolist()) for i in range(len(ds))] == texts

"""tools/preprocess_data.py takes a Megatron-LM preprocessing command as it is: its
README's `--vocab` (its parser's prefix of --vocab-file), `--partitions`,
`--keep-sequential-samples` and `--lang` stopped with 'unrecognized arguments' or
'ambiguous option', and write the files the plain command writes."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_preprocess import _load_module, _write_jsonl

VOCAB = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "bert" / "vocab.txt"


@pytest.mark.skipif(not VOCAB.exists(), reason="../shared/data/bert/vocab.txt absent")
def test_megatron_lm_preprocess_command_runs_unchanged(tmp_path, capsys):
    _write_jsonl(tmp_path / "in.jsonl", [f"Sentence {i} here. And another one {i}!"
                                         for i in range(30)])
    module = _load_module()
    common = ["--input", str(tmp_path / "in.jsonl"), "--dataset-impl", "mmap",
              "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences"]
    module.main(common + ["--vocab-file", str(VOCAB), "--output-prefix", str(tmp_path / "a")])
    module.main(common + ["--vocab", str(VOCAB), "--workers", "2", "--partitions", "2",
                          "--keep-sequential-samples", "--lang", "english",
                          "--output-prefix", str(tmp_path / "b")])
    assert "note: --partitions 2:" in capsys.readouterr().err
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_sentence{ext}").read_bytes() == \
            (tmp_path / f"b_text_sentence{ext}").read_bytes()

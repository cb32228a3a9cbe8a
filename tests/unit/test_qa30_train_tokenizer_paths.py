"""tools/train_tokenizer.py: a directory given as --input was called 'no such file', and
an --output-prefix under a file was a bare '[Errno 17] File exists' naming no flag."""
from __future__ import annotations

import pytest

from tests.unit.test_tokenizer_tools import _load_tool


def test_directory_input_and_unwritable_prefix_name_the_flag(tmp_path):
    tool = _load_tool("train_tokenizer")
    text = tmp_path / "plain.txt"
    text.write_text("some words\n")
    with pytest.raises(FileNotFoundError, match=r"^--input '.*' is a directory; expected a text"):
        tool.main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "t")])
    with pytest.raises(OSError, match=r"^--output-prefix .*plain\.txt/t: cannot create the "
                                      r"directory .*plain\.txt \(File exists\)"):
        tool.main(["--input", str(text), "--output-prefix", str(text / "t")])

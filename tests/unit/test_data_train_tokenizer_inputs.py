"""tools/train_tokenizer.py: a problem in the input found while SentencePiece reads it
is reported as our one line (flag, file, line), not wrapped in SentencePiece's
"INTERNAL: ... At: file(line)" text or a pybind11 cast error."""
import pytest

from megatron.errors import UserError

pytest.importorskip("sentencepiece")


def _train(tmp_path, name, extra=()):
    from tools.train_tokenizer import _command_line

    _command_line(["--input", str(tmp_path / "good.jsonl"), str(tmp_path / name),
                   "--vocab-size", "300", "--output-prefix", str(tmp_path / "t")] + list(extra))


def _good(tmp_path):
    with open(tmp_path / "good.jsonl", "w") as f:
        for i in range(200):
            f.write('{"text": "document %d says hello world, again and again."}\n' % i)


@pytest.mark.parametrize("content,expected", [
    ('{"text": "a"}\n{"body": "b"}\n', r"line 2: no key 'text'"),
    ('{"text": "a"}\n[1]\n', r"line 2: expected a JSON object, found list"),
    ('{"text": "a"}\n{"text": "b \\ud800"}\n', r"line 2: 'text' holds a lone UTF-16 surrogate"),
])
def test_input_problem_in_a_later_file_is_our_line(tmp_path, content, expected):
    _good(tmp_path)
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(UserError, match=expected) as info:
        _train(tmp_path, "bad.jsonl", ["--input-format", "json"])
    msg = str(info.value)
    assert "\n" not in msg and "bad.jsonl" in msg
    assert "INTERNAL" not in msg and "At:" not in msg and "C++" not in msg

"""tools/make_demo_corpus.py: a bad --extra-text file is one error line naming the flag
and the file (exit status 2), found before the slow walk over the modules."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "make_demo_corpus.py"


@pytest.mark.parametrize("name,content,expected", [
    ("missing.txt", None, "--extra-text: no such file"),
    ("latin1.txt", b"caf\xe9\n", "--extra-text '.*latin1.txt': not UTF-8 text"),
])
def test_bad_extra_text_is_one_error_line(tmp_path, name, content, expected):
    import re

    if content is not None:
        (tmp_path / name).write_bytes(content)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--output", str(tmp_path / "c.jsonl"),
                           "--modules", "json", "--no-topics", "--extra-text",
                           str(tmp_path / name)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert re.search(expected, err) and name in err, err
    assert not (tmp_path / "c.jsonl").exists()


def test_missing_extra_text_is_found_before_the_modules_are_read(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_demo_corpus as tool
    finally:
        sys.path.pop(0)

    def walk(*args, **kwargs):
        raise AssertionError("modules read before --extra-text was checked")
    monkeypatch.setattr(tool, "collect_documents", walk)
    with pytest.raises(FileNotFoundError, match="--extra-text"):
        tool.main(["--output", str(tmp_path / "c.jsonl"), "--extra-text",
                   str(tmp_path / "missing.txt")])

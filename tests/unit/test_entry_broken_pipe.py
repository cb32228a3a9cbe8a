"""megatron.entry.run_entry_point when standard output's reader goes away
(``tools/plan.py ... | head``): exit 141 as ``cat`` would, no traceback; a
BrokenPipeError from any other pipe stays a bug with its traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(tmp_path, body: str) -> str:
    lines = ["import os, sys", f"sys.path.insert(0, {ROOT!r})",
             "from megatron.entry import run_entry_point", "def main():"]
    lines += ["    " + line for line in textwrap.dedent(body).strip().splitlines()]
    lines.append("run_entry_point(main)")
    path = tmp_path / "tool.py"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _env():
    return {k: v for k, v in os.environ.items() if k != "MEGATRON_DEBUG"}


def test_reader_closing_stdout_exits_141_without_a_traceback(tmp_path):
    tool = _script(tmp_path, """
        for i in range(200000):
            print("row", i)
    """)
    proc = subprocess.Popen([sys.executable, tool], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env())
    assert proc.stdout.readline() == b"row 0\n"
    proc.stdout.close()  # what `| head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""


def test_broken_pipe_of_another_pipe_is_a_bug_with_its_traceback(tmp_path):
    tool = _script(tmp_path, """
        r, w = os.pipe()
        os.close(r)
        os.write(w, b"x")  # BrokenPipeError, while stdout is fine
    """)
    proc = subprocess.run([sys.executable, tool], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "BrokenPipeError" in proc.stderr


def test_output_that_fits_the_pipe_still_exits_0(tmp_path):
    tool = _script(tmp_path, """
        print("one line")
    """)
    proc = subprocess.run([sys.executable, tool], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "one line\n", "")

"""examples/pretrain_bert_cpu.sh with INPUT=: a second INPUT (or an edited one) is
preprocessed again.  The script only checked that $OUT/corpus_text_sentence.idx existed,
so a user who switched INPUT trained on the previous corpus without a word."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Stands in for python: logs each command; "preprocess_data.py" writes its .idx, the
# torchrun launch succeeds without training.
STUB = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
if [[ "$1" == tools/preprocess_data.py ]]; then
  while [ $# -gt 0 ]; do [ "$1" = --output-prefix ] && echo idx > "$2_text_sentence.idx"; shift; done
fi
"""


def _run(tmp_path, corpus):
    env = {**os.environ, "PYTHON": str(tmp_path / "py"), "LOG": str(tmp_path / "log"),
           "VOCAB": str(tmp_path / "vocab.txt"), "INPUT": str(corpus),
           "OUT": str(tmp_path / "data"), "SAVE": str(tmp_path / "ckpt")}
    subprocess.run(["bash", str(REPO / "examples" / "pretrain_bert_cpu.sh")], env=env,
                   check=True, capture_output=True, timeout=60)
    runs = (tmp_path / "log").read_text().splitlines()
    return sum(r.startswith("tools/preprocess_data.py") for r in runs), runs[-1]


def test_another_input_is_preprocessed_again(tmp_path):
    (tmp_path / "py").write_text(STUB)
    (tmp_path / "py").chmod((tmp_path / "py").stat().st_mode | stat.S_IEXEC)
    (tmp_path / "vocab.txt").write_text("[PAD]\n")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"text": "A first corpus."}\n')
    b.write_text('{"text": "Another corpus."}\n')
    assert _run(tmp_path, a)[0] == 1
    assert _run(tmp_path, a)[0] == 1  # same INPUT: the dataset is reused
    count, launch = _run(tmp_path, b)
    assert count == 2 and f"--data-path {tmp_path / 'data' / 'corpus_text_sentence'}" in launch
    os.utime(b, (1, 1))  # an edited INPUT (another modification time)
    assert _run(tmp_path, b)[0] == 3

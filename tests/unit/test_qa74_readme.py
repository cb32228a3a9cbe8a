"""The README's main command as a user mistypes it (helper-74's QA pass on the README).

`BLOCK=llama bash examples/pretrain_gpt_cpu_demo.sh` is the README's Llama-block demo. A
mistyped BLOCK stopped with one line, but only after the script had run the set-up and
deleted the previous demo run's checkpoints, which the evaluation scripts read: the
variable is now checked before anything runs.  Stand-ins for python3 and torchrun record
each call and do nothing else, so no training or installation happens here."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STUB = """#!/usr/bin/env bash
n=$(ls "$CAPTURE" | wc -l)
printf '%s\\0' "$(basename "$0")" "$@" > "$CAPTURE/$n"
"""


def _demo(tmp_path: Path, **env: str):
    bin_dir, capture, demo = tmp_path / "bin", tmp_path / "capture", tmp_path / "demo"
    for d in (bin_dir, capture, demo):
        d.mkdir()
    for name in ("torchrun", "py"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    # a demo folder after a previous run: corpus, tokenizer, dataset and checkpoints
    for name in ("corpus.jsonl", "tokenizer.model", "corpus_text_document.bin",
                 "corpus_text_document.idx"):
        (demo / name).write_text("x")
    (demo / "checkpoints" / "iter_0000200").mkdir(parents=True)
    (demo / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("200")
    full = {**{k: v for k, v in os.environ.items() if k != "BLOCK"},
            "PYTHON": str(bin_dir / "py"), "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "CAPTURE": str(capture), "DEMO_DIR": str(demo), **env}
    out = subprocess.run(["bash", str(REPO / "examples" / "pretrain_gpt_cpu_demo.sh")],
                         env=full, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    calls = [(capture / str(i)).read_bytes().decode().split("\0")[:-1]
             for i in range(len(list(capture.iterdir())))]
    return out, calls, demo


def test_a_mistyped_block_keeps_the_previous_demo_checkpoints(tmp_path):
    out, calls, demo = _demo(tmp_path, BLOCK="lama")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["error: BLOCK=lama: expected gpt2 or llama"]
    assert (demo / "checkpoints" / "iter_0000200").is_dir()
    assert "removing" not in out.stdout
    assert calls == []  # no set-up (pip), no corpus step, no launch


def test_a_good_block_still_removes_them_and_launches(tmp_path):
    out, calls, demo = _demo(tmp_path, BLOCK="llama", TRAIN_ITERS="50")
    assert out.returncode == 0, out.stderr
    assert not (demo / "checkpoints").exists()
    launch = calls[-1]
    assert "pretrain_gpt.py" in launch and "--swiglu" in launch
    assert launch[launch.index("--train-iters") + 1] == "50"
    # its last lines are the commands to run next, with the batches TRAIN_ITERS gives
    assert "tools/generate_samples_gpt.py --load" in out.stdout
    assert "--trace-batches 25:28" in out.stdout.strip().splitlines()[-1]

"""User errors of tools/checkpoint_util.py, tools/preprocess_data.py and
tools/draw_timeline.py: one ``error:`` line naming the flag or file, exit code 2
(docs/failure_behaviour.md), no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from megatron.entry import run_entry_point

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str, args: List[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEGATRON_DEBUG", None)
    return subprocess.run([sys.executable, str(ROOT / "tools" / name)] + [str(a) for a in args],
                          env=env, capture_output=True, text=True, timeout=300)


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ----------------------------------------------------------------------- checkpoint_util.py
def test_checkpoint_util_user_error_exits_2_with_one_line(tmp_path):
    proc = _tool("checkpoint_util.py", ["--load", tmp_path / "missing", "--save", tmp_path / "o"])
    assert proc.returncode == 2, proc.stderr
    assert "missing" in _one_error_line(proc.stderr)


def test_checkpoint_util_main_exits_2_when_called_from_python(tmp_path, capsys):
    from tools.checkpoint_util import main

    with pytest.raises(SystemExit) as info:
        main(["--load", str(tmp_path / "missing"), "--save", str(tmp_path / "o")])
    assert info.value.code == 2
    _one_error_line(capsys.readouterr().err)


def test_reshard_to_t3_names_the_model_size_and_writes_nothing(tmp_path, capsys):
    from megatron.checkpoint_convert import read_full_state, write_layout
    from megatron.errors import CheckpointError
    from tests.unit.test_tasks_checkpoint_util import _trained_full_state_checkpoint
    from tools.checkpoint_util import main

    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    # The config records no model sizes: the message names the weight's dimension.
    with pytest.raises(SystemExit) as info:
        main(["--load", src, "--save", str(tmp_path / "t3"), "--target-tensor-parallel-size",
              "3"])
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--target-tensor-parallel-size 3 does not divide the checkpoint's hidden size (32;" \
        in line, line
    # With the sizes recorded (as training saves them) the heads are checked before
    # anything is written: 4 heads do not divide by 3 though 3 x hidden size does.
    state = read_full_state(src)
    state.common["config"]["model"].update(num_attention_heads=4, hidden_size=32,
                                           ffn_hidden_size=128)
    with pytest.raises(CheckpointError, match=r"--target-tensor-parallel-size 3 does not "
                       r"divide the checkpoint's number of attention heads \(4\)$"):
        write_layout(state, str(tmp_path / "t3b"), 3, 1)
    assert not os.path.exists(tmp_path / "t3b")


# ----------------------------------------------------------------------- preprocess_data.py
def _jsonl(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["vocab-file", "json-keys", "not-json", "input",
                                  "output-prefix"])
def test_preprocess_user_errors_exit_2_naming_the_flag(tmp_path, case):
    good = _jsonl(tmp_path, json.dumps({"text": "hello"}) + "\n")
    args = ["--input", good, "--tokenizer-type", "CharTokenizer",
            "--output-prefix", tmp_path / "out" / "p"]
    expect = "--" + case
    if case == "vocab-file":
        args[3] = "BertWordPieceLowerCase"
        args += ["--vocab-file", tmp_path / "no_vocab.txt"]
    elif case == "json-keys":
        args += ["--json-keys", "body"]
    elif case == "not-json":
        _jsonl(tmp_path, "this is not json\n")
        expect = "--input"
    elif case == "input":
        args[1] = tmp_path / "missing.jsonl"
    else:  # a directory that cannot be created: its parent is a regular file
        (tmp_path / "afile").write_text("")
        args[-1] = tmp_path / "afile" / "sub" / "p"
    proc = _tool("preprocess_data.py", args)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    assert expect in line, line
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


# ------------------------------------------------------------------------- draw_timeline.py
@pytest.mark.parametrize("pattern", ["none*.json", "none.json"])
def test_draw_timeline_missing_trace_is_one_line(tmp_path, capsys, pattern):
    from tools.draw_timeline import main

    trace = str(tmp_path / pattern)
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, ["--trace", trace, "--output", str(tmp_path / "t.png")])
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--trace" in line and trace in line, line


@pytest.mark.parametrize("flags, expect", [
    (["--output", "{tmp}/t.xyz"], "--output {tmp}/t.xyz: expected an image file name ending "
                                  "in .png, .pdf or .svg"),
    (["--output", "{tmp}/t"], "found no extension"),
    (["--output", "{tmp}"], "--output {tmp} is a directory"),
    (["--output", "{tmp}/afile/t.png"], "--output {tmp}/afile/t.png: {tmp}/afile is a file"),
    (["--chrome-trace", "{tmp}/afile/c.json"], "--chrome-trace {tmp}/afile/c.json: "),
    (["--stages", "0"], "--stages must be >= 1, got 0"),
    (["--microbatches", "-1"], "--microbatches must be >= 1, got -1"),
    (["--batches", "0"], "--batches must be >= 1, got 0"),
    (["--schedule", "2bw", "--microbatches", "2"], "--microbatches 2: --schedule 2bw needs "
                                                   "--microbatches >= --stages (4)"),
    (["--forward-cost", "-1"], "--forward-cost must be a positive number, got -1"),
    (["--backward-cost", "0"], "--backward-cost must be a positive number, got 0"),
    (["--backward-cost", "nan"], "--backward-cost must be a positive number, got nan"),
    (["--comm-latency", "-0.5"], "--comm-latency must be a number >= 0, got -0.5"),
], ids=["format", "no-extension", "directory", "under-a-file", "chrome-under-a-file",
        "stages", "microbatches", "batches", "2bw-m<d", "forward", "backward", "nan", "latency"])
def test_draw_timeline_bad_flags_are_one_line_and_write_nothing(tmp_path, capsys, flags,
                                                                 expect):
    from tools.draw_timeline import main

    (tmp_path / "afile").write_text("")
    args = ["--schedule", "flush", "--output", str(tmp_path / "t.png")]
    args += [f.format(tmp=tmp_path) for f in flags]  # the last --output / --schedule wins
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, args)
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: ") and expect.format(tmp=tmp_path) in line, line
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_draw_timeline_names_the_ranks_without_a_trace_file(tmp_path, capsys):
    from megatron.pipeline.schedules import build_schedule
    from megatron.pipeline.simulator import simulate, unit_cost
    from megatron.pipeline.trace import save_trace
    from tools.draw_timeline import main

    # a run of 2 stages x 2 data-parallel ranks; rank r is stage r % 2 here
    events = simulate(build_schedule("flush", 2, 2), unit_cost()).events
    meta = {"schedule": "flush", "stages": 2, "data_parallel": 2}
    for rank in (0, 2):  # ranks 1 and 3 (all of stage 1) did not write their files
        save_trace(tmp_path / f"timeline_rank{rank}.json",
                   [e for e in events if e.stage == 0], dict(meta, rank=rank))
    png = tmp_path / "t.png"
    assert main(["--trace", str(tmp_path / "timeline_rank*.json"), "--output", str(png)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning: --trace" in err[0], err
    assert "no file for rank(s) 1, 3 (found rank(s) 0, 2 of a run of at least 4)" in err[0]
    assert "no event of stage(s) 1 of 2" in err[0]
    assert png.is_file()
    for rank in (1, 3):  # every file there: no warning
        save_trace(tmp_path / f"timeline_rank{rank}.json",
                   [e for e in events if e.stage == 1], dict(meta, rank=rank))
    assert main(["--trace", str(tmp_path / "timeline_rank*.json"), "--output", str(png)]) == 0
    assert capsys.readouterr().err == ""


def test_a_file_where_an_output_directory_should_be_is_one_line(tmp_path, capsys):
    """checkpoint_util's --save/--to-hf and draw_timeline's --output under a path whose
    parent is a file: one line naming the flag and the file, before anything is read."""
    from megatron.errors import UserError, check_parents_are_directories
    from tools.checkpoint_util import main

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(UserError, match=rf"^--x {blocker}/d/e: {blocker} is a file; expected "
                                        r"a directory path$"):
        check_parents_are_directories("--x", str(blocker / "d" / "e"))
    check_parents_are_directories("--x", str(tmp_path / "new" / "deeper"))  # absent: fine
    for flag in ("--save", "--to-hf"):
        with pytest.raises(SystemExit) as info:
            main(["--load", str(tmp_path / "ckpt"), flag, str(blocker / "out")])
        assert info.value.code == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"{flag} {blocker}/out: {blocker} is a file" in line, line
    proc = _tool("draw_timeline.py", ["--schedule", "flush", "--stages", "2", "--microbatches",
                                      "4", "--output", blocker / "t.png"])
    assert proc.returncode == 2, proc.stderr
    assert f"--output {blocker}/t.png: {blocker} is a file" in _one_error_line(proc.stderr)

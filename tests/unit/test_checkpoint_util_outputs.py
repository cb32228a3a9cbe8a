"""Where tools/checkpoint_util.py writes: never over a user's files.

* ``--save`` (reshard, ``--from-hf``) holding another run's checkpoints is refused with one
  line, as the trainer refuses it for a new run: nothing there is replaced and its tracker
  is not moved back.  A new or empty directory is fine.
* ``--to-hf`` is written into a sibling staging directory and renamed into place at the
  end: a non-empty directory is refused (no stale tokenizer files mixed in), a failed
  export leaves nothing.
* A path that is a file, and the flags in each message, are the ones the user gave.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

import pytest
import torch

pytest.importorskip("safetensors")

from megatron.checkpoint_discovery import find_checkpoint  # noqa: E402
from megatron.checkpoint_files import TRACKER  # noqa: E402
from megatron.errors import CheckpointError, UserError  # noqa: E402
from tests.unit.test_tasks_checkpoint_util import _trained_full_state_checkpoint  # noqa: E402
from tests.unit.test_untrusted_files import _hf_dir  # noqa: E402
from tools.checkpoint_util import convert, main  # noqa: E402


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _snapshot(root: Path) -> Dict[str, bytes]:
    """Every file under ``root`` with its bytes (directories as empty entries)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out[rel + "/"] = b""
        for name in filenames:
            out[os.path.join(rel, name)] = Path(dirpath, name).read_bytes()
    return out


def _error(capsys, argv: List[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _other_run(root: Path) -> Path:
    """A --save directory of another run: iterations 7 (the source's number) and 14,
    tracker at 14."""
    _trained_full_state_checkpoint(str(root))
    iter14 = root / "iter_0000014"
    os.makedirs(iter14 / "mp_rank_00")
    (iter14 / "mp_rank_00" / "model_optim_rng.json").write_text("{}")
    (root / TRACKER).write_text("14")
    return root


# ------------------------------------------------------------------ 1. --save holding checkpoints
def test_reshard_refuses_a_save_holding_another_runs_checkpoints(tmp_path, capsys):
    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    other = _other_run(tmp_path / "other")
    before = _snapshot(other)
    line = _error(capsys, ["--load", src, "--save", str(other),
                           "--target-tensor-parallel-size", "2"])
    assert line.startswith(f"error: --save {other} already holds checkpoints"), line
    assert "iter_0000014" in line and TRACKER in line, line
    assert _snapshot(other) == before  # tracker still 14, iter_0000007 not replaced
    with pytest.raises(UserError, match="already holds checkpoints"):  # the library too
        convert(src, str(other), tp=1, pp=1)
    assert _snapshot(other) == before


def test_reshard_refuses_a_save_holding_only_a_tracker(tmp_path, capsys):
    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    out = tmp_path / "out"
    out.mkdir()
    (out / TRACKER).write_text("3")
    assert "already holds checkpoints" in _error(capsys, ["--load", src, "--save", str(out)])
    assert (out / TRACKER).read_text() == "3" and os.listdir(out) == [TRACKER]


def test_reshard_into_an_empty_or_new_directory_is_fine(tmp_path, capsys):
    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (empty, tmp_path / "new" / "dir"):
        main(["--load", src, "--save", str(out), "--target-tensor-parallel-size", "2"])
        assert find_checkpoint(str(out)).iteration == 7
        assert sorted(os.listdir(out)) == ["iter_0000007", TRACKER]


def test_from_hf_refuses_a_save_holding_checkpoints(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    other = _other_run(tmp_path / "other")
    before = _snapshot(other)
    line = _error(capsys, ["--from-hf", str(hf), "--save", str(other)])
    assert line.startswith(f"error: --save {other} already holds checkpoints"), line
    assert _snapshot(other) == before  # the tracker did not go back to 0
    from megatron.hf_import import import_hf
    with pytest.raises(UserError, match="already holds checkpoints"):
        import_hf(str(hf), str(other))
    assert _snapshot(other) == before


@pytest.mark.parametrize("workflow", ["reshard", "from-hf", "to-hf"])
def test_an_output_that_is_a_file_is_one_line(tmp_path, capsys, workflow):
    src, _, _ = _trained_full_state_checkpoint(str(tmp_path / "src"))
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    flag = "--to-hf" if workflow == "to-hf" else "--save"
    source = (["--from-hf", str(_hf_dir(tmp_path / "hf"))] if workflow == "from-hf"
              else ["--load", src])
    for out, found in ((afile, "is a file"), (afile / "sub", f"{afile} is a file")):
        line = _error(capsys, source + [flag, str(out)])
        assert line.startswith(f"error: {flag} {out}") and found in line, line
    assert afile.read_text() == "keep me"


# ------------------------------------------------------------------ 2. --to-hf staged
def _gpt_checkpoint(tmp_path: Path) -> str:
    """An iteration-0 GPT checkpoint (imported from a tiny GPT-2 directory)."""
    out = str(tmp_path / "ck")
    main(["--from-hf", str(_hf_dir(tmp_path / "hf")), "--save", out])
    return out


def test_to_hf_refuses_a_non_empty_directory(tmp_path, capsys):
    ck = _gpt_checkpoint(tmp_path)
    out = tmp_path / "hf_out"
    out.mkdir()
    (out / "vocab.json").write_text("{}")  # a tokenizer file of another model
    capsys.readouterr()
    line = _error(capsys, ["--load", ck, "--to-hf", str(out)])
    assert line.startswith(f"error: --to-hf {out}: expected a new or empty directory"), line
    assert "vocab.json" in line, line
    assert os.listdir(out) == ["vocab.json"]


def test_to_hf_is_renamed_into_place_when_complete(tmp_path, capsys, monkeypatch):
    import megatron.hf_interop as hf_interop

    ck = _gpt_checkpoint(tmp_path)
    out = tmp_path / "exports" / "hf_out"
    out.parent.mkdir()
    real = hf_interop.tokenizer_files
    seen = {}

    def tokenizer_files(data_cfg, where, n_positions):  # the last file written
        seen["where"], seen["files"] = where, sorted(os.listdir(where))
        seen["out_exists"] = out.exists()
        return real(data_cfg, where, n_positions)

    monkeypatch.setattr(hf_interop, "tokenizer_files", tokenizer_files)
    main(["--load", ck, "--to-hf", str(out)])
    assert seen["out_exists"] is False and seen["files"] == ["config.json", "model.safetensors"]
    assert os.path.dirname(seen["where"]) == str(out.parent)  # a sibling: one rename
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(out.parent) == ["hf_out"]
    empty = tmp_path / "exports" / "empty"  # an existing empty directory is fine too
    empty.mkdir()
    main(["--load", ck, "--to-hf", str(empty)])
    assert sorted(os.listdir(empty)) == ["config.json", "model.safetensors"]


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    import megatron.hf_interop as hf_interop

    ck = _gpt_checkpoint(tmp_path)

    def crash(*args, **kwargs):
        raise RuntimeError("killed while writing")

    monkeypatch.setattr(hf_interop, "tokenizer_files", crash)
    out = tmp_path / "exports" / "hf_out"
    with pytest.raises(RuntimeError, match="killed while writing"):
        main(["--load", ck, "--to-hf", str(out)])
    assert not out.exists() and os.listdir(out.parent) == []


# ------------------------------------------------------------------ 3. the flags the user gave
def test_to_hf_inside_load_names_to_hf(tmp_path, capsys):
    ck = _gpt_checkpoint(tmp_path)
    capsys.readouterr()
    out = os.path.join(ck, "hf")
    line = _error(capsys, ["--load", ck, "--to-hf", out])
    assert line.startswith(f"error: --to-hf {out}: expected a directory outside --load"), line
    assert "--save" not in line, line
    assert not os.path.exists(out)


def test_from_hf_save_inside_it_names_from_hf(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    out = str(hf / "ckpt")
    line = _error(capsys, ["--from-hf", str(hf), "--save", out])
    assert line.startswith(f"error: --save {out}: expected a directory outside --from-hf"), line
    assert "--load" not in line, line
    assert not os.path.exists(out)


def test_workflow_errors_are_one_line(tmp_path, capsys):
    hf = str(_hf_dir(tmp_path / "hf"))
    assert "--from-hf needs --save" in _error(capsys, ["--from-hf", hf])
    line = _error(capsys, ["--from-hf", hf, "--save", str(tmp_path / "o"), "--load", hf])
    assert line.startswith("error: --load applies to"), line
    line = _error(capsys, ["--load", hf, "--save", str(tmp_path / "o"),
                           "--target-tensor-parallel-size", "0"])
    assert "--target-tensor-parallel-size must be >= 1" in line


# ------------------------------------------------------------------ 4. a Hugging Face --load
def test_a_hugging_face_directory_is_not_a_checkpoint(tmp_path, capsys):
    hf = _hf_dir(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"looks like a Hugging Face model directory "
                       r"\(config.json, model.safetensors\).*tools/checkpoint_util.py "
                       r"--from-hf .* --save CKPT"):
        find_checkpoint(str(hf))
    line = _error(capsys, ["--load", str(hf), "--to-hf", str(tmp_path / "out")])
    assert "looks like a Hugging Face model directory" in line and "--from-hf" in line, line
    # what stays a fresh start: nothing there, an empty directory, a config without weights
    (tmp_path / "empty").mkdir()
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text("{}")
    for root in ("absent", "empty", "cfg_only"):
        assert find_checkpoint(str(tmp_path / root)).iteration is None


def test_training_with_load_of_a_hugging_face_directory_stops(tmp_path):
    """It used to start from scratch silently (no tracker: "holds no checkpoint")."""
    import pretrain_gpt

    hf = _hf_dir(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=f"--load {hf} looks like a Hugging Face model "
                       f"directory .* --from-hf {hf} --save CKPT"):
        pretrain_gpt.main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                           "4", "--seq-length", "16", "--tokenizer-type", "CharTokenizer",
                           "--make-vocab-size-divisible-by", "64", "--num-workers", "0",
                           "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
                           "--train-iters", "1", "--lr", "1e-2", "--eval-iters", "0",
                           "--load", str(hf), "--save", str(tmp_path / "ck")])
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]
    assert find_checkpoint(str(tmp_path / "ck")).iteration is None  # nothing trained or saved

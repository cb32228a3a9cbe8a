"""QA pass 53: tools/checkpoint_util.py's Hugging Face workflows refuse, in one line, the
flags that would do nothing there (a layout or padding for --to-hf, whose transformers
model has neither; a checkpoint iteration or vocabulary size for --from-hf, which reads
config.json), as --to-hf already refused the stage-split flags, instead of ignoring
them silently."""
from __future__ import annotations

import pytest

from tools.checkpoint_util import main


def _one_line(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("flag", ["--target-tensor-parallel-size",
                                  "--target-pipeline-parallel-size",
                                  "--target-data-parallel-size",
                                  "--make-vocab-size-divisible-by"])
def test_export_refuses_layout_and_padding_flags(tmp_path, capsys, flag):
    err = _one_line(capsys, ["--load", str(tmp_path / "ckpt"), "--to-hf",
                             str(tmp_path / "hf"), flag, "2"])
    assert f"{flag} applies to" in err and "not --to-hf" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("flag", ["--iteration", "--true-vocab-size",
                                  "--target-data-parallel-size"])
def test_import_refuses_flags_it_does_not_read(tmp_path, capsys, flag):
    err = _one_line(capsys, ["--from-hf", str(tmp_path / "hf"), "--save",
                             str(tmp_path / "out"), flag, "2"])
    assert f"{flag} applies to" in err and "not --from-hf" in err, err
    assert not (tmp_path / "out").exists()

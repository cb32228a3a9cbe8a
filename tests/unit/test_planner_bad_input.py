"""tools/plan.py and planner profiles given bad input: one ``plan.py: error:`` line that
names the flag (or the profile's field) and what was expected, exit code 2, never a
traceback nor a plan priced with a nonsense value."""
from __future__ import annotations

import pytest

from megatron.pipeline.planner.profile import Profile
from tools.plan import run

from tests.unit.test_planner_profile import make_profile

GPT = ["--model", "gpt-1.3b", "--num-gpus", "8", "--max-batch-size", "64"]


def _error(capsys, *argv: str) -> str:
    """The one error line of a refused plan (asserting there is nothing else)."""
    assert run([*GPT, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("plan.py: error: "), err
    return err


@pytest.mark.parametrize("flag, value, expected", [
    ("--gpu-memory-gb", "0", "> 0"),
    ("--gpu-memory-gb", "-3", "> 0"),
    ("--gpu-memory-gb", "nan", "> 0"),
    ("--gpu-memory-gb", "inf", "> 0"),
    ("--intra-server-bandwidth", "0", "> 0"),
    ("--inter-server-bandwidth", "nan", "> 0"),
    ("--inter-server-bandwidth", "-1", "> 0"),
    ("--achieved-tflops", "inf", "> 0"),
    ("--achieved-tflops", "0", "> 0"),
    ("--gpus-per-server", "0", ">= 1"),
    ("--c-extra", "0.5", ">= 1"),
    ("--c-extra", "nan", ">= 1"),
    ("--c-extra", "-1", ">= 1"),
    ("--max-microbatch-size", "0", ">= 1"),
    ("--top", "-1", ">= 0"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(capsys, flag, value, expected):
    err = _error(capsys, flag, value)
    assert f"{flag} {value}" in err or f"{flag} must be" in err, err
    assert expected in err, err


def test_gpu_memory_below_the_reserved_part_is_an_error(capsys):
    # p3.16xlarge reserves 1 GiB per GPU (CUDA context, fragmentation): 0.5 GiB leaves
    # nothing to plan with, which used to read "-0.5 GiB usable" in a no-fit message
    err = _error(capsys, "--gpu-memory-gb", "0.5")
    assert "--gpu-memory-gb 0.5" in err and "1 GiB" in err, err
    err = _error(capsys, "--gpu-memory-gb", "1")
    assert "--gpu-memory-gb 1" in err, err


@pytest.mark.parametrize("where", ["missing/dir/plan.json", "."])
def test_an_unwritable_json_path_is_one_line(capsys, tmp_path, where):
    blocker = tmp_path / "missing"
    blocker.write_text("a file, not a folder")
    path = tmp_path / where
    assert run([*GPT, "--json", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("plan.py: error: --json "), err
    assert str(path) in err


@pytest.mark.parametrize("edit, field", [
    (lambda p: p.update(device="gpu"), r"device must be a JSON object, got 'gpu'"),
    (lambda p: p.update(model=["gpt"]), r"model must be a JSON object, got \['gpt'\]"),
    (lambda p: p.update(weights=[]), r"weights must be a JSON object, got \[\]"),
    (lambda p: p["model"].update(dtype="int4"),
     r"model\.dtype must be one of fp16, bf16, fp32, fp64, got 'int4'"),
    (lambda p: p["model"].update(dtype=7),
     r"model\.dtype must be one of fp16, bf16, fp32, fp64, got 7"),
    (lambda p: p["model"].update(grad_bytes="x"),
     r"model\.grad_bytes must be a positive number, got 'x'"),
    (lambda p: p["model"].update(dtype_bytes=0),
     r"model\.dtype_bytes must be a positive number, got 0"),
    (lambda p: p["model"].update(cross_entropy_loss_fusion="false"),
     r"model\.cross_entropy_loss_fusion must be bool, got 'false'"),
])
def test_a_wrong_profile_field_names_the_file_and_the_field(edit, field):
    data = make_profile()
    edit(data)
    with pytest.raises(ValueError, match=f"--profile my.json: {field}"):
        Profile(data, "my.json")


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--iters", "-1"], ["--quick", "--iters", "4"],
                                  ["--cuda", "--iters", "3"]])
def test_validation_bench_refuses_too_few_iterations_before_it_runs(capsys, argv):
    """--iters 0 used to mean the default (10), and a short --cuda run profiled GPT-345M
    for minutes before the median of no step times failed with a traceback."""
    from bench.planner_validation import WARMUP_BATCHES, main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert f"--iters {argv[-1]}: expected at least {WARMUP_BATCHES + 3}" in capsys.readouterr().err


def test_a_shape_mismatch_names_only_flags_the_user_can_give():
    """Multi-head attention in both the plan and the profile: the differing head count is
    named, not a --num-query-groups that needs --group-query-attention."""
    from megatron.pipeline.planner import CostModel, ModelSpec, get_hardware

    prof = Profile(make_profile(), "my.json")
    other = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=8, seq_length=16,
                      vocab_size=64)
    with pytest.raises(ValueError, match="another model shape") as exc:
        CostModel(other, get_hardware("cpu"), profile=prof)
    assert "--num-attention-heads 8 (profiled 4)" in str(exc.value)
    assert "--num-query-groups" not in str(exc.value)
    grouped = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=64, num_query_groups=2)
    with pytest.raises(ValueError, match="--num-query-groups 2 .profiled 4."):
        CostModel(grouped, get_hardware("cpu"), profile=prof)



def test_no_fit_names_the_batch_before_the_depths_that_cannot_split_the_model(capsys):
    """256 GPUs with a batch of 16: every depth that splits 24 layers has w >= 32 > 16
    replicas.  The message used to list three alphabetically first depths that do not
    divide 24 (d=128, d=16, d=256), and not the batch."""
    assert run(["--model", "gpt-1.3b", "--num-gpus", "256", "--max-batch-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "fits on 256 p3.16xlarge GPUs with global batch <= 16: w*b = 32 exceeds the " \
           "batch size 16;" in err, err

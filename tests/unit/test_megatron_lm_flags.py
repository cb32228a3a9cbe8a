"""Megatron-LM's scripts run as they are: older flag names are read under ours, flags
that change nothing here are accepted with one note, flags of features not built here
stop the run with one line naming them, and an unknown flag is one line naming the
closest known flag.  No process group: parsing and validation only."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron import megatron_lm_flags as mlf
from megatron.arguments import ArgumentError, parse_and_validate, parse_args, validate_args

REPO = Path(__file__).resolve().parents[2]

# Megatron-LM's examples/pretrain_gpt.sh (GPT-345M, 2021), every flag as it is there,
# with --mock-data for its data and vocabulary files (and gloo for its nccl: CPU ranks).
MEGATRON_PRETRAIN_GPT_SH = [
    "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--micro-batch-size", "4", "--global-batch-size", "8", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--train-iters", "500000",
    "--lr-decay-iters", "320000", "--data-impl", "mmap", "--split", "949,50,1",
    "--distributed-backend", "gloo", "--lr", "0.00015", "--min-lr", "1.0e-5",
    "--lr-decay-style", "cosine", "--weight-decay", "1e-2", "--clip-grad", "1.0",
    "--lr-warmup-fraction", ".01", "--checkpoint-activations", "--log-interval", "100",
    "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--fp16",
    "--mock-data", "--vocab-size", "50257"]

# Megatron-LM's examples/finetune_mnli_distributed.sh (2020 flag names) minus the task
# group (tasks/main.py's own flags).
MEGATRON_FINETUNE_MNLI_SH = [
    "--seed", "1234", "--tokenizer-type", "NullTokenizer", "--vocab-size", "30522",
    "--model-parallel-size", "1", "--num-layers", "24", "--hidden-size", "1024",
    "--num-attention-heads", "16", "--batch-size", "8", "--checkpoint-activations",
    "--lr", "5.0e-5", "--lr-decay-style", "linear", "--warmup", "0.065",
    "--seq-length", "512", "--max-position-embeddings", "512", "--log-interval", "10",
    "--eval-interval", "100", "--eval-iters", "50", "--weight-decay", "1.0e-1", "--fp16",
    "--train-iters", "100", "--mock-data"]

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (2024), every flag as it is
# there, with --mock-data for its data and vocabulary files.
MEGATRON_GPT3_175B_SH = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--seq-length", "2048", "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536",
    "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000", "--tensor-model-parallel-size", "8",
    "--pipeline-model-parallel-size", "16", "--split", "949,50,1", "--log-interval", "100",
    "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
    "--mock-data", "--vocab-size", "50257"]

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--micro-batch-size", "2", "--seq-length", "32", "--max-position-embeddings", "32",
         "--train-iters", "4", "--lr", "1e-4", "--mock-data", "--vocab-size", "100"]


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")


def test_megatron_pretrain_gpt_sh_validates_with_its_recomputation(tmp_path, capsys):
    argv = MEGATRON_PRETRAIN_GPT_SH + ["--save", str(tmp_path / "ck"),
                                       "--load", str(tmp_path / "ck")]
    _, cfg = parse_and_validate(argv, world_size=2)
    m = cfg.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == \
        ("full", "uniform", 1)
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (4, 8)
    assert cfg.training.num_microbatches(2) == 1
    err = capsys.readouterr().err
    assert "note: Megatron-LM's older flag names read as: --checkpoint-activations adds " \
           "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" in err
    assert "--data-impl mmap: datasets are Megatron's mmap format" in err
    assert "error" not in err


@pytest.mark.parametrize("schedule", ["flush", "2bw"])
def test_megatron_gpt3_175b_sh_validates_with_its_batch_ramp(tmp_path, capsys, schedule):
    """128 ranks (t=8 x d=16): the ramp starts at 16 microbatches of one sample, which
    PipeDream-2BW at depth 16 can run; 500,000 iterations, each of its ramp size, with the
    LR schedule in iterations (Megatron-LM's own checks refuse the script's --train-iters
    with --rampup-batch-size)."""
    paths = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck")]  # (and its
    # --tensorboard-dir, which needs the tensorboard package: not a test dependency)
    _, cfg = parse_and_validate(MEGATRON_GPT3_175B_SH + paths + ["--pipeline-schedule", schedule],
                                world_size=128)
    tr, oc = cfg.training, cfg.optimizer
    assert tr.train_iters == 500000 and tr.global_batch_size == 1536
    assert tr.batch_sizes().sizes(2) == [16, 16] and tr.batch_size_at(5859376) == 1536
    assert (oc.lr_schedule_unit, oc.lr_decay_iters, oc.lr_warmup_iters) == ("iterations", 430000, 430)
    assert "error" not in capsys.readouterr().err


DATA = REPO.parent / "shared" / "data"
GPT2 = (DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe")


@pytest.mark.skipif(not all(p.exists() for p in GPT2 + (DATA / "corpus" / "tinyshakespeare.txt",)),
                    reason="../shared/data (GPT-2 vocabulary, tinyshakespeare) absent")
def test_megatron_pretrain_gpt_sh_trains_as_it_is(tmp_path):
    """The script passes --vocab-file and --merge-file without --tokenizer-type (Megatron-
    LM's pretrain_gpt.py defaults it to GPT2BPETokenizer): it trains here, sizes shrunk
    to a CPU's, nccl as gloo, fp32 for fp16 (emulated on a CPU)."""
    text = (DATA / "corpus" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:40000]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in
                                                text.split("\n\n") if t.strip()) + "\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")},
           "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                    str(tmp_path / "c.jsonl"), "--json-keys", "text", "--tokenizer-type",
                    "GPT2BPETokenizer", "--vocab-file", str(GPT2[0]), "--merge-file",
                    str(GPT2[1]), "--append-eod", "--workers", "1", "--output-prefix",
                    str(tmp_path / "c")], check=True, env=env, capture_output=True, timeout=120)
    sizes = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4",
             "--seq-length": "64", "--max-position-embeddings": "64", "--train-iters": "3",
             "--lr-decay-iters": "3", "--save-interval": "3", "--eval-interval": "2",
             "--eval-iters": "1", "--log-interval": "1", "--distributed-backend": "gloo"}
    argv = [sizes.get(prev, a) if prev in sizes else a
            for prev, a in zip([None] + MEGATRON_PRETRAIN_GPT_SH, MEGATRON_PRETRAIN_GPT_SH)]
    argv = [a for a in argv[:argv.index("--mock-data")] if a != "--fp16"]
    argv += ["--data-path", str(tmp_path / "c_text_document"), "--vocab-file", str(GPT2[0]),
             "--merge-file", str(GPT2[1]), "--save", str(tmp_path / "ck"), "--load",
             str(tmp_path / "ck"), "--num-workers", "0"]
    out = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: --tokenizer-type GPT2BPETokenizer (this entry point's default" in out.stderr
    assert "recompute layers, 1 per chunk" in out.stdout
    assert " iteration        3/       3 |" in out.stdout
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_megatron_finetune_mnli_sh_old_names_mean_the_new_flags(capsys):
    from tasks.finetune_utils import finetune_args

    args, cfg = parse_and_validate(MEGATRON_FINETUNE_MNLI_SH, extra_args_provider=finetune_args,
                                   world_size=8)
    assert args.tensor_model_parallel_size == 1
    assert cfg.training.micro_batch_size == 8 and cfg.training.global_batch_size == 64
    assert args.lr_warmup_fraction == pytest.approx(0.065)
    assert cfg.model.recompute_method == "uniform"
    err = capsys.readouterr().err
    for old, new in (("--model-parallel-size", "--tensor-model-parallel-size"),
                     ("--batch-size", "--micro-batch-size"), ("--warmup", "--lr-warmup-fraction")):
        assert f"{old} as {new}" in err


def test_equals_form_and_block_method_under_old_names():
    args = parse_args(SMALL + ["--activations-checkpoint-method=block",
                               "--activations-checkpoint-num-layers", "1",
                               "--checkpoint-activations"])
    validate_args(args, 1)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == \
        ("full", "block", 1)
    # --activations-checkpoint-method alone (Megatron-LM 2021) implies full granularity
    args = parse_args(SMALL + ["--activations-checkpoint-method", "uniform",
                               "--checkpoint-num-layers", "2"])
    validate_args(args, 1)
    assert (args.recompute_granularity, args.recompute_num_layers) == ("full", 2)


def test_a_flag_under_two_names_is_refused():
    with pytest.raises(ArgumentError, match=r"conflicting Megatron-LM flags: --batch-size and "
                                            r"--micro-batch-size all mean --micro-batch-size "
                                            r"\(keep one\)"):
        validate_args(parse_args(SMALL + ["--batch-size", "4"]), 1)
    with pytest.raises(ArgumentError, match="--checkpoint-num-layers and --activations-"
                                            "checkpoint-num-layers all mean --recompute-num"):
        validate_args(parse_args(SMALL + ["--checkpoint-activations", "--checkpoint-num-layers",
                                          "1", "--activations-checkpoint-num-layers", "2"]), 1)
    with pytest.raises(ArgumentError, match=r"--checkpoint-activations \(full recomputation\) "
                                            "and --recompute-granularity selective"):
        validate_args(parse_args(SMALL + ["--checkpoint-activations",
                                          "--recompute-granularity", "selective"]), 1)


def test_old_recompute_flags_follow_megatron_lm_defaults():
    # a chunk size without --checkpoint-activations or a method: Megatron-LM ignores it
    args = validate_args(parse_args(SMALL + ["--checkpoint-num-layers", "2"]), 1)
    assert args.recompute_num_layers is None and args.recompute_granularity is None
    assert any("--checkpoint-num-layers dropped" in n for n in args.megatron_lm_notes)
    # --activations-checkpoint-method alone: full granularity, 1 layer per chunk
    args = validate_args(parse_args(SMALL + ["--activations-checkpoint-method", "uniform"]), 1)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == \
        ("full", "uniform", 1)
    # ours given: a note says what --recompute-activations means here
    args = validate_args(parse_args(SMALL + ["--recompute-activations"]), 1)
    assert any("--recompute-activations is the paper's whole-stage" in n
               for n in args.megatron_lm_notes)


def test_an_entry_points_own_flag_wins_over_the_compatibility_entry():
    from megatron.arguments import build_parser

    def provider(parser):
        parser.add_argument("--keep-last", action="store_true")  # refused here otherwise
        parser.add_argument("--warmup", type=int, default=0)  # renamed here otherwise
        return parser

    build_parser(provider)  # no argparse conflict
    args = validate_args(parse_args(SMALL + ["--keep-last", "--warmup", "3"], provider), 1)
    assert args.keep_last and args.warmup == 3 and args.lr_warmup_fraction is None


def test_a_value_is_never_renamed():
    out, notes, conflicts = mlf.rewrite_argv(["--data-path", "--warmup-corpus", "--batch-size=3"])
    assert out == ["--data-path", "--warmup-corpus", "--micro-batch-size=3"]
    assert notes == ["--batch-size as --micro-batch-size"] and conflicts == []


def _refused_argv(flag: mlf.CompatFlag):
    if flag.nargs == 0:
        return [flag.name]
    if flag.nargs == "*":
        return [flag.name, "16", "16", "1000"]
    return [flag.name, "bogus" if flag.ok_values else "7"]


REFUSED = [f for f in mlf.FLAGS if f.kind == "refused" or f.ok_values]


@pytest.mark.parametrize("flag", REFUSED, ids=[f.name for f in REFUSED])
def test_every_refused_flag_is_one_error_naming_it(flag):
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(SMALL + _refused_argv(flag)), 1)
    text = str(info.value)
    assert f"{flag.name}" in text and "does not implement" in text and "\n" not in text


IGNORED = [f for f in mlf.FLAGS if f.kind == "ignored"]


@pytest.mark.parametrize("flag", IGNORED, ids=[f.name for f in IGNORED])
def test_every_ignored_flag_is_accepted_and_noted(flag):
    argv = [flag.name] if flag.nargs == 0 else [flag.name, (flag.ok_values or ("x",))[0]]
    args = validate_args(parse_args(SMALL + argv), 1)
    assert any(flag.name in note for note in args.megatron_lm_notes)


def test_all_refused_flags_are_named_in_one_line():
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(SMALL + ["--tp-comm-overlap", "--num-experts", "8",
                                          "--use-torch-fsdp2"]), 1)
    text = str(info.value)
    assert text.startswith("Megatron-LM flags this trainer does not implement")
    assert all(f in text for f in ("--tp-comm-overlap", "--num-experts",
                                   "--use-torch-fsdp2"))


def test_kv_channels_sets_the_head_size():
    args = validate_args(parse_args(SMALL + ["--kv-channels", "16"]), 1)  # 64 / 4
    assert args.kv_channels == 16
    args = validate_args(parse_args(SMALL + ["--kv-channels", "8"]), 1)
    assert args.kv_channels == 8  # heads of 8: queries 32 wide in a hidden size of 64
    with pytest.raises(ArgumentError, match="--kv-channels must be >= 1"):
        validate_args(parse_args(SMALL + ["--kv-channels", "0"]), 1)


def test_old_launcher_local_rank_is_accepted():
    try:  # validation sets LOCAL_RANK from the flag when the launcher did not
        args = validate_args(parse_args(SMALL + ["--local-rank=1"]), 1)
        assert args.launcher_local_rank == 1 and os.environ["LOCAL_RANK"] == "1"
    finally:
        os.environ.pop("LOCAL_RANK", None)
    assert args.megatron_lm_notes == []


def test_renamed_and_compat_names_are_not_flags_of_ours():
    from megatron.arguments import build_parser

    ours = {s for a in build_parser()._actions for s in a.option_strings
            if a.help != "==SUPPRESS=="}
    assert not ours & set(mlf.RENAMED)
    assert not ours & {f.name for f in mlf.FLAGS}
    assert set(mlf.RENAMED.values()) <= ours


def test_docs_table_is_the_generated_one():
    doc = (REPO / "docs" / "megatron_lm_flags.md").read_text()
    assert doc == mlf.markdown(), "regenerate: python -m megatron.megatron_lm_flags > " \
                                  "docs/megatron_lm_flags.md"


def _run(argv, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    full.update(PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, env=full, timeout=120)


def test_unknown_flag_is_one_line_with_the_closest_flag():
    out = _run(SMALL + ["--micro-batch", "3", "--hiden-size", "4"])
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines == ["error: unrecognized arguments: --micro-batch 3 --hiden-size 4 (did you "
                     "mean --micro-batch-size for --micro-batch, --hidden-size for "
                     "--hiden-size?); all flags: pretrain_gpt.py --help"], out.stderr
    # the same verdict on local rank 1 of a launch: printed once, by local rank 0
    quiet = _run(SMALL + ["--micro-batch", "3"], RANK="1", LOCAL_RANK="1")
    assert quiet.returncode == 2 and quiet.stderr == ""


def test_exit_duration_and_missing_checkpoint_flags(tmp_path):
    with pytest.raises(ArgumentError, match="--exit-duration-in-mins must be positive"):
        validate_args(parse_args(SMALL + ["--exit-duration-in-mins", "0"]), 1)
    with pytest.raises(ArgumentError, match="--exit-on-missing-checkpoint needs --load"):
        validate_args(parse_args(SMALL + ["--exit-on-missing-checkpoint"]), 1)
    empty = tmp_path / "typo"
    with pytest.raises(ArgumentError, match=f"--load {empty} holds no checkpoint "
                                            r"\(not a directory\)"):
        validate_args(parse_args(SMALL + ["--exit-on-missing-checkpoint", "--load",
                                          str(empty)]), 1)
    empty.mkdir()
    with pytest.raises(ArgumentError, match="no iter_"):
        validate_args(parse_args(SMALL + ["--exit-on-missing-checkpoint", "--load",
                                          str(empty)]), 1)
    (empty / "iter_0000002").mkdir()
    args = validate_args(parse_args(SMALL + ["--exit-on-missing-checkpoint", "--load",
                                             str(empty)]), 1)
    assert args.exit_on_missing_checkpoint


def test_entry_point_tokenizer_default_needs_a_vocabulary(tmp_path):
    """pretrain_bert.py's default (BertWordPieceLowerCase) applies when a --vocab-file is
    given without --tokenizer-type; a bare --vocab-size stays the synthetic NullTokenizer;
    an explicit --tokenizer-type wins."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    base = [a for a in SMALL if a not in ("--vocab-size", "100")]
    args = validate_args(parse_args(base + ["--vocab-file", str(vocab)]), 1,
                         "BertWordPieceLowerCase")
    assert args.tokenizer_type == "BertWordPieceLowerCase"
    assert any("--tokenizer-type BertWordPieceLowerCase" in n for n in args.megatron_lm_notes)
    assert validate_args(parse_args(SMALL), 1, "GPT2BPETokenizer").tokenizer_type == "NullTokenizer"
    args = validate_args(parse_args(base + ["--vocab-file", str(vocab), "--tokenizer-type",
                                            "BertWordPieceCase"]), 1, "BertWordPieceLowerCase")
    assert args.tokenizer_type == "BertWordPieceCase"


def test_use_checkpoint_args_takes_the_shape_the_command_line_leaves_out(tmp_path):
    ck = tmp_path / "ck"
    shape = ["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "40", "--openai-gelu"]
    out = _run(shape + ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4",
                        "--mock-data", "--vocab-size", "77", "--num-workers", "0",
                        "--eval-iters", "0", "--save", str(ck)])
    assert out.returncode == 0, out.stderr[-2000:]
    args = validate_args(parse_args(["--use-checkpoint-args", "--load", str(ck),
                                     "--micro-batch-size", "2", "--train-iters", "4",
                                     "--lr", "1e-4", "--mock-data", "--seq-length", "16"]), 1)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (3, 48, 4)
    assert (args.max_position_embeddings, args.openai_gelu) == (40, True)
    assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 77)
    assert args.seq_length == 16  # given: the command line wins
    note = next(n for n in args.megatron_lm_notes if "--use-checkpoint-args" in n)
    assert note.startswith(f"note: --use-checkpoint-args: from --load {ck} (iteration 1): "
                           "--num-layers 3, --hidden-size 48") and "--seq-length" not in note
    # no checkpoint yet (the first run of a restart loop), or no --load: the command line's
    # flags, with a note, as Megatron-LM
    for extra in (["--load", str(tmp_path / "none")], []):
        args = validate_args(parse_args(["--use-checkpoint-args", *extra, *SMALL]), 1)
        assert args.num_layers == 2
        assert any("using the command line's flags" in n for n in args.megatron_lm_notes)


def test_log_num_zeros_in_grad_counts_the_unused_position_rows():
    """--log-num-zeros-in-grad (Megatron-LM's): the 32 position-embedding rows past
    --seq-length get no gradient, so each step has at least 32 x 64 zero elements; the
    count is a whole number on every log line.  --log-params-norm adds the weights' norm,
    after the zeros, as Megatron-LM orders them."""
    out = _run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--micro-batch-size", "2", "--seq-length", "32", "--max-position-embeddings",
                "64", "--train-iters", "2", "--lr", "1e-2", "--mock-data", "--vocab-size", "100",
                "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1",
                "--log-num-zeros-in-grad", "--log-params-norm"])
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if " iteration " in line]
    # printed as Megatron-LM's float ('2048.0'), a whole number
    zeros = [float(line.split("num zeros: ")[1].split(" ")[0]) for line in lines]
    assert all(z == int(z) for z in zeros)
    assert len(zeros) == 2 and all(z >= 32 * 64 for z in zeros), out.stdout[-2000:]
    norms = [float(line.split("| params norm: ")[1].split(" ")[0]) for line in lines]
    assert all(n > 0 and math.isfinite(n) for n in norms) and norms[0] != norms[1]
    assert lines[0].index("num zeros") < lines[0].index("params norm")


def test_a_time_limit_at_the_last_iteration_ends_the_run_normally(tmp_path):
    """--exit-duration-in-mins already passed when the run's last batch ends: the run's
    own end follows (end-of-training validation and save), not an early stop."""
    out = _run(SMALL[:SMALL.index("--train-iters")] + SMALL[SMALL.index("--train-iters") + 2:]
               + ["--train-iters", "1", "--num-workers", "0", "--eval-iters", "1",
                  "--exit-duration-in-mins", "0.0001", "--save", str(tmp_path / "ck")])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stopped at iteration" not in out.stdout
    assert "validation loss at iteration 1 on validation set" in out.stdout
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

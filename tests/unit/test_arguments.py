"""Tests for megatron/arguments.py: bad command lines, derived values, config mapping."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from megatron.arguments import (
    ArgumentError,
    build_config,
    parse_and_validate,
    parse_args,
    validate_args,
)
from megatron.config import MegatronConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

# A small, valid training command line; each bad case below changes it.
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def without(argv: List[str], flag: str, takes_value: bool = True) -> List[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + int(takes_value):]


def check(argv: List[str], world_size: int = 1):
    return validate_args(parse_args(argv), world_size)


@pytest.fixture
def files(tmp_path: Path) -> dict:
    """Real (tiny) files for tokenizer and data flags; only existence is checked."""
    for name in ("vocab.json", "merges.txt", "sp.model", "bert_vocab.txt",
                 "a.bin", "a.idx", "b.bin", "b.idx", "onlybin.bin"):
        (tmp_path / name).write_text("x")
    return {k: str(tmp_path / v) for k, v in {
        "vocab": "vocab.json", "merges": "merges.txt", "sp": "sp.model",
        "bert": "bert_vocab.txt", "a": "a", "b": "b", "onlybin": "onlybin",
        "missing": "nope"}.items()}


# (id, argv built from BASE, world size, text the message must contain)
BAD_CASES = [
    ("no-num-layers", without(BASE, "--num-layers"), 1, "--num-layers"),
    ("no-hidden", without(BASE, "--hidden-size"), 1, "--hidden-size"),
    ("no-heads", without(BASE, "--num-attention-heads"), 1, "--num-attention-heads"),
    ("no-seq", without(BASE, "--seq-length"), 1, "--seq-length"),
    ("no-mbs", without(BASE, "--micro-batch-size"), 1, "--micro-batch-size"),
    ("no-iters", without(BASE, "--train-iters"), 1, "--train-iters"),
    ("iters-and-samples", BASE + ["--train-samples", "40"], 1, "--train-samples"),
    ("no-lr", without(BASE, "--lr"), 1, "--lr is required"),
    ("world-not-divisible", BASE + ["--tensor-model-parallel-size", "2",
                                    "--pipeline-model-parallel-size", "2"], 6,
     "--tensor-model-parallel-size (2) x --pipeline-model-parallel-size (2)"),
    ("gbs-not-divisible", BASE + ["--micro-batch-size", "4", "--global-batch-size", "6"], 2,
     "--global-batch-size (6) must be divisible by --micro-batch-size (4) x data-parallel size (2) = 8"),
    ("layers-vs-pp", BASE + ["--num-layers", "5", "--pipeline-model-parallel-size", "2",
                             "--global-batch-size", "8"], 2, "--num-layers (5)"),
    ("uneven-first-last-sum", BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                      "--global-batch-size", "8",
                                      "--decoder-first-pipeline-num-layers", "1",
                                      "--decoder-last-pipeline-num-layers", "2"], 2,
     "must equal --num-layers (4)"),
    ("uneven-middle", BASE + ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                              "--global-batch-size", "8",
                              "--decoder-first-pipeline-num-layers", "3"], 4,
     "leaves 5 layers, which must split evenly"),
    ("uneven-without-pp", BASE + ["--decoder-last-pipeline-num-layers", "1"], 1,
     "need --pipeline-model-parallel-size > 1"),
    ("heads-vs-hidden", BASE + ["--num-attention-heads", "5"], 1, "--num-attention-heads (5)"),
    ("tp-vs-heads", BASE + ["--tensor-model-parallel-size", "8"], 8, "--tensor-model-parallel-size (8)"),
    ("fp16-bf16", BASE + ["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
    ("fp64-fp16", BASE + ["--fp64", "--fp16"], 1, "--fp64"),
    ("fp64-bf16", BASE + ["--fp64", "--bf16"], 1, "--fp64"),
    ("loss-scale-zero", BASE + ["--fp16", "--loss-scale", "0"], 1, "--loss-scale"),
    ("loss-scale-neg", BASE + ["--fp16", "--loss-scale", "-4"], 1, "--loss-scale"),
    ("min-gt-initial-scale", BASE + ["--min-loss-scale", "1024", "--initial-loss-scale", "16"], 1,
     "--min-loss-scale (1024.0) must be <= --initial-loss-scale (16.0)"),
    ("2bw-m-lt-d", BASE + ["--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "4",
                           "--global-batch-size", "6"], 4, "PipeDream-2BW needs m >= d"),
    ("seq-gt-pos", BASE + ["--max-position-embeddings", "16"], 1, "--max-position-embeddings (16)"),
    ("warmup-iters-and-fraction", BASE + ["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], 1,
     "--lr-warmup-iters and --lr-warmup-fraction"),
    ("warmup-fraction-range", BASE + ["--lr-warmup-fraction", "1.5"], 1, "--lr-warmup-fraction"),
    ("min-lr-gt-lr", BASE + ["--min-lr", "0.1"], 1, "--min-lr (0.1) must be <= --lr (0.001)"),
    ("neg-hidden-dropout", BASE + ["--hidden-dropout", "-0.1"], 1, "--hidden-dropout"),
    ("dropout-one", BASE + ["--attention-dropout", "1.0"], 1, "--attention-dropout"),
    ("gpt2-no-merge", without(BASE, "--vocab-size") + ["--tokenizer-type", "GPT2BPETokenizer",
                                                        "--vocab-file", "{vocab}"], 1, "--merge-file"),
    ("gpt2-missing-vocab", without(BASE, "--vocab-size") + [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{missing}",
        "--merge-file", "{merges}"], 1, "--vocab-file {missing} does not exist"),
    ("sp-no-model", without(BASE, "--vocab-size") + ["--tokenizer-type", "SentencePieceTokenizer"], 1,
     "--tokenizer-model"),
    ("sp-missing-model", without(BASE, "--vocab-size") + [
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "{missing}"], 1,
     "--tokenizer-model {missing} does not exist"),
    ("bert-no-vocab", without(BASE, "--vocab-size") + ["--tokenizer-type", "BertWordPieceLowerCase"], 1,
     "--vocab-file"),
    ("null-no-vocab-size", without(BASE, "--vocab-size") + ["--tokenizer-type", "NullTokenizer"], 1,
     "--vocab-size"),
    ("no-tokenizer", without(BASE, "--vocab-size"), 1, "--tokenizer-type"),
    ("no-data", without(BASE, "--mock-data", takes_value=False), 1, "--data-path"),
    ("data-and-mock", BASE + ["--data-path", "{a}"], 1, "--data-path and --mock-data are mutually exclusive"),
    ("data-odd-weighted", without(BASE, "--mock-data", False) + ["--data-path", "0.3", "{a}", "0.7"], 1,
     "--data-path in weighted form"),
    ("data-neg-weight", without(BASE, "--mock-data", False) + ["--data-path", "-1", "{a}", "1", "{b}"], 1,
     "--data-path weights must be positive"),
    ("data-two-weights", without(BASE, "--mock-data", False) + ["--data-path", "0.5", "0.5", "{a}", "{b}"],
     1, "--data-path in weighted form"),
    ("data-missing-idx", without(BASE, "--mock-data", False) + ["--data-path", "{onlybin}"], 1,
     "{onlybin}.idx does not exist"),
    ("data-missing-prefix", without(BASE, "--mock-data", False) + ["--data-path", "1", "{a}", "2",
                                                                   "{missing}"], 1,
     "{missing}.bin does not exist"),
    ("data-path-with-extension", without(BASE, "--mock-data", False) + ["--data-path", "{a}.bin"],
     1, "does not exist; a prefix names the pair without its extension: --data-path {a}"),
    ("data-empty", without(BASE, "--mock-data", False) + ["--data-path"], 1,
     "--data-path was given without any prefix"),
    ("save-interval-no-save", BASE + ["--save-interval", "5"], 1, "--save-interval needs --save"),
    ("method-no-granularity", BASE + ["--recompute-method", "uniform", "--recompute-num-layers", "1"], 1,
     "--recompute-granularity full"),
    ("method-no-num-layers", BASE + ["--recompute-granularity", "full", "--recompute-method", "block"], 1,
     "--recompute-num-layers"),
    ("selective-with-method", BASE + ["--recompute-granularity", "selective", "--recompute-method",
                                      "uniform", "--recompute-num-layers", "1"], 1,
     "--recompute-granularity selective"),
    ("recompute-activations-vs-selective", BASE + ["--recompute-activations", "--recompute-granularity",
                                                   "selective"], 1, "--recompute-activations"),
    ("recompute-num-layers-too-many", BASE + ["--recompute-granularity", "full", "--recompute-method",
                                              "block", "--recompute-num-layers", "5"], 1,
     "--recompute-num-layers (5)"),
    ("split-four-parts", BASE + ["--split", "1,1,1,1"], 1, "--split"),
    ("split-negative", BASE + ["--split", "90,-5,15"], 1, "--split"),
    ("split-garbage", BASE + ["--split", "a,b"], 1, "--split"),
    ("exit-interval-zero", BASE + ["--exit-interval", "0"], 1, "--exit-interval"),
    ("eval-interval-zero", BASE + ["--eval-interval", "0"], 1, "--eval-interval"),
    ("tp-zero", BASE + ["--tensor-model-parallel-size", "0"], 1, "--tensor-model-parallel-size"),
    ("pp-zero", BASE + ["--pipeline-model-parallel-size", "0"], 1, "--pipeline-model-parallel-size"),
    ("num-workers-neg", BASE + ["--num-workers", "-1"], 1, "--num-workers"),
    ("clip-grad-neg", BASE + ["--clip-grad", "-1"], 1, "--clip-grad"),
    ("samples-lt-gbs", without(BASE, "--train-iters") + ["--train-samples", "3", "--global-batch-size",
                                                         "8"], 1, "--train-samples (3)"),
    ("decay-iters-and-samples", BASE + ["--lr-decay-iters", "5", "--lr-decay-samples", "10"], 1,
     "--lr-decay-samples"),
    ("warmup-gt-decay", BASE + ["--lr-warmup-iters", "20"], 1, "--lr-decay-iters"),
    ("mbs-zero", BASE + ["--micro-batch-size", "0"], 1, "--micro-batch-size"),
    ("adam-beta-one", BASE + ["--adam-beta2", "1.0"], 1, "--adam-beta2"),
    ("world-size-zero", BASE, 0, "WORLD_SIZE"),
]


def _fill(text: str, files: dict) -> str:
    return text.format(**files)


@pytest.mark.parametrize("argv,world_size,expected", [c[1:] for c in BAD_CASES],
                         ids=[c[0] for c in BAD_CASES])
def test_bad_command_line_names_the_flag(argv, world_size, expected, files):
    argv = [_fill(a, files) for a in argv]
    with pytest.raises(ArgumentError) as info:
        check(argv, world_size)
    message = str(info.value)
    assert _fill(expected, files) in message
    assert "\n" not in message


def test_enough_bad_cases():
    assert len(BAD_CASES) >= 25
    assert len({c[0] for c in BAD_CASES}) == len(BAD_CASES)
    assert issubclass(ArgumentError, ValueError)


def test_nccl_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ArgumentError, match="--distributed-backend nccl"):
        check(BASE + ["--distributed-backend", "nccl"])
    assert check(BASE + ["--distributed-backend", "gloo"]).distributed_backend == "gloo"


def test_defaults_are_derived():
    args = check(BASE, world_size=8)
    assert args.world_size == 8
    assert args.data_parallel_size == 8
    assert args.ffn_hidden_size == 256
    assert args.max_position_embeddings == 32
    assert args.global_batch_size == 2 * 8
    assert args.num_microbatches == 1
    assert args.lr_decay_iters == 10
    assert args.lr_warmup_iters == 0
    assert args.recompute_granularity is None
    assert args.params_dtype == torch.float32
    assert args.tokenizer_type == "NullTokenizer"
    assert args.pipeline_schedule == "flush"
    assert args.make_vocab_size_divisible_by == 128
    assert args.initial_loss_scale == 2.0 ** 32
    assert args.split == "969, 30, 1"


def test_parallel_layout_and_microbatches():
    args = check(BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                         "--global-batch-size", "24", "--pipeline-schedule", "2bw"], world_size=12)
    assert args.data_parallel_size == 3
    assert args.num_microbatches == 24 // (2 * 3)


def test_2bw_with_m_equal_d_and_every_schedule_with_pp1():
    check(BASE + ["--pipeline-schedule", "2bw", "--pipeline-model-parallel-size", "4",
                  "--global-batch-size", "8"], world_size=4)
    for schedule in ("none", "gpipe", "flush", "2bw"):
        assert check(BASE + ["--pipeline-schedule", schedule]).pipeline_schedule == schedule


def test_samples_become_iterations():
    argv = without(BASE, "--train-iters") + [
        "--train-samples", "100", "--global-batch-size", "8",
        "--lr-decay-samples", "80", "--lr-warmup-samples", "20"]
    args = check(argv)
    assert args.train_iters == 100 // 8
    assert args.lr_decay_iters == 10
    assert args.lr_warmup_iters == 3  # ceil(20 / 8)
    # ... but the schedule a --train-samples run uses counts samples, as Megatron's does
    assert (args.lr_schedule_unit, args.lr_decay_samples, args.lr_warmup_samples) == (
        "samples", 80, 20)


def test_sample_based_schedule_defaults():
    argv = without(BASE, "--train-iters") + ["--train-samples", "100", "--global-batch-size", "8"]
    args = check(argv + ["--lr-warmup-fraction", "0.05"])
    assert (args.lr_decay_samples, args.lr_warmup_samples) == (100, 5)  # not whole batches
    args = check(argv + ["--lr-decay-iters", "10", "--lr-warmup-iters", "2"])
    assert (args.lr_decay_samples, args.lr_warmup_samples) == (80, 16)
    assert check(BASE).lr_schedule_unit == "iterations"
    cfg = build_config(check(argv)).optimizer
    assert (cfg.lr_schedule_unit, cfg.lr_decay_samples, cfg.lr_warmup_samples) == (
        "samples", 100, 0)


def test_warmup_fraction_of_decay():
    args = check(BASE + ["--train-iters", "200", "--lr-warmup-fraction", "0.05"])
    assert args.lr_decay_iters == 200
    assert args.lr_warmup_iters == 10
    args = check(BASE + ["--lr-decay-iters", "40", "--lr-warmup-fraction", "0.25"])
    assert (args.lr_decay_iters, args.lr_warmup_iters) == (40, 10)


@pytest.mark.parametrize("flag,dtype", [([], torch.float32), (["--fp16"], torch.float16),
                                        (["--bf16"], torch.bfloat16), (["--fp64"], torch.float64)])
def test_params_dtype(flag, dtype):
    args = check(BASE + flag)
    assert args.params_dtype == dtype
    assert build_config(args).model.params_dtype == dtype


def test_recompute_activations_means_full_stage_recompute():
    args = check(BASE + ["--recompute-activations"])
    assert args.recompute_granularity == "full"
    assert build_config(args).model.stage_recompute
    args = check(BASE + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "2"])
    assert not build_config(args).model.stage_recompute


def test_skip_train_needs_no_iters_lr_or_data():
    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "4", "--micro-batch-size", "1", "--skip-train"]
    args = check(argv)
    assert args.train_iters is None and args.lr_decay_iters is None
    assert build_config(args).training.skip_train


def test_valid_files_and_weighted_data(files):
    argv = without(without(BASE, "--mock-data", False), "--vocab-size") + [
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab"],
        "--merge-file", files["merges"], "--data-path", "0.3", files["a"], "0.7", files["b"]]
    config = build_config(check(argv))
    assert config.data.data_path == ["0.3", files["a"], "0.7", files["b"]]
    assert config.data.vocab_file == files["vocab"] and config.data.merge_file == files["merges"]
    argv = without(BASE, "--mock-data", False) + ["--data-path", files["a"], files["b"]]
    assert check(argv).data_path == [files["a"], files["b"]]


def _pretend_tensorboard_is_installed(monkeypatch):
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        importlib.machinery.ModuleSpec(name, None) if name == "tensorboard" else real(name, *a)))


def test_build_config_maps_every_field(monkeypatch):
    _pretend_tensorboard_is_installed(monkeypatch)
    argv = BASE + [
        "--ffn-hidden-size", "96", "--max-position-embeddings", "64", "--hidden-dropout", "0.2",
        "--attention-dropout", "0.3", "--init-method-std", "0.01", "--layernorm-epsilon", "1e-6",
        "--global-batch-size", "16", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
        "--distributed-backend", "gloo", "--distributed-timeout-minutes", "3",
        "--fp16", "--loss-scale", "128", "--initial-loss-scale", "1024", "--min-loss-scale", "2",
        "--loss-scale-window", "50", "--hysteresis", "3", "--optimizer", "sgd", "--min-lr", "1e-5",
        "--lr-decay-style", "cosine", "--lr-decay-iters", "8", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "0.5", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--adam-eps", "1e-6", "--sgd-momentum", "0.5", "--seed", "7", "--save", "/tmp/ck",
        "--load", "/tmp/ld", "--save-interval", "4", "--no-save-optim", "--no-load-optim",
        "--no-load-rng", "--finetune", "--log-interval", "3", "--eval-interval", "5",
        "--eval-iters", "2", "--exit-interval", "9", "--tensorboard-dir", "/tmp/tb",
        "--timeline-file", "/tmp/tl.json", "--split", "8,1,1", "--data-cache-path", "/tmp/cache",
        "--num-workers", "0", "--make-vocab-size-divisible-by", "64", "--eod-mask-loss"]
    config = build_config(check(argv, world_size=8))
    assert isinstance(config, MegatronConfig)
    m, p, pr, o, d, t = (config.model, config.parallel, config.precision, config.optimizer,
                         config.data, config.training)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (4, 64, 4, 96)
    assert (m.seq_length, m.max_position_embeddings, m.padded_vocab_size) == (32, 64, 0)
    assert (m.hidden_dropout, m.attention_dropout, m.init_method_std, m.layernorm_epsilon) == (
        0.2, 0.3, 0.01, 1e-6)
    assert m.params_dtype == torch.float16 and m.num_tokentypes == 0
    assert (p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (8, 2, 2)
    assert p.data_parallel_size == 2 and p.pipeline_schedule == "2bw"
    assert (p.distributed_backend, p.distributed_timeout_minutes) == ("gloo", 3.0)
    assert (pr.fp16, pr.bf16, pr.loss_scale, pr.initial_loss_scale, pr.min_loss_scale) == (
        True, False, 128.0, 1024.0, 2.0)
    assert (pr.loss_scale_window, pr.hysteresis, pr.fp32_master_weights) == (50, 3, True)
    assert (o.optimizer, o.lr, o.min_lr, o.lr_decay_style, o.lr_decay_iters, o.lr_warmup_iters) == (
        "sgd", 1e-3, 1e-5, "cosine", 8, 2)
    assert (o.weight_decay, o.clip_grad, o.adam_beta1, o.adam_beta2, o.adam_eps, o.sgd_momentum) == (
        0.1, 0.5, 0.8, 0.95, 1e-6, 0.5)
    assert (d.data_path, d.split, d.data_cache_path, d.num_workers) == ([], "8,1,1", "/tmp/cache", 0)
    assert (d.tokenizer_type, d.make_vocab_size_divisible_by, d.eod_mask_loss, d.mock_data) == (
        "NullTokenizer", 64, True, True)
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.train_samples, t.seed) == (
        2, 16, 10, None, 7)
    assert (t.log_interval, t.eval_interval, t.eval_iters, t.exit_interval) == (3, 5, 2, 9)
    assert (t.save, t.load, t.save_interval, t.tensorboard_dir, t.timeline_file) == (
        "/tmp/ck", "/tmp/ld", 4, "/tmp/tb", "/tmp/tl.json")
    assert (t.no_save_optim, t.no_load_optim, t.no_load_rng, t.finetune, t.skip_train) == (
        True, True, True, True, False)
    assert t.num_microbatches(p.data_parallel_size) == 4
    config.to_dict()  # serialisable for logging / checkpoints


def test_fp64_and_fp32_keep_no_master_copy():
    assert not build_config(check(BASE + ["--fp64"])).precision.fp32_master_weights
    assert not build_config(check(BASE)).precision.fp32_master_weights
    assert build_config(check(BASE + ["--bf16"])).precision.fp32_master_weights


def test_extra_args_provider_and_unknown_args():
    def provider(parser):
        group = parser.add_argument_group("bert")
        group.add_argument("--num-tokentypes", type=int, default=2)
        return parser

    args = parse_args(BASE, extra_args_provider=provider)
    assert args.num_tokentypes == 2
    assert build_config(validate_args(args, 1)).model.num_tokentypes == 2
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--no-such-flag"])
    assert parse_args(BASE + ["--no-such-flag"], ignore_unknown_args=True).num_layers == 4


def test_parse_and_validate_reads_world_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args, config = parse_and_validate(BASE)
    assert args.data_parallel_size == 4 and config.parallel.world_size == 4
    args, _ = parse_and_validate(BASE, world_size=2)
    assert args.data_parallel_size == 2


def test_parse_and_validate_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        parse_and_validate(BASE + ["--fp16", "--bf16"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: --fp16 and --bf16 are mutually exclusive\n"


def test_subprocess_bad_command_line_exits_2_with_one_line():
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("WORLD_SIZE", None)
    code = "from megatron.arguments import parse_and_validate; parse_and_validate()"
    argv = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "128", "--pipeline-model-parallel-size", "2"]
    proc = subprocess.run([sys.executable, "-c", code, *argv], env={**env, "WORLD_SIZE": "2"},
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: --num-layers (3) must be divisible by "
                               "--pipeline-model-parallel-size (2)")
    assert proc.stdout == ""


def test_tensorboard_dir_without_the_package_is_an_argument_error(monkeypatch, tmp_path):
    """It failed after data set-up, with a traceback on the last rank."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ArgumentError, match="--tensorboard-dir .* needs the tensorboard package"):
        check(BASE + ["--tensorboard-dir", str(tmp_path / "tb")])


def test_loss_scale_without_fp16_or_bf16_warns(capsys):
    check(BASE + ["--loss-scale", "1024"])
    assert "--loss-scale 1024.0 is ignored" in capsys.readouterr().err
    check(BASE + ["--loss-scale", "1024", "--bf16"])
    assert "ignored" not in capsys.readouterr().err


def test_skip_train_needs_no_decay_length_for_a_warmup_fraction():
    """Evaluation only takes no step: --lr-warmup-fraction without a train length is not
    refused there (finetuning's --epochs 0 passes the examples' fraction; helper-42)."""
    args = check(without(BASE, "--train-iters") + ["--skip-train", "--lr-warmup-fraction",
                                                    "0.01", "--lr-decay-style", "linear"])
    assert args.lr_warmup_iters == 0

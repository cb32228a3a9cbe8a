"""examples/*.sh as a user runs them, without training: every script parses (bash -n),
and the command line it launches (recorded by a stand-in for python3 and torchrun) passes
the trainer's argument validation at the world size it launches, with every flag known.

Also the chain between scripts: the finetuning scripts build the model that
pretrain_bert_cpu.sh saves, and the evaluation scripts the one pretrain_gpt_cpu_demo.sh
saves, for each of the demo's BLOCKs (a Llama-block demo checkpoint used to be refused by
evaluate_*.sh, which had no BLOCK).  And the variables checked before any launch."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from megatron.arguments import parse_and_validate

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SOURCED = ("demo_block_flags.sh", "zeroshot_model.sh")  # sourced by other scripts
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.sh") if p.name not in SOURCED)

# Stands in for python3 and torchrun: records each command line (its working directory,
# then the NUL-separated arguments; one file a call) and does nothing else.
STUB = """#!/usr/bin/env bash
n=$(ls "$CAPTURE" | wc -l)
printf '%s\\0' "$PWD" "$(basename "$0")" "$@" > "$CAPTURE/$n"
"""


@pytest.fixture()
def runner(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "py"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    files = tmp_path / "files"
    files.mkdir()
    for name in ("d.bin", "d.idx", "vocab.txt", "encoder.json", "vocab.bpe", "tok.model"):
        (files / name).write_text("")
    demo = tmp_path / "demo"  # a demo folder whose corpus and tokenizer are made
    demo.mkdir()
    for name in ("corpus.jsonl", "tokenizer.model", "corpus_text_document.bin",
                 "corpus_text_document.idx"):
        (demo / name).write_text("x")
    base = {"PYTHON": str(bin_dir / "py"), "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "DATA": str(files / "d"), "VOCAB": str(files / "vocab.txt"),
            "MERGES": str(files / "vocab.bpe"), "TOKENIZER_MODEL": str(files / "tok.model"),
            # every output in tmp_path (validation creates --save)
            "SAVE": str(tmp_path / "save"), "CKPT": str(tmp_path / "ckpt"),
            "DEMO_DIR": str(tmp_path / "demo"),
            "OUT": str(tmp_path / "out")}
    counter = {"n": 0}

    def run(script: str, repo: Path = REPO, check: bool = True,
            **env: str) -> Tuple[subprocess.CompletedProcess, List[List[str]]]:
        counter["n"] += 1
        capture = tmp_path / f"capture{counter['n']}"
        capture.mkdir()
        full = {**{k: v for k, v in os.environ.items()
                   if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SIZE", "BLOCK")},
                **base, "CAPTURE": str(capture)}
        if env.get("VOCAB") == "gpt2":  # the GPU GPT scripts take GPT-2 BPE files
            env["VOCAB"] = str(files / "encoder.json")
        full.update(env)
        # started from another directory: each script runs in the repository root
        out = subprocess.run(["bash", str(repo / "examples" / script)], env=full,
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
        if check:
            assert out.returncode == 0, out.stderr[-2000:]
        calls = [(capture / str(i)).read_bytes().decode().split("\0")[:-1]
                 for i in range(len(list(capture.iterdir())))]
        assert all(c[0] == str(repo) for c in calls), (script, {c[0] for c in calls})
        return out, [c[1:] for c in calls]

    return run


def _copy_of_examples(tmp_path: Path) -> Path:
    """A repository root holding only examples/: a script's default (relative) outputs
    land there, not in the checkout."""
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES, repo / "examples")
    return repo


def _launch(command: List[str]) -> Tuple[str, List[str], int]:
    """(entry point, its argv, world size) of a torchrun / python -m torch.distributed.run
    command line."""
    i = next(k for k, a in enumerate(command) if a.endswith(".py"))
    launcher = command[1:i]

    def opt(name: str) -> int:
        return int(launcher[launcher.index(name) + 1]) if name in launcher else 1

    return command[i], command[i + 1:], opt("--nnodes") * opt("--nproc-per-node")


def _validate(command: List[str]):
    entry, argv, world = _launch(command)
    if entry == "pretrain_gpt.py":
        return parse_and_validate(argv, world_size=world, default_tokenizer="GPT2BPETokenizer",
                                  per_token_loss=True)
    if entry == "pretrain_bert.py":
        from pretrain_bert import add_bert_args

        return parse_and_validate(argv, extra_args_provider=add_bert_args, world_size=world,
                                  default_tokenizer="BertWordPieceLowerCase")
    assert entry == "tasks/main.py", command
    task = argv[argv.index("--task") + 1]
    if task in ("MNLI", "RACE"):  # tasks/finetune_utils.py adds --train-iters from --epochs
        from tasks.finetune_utils import finetune_args

        return parse_and_validate(argv + ["--train-iters", "10"],
                                  extra_args_provider=finetune_args, world_size=world,
                                  default_tokenizer="BertWordPieceLowerCase")
    from tasks.arguments import add_task_args  # evaluation: what zeroshot_gpt adds

    return parse_and_validate(argv + ["--skip-train", "--lr-decay-style", "constant"],
                              extra_args_provider=add_task_args, world_size=world)


# (script, its variables) for each layout a script offers
CASES: List[Tuple[str, Dict[str, str]]] = [
    ("pretrain_gpt_cpu_demo.sh", {}), ("pretrain_gpt_cpu_demo.sh", {"BLOCK": "llama"}),
    ("pretrain_bert_cpu.sh", {}), ("pretrain_bert_cpu.sh", {"DATA": ""}),
    ("pretrain_bert_cpu.sh", {"NPROC": "1", "PP": "1", "SCHEDULE": "flush"}),
    ("finetune_mnli.sh", {}), ("finetune_mnli.sh", {"SIZE": "355m"}),
    ("finetune_race.sh", {}), ("finetune_race.sh", {"SIZE": "355m"}),
    ("evaluate_wikitext103.sh", {}), ("evaluate_wikitext103.sh", {"BLOCK": "llama"}),
    ("evaluate_wikitext103.sh", {"STRIDE": "64"}),
    ("evaluate_wikitext103.sh", {"SIZE": "355m", "VOCAB": "gpt2"}),
    ("evaluate_lambada.sh", {}), ("evaluate_lambada.sh", {"BLOCK": "llama", "STRICT": "1"}),
    ("evaluate_lambada.sh", {"SIZE": "355m", "VOCAB": "gpt2"}),
    ("pretrain_gpt_345m_single_gpu.sh", {"VOCAB": "gpt2"}),
    ("pretrain_gpt_345m_single_gpu.sh", {"VOCAB": "gpt2", "PRECISION": "fp16"}),
    ("pretrain_gpt_p3_16xlarge.sh", {"VOCAB": "gpt2"}),
    ("pretrain_gpt_p3_16xlarge.sh", {"VOCAB": "gpt2", "PP": "4", "SCHEDULE": "flush"}),
    ("pretrain_bert_p3_16xlarge.sh", {}),
]


def test_every_example_is_checked_and_parses():
    assert {s for s, _ in CASES} == set(SCRIPTS)
    for script in SCRIPTS + list(SOURCED):
        out = subprocess.run(["bash", "-n", str(EXAMPLES / script)], capture_output=True,
                             text=True, timeout=10)
        assert out.returncode == 0, (script, out.stderr)


@pytest.mark.parametrize("script,env", CASES,
                         ids=[f"{s}-{'-'.join(f'{k}={v}' for k, v in e.items())}"
                              for s, e in CASES])
def test_the_launched_command_line_validates(runner, script, env, capsys):
    _, launches = runner(script, **env)
    assert launches, "no launch recorded"
    entry, _, world = _launch(launches[-1])
    args, cfg = _validate(launches[-1])
    assert cfg.parallel.world_size == world
    assert "error" not in capsys.readouterr().err


def _model(runner, script: str, **env):
    _, launches = runner(script, **env)
    args, cfg = _validate(launches[-1])
    shape = dict(vars(cfg.model))
    for key in ("seq_length", "vocab_size", "padded_vocab_size"):
        shape.pop(key, None)
    return shape, args


@pytest.mark.parametrize("block", ["gpt2", "llama"])
def test_evaluation_builds_the_demo_model(runner, block):
    demo, demo_args = _model(runner, "pretrain_gpt_cpu_demo.sh", BLOCK=block)
    for script in ("evaluate_wikitext103.sh", "evaluate_lambada.sh"):
        model, args = _model(runner, script, BLOCK=block)
        assert model == demo, script
        assert args.tokenizer_type == demo_args.tokenizer_type == "SentencePieceTokenizer"
    # and the defaults read what the demo writes
    _, launches = runner("evaluate_lambada.sh", TOKENIZER_MODEL="")
    argv = launches[-1]
    assert argv[argv.index("--load") + 1].endswith("/demo/checkpoints")
    assert argv[argv.index("--tokenizer-model") + 1].endswith("/demo/tokenizer.model")


def test_finetuning_builds_the_pretrained_bert_model(runner, tmp_path):
    bert, bert_args = _model(runner, "pretrain_bert_cpu.sh")
    for script in ("finetune_mnli.sh", "finetune_race.sh"):
        model, args = _model(runner, script)
        assert {k: model[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                      "max_position_embeddings")} == \
            {k: bert[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                  "max_position_embeddings")}, script
        assert args.tokenizer_type == bert_args.tokenizer_type
    # the default PRETRAINED is the default SAVE of pretrain_bert_cpu.sh
    repo = _copy_of_examples(tmp_path)
    _, launches = runner("finetune_mnli.sh", repo=repo, SAVE="")
    argv = launches[-1]
    assert argv[argv.index("--pretrained-checkpoint") + 1] == "checkpoints/bert_cpu"
    _, launches = runner("pretrain_bert_cpu.sh", repo=repo, SAVE="")
    argv = launches[-1]
    assert argv[argv.index("--save") + 1] == "checkpoints/bert_cpu"


@pytest.mark.parametrize("script,task", [("finetune_mnli.sh", "mnli"),
                                         ("finetune_race.sh", "race")])
def test_finetuning_never_removes_a_previous_run(runner, tmp_path, script, task):
    """A finetuned model is never deleted by the script: its default SAVE is passed to
    the trainer as it is (which refuses a --save holding another run's checkpoints)."""
    repo = _copy_of_examples(tmp_path)
    old = repo / "checkpoints" / f"{task}_cpu"
    (old / "iter_0000001").mkdir(parents=True)
    (old / "latest_checkpointed_iteration.txt").write_text("1")
    out, launches = runner(script, repo=repo, SAVE="")
    assert (old / "iter_0000001").is_dir() and "removing" not in out.stdout
    assert launches[-1][launches[-1].index("--save") + 1] == f"checkpoints/{task}_cpu"


@pytest.mark.parametrize("script,env,message", [
    ("evaluate_lambada.sh", {"BLOCK": "gpt3"}, "BLOCK=gpt3: expected gpt2 or llama"),
    ("evaluate_wikitext103.sh", {"SIZE": "345m"}, "SIZE=345m: expected cpu or 355m"),
    ("finetune_mnli.sh", {"SIZE": "large"}, "SIZE=large: expected cpu or 355m"),
    ("finetune_race.sh", {"SIZE": "large"}, "SIZE=large: expected cpu or 355m"),
    ("pretrain_gpt_cpu_demo.sh", {"BLOCK": "gpt3"}, "BLOCK=gpt3: expected gpt2 or llama"),
    ("pretrain_gpt_345m_single_gpu.sh", {"PRECISION": "fp32"}, "PRECISION=fp32: expected"),
    ("pretrain_bert_cpu.sh", {"VOCAB": "/nonexistent/vocab.txt"}, "no such file"),
])
def test_a_bad_variable_is_one_line_before_any_launch(runner, script, env, message):
    out, launches = runner(script, check=False, **env)
    assert out.returncode != 0 and message in out.stderr
    assert not [c for c in launches if c[0] == "torchrun" or "torch.distributed.run" in c]

"""One spawn of two gloo ranks serving every BERT / finetuning distributed test.

Starting processes (importing torch) costs far more than these tiny trainings, so all
steps of test_bert_schedules.py and test_finetune_e2e.py run one after another in the
same two ranks, once per pytest session (``spawn_all`` is cached).  Import this module
as ``tests.distributed.test_bert_harness`` so every test file shares the cache.
This file holds no tests.
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch

from tests.dist_utils import run_distributed

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
ROOT = Path(tempfile.mkdtemp(prefix="bert_dist_tests_"))
atexit.register(shutil.rmtree, str(ROOT), True)

# A tiny BERT in float64 without dropout: every schedule/layout must agree to ~1e-12.
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--make-vocab-size-divisible-by", "64", "--tokenizer-type", "NullTokenizer",
        "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0", "--fp64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--seed", "7", "--log-interval", "1000",
        "--eval-interval", "1000", "--eval-iters", "1", "--num-workers", "0",
        # the single-process reference runs in the test process: on the CPU like the
        # gloo ranks, also where a GPU is visible
        "--distributed-backend", "gloo"]

# A small BERT with the real uncased WordPiece vocabulary, for finetuning end to end.
REAL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
        str(DATA / "bert" / "vocab.txt"), "--micro-batch-size", "2", "--lr", "1e-3",
        "--seed", "5", "--log-interval", "1000", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0"]

# 43 pads CharTokenizer's 257 ids to 258 rows for t = 1 and t = 2 alike; a different
# padded vocabulary would change the softmax over the padding rows.
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--tokenizer-type", "CharTokenizer",
       "--make-vocab-size-divisible-by", "43", "--seed", "3", "--num-workers", "0", "--fp64",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2",
       "--log-interval", "1000"]

Step = Tuple[str, str, List[str]]


def pp_args(d: int, schedule: str, *extra: str) -> List[str]:
    return TINY + ["--pipeline-model-parallel-size", str(d), "--pipeline-schedule", schedule,
                   *extra]


def schedule_steps(root: Path) -> List[Step]:
    return [
        ("d2_flush", "bert", pp_args(2, "flush", "--save", str(root / "d2"))),
        ("d2_gpipe", "bert", pp_args(2, "gpipe")),
        ("d2_none", "bert", pp_args(2, "none")),
        ("d2_2bw", "bert", pp_args(2, "2bw")),
        ("d1_w2", "bert", pp_args(1, "flush", "--save", str(root / "d1"))),
        ("t2", "bert", pp_args(1, "flush", "--tensor-model-parallel-size", "2")),
        ("t2_sp", "bert", pp_args(1, "flush", "--tensor-model-parallel-size", "2",
                                  "--sequence-parallel")),
        # 2BW interrupted after batch 2 and resumed from its checkpoint
        ("2bw_first", "bert", pp_args(2, "2bw", "--exit-interval", "2",
                                      "--save", str(root / "resume"))),
        ("2bw_resumed", "bert", pp_args(2, "2bw", "--load", str(root / "resume"))),
    ]


def race_files(split: str, level: str, n: int) -> List[str]:
    files = sorted((DATA / "race" / split / level).glob("*.txt"), key=lambda p: int(p.stem))
    return [str(p) for p in files[:n]]


def finetune_steps(root: Path) -> List[Step]:
    if not (DATA / "bert" / "vocab.txt").exists() or not (DATA / "glue" / "MNLI").exists() \
            or not (DATA / "race").exists():
        return []
    mnli = DATA / "glue" / "MNLI"
    bert_ckpt = str(root / "bert_real")
    return [
        ("bert_pretrain", "bert", REAL + [
            "--mock-data", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--eval-iters", "1", "--save", bert_ckpt]),
        ("mnli", "task", REAL + [
            "--task", "MNLI", "--pipeline-model-parallel-size", "2", "--pipeline-schedule",
            "2bw", "--global-batch-size", "4", "--epochs", "2",
            "--train-data", str(mnli / "train.tsv"),
            "--valid-data", str(mnli / "dev_matched.tsv"), str(mnli / "dev_mismatched.tsv"),
            "--pretrained-checkpoint", bert_ckpt, "--save", str(root / "mnli")]),
        ("race", "task", REAL + [
            "--task", "RACE", "--global-batch-size", "4", "--epochs", "1",
            "--train-data", *race_files("dev", "middle", 2),
            "--valid-data", race_files("test", "middle", 1)[0], race_files("test", "high", 1)[0],
            "--pretrained-checkpoint", bert_ckpt]),
        # the same on two tensor ranks with sequence parallelism (no data parallelism)
        ("race_t2_sp", "task", REAL + [
            "--task", "RACE", "--global-batch-size", "4", "--epochs", "1",
            "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--train-data", *race_files("dev", "middle", 2),
            "--valid-data", race_files("test", "middle", 1)[0], race_files("test", "high", 1)[0],
            "--pretrained-checkpoint", bert_ckpt]),
        ("gpt_pretrain", "gpt", GPT + [
            "--mock-data", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
            "--train-iters", "1", "--lr", "1e-2", "--eval-iters", "0",
            "--save", str(root / "gpt")]),
        ("wikitext_t2", "task", GPT + [
            "--task", "WIKITEXT103", "--tensor-model-parallel-size", "2",
            "--valid-data", str(root / "wiki.txt"), "--load", str(root / "gpt"),
            "--overlapping-eval", "6"]),
        ("wikitext_t2_sp", "task", GPT + [
            "--task", "WIKITEXT103", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--valid-data", str(root / "wiki.txt"),
            "--load", str(root / "gpt"), "--overlapping-eval", "6"]),
    ]


WIKI_TEXT = (" = Valkyria Chronicles III = \n \n Senjō no Valkyria 3 : Unrecorded Chronicles is "
             "a tactical role @-@ playing video game developed by Sega and Media.Vision for "
             "the PlayStation Portable . Released in January 2011 in Japan , it is the third "
             "game in the Valkyria series . \n")


def run_steps(rank: int, world: int, steps: Sequence[Step]) -> Dict[str, Dict[str, Any]]:
    """Run (name, kind, argv) steps in order in this rank; kind: 'bert' (pretrain_bert.py),
    'gpt' (pretrain_gpt.py) or 'task' (tasks/main.py)."""
    import pretrain_bert
    import pretrain_gpt
    from tasks.main import main as task_main

    out: Dict[str, Dict[str, Any]] = {}
    for name, kind, argv in steps:
        torch.manual_seed(0)
        if kind == "task":
            result = task_main(list(argv))
            if result is None or not hasattr(result, "accuracy"):
                out[name] = {"perplexity": result}
            else:
                out[name] = {"accuracy": result.accuracy, "iteration": result.iteration,
                             "samples": {k: r.samples for k, r in result.reports.items()},
                             "malformed": {k: len(r.malformed) for k, r in result.reports.items()},
                             "train_losses": result.training.losses}
            continue
        result = (pretrain_bert if kind == "bert" else pretrain_gpt).main(list(argv))
        out[name] = {"losses": result.losses, "eval": result.eval_losses,
                     "versions": [r.weight_version for r in result.reports]}
    return out


@functools.lru_cache(maxsize=None)
def spawn_all() -> Tuple[Dict[str, Dict[str, Any]], ...]:
    """Results of every step, indexed by rank (computed once)."""
    (ROOT / "wiki.txt").write_text(WIKI_TEXT)
    steps = schedule_steps(ROOT) + finetune_steps(ROOT)
    return tuple(run_distributed(run_steps, world_size=2, args=(steps,), timeout=400))

"""Flags of tasks/main.py, added to the trainer's parser (Megatron's names)."""
from __future__ import annotations

import argparse

TASKS = ("MNLI", "RACE", "WIKITEXT103", "LAMBADA")


def add_task_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("tasks", "finetuning and zero-shot evaluation")
    g.add_argument("--task", choices=TASKS, default=None, help="Which task to run.")
    g.add_argument("--train-data", nargs="+", default=None,
                   help="Training files (MNLI: train.tsv; RACE: directories such as "
                        "RACE/train/middle RACE/train/high).")
    g.add_argument("--valid-data", nargs="+", default=None,
                   help="Validation sets, each reported separately (MNLI: dev_matched.tsv "
                        "dev_mismatched.tsv; RACE: directories; WIKITEXT103: the test file; "
                        "LAMBADA: the JSON-lines test file, {\"text\": ...} a line).")
    g.add_argument("--epochs", type=int, default=None,
                   help="Finetuning epochs (sets --train-iters from the training set size).")
    g.add_argument("--keep-last", action="store_true",
                   help="Train on the last incomplete global batch of each epoch too, its "
                        "missing examples padded with weight 0 (default: drop it, as "
                        "Megatron-LM's finetuning does). Validation always scores every "
                        "example.")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="Checkpoint directory whose model weights initialise the model; any "
                        "tensor/pipeline layout (tools/checkpoint_util.py re-splits it).")
    g.add_argument("--overlapping-eval", type=int, default=None,
                   help="WIKITEXT103: stride of the sliding evaluation window (default: "
                        "--seq-length, i.e. non-overlapping windows).")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: a passage counts as correct only when every token of its "
                        "whole last word is predicted (default: only the passage's last "
                        "token).")
    # Finetuning reads its own files (--train-data/--valid-data), not a --data-path
    # corpus; this default tells the trainer's validation that no corpus is expected.
    parser.set_defaults(mock_data=True)
    return parser

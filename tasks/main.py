"""Downstream tasks with the trainer's flags: finetune BERT, evaluate GPT.

    python tasks/main.py --task MNLI --train-data MNLI/train.tsv \\
        --valid-data MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv \\
        --pretrained-checkpoint bert_ckpt --epochs 3 --tokenizer-type BertWordPieceLowerCase \\
        --vocab-file vocab.txt --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
        --seq-length 512 --micro-batch-size 8 --global-batch-size 32 --lr 1e-5

    --task RACE         --train-data RACE/train/middle RACE/train/high --valid-data ...
    --task WIKITEXT103  --valid-data wiki.test.tokens --load gpt_ckpt [--overlapping-eval 32]
    --task LAMBADA      --valid-data lambada_test.jsonl --load gpt_ckpt [--strict-lambada]

Pipeline, tensor and data parallel flags (--pipeline-schedule, ...) work as in pretraining.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.arguments import TASKS  # noqa: E402


def main(argv: Optional[List[str]] = None):
    argv = list(argv if argv is not None else sys.argv[1:])
    from megatron.arguments import OneLineParser

    pre = OneLineParser(prog="tasks/main.py", add_help=False, allow_abbrev=False)
    pre.add_argument("--task", choices=TASKS, default=None)
    task = pre.parse_known_args(argv)[0].task
    if task is None and ("-h" in argv or "--help" in argv):
        from megatron.arguments import build_parser
        from tasks.finetune_utils import finetune_args

        parser = build_parser(finetune_args)   # the trainer's flags and the tasks' own
        parser.prog = "tasks/main.py"
        parser.description = (f"Finetune BERT or evaluate GPT on a downstream task: --task "
                              f"{{{','.join(TASKS)}}} with the trainer's flags.")
        parser.print_help()
        return None
    if task is None:
        from megatron.errors import exit_once_per_node

        # every rank has the same command line: one line per node
        exit_once_per_node(f"error: --task is required (one of {', '.join(TASKS)})")
    if task == "MNLI":
        from tasks.glue.mnli import main as run
    elif task == "RACE":
        from tasks.race.finetune import main as run
    else:
        from tasks.zeroshot_gpt.evaluate import main as run  # WIKITEXT103, LAMBADA
    return run(argv)


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

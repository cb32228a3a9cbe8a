"""--task RACE: finetune a pretrained BERT as a 4-way multiple-choice model."""
from __future__ import annotations

from typing import List, Optional

from tasks.race.data import NUM_CHOICES, build_dataset, read_race


def model_provider(cfg, groups, pre_process: bool, post_process: bool):
    from megatron.model.multiple_choice import MultipleChoice
    from megatron.tensor_parallel.utils import TPInfo

    layers = cfg.parallel.stage_layers(cfg.model.num_layers, groups.pp_rank)
    return MultipleChoice(cfg.model, TPInfo.from_groups(groups), num_choices=NUM_CHOICES,
                          pre_process=pre_process, post_process=post_process,
                          layer_numbers=layers, seed=cfg.training.seed)


def main(argv: Optional[List[str]] = None):
    from tasks.finetune_utils import FinetuneTask, finetune

    # the pooler too: a BERT pretrained with --bert-no-binary-head has none
    task = FinetuneTask(name="RACE", read=read_race, build=build_dataset,
                        model_provider=model_provider,
                        head_prefixes=("multichoice_head.", "pooler."))
    return finetune(task, argv)

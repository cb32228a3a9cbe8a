"""Pretrain BERT (masked LM + sentence-order prediction).

    torchrun --nproc-per-node 4 pretrain_bert.py --num-layers 4 --hidden-size 256 \\
        --num-attention-heads 8 --seq-length 128 --micro-batch-size 4 --global-batch-size 32 \\
        --pipeline-model-parallel-size 2 --pipeline-schedule 2bw --lr 1e-4 --train-iters 200 \\
        --data-path corpus_text_sentence --tokenizer-type BertWordPieceLowerCase \\
        --vocab-file vocab.txt

``--data-path`` names a sentence-level dataset (``tools/preprocess_data.py
--split-sentences``).  ``--mock-data`` trains on synthetic sentence pairs instead.
The providers below are all this file contributes; megatron.training does the rest.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron.config import MegatronConfig
from megatron.data.bert_dataset import MaskingConfig
from megatron.parallel_state import ParallelGroups


@dataclass
class BertTask:
    """BERT flags (not part of MegatronConfig), set by ``main`` before training starts."""

    masking: MaskingConfig = field(default_factory=MaskingConfig)


TASK = BertTask()


def add_bert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("bert", "BERT pretraining")
    g.add_argument("--bert-no-binary-head", action="store_true",
                   help="Train the masked LM only, without the sentence-order head.")
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="Fraction of tokens to predict (80%% [MASK], 10%% random, 10%% kept).")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="Probability that a sample gets a random shorter target length.")
    g.add_argument("--whole-word-masking", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="Mask whole words (a WordPiece token and its ## continuations), as "
                        "Megatron-LM always does (the default); --no-whole-word-masking "
                        "masks single WordPiece tokens.")
    g.add_argument("--masking-max-ngram", type=int, default=3,
                   help="Mask n-grams of up to N consecutive words, P(n) ~ 1/n, as "
                        "Megatron-LM (3, its fixed value); 1 masks single words as "
                        "Google's BERT.")
    # Read by megatron.arguments.build_config: word + position + token-type embeddings.
    parser.set_defaults(num_tokentypes=2)
    return parser


def masking_from_args(argv: Optional[Sequence[str]]) -> MaskingConfig:
    """The BERT flags of ``argv`` (unknown flags ignored); exits with one line if invalid."""
    from megatron.arguments import OneLineParser

    parser = add_bert_args(OneLineParser(prog="pretrain_bert.py", add_help=False,
                                         allow_abbrev=False))
    args, _ = parser.parse_known_args(list(argv) if argv is not None else None)
    problem = None
    if not 0.0 < args.mask_prob < 1.0:
        problem = f"--mask-prob must be in (0, 1), got {args.mask_prob}"
    elif not 0.0 <= args.short_seq_prob <= 1.0:
        problem = f"--short-seq-prob must be in [0, 1], got {args.short_seq_prob}"
    elif args.masking_max_ngram < 1:
        problem = f"--masking-max-ngram must be >= 1, got {args.masking_max_ngram}"
    if problem:
        from megatron.errors import exit_once_per_node

        exit_once_per_node(f"error: {problem}")  # every rank has it: one line per node
    return MaskingConfig(masked_lm_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
                         binary_head=not args.bert_no_binary_head,
                         whole_word_masking=args.whole_word_masking,
                         max_ngram=args.masking_max_ngram)


def model_provider(cfg: MegatronConfig, groups: ParallelGroups, pre_process: bool,
                   post_process: bool) -> torch.nn.Module:
    from megatron.model.bert_model import BertModel
    from megatron.tensor_parallel.utils import TPInfo

    layers = cfg.parallel.stage_layers(cfg.model.num_layers, groups.pp_rank)
    return BertModel(cfg.model, TPInfo.from_groups(groups), pre_process=pre_process,
                     post_process=post_process, layer_numbers=layers, seed=cfg.training.seed,
                     add_binary_head=TASK.masking.binary_head)


def datasets_provider(cfg: MegatronConfig, tokenizer, num_samples: Tuple[int, int, int]):
    from megatron.data.bert_dataset import (BertVocabInfo, MockBertDataset,
                                            build_split_path_datasets,
                                            build_train_valid_test_datasets)

    if tokenizer is None:
        raise ValueError("BERT needs a tokenizer: --tokenizer-type BertWordPieceLowerCase "
                         "--vocab-file vocab.txt (or NullTokenizer --vocab-size N with --mock-data)")
    info = BertVocabInfo.from_tokenizer(tokenizer)
    if cfg.data.mock_data:
        return tuple(MockBertDataset(n, cfg.model.seq_length, info, TASK.masking,
                                     cfg.training.seed + i) if n > 0 else None
                     for i, n in enumerate(num_samples))
    if cfg.data.split_data_paths is not None:  # --train/--valid/--test-data-path
        return build_split_path_datasets(cfg.data.split_data_paths, num_samples,
                                         cfg.model.seq_length, cfg.training.seed, info,
                                         TASK.masking, cfg.data.data_cache_path)
    return build_train_valid_test_datasets(cfg.data.data_path, cfg.data.split, num_samples,
                                           cfg.model.seq_length, cfg.training.seed, info,
                                           TASK.masking, cfg.data.data_cache_path)


def get_batch(data: Dict[str, Any], device: torch.device) -> Dict[str, torch.Tensor]:
    from megatron.initialize import to_device

    # pinned, non-blocking on CUDA; widened to int64 on the device
    batch = {k: to_device(data[k], device).long() for k in
             ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")}
    # Unmasked positions carry label -1; any valid id will do there since the loss
    # mask removes them.
    batch["labels"] = batch["labels"].clamp(min=0)
    return batch


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output):
    """Masked-LM loss (mean over masked tokens of the microbatch) + sentence-order loss."""
    lm_losses, sop_logits = output
    if lm_losses.dtype in (torch.float16, torch.bfloat16):
        lm_losses = lm_losses.float()
    mask = loss_mask.to(lm_losses.dtype).reshape(-1)
    lm_loss = torch.sum(lm_losses.reshape(-1) * mask) / mask.sum().clamp(min=1.0)
    if sop_logits is None:
        return lm_loss, {"lm loss": lm_loss.detach()}
    logits = sop_logits.float() if sop_logits.dtype in (torch.float16, torch.bfloat16) \
        else sop_logits
    sop_loss = F.cross_entropy(logits, sentence_order.reshape(-1))
    return lm_loss + sop_loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
    device = next(model.parameters()).device
    batch = get_batch(next(data_iterator), device)
    output = model(batch["text"], batch["padding_mask"], batch["types"],
                   lm_labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], batch["is_random"])


def flops_per_iteration(cfg: MegatronConfig) -> float:
    from megatron.model.flops import gpt_flops_per_iteration

    # The transformer and the vocabulary projection dominate, as in GPT.
    return gpt_flops_per_iteration(cfg.model, cfg.training.global_batch_size, cfg.model.seq_length)


def main(argv: Optional[List[str]] = None):
    from megatron.training import pretrain

    TASK.masking = masking_from_args(argv)
    return pretrain(datasets_provider, model_provider, forward_step,
                    extra_args_provider=add_bert_args, argv=argv,
                    flops_per_iteration=flops_per_iteration,
                    default_tokenizer="BertWordPieceLowerCase")  # as Megatron-LM's


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

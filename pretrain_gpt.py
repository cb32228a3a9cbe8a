"""Pretrain GPT.

    torchrun --nproc-per-node 4 pretrain_gpt.py --num-layers 4 --hidden-size 256 \\
        --num-attention-heads 8 --seq-length 128 --micro-batch-size 4 --global-batch-size 32 \\
        --pipeline-model-parallel-size 2 --pipeline-schedule 2bw --lr 3e-4 --train-iters 200 \\
        --data-path corpus_text_document --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model

The three providers below are all this file contributes; megatron.training does the rest.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Dict, Iterator, Tuple

import torch

from megatron.config import MegatronConfig
from megatron.parallel_state import ParallelGroups


class GPTTask:
    """State shared by the providers: the end-of-document id and what to do at document
    boundaries (``megatron.data.document_masks``)."""

    eod: int | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    per_token_loss: bool = False


def model_provider(cfg: MegatronConfig, groups: ParallelGroups, pre_process: bool,
                   post_process: bool) -> torch.nn.Module:
    from megatron.model import GPTModel
    from megatron.tensor_parallel.utils import TPInfo

    layers = cfg.parallel.stage_layers(cfg.model.num_layers, groups.pp_rank)
    return GPTModel(cfg.model, TPInfo.from_groups(groups), pre_process=pre_process,
                    post_process=post_process, layer_numbers=layers, seed=cfg.training.seed)


def datasets_provider(cfg: MegatronConfig, tokenizer, num_samples: Tuple[int, int, int]):
    # only the document-boundary flags read the end-of-document id (some tokenizers have
    # none; arguments.py refuses these flags without a tokenizer)
    d = cfg.data
    boundaries = d.eod_mask_loss or d.reset_position_ids or d.reset_attention_mask
    GPTTask.eod = tokenizer.eod if tokenizer is not None and boundaries else None
    GPTTask.eod_mask_loss = d.eod_mask_loss
    GPTTask.reset_position_ids = d.reset_position_ids
    GPTTask.reset_attention_mask = d.reset_attention_mask
    GPTTask.per_token_loss = cfg.training.calculate_per_token_loss
    if cfg.data.mock_data:
        from megatron.data.gpt_dataset import MockGPTDataset

        vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.padded_vocab_size
        return tuple(MockGPTDataset(n, cfg.model.seq_length, vocab, cfg.training.seed + i)
                     if n > 0 else None
                     for i, n in enumerate(num_samples))
    from megatron.data.gpt_dataset import (build_split_path_datasets,
                                           build_train_valid_test_datasets)

    # Token ids are checked against the tokenizer's vocabulary, so data made with
    # another tokenizer stops with the file and id instead of an embedding IndexError.
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.padded_vocab_size
    if cfg.data.split_data_paths is not None:  # --train/--valid/--test-data-path
        return build_split_path_datasets(cfg.data.split_data_paths, num_samples,
                                         cfg.model.seq_length, cfg.training.seed,
                                         cfg.data.data_cache_path, vocab_size=vocab)
    return build_train_valid_test_datasets(cfg.data.data_path, cfg.data.split, num_samples,
                                           cfg.model.seq_length, cfg.training.seed,
                                           cfg.data.data_cache_path, vocab_size=vocab)


def get_batch(data: Dict[str, Any], device: torch.device) -> Dict[str, torch.Tensor]:
    """Shift one sample of seq_length+1 tokens into inputs and labels, with the loss mask,
    positions and attention mask of ``megatron.data.document_masks`` (attention_mask None:
    causal).

    The ids travel in their stored dtype (pinned, non-blocking on CUDA) and widen on the
    device; nothing here waits for the device (no boolean indexing)."""
    from megatron.data.document_masks import ltor_masks_and_position_ids
    from megatron.initialize import to_device

    text = to_device(data["text"], device).long()
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = ltor_masks_and_position_ids(
        tokens, GPTTask.eod, reset_position_ids=GPTTask.reset_position_ids,
        reset_attention_mask=GPTTask.reset_attention_mask,
        eod_mask_loss=GPTTask.eod_mask_loss)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids, "attention_mask": attention_mask}


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean of the per-token losses where loss_mask is 1; with --calculate-per-token-loss
    their sum and the number of tokens summed (the engine divides by the global batch's)."""
    losses = output.float() if output.dtype in (torch.float16, torch.bfloat16) else output
    total = torch.sum(losses.view(-1) * loss_mask.view(-1))
    if GPTTask.per_token_loss:
        return total, loss_mask.sum(), {"lm loss": total.detach()}
    loss = total / loss_mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
    device = next(model.parameters()).device
    batch = get_batch(next(data_iterator), device)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def flops_per_iteration(cfg: MegatronConfig) -> float:
    from megatron.model.flops import gpt_flops_per_iteration

    return gpt_flops_per_iteration(cfg.model, cfg.training.global_batch_size, cfg.model.seq_length)


def main(argv=None):
    from megatron.training import pretrain

    return pretrain(datasets_provider, model_provider, forward_step, argv=argv,
                    flops_per_iteration=flops_per_iteration,
                    default_tokenizer="GPT2BPETokenizer",  # as Megatron-LM's pretrain_gpt.py
                    per_token_loss=True)


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

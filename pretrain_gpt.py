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
    """State shared by the providers (the end-of-document id for loss masking)."""

    eod: int | None = None
    eod_mask_loss: bool = False


def model_provider(cfg: MegatronConfig, groups: ParallelGroups, pre_process: bool,
                   post_process: bool) -> torch.nn.Module:
    from megatron.model import GPTModel
    from megatron.tensor_parallel.utils import TPInfo

    layers = cfg.parallel.stage_layers(cfg.model.num_layers, groups.pp_rank)
    return GPTModel(cfg.model, TPInfo.from_groups(groups), pre_process=pre_process,
                    post_process=post_process, layer_numbers=layers, seed=cfg.training.seed)


def datasets_provider(cfg: MegatronConfig, tokenizer, num_samples: Tuple[int, int, int]):
    # only --eod-mask-loss reads the end-of-document id (a tokenizer may have none)
    GPTTask.eod = tokenizer.eod if tokenizer is not None and cfg.data.eod_mask_loss else None
    GPTTask.eod_mask_loss = cfg.data.eod_mask_loss
    if cfg.data.mock_data:
        from megatron.data.gpt_dataset import MockGPTDataset

        vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.padded_vocab_size
        return tuple(MockGPTDataset(n, cfg.model.seq_length, vocab, cfg.training.seed + i)
                     if n > 0 else None
                     for i, n in enumerate(num_samples))
    from megatron.data.gpt_dataset import build_train_valid_test_datasets

    # Token ids are checked against the tokenizer's vocabulary, so data made with
    # another tokenizer stops with the file and id instead of an embedding IndexError.
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.padded_vocab_size
    return build_train_valid_test_datasets(cfg.data.data_path, cfg.data.split, num_samples,
                                           cfg.model.seq_length, cfg.training.seed,
                                           cfg.data.data_cache_path, vocab_size=vocab)


def get_batch(data: Dict[str, Any], device: torch.device) -> Dict[str, torch.Tensor]:
    """Shift one sample of seq_length+1 tokens into inputs and labels.

    The ids travel in their stored dtype (pinned, non-blocking on CUDA) and widen on the
    device; nothing here waits for the device (masked_fill, not boolean indexing)."""
    from megatron.initialize import to_device

    text = to_device(data["text"], device).long()
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    loss_mask = torch.ones(labels.shape, dtype=torch.float32, device=device)
    if GPTTask.eod_mask_loss and GPTTask.eod is not None:
        loss_mask.masked_fill_(tokens == GPTTask.eod, 0.0)
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": position_ids}


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean of the per-token losses where loss_mask is 1."""
    losses = output.float() if output.dtype in (torch.float16, torch.bfloat16) else output
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator: Iterator[Any], model: torch.nn.Module):
    device = next(model.parameters()).device
    batch = get_batch(next(data_iterator), device)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def flops_per_iteration(cfg: MegatronConfig) -> float:
    from megatron.model.flops import gpt_flops_per_iteration

    return gpt_flops_per_iteration(cfg.model, cfg.training.global_batch_size, cfg.model.seq_length)


def main(argv=None):
    from megatron.training import pretrain

    return pretrain(datasets_provider, model_provider, forward_step, argv=argv,
                    flops_per_iteration=flops_per_iteration,
                    default_tokenizer="GPT2BPETokenizer")  # as Megatron-LM's pretrain_gpt.py


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

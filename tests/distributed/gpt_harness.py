"""Run small GPT trainings inside spawned gloo ranks and collect what tests compare.

One spawn runs a list of configurations one after another in the same process group
(starting processes is the slow part on two cores).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# A tiny GPT in float64 without dropout: every schedule/layout must agree to ~1e-12.
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--make-vocab-size-divisible-by", "64",
        "--tokenizer-type", "NullTokenizer", "--mock-data",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--fp64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
        "--lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--seed", "7", "--log-interval", "1000", "--eval-interval", "1000",
        "--eval-iters", "1", "--num-workers", "0"]


def inject_overflow_stage0_iter2(iteration: int, stage: int) -> bool:
    return iteration == 2 and stage == 0


def summarize(result, rank: int) -> Dict[str, Any]:
    return {"rank": rank,
            "losses": {k: v["lm loss"] for k, v in result.losses.items()},
            "skipped": [r.skipped for r in result.reports],
            "versions": [r.weight_version for r in result.reports],
            "grad_norms": [r.grad_norm for r in result.reports],
            "params_norms": [r.params_norm for r in result.reports],
            "loss_scales": [r.loss_scale for r in result.reports],
            "grad_scales": [r.grad_scale for r in result.reports],
            "memory": result.memory,
            "eval": result.eval_losses,
            "iteration": result.iteration,
            "exited_early": result.exited_early,
            "shared_embedding": result.shared_embedding}


def train_configs(rank: int, world: int, configs: Sequence[Tuple[str, List[str], Optional[str]]]
                  ) -> Dict[str, Dict[str, Any]]:
    """configs: (name, argv, fault-injection function name or None)."""
    import pretrain_gpt
    from megatron.training import pretrain

    out = {}
    for name, argv, fault in configs:
        torch.manual_seed(0)
        inject = globals()[fault] if fault else None
        result = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                          pretrain_gpt.forward_step, argv=list(argv), fault_injection=inject)
        out[name] = summarize(result, rank)
    return out


def last_rank(results: List[Dict[str, Dict[str, Any]]], name: str) -> Dict[str, Any]:
    return results[-1][name]

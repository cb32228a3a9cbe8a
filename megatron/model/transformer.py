"""Pre-LayerNorm transformer blocks with Megatron's tensor-parallel split.

Activations are [seq, batch, hidden] throughout (Megatron's layout).  A
``ParallelTransformer`` holds a contiguous range of GLOBAL layer numbers, so a pipeline
stage is simply the transformer of its layers; each layer's weights are initialised
from its global number and therefore do not depend on how the model is cut.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.tensor_parallel import (ColumnParallelLinear, InitKey, RowParallelLinear, TPInfo,
                                      checkpoint, divide, get_rng_tracker, init_method_normal,
                                      scaled_init_method_normal)

_MASK_FILL = -10000.0  # Megatron's value: fully masked rows become uniform, never NaN


def layer_norm(config: ModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                        dtype=config.params_dtype)


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + mask) V for this rank's heads, softmax in fp32 or wider.

    ``backend``: 'manual' (explicit fp32 softmax: the reference the tests hold the
    kernel to), 'sdpa' (torch's ``scaled_dot_product_attention``, whose CUDA and CPU
    kernels keep the softmax in fp32 and save no [s, s] probabilities for the backward)
    or 'auto' (sdpa).  On a 2-core CPU sdpa's forward and backward took 0.53-0.69x the
    manual path's time without dropout and 0.91-1.0x with it (seq 64-1024).
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, backend: str = "auto") -> None:
        super().__init__()
        if backend not in ("auto", "manual", "sdpa"):
            raise ValueError(f"attention backend {backend!r}: expected auto, manual or sdpa")
        self.backend = backend
        self.head_dim = config.kv_channels
        self.dropout_p = config.attention_dropout
        # With t > 1 each rank owns different heads, so their dropout masks come from the
        # tensor-parallel RNG stream.  With t = 1 the default stream serves: swapping
        # generator states costs host work per layer and breaks --compile-layers' graph
        # (dynamo does not trace get/set_rng_state) into five.
        self.fork_rng = tp.size > 1

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """q, k, v: [s, b, heads, head_dim]; returns [s, b, heads * head_dim]."""
        s, b, np_, hn = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        p = self.dropout_p if self.training else 0.0
        fork = (get_rng_tracker().fork() if p > 0 and self.fork_rng
                else contextlib.nullcontext())
        with fork:
            if self.backend != "manual":
                ctx = self._sdpa(q, k, v, mask, p)
            else:
                ctx = self._manual(q, k, v, mask, p)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)

    def _manual(self, q, k, v, mask, p):
        compute = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q, k.transpose(-1, -2)).to(compute) / math.sqrt(self.head_dim)
        if mask is None:
            s = q.size(2)
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(diagonal=1)
        scores = scores.masked_fill(mask, _MASK_FILL)
        probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, p=p, training=p > 0).to(v.dtype)
        return torch.matmul(probs, v)

    def _sdpa(self, q, k, v, mask, p):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        additive = additive.masked_fill(mask, _MASK_FILL)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=p)


class ParallelAttention(nn.Module):
    """Self-attention: fused QKV (column-parallel) -> core attention -> row-parallel out.

    The QKV output features are ordered [head, (q, k, v), head_dim], so a contiguous
    column split hands each rank whole heads with their q, k and v together.
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, key: InitKey) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads_per_rank = divide(config.num_attention_heads, tp.size,
                                     "--num-attention-heads")
        self.head_dim = config.kv_channels
        self.query_key_value = ColumnParallelLinear(
            h, 3 * h, tp=tp, init_method=init_method_normal(config.init_method_std),
            params_dtype=config.params_dtype, init_key=key.child("query_key_value"))
        self.core_attention = CoreAttention(config, tp)
        self.dense = RowParallelLinear(
            h, h, tp=tp, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            params_dtype=config.params_dtype, init_key=key.child("dense"))
        self.checkpoint_core_attention = config.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        qkv, _ = self.query_key_value(x)
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, self.heads_per_rank, 3, self.head_dim).unbind(dim=3)
        if self.checkpoint_core_attention and torch.is_grad_enabled():
            ctx = checkpoint(self.core_attention, q, k, v, mask)
        else:
            ctx = self.core_attention(q, k, v, mask)
        out, _ = self.dense(ctx)
        return out


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, config: ModelConfig, tp: TPInfo, key: InitKey) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.gelu_approximate = config.gelu_approximate
        self.dense_h_to_4h = ColumnParallelLinear(
            h, ffn, tp=tp, init_method=init_method_normal(config.init_method_std),
            params_dtype=config.params_dtype, init_key=key.child("dense_h_to_4h"))
        self.dense_4h_to_h = RowParallelLinear(
            ffn, h, tp=tp, input_is_parallel=True,
            init_method=scaled_init_method_normal(config.init_method_std, config.num_layers),
            params_dtype=config.params_dtype, init_key=key.child("dense_4h_to_h"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.dense_h_to_4h(x)
        out, _ = self.dense_4h_to_h(F.gelu(y, approximate=self.gelu_approximate))
        return out


class ParallelTransformerLayer(nn.Module):
    """x + drop(attn(LN(x))), then + drop(mlp(LN(.))); ``layer_number`` is global, 0-based."""

    def __init__(self, config: ModelConfig, tp: TPInfo, layer_number: int, *, seed: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        key = InitKey(seed, layer_number)
        self.input_layernorm = layer_norm(config)
        self.self_attention = ParallelAttention(config, tp, key.child("self_attention"))
        self.post_attention_layernorm = layer_norm(config)
        self.mlp = ParallelMLP(config, tp, key.child("mlp"))
        self.hidden_dropout = config.hidden_dropout

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # Residual-branch dropout uses the default stream: x is replicated across TP ranks.
        attn = self.self_attention(self.input_layernorm(x), mask)
        x = x + F.dropout(attn, p=self.hidden_dropout, training=self.training)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + F.dropout(mlp, p=self.hidden_dropout, training=self.training)


class _KeptForRecompute(torch.autograd.Function):
    """Identity (a view) that saves its input for backward.

    A non-reentrant checkpoint keeps the input of its chunk alive in a closure, where the
    executor's saved-tensor counter (``megatron.pipeline.memory.StashTracker``) cannot
    see it, while the tensors saved inside the chunk are discarded.  Saving the same
    storage here costs no memory and makes the counter count what layer recomputation
    really stashes: one hidden state per checkpointed chunk."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


def _check_recompute(config: ModelConfig) -> None:
    method = config.recompute_method
    if method is None:
        return
    if method not in ("uniform", "block"):
        raise ValueError(f"--recompute-method {method!r}: expected 'uniform' or 'block'")
    if config.recompute_granularity == "selective":
        raise ValueError("--recompute-method applies to --recompute-granularity full only, "
                         "not selective")
    if not config.recompute_num_layers or config.recompute_num_layers < 1:
        raise ValueError(f"--recompute-method {method} needs --recompute-num-layers >= 1")


class ParallelTransformer(nn.Module):
    """The layers ``layer_numbers`` (global, 0-based) plus, on the last stage, a final LN."""

    def __init__(self, config: ModelConfig, tp: TPInfo, layer_numbers: range, *, seed: int,
                 post_layer_norm: Optional[bool] = None) -> None:
        super().__init__()
        if len(layer_numbers) == 0 or layer_numbers.step != 1 or layer_numbers.start < 0 \
                or layer_numbers.stop > config.num_layers:
            raise ValueError(f"layer_numbers {layer_numbers} must be a non-empty contiguous "
                             f"range inside [0, --num-layers {config.num_layers})")
        _check_recompute(config)
        self.layer_numbers = layer_numbers
        self.recompute_method = config.recompute_method
        self.recompute_num_layers = config.recompute_num_layers
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(config, tp, n, seed=seed) for n in layer_numbers)
        if config.compile_layers:
            # Module.compile() compiles forward in place: state_dict keys, parameters
            # and the weight-buffer swaps of 2BW see the same module.  Layers are the
            # unit: every layer has the same code, so one compiled graph serves all.
            for layer in self.layers:
                layer.compile()
        if post_layer_norm is None:
            post_layer_norm = layer_numbers.stop == config.num_layers
        self.final_layernorm = layer_norm(config) if post_layer_norm else None

    def _run(self, start: int, end: int):
        def run(hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
            for layer in self.layers[start:end]:
                hidden = layer(hidden, mask)
            return hidden
        return run

    def forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = len(self.layers)
        if self.recompute_method is None or not torch.is_grad_enabled():
            hidden = self._run(0, n)(hidden, mask)
        elif self.recompute_method == "uniform":
            # chunks of k layers; only each chunk's input is kept, the chunk's
            # activations are rebuilt during the backward pass (one chunk at a time)
            k = self.recompute_num_layers
            for start in range(0, n, k):
                hidden = checkpoint(self._run(start, min(start + k, n)),
                                    _KeptForRecompute.apply(hidden), mask)
        else:  # block: the first k layers of this stage, each checkpointed on its own
            for i in range(n):
                run = self._run(i, i + 1)
                hidden = (checkpoint(run, _KeptForRecompute.apply(hidden), mask)
                          if i < self.recompute_num_layers else run(hidden, mask))
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        return hidden

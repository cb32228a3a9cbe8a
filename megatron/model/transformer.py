"""Pre-LayerNorm transformer blocks with Megatron's tensor-parallel split.

Activations are [seq, batch, hidden] throughout (Megatron's layout); with
--sequence-parallel a tensor rank holds s/t of the sequence between the attention and
MLP regions (``sequence_parallel``).  A
``ParallelTransformer`` holds a contiguous range of GLOBAL layer numbers, so a pipeline
stage is simply the transformer of its layers; each layer's weights are initialised
from its global number and therefore do not depend on how the model is cut.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.tensor_parallel import (ColumnParallelLinear, InitKey, InitMethod,
                                      RowParallelLinear, TPInfo, checkpoint,
                                      copy_to_tp_region, divide, get_rng_tracker,
                                      init_method_normal, init_method_xavier_uniform,
                                      scaled_init_method_normal)

_MASK_FILL = -10000.0  # Megatron's value: fully masked rows become uniform, never NaN


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""--attention-backend's values (Megatron-LM's); see ``attention_kernel``."""


def attention_kernel(backend: str) -> str:
    """CoreAttention's implementation for an --attention-backend: 'sdpa' (torch's
    ``scaled_dot_product_attention``: it picks flash attention, the memory-efficient or
    the cuDNN kernel for the device, dtype and mask, so 'flash' and 'fused' cannot force
    one and mean the same as 'auto') or 'manual' (the explicit softmax: 'unfused',
    'local')."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    return "manual" if backend in ("unfused", "local") else "sdpa"


def sequence_parallel(config: ModelConfig, tp: TPInfo) -> bool:
    """Whether activations outside the tensor-parallel regions are split along the
    sequence: --sequence-parallel with more than one tensor rank."""
    return config.sequence_parallel and tp.is_parallel


def weight_init_method(config: ModelConfig) -> InitMethod:
    """How every weight matrix but the output projections is drawn: N(0,
    --init-method-std^2), or with --init-method-xavier-uniform Xavier's uniform over
    the full matrix (embedding tables included, as Megatron-LM's init_method)."""
    if config.init_method_xavier_uniform:
        return init_method_xavier_uniform()
    return init_method_normal(config.init_method_std)


def output_init_method(config: ModelConfig) -> InitMethod:
    """The attention and MLP output projections: N(0, std^2 / (2 --num-layers)) so the
    residual sum keeps its scale; with --init-method-xavier-uniform the same Xavier
    draw as every other matrix (Megatron-LM does not scale it in that mode)."""
    if config.init_method_xavier_uniform:
        return init_method_xavier_uniform()
    return scaled_init_method_normal(config.init_method_std, config.num_layers)


class Float32LayerNorm(nn.LayerNorm):
    """LayerNorm of the float32 residual stream (--fp32-residual-connection): computed
    in float32 with its fp16/bf16 weights cast up, returning float32 (the caller casts
    what the linear layers read).  Its parameters and state-dict keys are LayerNorm's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                            self.bias.float(), self.eps)


class Float32RMSNorm(nn.RMSNorm):
    """RMSNorm of the float32 residual stream: see ``Float32LayerNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps)


def fp32_residual(config: ModelConfig) -> bool:
    """Whether the residual stream is kept in float32 while the weights are not
    (--fp32-residual-connection with --fp16/--bf16; ``ModelConfig.residual_dtype``)."""
    return config.residual_dtype != config.params_dtype


def layer_norm(config: ModelConfig, tp: Optional[TPInfo] = None, *,
               stream: bool = False) -> nn.Module:
    """The block's normalisation: torch's LayerNorm or RMSNorm (--normalization), both
    with a weight (RMSNorm has no bias), epsilon --norm-epsilon / --layernorm-epsilon.

    ``stream``: the norm reads the residual stream (a layer's two norms, the final
    norm); with a float32 stream (``fp32_residual``) it computes in float32 and returns
    float32 (``Float32LayerNorm``).

    Under sequence parallelism (``tp`` given) the norm sees s/t positions per rank, so
    its weights' gradients are partial: they are marked ``sequence_parallel`` and the
    trainer sums them over the tensor ranks."""
    in_fp32 = stream and fp32_residual(config)
    if config.normalization == "RMSNorm":
        norm = (Float32RMSNorm if in_fp32 else nn.RMSNorm)(
            config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    elif config.normalization != "LayerNorm":
        raise ValueError(f"--normalization {config.normalization!r}: expected one of "
                         f"{', '.join(NORMALIZATIONS)}")
    else:
        norm = (Float32LayerNorm if in_fp32 else nn.LayerNorm)(
            config.hidden_size, eps=config.layernorm_epsilon, dtype=config.params_dtype)
    if tp is not None and sequence_parallel(config, tp):
        for p in norm.parameters():
            p.sequence_parallel = True
    return norm


def head_norm(config: ModelConfig) -> nn.Module:
    """--qk-layernorm's norm of one attention head: ``normalization`` over head_dim."""
    cls = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
    return cls(config.kv_channels, eps=config.layernorm_epsilon, dtype=config.params_dtype)


def check_architecture(config: ModelConfig, tp: TPInfo) -> None:
    """The block options' own consistency (the flags' checks, for a model built directly)."""
    if config.normalization not in NORMALIZATIONS:
        raise ValueError(f"--normalization {config.normalization!r}: expected one of "
                         f"{', '.join(NORMALIZATIONS)}")
    if config.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        raise ValueError(f"--position-embedding-type {config.position_embedding_type!r}: "
                         f"expected one of {', '.join(POSITION_EMBEDDING_TYPES)}")
    groups = config.num_query_groups
    if groups < 1 or config.num_attention_heads % groups:
        raise ValueError(f"--num-query-groups {groups} must divide --num-attention-heads "
                         f"({config.num_attention_heads})")
    divide(groups, tp.size, "--num-query-groups")
    attention_kernel(config.attention_backend)
    if sequence_parallel(config, tp) and config.seq_length % tp.size:
        raise ValueError(f"--sequence-parallel splits the sequence over the "
                         f"{tp.size} tensor ranks: --seq-length {config.seq_length} must be "
                         f"divisible by --tensor-model-parallel-size {tp.size}")
    if config.position_embedding_type == "rope":
        if not 0.0 < config.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent {config.rotary_percent}: expected a value "
                             f"in (0, 1]")
        if config.rotary_dim < 2:
            raise ValueError(f"--rotary-percent {config.rotary_percent} of a head's "
                             f"{config.kv_channels} dimensions leaves fewer than 2 to rotate")
        if config.rotary_base <= 0:
            raise ValueError(f"--rotary-base {config.rotary_base}: expected > 0")
    else:
        for flag, given in (("--rotary-interleaved", config.rotary_interleaved),
                            ("--rotary-seq-len-interpolation-factor",
                             config.rotary_seq_len_interpolation_factor is not None)):
            if given:
                raise ValueError(f"{flag} needs --position-embedding-type rope")
    factor = config.rotary_seq_len_interpolation_factor
    if factor is not None and not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"--rotary-seq-len-interpolation-factor {factor}: expected a "
                         f"number >= 1 (how many times longer the context is stretched)")
    if config.squared_relu and config.swiglu:
        raise ValueError("--squared-relu and --swiglu are two MLP activations: give one")
    if config.rope_scaling:
        if config.position_embedding_type != "rope":
            raise ValueError("--use-rope-scaling needs --position-embedding-type rope")
        if not config.rope_scaling_factor >= 1.0:
            raise ValueError(f"--rope-scaling-factor {config.rope_scaling_factor}: expected "
                             f">= 1 (how many times slower the low frequencies turn)")


def flag_number(x: float) -> str:
    """A flag's number as short as it reads back exactly: 8.0 -> '8', 0.125 -> '0.125'."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def non_gpt2_options(config) -> list:
    """The flags of a config whose block differs from GPT-2/BERT's (Llama-style options),
    for models and exports that build only the GPT-2/BERT block.  ``config``: a
    ModelConfig, or anything with its block fields (hf_interop's recorded configs)."""
    found = []
    if config.normalization != "LayerNorm":
        found.append(f"--normalization {config.normalization}")
    if config.position_embedding_type != "learned_absolute":
        found.append(f"--position-embedding-type {config.position_embedding_type}")
        if config.rope_scaling:
            found.append(f"--use-rope-scaling --rope-scaling-factor "
                         f"{flag_number(config.rope_scaling_factor)}")
        if config.rotary_interleaved:
            found.append("--rotary-interleaved")
        if config.rotary_seq_len_interpolation_factor is not None:
            found.append(f"--rotary-seq-len-interpolation-factor "
                         f"{flag_number(config.rotary_seq_len_interpolation_factor)}")
    if config.swiglu:
        found.append("--swiglu")
    if config.qk_layernorm:
        found.append("--qk-layernorm")
    if config.num_query_groups != config.num_attention_heads:
        found.append(f"--num-query-groups {config.num_query_groups}")
    if config.kv_channels is not None \
            and config.kv_channels * config.num_attention_heads != config.hidden_size:
        found.append(f"--kv-channels {config.kv_channels}")
    if not config.add_bias_linear:
        found.append("--disable-bias-linear")
        if config.add_qkv_bias:
            found.append("--add-qkv-bias")
    if config.untie_embeddings_and_output_weights:
        found.append("--untie-embeddings-and-output-weights")
    return found


class RotaryEmbedding(nn.Module):
    """cos and sin of RoPE's angles position * base^(-2i/r) for the first r dimensions of
    a head (r = ``config.rotary_dim``), in the "rotate half" layout of Megatron-LM and
    Hugging Face's Llama: dimension j < r/2 is paired with j + r/2.  With
    ``config.rotary_interleaved`` (--rotary-interleaved) the pairs are the adjacent
    dimensions (2i, 2i + 1), and the tables repeat each angle twice in a row instead of
    repeating the half: ``apply_rotary`` reads the layout from ``interleaved``.

    With ``config.rope_scaling`` (--use-rope-scaling) the frequencies are Llama 3.1's:
    see ``llama3_scaled_inv_freq``.  With ``config.rotary_seq_len_interpolation_factor``
    (linear position interpolation) the positions are divided by the factor before
    they meet the frequencies: a context factor times longer than the trained one
    spans the same angles.

    No parameters and no buffers (nothing in the state dict): the tables are made for
    the sequence length at hand, computed in float64 and cast to the activations' dtype,
    and kept for the next call with the same length, device and dtype.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dim = config.rotary_dim
        self.base = float(config.rotary_base)
        self.scaling_factor = config.rope_scaling_factor if config.rope_scaling else None
        self.interleaved = config.rotary_interleaved
        self.interpolation_factor = config.rotary_seq_len_interpolation_factor
        self._cache: dict = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """base^(-2i/r) for i < r/2 (float64), Llama 3.1-scaled when asked for."""
        inv = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64,
                                                device=device) / self.dim))
        if self.scaling_factor is not None:
            inv = llama3_scaled_inv_freq(inv, self.scaling_factor)
        return inv

    def forward(self, seq_len: int, device: torch.device,
                dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [s, 1, 1, r] in ``dtype``: broadcast over batch and heads."""
        key = (seq_len, device, dtype)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        positions = torch.arange(seq_len, dtype=torch.float64, device=device)
        if self.interpolation_factor is not None:
            positions = positions / self.interpolation_factor
        angles = torch.outer(positions, self.inv_freq(device))
        if self.interleaved:  # angle i at dimensions 2i and 2i + 1
            angles = angles.repeat_interleave(2, dim=-1)[:, None, None, :]
        else:  # angle i at dimensions i and i + r/2
            angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]
        table = (angles.cos().to(dtype), angles.sin().to(dtype))
        self._cache = {key: table}  # one length at a time: no growth over a run
        return table


# Llama 3.1's RoPE scaling constants (Megatron-LM fixes them too; only the factor is a flag)
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: frequencies whose wavelength exceeds the original
    8192-token context / 1 are slowed down ``factor`` times, those shorter than 8192 / 4
    are kept, and the band between is blended linearly in context / wavelength.  (Only
    the rotation speeds change; positions stay 0, 1, 2, ...)"""
    wavelength = 2 * math.pi / inv_freq
    ratio = LLAMA3_ORIGINAL_CONTEXT / wavelength  # periods that fit in the old context
    blend = ((ratio - LLAMA3_LOW_FREQ_FACTOR)
             / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)).clamp(0.0, 1.0)
    return (1.0 - blend) * inv_freq / factor + blend * inv_freq


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``cos.size(-1)`` dimensions of x [s, b, heads, head_dim]: the
    pairs (j, j + r/2), or with ``interleaved`` the pairs (2i, 2i + 1); cos and sin
    come from a ``RotaryEmbedding`` of the same layout."""
    r = cos.size(-1)
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:  # (x_2i, x_2i+1) -> (-x_2i+1, x_2i), pair by pair
        pairs = rot.unflatten(-1, (r // 2, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        first, second = rot.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)
    rotated = rot * cos + turned * sin
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated


class _SoftmaxKeptAs(torch.autograd.Function):
    """softmax over the last dimension, computed in the scores' dtype (fp32 or wider) and
    returned -- and kept for the backward -- in ``dtype``, the values' dtype.  What
    Megatron's fused softmax kernels keep: 2 bytes per score in fp16/bf16 where
    ``torch.softmax(x.float())`` keeps 4.  The gradient y (g - sum(g y)) is formed in the
    scores' dtype from the kept y; in fp32/fp64 it is torch's softmax backward."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1).to(dtype)
        ctx.save_for_backward(probs)
        ctx.compute = scores.dtype
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (probs,) = ctx.saved_tensors
        y, g = probs.to(ctx.compute), grad.to(ctx.compute)
        return y * (g - (g * y).sum(dim=-1, keepdim=True)), None


class CoreAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + mask) V for this rank's heads, softmax in fp32 or wider.

    ``backend``: 'manual' (explicit softmax, probabilities kept in the values' dtype:
    the reference the tests hold the kernel to, --attention-backend unfused/local),
    'sdpa' (torch's ``scaled_dot_product_attention``, whose CUDA and CPU kernels keep
    the softmax in fp32 and save no [s, s] probabilities for the backward -- except
    torch's CPU math fallback, which it takes with dropout) or 'auto' (the config's
    --attention-backend).  On a 2-core CPU sdpa's forward and backward took 0.53-0.69x
    the manual path's time without dropout and 0.91-1.0x with it (seq 64-1024).
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, backend: str = "auto") -> None:
        super().__init__()
        if backend not in ("auto", "manual", "sdpa"):
            raise ValueError(f"attention backend {backend!r}: expected auto, manual or sdpa")
        if backend == "auto":
            backend = attention_kernel(config.attention_backend)
        self.backend = backend
        self.head_dim = config.kv_channels
        self.dropout_p = config.attention_dropout
        # With t > 1 each rank owns different heads, so their dropout masks come from the
        # tensor-parallel RNG stream.  With t = 1 the default stream serves: swapping
        # generator states costs host work per layer and breaks --compile-layers' graph
        # (dynamo does not trace get/set_rng_state) into five.
        self.fork_rng = tp.size > 1
        self._causal: Optional[torch.Tensor] = None   # the manual path's causal mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[torch.Tensor]) -> torch.Tensor:
        """q: [s, b, heads, head_dim]; k, v: [s, b, groups, head_dim], where groups
        divides heads (grouped-query attention: query head i reads key/value head
        i // (heads / groups)); returns [s, b, heads * head_dim]."""
        s, b, np_, hn = q.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        if k.size(1) != np_ and self.backend == "manual":
            # each key/value head serves heads/groups consecutive query heads (sdpa
            # does the same without materialising the copies: enable_gqa)
            k = k.repeat_interleave(np_ // k.size(1), dim=1)
            v = v.repeat_interleave(np_ // v.size(1), dim=1)
        p = self.dropout_p if self.training else 0.0
        fork = (get_rng_tracker().fork() if p > 0 and self.fork_rng
                else contextlib.nullcontext())
        with fork:
            if self.backend != "manual":
                ctx = self._sdpa(q, k, v, mask, p)
            else:
                ctx = self._manual(q, k, v, mask, p)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)

    def prepare_mask(self, mask: Optional[torch.Tensor], dtype: torch.dtype, seq: int,
                     device: torch.device) -> Optional[torch.Tensor]:
        """The form of a bool mask (True = masked; None: causal) this backend reads,
        made once per stage forward and shared by its layers, which keep it for the
        backward -- one per microbatch and stage instead of one per layer: for sdpa an
        additive mask (0 or -10000 in ``dtype``; None stays None, the causal kernel),
        for the manual path the bool mask (None: one [seq, seq] causal mask, made once
        and shared by every microbatch)."""
        if self.backend == "manual":
            if mask is None:
                causal = self._causal
                if causal is None or causal.size(0) != seq or causal.device != device:
                    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
                    self._causal = causal
                return causal
            return mask
        if mask is None or mask.dtype != torch.bool:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, _MASK_FILL)

    def _manual(self, q, k, v, mask, p):
        compute = torch.promote_types(q.dtype, torch.float32)
        # 1/sqrt(d) applied inside the matmul, before its result is rounded to q's dtype
        # (Megatron-LM's baddbmm with alpha): in fp16 the raw q.k of a wide head can
        # pass 65504 while the scaled score is small
        b, np_, sq, hn = q.shape
        flat_q = q.reshape(b * np_, sq, hn)
        flat_k = k.reshape(b * np_, k.size(2), hn)
        scores = torch.baddbmm(flat_q.new_empty(b * np_, sq, k.size(2)), flat_q,
                               flat_k.transpose(1, 2), beta=0.0,
                               alpha=1.0 / math.sqrt(self.head_dim))
        scores = scores.view(b, np_, sq, k.size(2)).to(compute)
        scores = scores.masked_fill(self.prepare_mask(mask, q.dtype, q.size(2), q.device),
                                    _MASK_FILL)
        probs = _SoftmaxKeptAs.apply(scores, v.dtype)
        probs = F.dropout(probs, p=p, training=p > 0)
        return torch.matmul(probs, v)

    def _sdpa(self, q, k, v, mask, p):
        gqa = {"enable_gqa": True} if k.size(1) != q.size(1) else {}
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, **gqa)
        additive = self.prepare_mask(mask, q.dtype, q.size(2), q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=p, **gqa)


class ParallelAttention(nn.Module):
    """Self-attention: fused QKV (column-parallel) -> [RoPE] -> core attention ->
    row-parallel out.

    The QKV output features are ordered [group, (the group's q heads, k, v), head_dim]
    (Megatron-LM's layout), so a contiguous column split hands each rank whole groups,
    each with its queries, key and value.  Multi-head attention is the case of one query
    head per group: [head, (q, k, v), head_dim].
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, key: InitKey) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads_per_rank = divide(config.num_attention_heads, tp.size,
                                     "--num-attention-heads")
        self.groups_per_rank = divide(config.num_query_groups, tp.size, "--num-query-groups")
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = config.kv_channels
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.query_key_value = ColumnParallelLinear(
            h, qkv_size, tp=tp, bias=config.add_bias_linear or config.add_qkv_bias,
            init_method=weight_init_method(config),
            params_dtype=config.params_dtype, init_key=key.child("query_key_value"),
            sequence_parallel=config.sequence_parallel)
        self.core_attention = CoreAttention(config, tp)
        self.tp = tp
        # one weight of head_dim for all query heads and one for all key heads; replicated
        # across tensor-parallel ranks (see ``_head_norm``)
        self.q_layernorm = head_norm(config) if config.qk_layernorm else None
        self.k_layernorm = head_norm(config) if config.qk_layernorm else None
        self.dense = RowParallelLinear(
            config.num_attention_heads * self.head_dim, h, tp=tp, input_is_parallel=True,
            bias=config.add_bias_linear,
            init_method=output_init_method(config),
            params_dtype=config.params_dtype, init_key=key.child("dense"),
            sequence_parallel=config.sequence_parallel)
        self.checkpoint_core_attention = config.recompute_granularity == "selective"
        self.rotary_interleaved = config.rotary_interleaved

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor],
                rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        qkv, _ = self.query_key_value(x)
        s, b = qkv.shape[:2]
        g, per = self.groups_per_rank, self.q_per_group
        q, k, v = qkv.view(s, b, g, per + 2, self.head_dim).split([per, 1, 1], dim=3)
        q = q.reshape(s, b, g * per, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None:
            q, k = self._head_norm(self.q_layernorm, q), self._head_norm(self.k_layernorm, k)
        if rotary is not None:
            q = apply_rotary(q, *rotary, interleaved=self.rotary_interleaved)
            k = apply_rotary(k, *rotary, interleaved=self.rotary_interleaved)
        if self.checkpoint_core_attention and torch.is_grad_enabled():
            # q, k and v stay alive for the recomputation (in the checkpoint's closure);
            # saving them in _KeptForRecompute too lets the executor's counter see them
            q, k, v = (_KeptForRecompute.apply(x) for x in (q, k, v))
            ctx = checkpoint(self.core_attention, q, k, v, mask)
        else:
            ctx = self.core_attention(q, k, v, mask)
        out, _ = self.dense(ctx)
        return out


    def _head_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm`` over the last dim of x [s, b, heads, head_dim].  Each tensor-parallel
        rank normalises only its own heads with the shared weight, so the weight's
        gradient is the sum over ranks: it enters through ``copy_to_tp_region``
        (identity forward, all-reduce backward), and every rank then holds the same
        whole gradient, as for the block's other replicated weights."""
        weight = copy_to_tp_region(norm.weight, self.tp)
        if isinstance(norm, nn.RMSNorm):
            return F.rms_norm(x, norm.normalized_shape, weight, norm.eps)
        return F.layer_norm(x, norm.normalized_shape, weight,
                            copy_to_tp_region(norm.bias, self.tp), norm.eps)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel); with --squared-relu the
    activation is relu(.)^2; with --swiglu, h -> 2 ffn -> silu(gate) * up -> h.

    SwiGLU's first weight is [gate; up] (2 ffn rows, gate first, as Megatron-LM's).  It
    is split with stride 2: rank r holds [gate_r; up_r], the rows of its own slice of
    both halves, so silu(gate) * up needs no communication.  Its full value does not
    depend on t (the rows are cut from the same [gate; up] tensor).
    """

    def __init__(self, config: ModelConfig, tp: TPInfo, key: InitKey) -> None:
        super().__init__()
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.gelu_approximate = config.gelu_approximate
        self.swiglu = config.swiglu
        self.squared_relu = config.squared_relu
        self.dense_h_to_4h = ColumnParallelLinear(
            h, 2 * ffn if self.swiglu else ffn, tp=tp, bias=config.add_bias_linear,
            stride=2 if self.swiglu else 1,
            init_method=weight_init_method(config),
            params_dtype=config.params_dtype, init_key=key.child("dense_h_to_4h"),
            sequence_parallel=config.sequence_parallel)
        self.dense_4h_to_h = RowParallelLinear(
            ffn, h, tp=tp, input_is_parallel=True, bias=config.add_bias_linear,
            init_method=output_init_method(config),
            params_dtype=config.params_dtype, init_key=key.child("dense_4h_to_h"),
            sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.dense_h_to_4h(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        elif self.squared_relu:
            # relu keeps its output, which square reads too: the same tensors as GeLU
            # (its input) -- the planner's 4 s b f per layer holds
            y = torch.square(F.relu(y))
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        out, _ = self.dense_4h_to_h(y)
        return out


class ParallelTransformerLayer(nn.Module):
    """x + drop(attn(LN(x))), then + drop(mlp(LN(.))); ``layer_number`` is global, 0-based.
    With --apply-residual-connection-post-layernorm both residuals start from the
    norm's output instead: LN(x) + drop(attn(LN(x))), and likewise around the MLP.

    With a float32 residual stream (--fp32-residual-connection under fp16/bf16) x and
    both sums are float32: the norms compute in float32, attention and MLP read their
    output cast to params_dtype, and their (dropped-out) params_dtype outputs are added
    to the float32 residual.  With --apply-residual-connection-post-layernorm as well,
    the residual is the norm's float32 output, not the params_dtype copy the sublayer
    reads: what stays float32 is then the same -- the layer's input, its intermediate
    sum and its output, hence everything between layers and stages -- and the stream
    does not lose the norm's precision on its way to the next layer.  (Megatron-LM adds
    the norm's fp16/bf16 output there, which leaves the layer's output in params_dtype
    while its pipeline buffers expect float32.)"""

    def __init__(self, config: ModelConfig, tp: TPInfo, layer_number: int, *, seed: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        key = InitKey(seed, layer_number)
        self.input_layernorm = layer_norm(config, tp, stream=True)
        self.self_attention = ParallelAttention(config, tp, key.child("self_attention"))
        self.post_attention_layernorm = layer_norm(config, tp, stream=True)
        self.mlp = ParallelMLP(config, tp, key.child("mlp"))
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sequence_parallel(config, tp)
        self.residual_post_norm = config.apply_residual_connection_post_layernorm
        # the dtype attention and the MLP read: params_dtype, cast from a float32 stream
        self.sublayer_dtype = config.params_dtype if fp32_residual(config) else None

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Residual-branch dropout.  Replicated x (no sequence parallelism): the default
        stream, the same mask on every tensor rank.  Sequence-parallel x: each rank holds
        other positions, so its mask comes from the tensor-parallel stream."""
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.sequence_parallel:
            with get_rng_tracker().fork():
                return F.dropout(x, p=self.hidden_dropout, training=True)
        return F.dropout(x, p=self.hidden_dropout, training=True)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attn = self.self_attention(self._sublayer_input(normed), mask, rotary)
        x = (normed if self.residual_post_norm else x) + self._dropout(attn)
        normed = self.post_attention_layernorm(x)
        mlp = self.mlp(self._sublayer_input(normed))
        return (normed if self.residual_post_norm else x) + self._dropout(mlp)

    def _sublayer_input(self, normed: torch.Tensor) -> torch.Tensor:
        """A norm's output as attention or the MLP reads it: params_dtype (the norm's
        float32 output cast down when the stream is float32)."""
        return normed if self.sublayer_dtype is None else normed.to(self.sublayer_dtype)


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
    """Megatron-LM's combinations only: layer checkpointing (a method and a layer count)
    exists under --recompute-granularity full alone.  The command line refuses the
    others (megatron.argument_checks); a config built directly must not run them either:
    a method without granularity 'full' checkpointed every chunk anyway (Megatron-LM
    recomputes nothing there), and a layer count without a method was dropped."""
    method, granularity = config.recompute_method, config.recompute_granularity
    if granularity not in (None, "full", "selective"):
        raise ValueError(f"--recompute-granularity {granularity!r}: expected 'full' or "
                         "'selective'")
    if method is None:
        if config.recompute_num_layers is not None:
            raise ValueError("--recompute-num-layers needs --recompute-granularity full "
                             "--recompute-method uniform|block")
        return
    if method not in ("uniform", "block"):
        raise ValueError(f"--recompute-method {method!r}: expected 'uniform' or 'block'")
    if granularity != "full":
        raise ValueError(f"--recompute-method {method} needs --recompute-granularity full"
                         + ("" if granularity is None else f", not {granularity}"))
    if not config.recompute_num_layers or config.recompute_num_layers < 1:
        raise ValueError(f"--recompute-method {method} needs --recompute-num-layers >= 1")


class ParallelTransformer(nn.Module):
    """The layers ``layer_numbers`` (global, 0-based) plus, on the last stage, a final LN.

    Takes and returns the residual stream (float32 with --fp32-residual-connection under
    fp16/bf16); the final LN's output, which the output layer or BERT's heads read, is in
    params_dtype."""

    def __init__(self, config: ModelConfig, tp: TPInfo, layer_numbers: range, *, seed: int,
                 post_layer_norm: Optional[bool] = None) -> None:
        super().__init__()
        if len(layer_numbers) == 0 or layer_numbers.step != 1 or layer_numbers.start < 0 \
                or layer_numbers.stop > config.num_layers:
            raise ValueError(f"layer_numbers {layer_numbers} must be a non-empty contiguous "
                             f"range inside [0, --num-layers {config.num_layers})")
        _check_recompute(config)
        check_architecture(config, tp)
        self.layer_numbers = layer_numbers
        self.rotary = (RotaryEmbedding(config) if config.position_embedding_type == "rope"
                       else None)
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
        self.final_layernorm = (layer_norm(config, tp, stream=True) if post_layer_norm
                                else None)
        # with a float32 stream: RoPE's tables, the attention mask and the final norm's
        # output (for the output layer, pooler and heads) in params_dtype, not the stream's
        self.compute_dtype = config.params_dtype if fp32_residual(config) else None
        # the whole sequence's length, which RoPE's tables and the mask span
        self.seq_shards = tp.size if sequence_parallel(config, tp) else 1

    def _run(self, start: int, end: int, rotary=None):
        def run(hidden: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
            for layer in self.layers[start:end]:
                hidden = layer(hidden, mask, rotary)
            return hidden
        return run

    def forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = len(self.layers)
        # RoPE's tables: made once per stage forward and shared by its layers (a
        # recomputed chunk reads the same tensors: they need no gradient)
        seq = hidden.size(0) * self.seq_shards
        dtype = self.compute_dtype or hidden.dtype   # what attention computes in
        rotary = (self.rotary(seq, hidden.device, dtype)
                  if self.rotary is not None else None)
        # likewise the attention mask in the form the attention kernel reads
        mask = self.layers[0].self_attention.core_attention.prepare_mask(
            mask, dtype, seq, hidden.device)
        if self.recompute_method is None or not torch.is_grad_enabled():
            hidden = self._run(0, n, rotary)(hidden, mask)
        elif self.recompute_method == "uniform":
            # chunks of k layers; only each chunk's input is kept, the chunk's
            # activations are rebuilt during the backward pass (one chunk at a time)
            k = self.recompute_num_layers
            for start in range(0, n, k):
                hidden = checkpoint(self._run(start, min(start + k, n), rotary),
                                    _KeptForRecompute.apply(hidden), mask)
        else:  # block: the first k layers of this stage, each checkpointed on its own
            for i in range(n):
                run = self._run(i, i + 1, rotary)
                hidden = (checkpoint(run, _KeptForRecompute.apply(hidden), mask)
                          if i < self.recompute_num_layers else run(hidden, mask))
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
            if self.compute_dtype is not None:
                hidden = hidden.to(self.compute_dtype)
        return hidden

"""Shape of a GPT/BERT model and its closed-form sizes: parameters, FLOPs, activations.

Symbols: ``b`` samples of ``s`` tokens per microbatch, hidden size h, MLP width f, a
attention heads of d dimensions each (--kv-channels; h / a by default), q = a d the
width of the queries and of the attention's output (its context), G key/value heads
("query groups", G = a without grouped-query attention) and kv = G d the width of the
keys (and of the values), V the padded vocabulary, t the tensor-parallel size.  Without
--kv-channels (or with d = h / a) q = h: a GPT-2/BERT block has q = kv = h.

Counting conventions (all per microbatch):

* Parameters of one layer: the fused QKV projection h (q + 2 kv), the output
  projection q h (from the a heads' q features back to h), the MLP 2 h f (SwiGLU:
  3 h f, its first matrix makes the gate and the up projection, 2 f features), their
  biases (q + 2 kv, h, f or 2 f, and h; none with --disable-bias-linear, but for the
  QKV one with --add-qkv-bias) and two norms (LayerNorm 2h each, RMSNorm h); with
  --qk-layernorm also the query and the key norm, one weight of d each (LayerNorm: and
  a bias), shared by all heads.  The embedding holds V h word vectors plus, with
  learned positions, s h of them (RoPE rotates queries and keys instead and has no
  parameters).  An untied GPT output layer is a V h matrix of its own on the last
  stage; a tied one is the word embedding, counted once (a pipeline of more than one
  stage keeps a copy of it on the last stage).
* FLOPs of one transformer layer's forward pass: 2 b s h (q + 2 kv) for the QKV
  projection, 2 b s q h for the output projection, 2 b s h f x 2 (SwiGLU: x 3) for the
  MLP and 4 b s^2 q for the two attention matmuls (Q K^T and the weighted sum over V:
  a query heads of d dimensions, whatever G is) -- megatron/model/flops.py's layer
  part.  With q = kv = h and f = 4h this is Megatron's 24 b s h^2 (1 + s / (6h)).  The
  backward pass costs twice the forward (Megatron's 72 b s h^2 (1 + s / (6h)) per
  layer per step = 3 x forward).  Norms (the query/key norms too), RoPE (scaled or
  not), the SwiGLU product and biases are elementwise work and, as in Megatron's count,
  not FLOPs here.
* Activation bytes (kept for the backward pass, moved by the elementwise work, sent
  between stages and tensor ranks): ``activations.py``, whose ``ActivationBytes``
  ``ModelSpec`` inherits.

Named presets (the paper's model sizes, two Llama shapes and Qwen3-0.6B) live in
``presets.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .activations import ActivationBytes

MODEL_KINDS = ("gpt", "bert")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
EXPLICIT_SOFTMAX_BACKENDS = ("unfused", "local")
"""The backends that keep the s x s probabilities (the others run sdpa's kernels)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec(ActivationBytes):
    """A GPT or BERT transformer as the planner sees it (keyword-only fields).

    The architecture fields after ``name`` carry ``ModelConfig``'s names and defaults
    (the trainer's Megatron flags in their docstrings); all defaults is a GPT-2/BERT
    block, whose counts are the paper's."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    """MLP width; None means 4 * hidden_size (with swiglu 8/3 of it, to a multiple of 64)."""
    kind: str = "gpt"
    """'gpt' (causal LM) or 'bert'."""
    name: str = ""
    normalization: str = "LayerNorm"
    """--normalization: 'LayerNorm' (weight and bias) or 'RMSNorm' (weight only)."""
    position_embedding_type: str = "learned_absolute"
    """--position-embedding-type: 'learned_absolute' (a position table) or 'rope'."""
    rotary_base: int = 10000
    """--rotary-base (RoPE only; changes no count)."""
    rotary_percent: float = 1.0
    """--rotary-percent (RoPE only; changes no count: the rotated q and k are whole
    new tensors whatever share of each head is rotated)."""
    rope_scaling: bool = False
    """--use-rope-scaling: Llama 3.1's RoPE frequencies (RoPE only; changes no count,
    carried so that planned commands and profiles keep it)."""
    rope_scaling_factor: float = 8.0
    """--rope-scaling-factor (with rope_scaling; changes no count)."""
    swiglu: bool = False
    """--swiglu: MLP down(silu(gate(x)) * up(x)), its first matrix h -> 2 f."""
    qk_layernorm: bool = False
    """--qk-layernorm: every query and key head normalised over head_dim (with
    ``normalization``) before RoPE: two head_dim-wide norms per layer (Qwen3)."""
    kv_channels: Optional[int] = None
    """--kv-channels d: the size of one attention head (queries a d wide, keys and values
    G d); None means hidden_size / num_attention_heads, as in ``ModelConfig``, which
    then must divide (Qwen3-0.6B: 16 heads of 128 in a hidden size of 1024)."""
    num_query_groups: Optional[int] = None
    """--group-query-attention --num-query-groups G: key/value heads; None means
    num_attention_heads (multi-head attention), as in ``ModelConfig``."""
    add_bias_linear: bool = True
    """False: --disable-bias-linear (no biases on the four linear layers of a block)."""
    add_qkv_bias: bool = False
    """--add-qkv-bias: the QKV projection keeps its bias without add_bias_linear (Qwen's)."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: GPT's output layer has a V x h weight of
    its own instead of the word embedding's."""
    fp32_logits: bool = False
    """The loss keeps the logits in float32 (Megatron's cross-entropy on
    ``output.float()``, which the paper's runs used) rather than in the training dtype
    (this trainer's chunked cross-entropy).  Not a trainer flag: for modelling others."""
    attention_backend: str = "auto"
    """--attention-backend: what the attention keeps for the backward pass (not the
    block's math): 'auto', 'flash', 'fused' (torch's scaled_dot_product_attention: a
    log-sum-exp per query) or 'unfused', 'local' (the explicit softmax: its s x s
    probabilities, dropout mask and output; the paper's Megatron)."""
    sequence_parallel: bool = False
    """--sequence-parallel: with t > 1 tensor ranks, what tensor parallelism replicates
    (the norms' and the column-parallel linears' inputs, the residual dropout masks, the
    tensors between stages) is split along the sequence, s / t positions per rank; t
    must then divide seq_length (``CostModel.check``).  Not the block's math but where
    its activations live, as ``attention_backend``; with t = 1 it changes nothing, as
    the trainer (and Megatron-LM) turn it off there."""
    reset_attention_mask: bool = False
    """--reset-attention-mask (GPT): attention stays inside each document of a sample,
    so every stage makes and keeps a [b, s, s] mask per microbatch, as BERT's padding
    mask (``stage_mask_bytes``).  The FLOPs are the causal ones; on a GPU the masked
    kernel is slower than the causal one, which a profile (taken causal) does not see."""
    fp32_residual_connection: bool = False
    """--fp32-residual-connection: the residual stream (the stage inputs and outputs, the
    norms' inputs) is float32 while the rest is in the training dtype: 4 bytes a value
    where the counts have 2 (``residual_bytes``; activations.py's docstring item).  Not the
    block's math but the precision of its sums, as ``attention_backend`` is a kernel."""

    def __post_init__(self) -> None:
        for attr in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size"):
            if getattr(self, attr) < 1:
                raise ValueError(f"model: --{attr.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, attr)}")
        if self.kv_channels is None:  # ModelConfig's (and Megatron-LM's) default: h / a
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"model: --hidden-size {self.hidden_size} must be divisible "
                                 f"by --num-attention-heads {self.num_attention_heads}, or "
                                 f"give --kv-channels")
            object.__setattr__(self, "kv_channels",
                               self.hidden_size // self.num_attention_heads)
        if self.kv_channels < 1:
            raise ValueError(f"model: --kv-channels must be >= 1, got {self.kv_channels}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model: --attention-backend {self.attention_backend!r}: expected "
                             f"one of {', '.join(ATTENTION_BACKENDS)}")
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model: kind must be one of {MODEL_KINDS}, got {self.kind!r}")
        if self.ffn_hidden_size is None:  # Megatron-LM's default: 4h, or 8h/3 (to 64) with SwiGLU
            object.__setattr__(self, "ffn_hidden_size",
                               int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
                               else 4 * self.hidden_size)
        if self.ffn_hidden_size < 1:
            raise ValueError(f"model: --ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"model: --normalization {self.normalization!r}: expected one of "
                             f"{', '.join(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"model: --position-embedding-type "
                             f"{self.position_embedding_type!r}: expected one of "
                             f"{', '.join(POSITION_EMBEDDING_TYPES)}")
        if self.rope:  # the trainer checks the rotary flags only with RoPE, as here
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ValueError(f"model: --rotary-percent {self.rotary_percent}: expected a "
                                 f"value in (0, 1]")
            if int(self.head_dim * self.rotary_percent) < 2:
                raise ValueError(f"model: --rotary-percent {self.rotary_percent} of the head "
                                 f"size {self.head_dim} leaves fewer than 2 dimensions to rotate")
            if self.rotary_base <= 0:
                raise ValueError(f"model: --rotary-base {self.rotary_base}: expected > 0")
        if self.rope_scaling:  # as the trainer: an error rather than a silent no-op
            if not self.rope:
                raise ValueError("model: --use-rope-scaling needs --position-embedding-type "
                                 "rope")
            if not self.rope_scaling_factor >= 1.0:
                raise ValueError(f"model: --rope-scaling-factor {self.rope_scaling_factor}: "
                                 f"expected >= 1")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        g = self.num_query_groups
        if g < 1 or self.num_attention_heads % g:
            raise ValueError(f"model: --num-query-groups {g} must divide "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.kind == "bert" and self.reset_attention_mask:
            raise ValueError("model: --reset-attention-mask applies to GPT models only "
                             "(BERT has its padding mask)")
        if self.kind == "bert" and self.llama_options():
            # the trainer's BertModel builds only BERT's own block and tied head
            raise ValueError(f"model: {' '.join(self.llama_options())} apply to GPT models "
                             f"only (BERT has LayerNorm, learned positions, GeLU, biases, "
                             f"heads of hidden size / heads and a tied output layer)")

    def llama_options(self) -> List[str]:
        """The trainer flags of the options that differ from a GPT-2 block, in the order
        ``command_line`` passes them (empty for a GPT-2/BERT block)."""
        flags: List[str] = []
        if self.normalization != "LayerNorm":
            flags += ["--normalization", self.normalization]
        if self.position_embedding_type != "learned_absolute":
            flags += ["--position-embedding-type", self.position_embedding_type]
            if self.rotary_base != 10000:
                flags += ["--rotary-base", str(self.rotary_base)]
            if self.rotary_percent != 1.0:
                flags += ["--rotary-percent", f"{self.rotary_percent:g}"]
            if self.rope_scaling:
                flags += ["--use-rope-scaling", "--rope-scaling-factor",
                          f"{self.rope_scaling_factor:g}"]
        if self.swiglu:
            flags.append("--swiglu")
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if self.custom_head_dim:
            flags += ["--kv-channels", str(self.kv_channels)]
        if self.grouped_query:
            flags += ["--group-query-attention", "--num-query-groups",
                      str(self.num_query_groups)]
        if not self.add_bias_linear:
            flags.append("--disable-bias-linear")
        if self.add_qkv_bias:
            flags.append("--add-qkv-bias")
        if self.untie_embeddings_and_output_weights:
            flags.append("--untie-embeddings-and-output-weights")
        return flags

    # ---------------------------------------------------------------- parameters
    @property
    def ffn(self) -> int:
        return int(self.ffn_hidden_size)  # type: ignore[arg-type]

    @property
    def head_dim(self) -> int:
        """d: the size of one attention head (--kv-channels, h / a by default)."""
        return int(self.kv_channels)  # type: ignore[arg-type]

    @property
    def custom_head_dim(self) -> bool:
        """The heads are not h / a wide: the command needs --kv-channels."""
        return self.head_dim * self.num_attention_heads != self.hidden_size

    @property
    def q_size(self) -> int:
        """q: width of the queries and of the attention's output, a x head_dim (h unless
        --kv-channels says otherwise)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """kv: width of the keys (and of the values), G x head_dim (q without GQA)."""
        return int(self.num_query_groups) * self.head_dim  # type: ignore[arg-type]

    @property
    def grouped_query(self) -> bool:
        """Fewer key/value heads than query heads."""
        return self.num_query_groups != self.num_attention_heads

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def keeps_scores(self) -> bool:
        """The attention keeps its s x s probabilities (--attention-backend unfused or
        local) rather than rebuilding them in the backward pass (flash/memory-efficient
        kernels)."""
        return self.attention_backend in EXPLICIT_SOFTMAX_BACKENDS

    def backend_options(self) -> List[str]:
        """The trainer flag of a non-default attention backend (GPT and BERT alike)."""
        return [] if self.attention_backend == "auto" else [
            "--attention-backend", self.attention_backend]

    @property
    def tied_output(self) -> bool:
        """The output layer is the word embedding (a copy on the last stage of a pipeline
        of more than one)."""
        return not self.untie_embeddings_and_output_weights

    @property
    def norm_params(self) -> int:
        """One norm: LayerNorm's weight and bias, or RMSNorm's weight."""
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """QKV (h -> q + 2 kv) + output projection (q -> h) + the MLP's matrices (+
        biases) + two norms (+ the query and key norms: head_dim wide, shared by the
        heads)."""
        h, f, q, kv = self.hidden_size, self.ffn, self.q_size, self.kv_size
        mlp_out = 2 * f if self.swiglu else f          # gate and up with SwiGLU
        weights = h * (q + 2 * kv) + q * h + h * mlp_out + f * h
        biases = h + mlp_out + h if self.add_bias_linear else 0
        if self.add_bias_linear or self.add_qkv_bias:
            biases += q + 2 * kv
        per_head_norm = (2 if self.normalization == "LayerNorm" else 1) * self.head_dim
        qk_norms = 2 * per_head_norm if self.qk_layernorm else 0
        return weights + biases + 2 * self.norm_params + qk_norms

    def layer_weight_bytes(self, bytes_per_param: float = 2.0) -> float:
        """Bytes of one layer's weights (fp16 by default)."""
        return self.params_per_layer * bytes_per_param

    @property
    def embedding_params(self) -> int:
        """Word + position (none with RoPE) (+ token-type for BERT) embeddings."""
        h = self.hidden_size
        extra = 2 * h if self.kind == "bert" else 0
        positions = 0 if self.rope else self.seq_length * h
        return self.vocab_size * h + positions + extra

    @property
    def output_params(self) -> int:
        """An untied output layer's V x h weight (0 when tied to the word embedding)."""
        return 0 if self.tied_output else self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters after the last layer, not counting a tied word embedding (an
        untied output layer is counted: it lives on the last stage)."""
        h = self.hidden_size
        final_norm = self.norm_params
        if self.kind == "gpt":
            return final_norm + self.output_params
        # pooler, LM-head transform (dense + LayerNorm), LM output bias, NSP classifier
        return final_norm + (h * h + h) + (h * h + h + 2 * h) + self.vocab_size + (2 * h + 2)

    @property
    def num_params(self) -> int:
        """Logical parameter count (a tied output embedding counted once)."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    def stage_parameters(self, layers: int, first: bool, last: bool,
                         t: int = 1) -> Tuple[Tuple[int, bool], ...]:
        """A pipeline stage's parameters on one of t tensor ranks, in the order the
        trainer's stage module holds them (``GPTModel`` / ``BertModel.parameters()``), each
        as (elements, whether it is the tied word embedding): what the executor lays into
        its gradient buckets, whole parameter by whole parameter
        (``CostModel.bucket_counts``).  The column-parallel matrices and their biases and
        the vocabulary's rows are split over the t ranks; the norms, the position and
        token-type tables, the row-parallel biases and BERT's pooler and binary head are
        whole on each.  The last stage of a cut pipeline (not also ``first``) holds a
        copy of a tied word embedding (BERT's always)."""
        h, f, d = self.hidden_size, self.ffn, self.head_dim

        def split(n: int) -> int:
            return -(-n // t)

        norm = [(h, False)] * (2 if self.normalization == "LayerNorm" else 1)
        head_norm = [(d, False)] * (2 if self.normalization == "LayerNorm" else 1)
        qkv, mlp_out = split(self.q_size + 2 * self.kv_size), split(2 * f if self.swiglu else f)
        layer = norm + [(qkv * h, False)]
        if self.add_bias_linear or self.add_qkv_bias:
            layer.append((qkv, False))
        if self.qk_layernorm:
            layer += head_norm + head_norm                     # the query's, the key's
        layer.append((h * split(self.q_size), False))
        layer += [(h, False)] if self.add_bias_linear else []
        layer += norm + [(mlp_out * h, False)]
        layer += [(mlp_out, False)] if self.add_bias_linear else []
        layer.append((h * split(f), False))
        layer += [(h, False)] if self.add_bias_linear else []
        word = split(self.vocab_size) * h
        bert = self.kind == "bert"
        out: List[Tuple[int, bool]] = []
        if first:
            out.append((word, self.tied_output))
            out += [] if self.rope else [(self.seq_length * h, False)]
            out += [(2 * h, False)] if bert else []            # token types
        out += layer * layers
        if last:
            out += norm                                        # the final norm
            if bert:  # pooler; LM head: output bias, dense, LayerNorm; binary head
                out += [(h * h, False), (h, False), (split(self.vocab_size), False),
                        (h * h, False), (h, False), (h, False), (h, False),
                        (2 * h, False), (2, False)]
            elif not self.tied_output:
                out.append((word, False))                      # the output layer
            if self.tied_output and not first:
                out.append((word, True))
        return tuple(out)

    # ---------------------------------------------------------------- FLOPs
    def layer_forward_flops(self, b: int) -> float:
        """The four matrices and the two attention matmuls (megatron/model/flops.py's
        layer part)."""
        h, f, s = self.hidden_size, self.ffn, self.seq_length
        q, kv = self.q_size, self.kv_size
        mlp = (3 if self.swiglu else 2) * h * f
        return 2.0 * b * s * (h * (q + 2 * kv) + q * h + mlp) + self.core_attention_flops(b)

    def core_attention_flops(self, b: int) -> float:
        """The two attention matmuls of one layer's forward (scores and context): what
        selective recomputation runs again in the backward pass."""
        return 4.0 * b * self.seq_length * self.seq_length * self.q_size

    def head_forward_flops(self, b: int) -> float:
        """Logits (and BERT's LM-head transform) for one microbatch: the same matmul
        whether the output layer is tied or not."""
        h, s = self.hidden_size, self.seq_length
        flops = 2.0 * b * s * h * self.vocab_size
        if self.kind == "bert":
            flops += 2.0 * b * s * h * h
        return flops

    def describe(self) -> str:
        arch = ""
        if self.llama_options():
            parts = [self.normalization] if self.normalization != "LayerNorm" else []
            parts += ["RoPE"] if self.rope else []
            parts += [f"RoPE scaling x{self.rope_scaling_factor:g}"] if self.rope_scaling else []
            parts += ["SwiGLU"] if self.swiglu else []
            parts += ["QK norm"] if self.qk_layernorm else []
            parts += [f"{self.num_query_groups} query groups"] if self.grouped_query else []
            parts += ["no linear biases"] if not self.add_bias_linear else []
            parts += ["QKV bias"] if self.add_qkv_bias else []
            parts += ["untied output"] if not self.tied_output else []
            arch = f", {', '.join(parts)}"
        if self.keeps_scores:
            arch += f", {self.attention_backend} attention"
        if self.sequence_parallel:
            arch += ", sequence parallel"
        if self.reset_attention_mask:
            arch += ", document attention mask"
        if self.fp32_residual_connection:
            arch += ", fp32 residual stream"
        heads = f"{self.num_attention_heads} heads" + (
            f" of {self.head_dim}" if self.custom_head_dim else "")
        return (f"{self.name or self.kind}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"ffn {self.ffn}, {heads}, seq {self.seq_length}, "
                f"vocab {self.vocab_size}{arch}, {self.num_params / 1e9:.2f}B parameters")

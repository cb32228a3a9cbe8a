"""Shape of a GPT/BERT model and its closed-form sizes: parameters, FLOPs, activations.

Symbols: ``b`` samples of ``s`` tokens per microbatch, hidden size h, MLP width f, a
attention heads of head_dim = h / a dimensions, G key/value heads ("query groups", G = a
without grouped-query attention) and kv = G head_dim the width of the keys (and of the
values), V the padded vocabulary, t the tensor-parallel size.

Counting conventions (all per microbatch):

* Parameters of one layer: the fused QKV projection h (h + 2 kv), the output
  projection h^2, the MLP 2 h f (SwiGLU: 3 h f, its first matrix makes the gate and the
  up projection, 2 f features), their biases (h + 2 kv, h, f or 2 f, and h; none with
  --disable-bias-linear, but for the QKV one with --add-qkv-bias) and two norms
  (LayerNorm 2h each, RMSNorm h).  The embedding holds V h word vectors plus, with
  learned positions, s h of them (RoPE rotates queries and keys instead and has no
  parameters).  An untied GPT output layer is a V h matrix of its own on the last
  stage; a tied one is the word embedding, counted once (a pipeline of d > 1 stages
  keeps a copy of it on the last stage).
* FLOPs of one transformer layer's forward pass: 2 b s h (h + 2 kv) for the QKV
  projection, 2 b s h^2 for the output projection, 2 b s h f x 2 (SwiGLU: x 3) for the
  MLP and 4 b s^2 h for the two attention matmuls (Q K^T and the weighted sum over V
  have a query heads whatever G is).  With G = a and f = 4h this is Megatron's
  24 b s h^2 (1 + s / (6h)).  The backward pass costs twice the forward (Megatron's
  72 b s h^2 (1 + s / (6h)) per layer per step = 3 x forward).  Norms, RoPE, the SwiGLU
  product and biases are elementwise work and, as in Megatron's count, not FLOPs here.
* Activation bytes of one layer kept for the backward pass, fp16, no recomputation,
  following Korthikanti et al. (2022), with tensor parallelism of size t and no
  sequence parallelism: s b h (10 + 8 / t) + 4 s b f / t + 5 a s^2 b / t.  With
  f = 4h and t = 1 this is s b h (34 + 5 a s / h).  Term by term (bytes):

    replicated on every tensor rank, 10 s b h: the inputs of the two norms (2 s b h
    each), of the QKV projection and of the first MLP matrix (2 s b h each), and the
    two dropout masks of the residual branches (s b h each, one byte per value);
    split over t, 8 s b h: the QKV projection's output, whose q, k and v views the
    attention keeps (6 s b h), and the attention context the output projection keeps
    (2 s b h); 4 s b f: the GeLU's input and output (the second matrix keeps the
    latter); 5 a s^2 b: softmax output (2), its dropout mask (1) and dropout output (2).

  The Llama-style options change it as follows (each derived from what the operations
  keep, and checked against the bytes the executor counts on the trainer's layers in
  tests/unit/test_planner_llama.py):

  - grouped-query attention: the QKV output is 2 s b (h + 2 kv), so the 6 s b h term
    becomes 2 s b (h + 2 kv).  K and V enter the attention at their G heads (a kernel
    that reads each group for its a / G query heads, as ``scaled_dot_product_attention``
    with ``enable_gqa``, the trainer's default backend, does; an attention that
    materialised the repeated heads would keep 4 s b (h - kv) more).  The softmax terms
    have a heads whatever G is.  With G < a and no RoPE the queries are also copied out
    of the fused output into head order (they are not one strided view of it: each
    group's block in the output holds its queries, key and value, Megatron-LM's layout),
    and attention keeps that copy: + 2 s b h / t.  The QKV output itself stays whole
    because k and v are views of it.
  - RoPE: the rotated q and k are new tensors, and attention keeps them instead of the
    projected ones, which still live on in the QKV output (v is a view of it): + 2 s b
    (h + kv) / t (this replaces the query copy of the previous item, which RoPE frees
    once it has rotated it); the same whatever share of a head --rotary-percent rotates
    (the rotated part and the rest are joined into one new tensor).  The rotation
    itself keeps only its cos and sin tables, s x rotated dimensions each, made once
    and shared by every layer and microbatch (no b factor, like the norms' per-token
    statistics: left out).
  - SwiGLU: the first MLP matrix outputs gate and up, 2 f features (4 s b f bytes, kept
    whole: silu keeps the gate, the product keeps the up half, both views of it); the
    product also keeps silu(gate) (2 s b f) and the second matrix keeps the product
    (2 s b f): 8 s b f / t in place of GeLU's 4 s b f / t.  (A fused SwiGLU kernel that
    recomputes silu in its backward, as Megatron-LM's is, would keep 6 s b f / t.)
  - RMSNorm: keeps its input and one statistic per token (1 / rms), as LayerNorm keeps
    its input, mean and 1 / std: the 2 s b h per norm is unchanged.  (torch 2.13's
    RMSNorm on the CPU is a composite of elementwise operations whose weight product
    also keeps the normalised input, 2 s b h more per norm; the closed form counts one
    fused norm, as Korthikanti's counts assume Megatron's fused kernels.)
  - --disable-bias-linear (and --add-qkv-bias): biases are parameters, not
    activations; the linear layers keep the same inputs and the GeLU the same input
    (x W, or x W + b) either way: no change.

  All together, with rope, gqa and swiglu 1 or 0 and gqa = 1 when G < a:
      s b h 10 + [2 s b (h + 2 kv) + 2 s b h + rope 2 s b (h + kv)
                  + (1 - rope) gqa 2 s b h + (4 + 4 swiglu) s b f + 5 a s^2 b] / t.
* Input activation of a pipeline stage: s b h fp16 values = 2 s b h bytes.

Named presets (the paper's model sizes and two Llama shapes) live in ``presets.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

MODEL_KINDS = ("gpt", "bert")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
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
    swiglu: bool = False
    """--swiglu: MLP down(silu(gate(x)) * up(x)), its first matrix h -> 2 f."""
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

    def __post_init__(self) -> None:
        for attr in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "vocab_size"):
            if getattr(self, attr) < 1:
                raise ValueError(f"model: --{attr.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, attr)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model: --hidden-size {self.hidden_size} must be divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
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
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        g = self.num_query_groups
        if g < 1 or self.num_attention_heads % g:
            raise ValueError(f"model: --num-query-groups {g} must divide "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.kind == "bert" and self.llama_options():
            # the trainer's BertModel builds only BERT's own block and tied head
            raise ValueError(f"model: {', '.join(self.llama_options())} apply to GPT models "
                             f"only (BERT has LayerNorm, learned positions, GeLU, biases and "
                             f"a tied output layer)")

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
        if self.swiglu:
            flags.append("--swiglu")
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
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """kv: width of the keys (and of the values), G x head_dim (h without GQA)."""
        return int(self.num_query_groups) * self.head_dim  # type: ignore[arg-type]

    @property
    def grouped_query(self) -> bool:
        """Fewer key/value heads than query heads."""
        return self.num_query_groups != self.num_attention_heads

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def tied_output(self) -> bool:
        """The output layer is the word embedding (a copy on the last of d > 1 stages)."""
        return not self.untie_embeddings_and_output_weights

    @property
    def norm_params(self) -> int:
        """One norm: LayerNorm's weight and bias, or RMSNorm's weight."""
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden_size

    @property
    def params_per_layer(self) -> int:
        """QKV + output projection + the MLP's matrices (+ biases) + two norms."""
        h, f, kv = self.hidden_size, self.ffn, self.kv_size
        mlp_out = 2 * f if self.swiglu else f          # gate and up with SwiGLU
        weights = h * (h + 2 * kv) + h * h + h * mlp_out + f * h
        biases = h + mlp_out + h if self.add_bias_linear else 0
        if self.add_bias_linear or self.add_qkv_bias:
            biases += h + 2 * kv
        return weights + biases + 2 * self.norm_params

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

    # ---------------------------------------------------------------- FLOPs
    def layer_forward_flops(self, b: int) -> float:
        h, f, s, kv = self.hidden_size, self.ffn, self.seq_length, self.kv_size
        mlp = (3 if self.swiglu else 2) * h * f
        return 2.0 * b * s * (h * (h + 2 * kv) + h * h + mlp) + 4.0 * b * s * s * h

    def head_forward_flops(self, b: int) -> float:
        """Logits (and BERT's LM-head transform) for one microbatch: the same matmul
        whether the output layer is tied or not."""
        h, s = self.hidden_size, self.seq_length
        flops = 2.0 * b * s * h * self.vocab_size
        if self.kind == "bert":
            flops += 2.0 * b * s * h * h
        return flops

    # ---------------------------------------------------------------- activations
    def layer_activation_bytes(self, b: int, t: int = 1) -> float:
        """Bytes one layer keeps for its backward pass (fp16, no recompute; the module
        docstring derives each term)."""
        h, f, s, a = self.hidden_size, self.ffn, self.seq_length, self.num_attention_heads
        kv = self.kv_size
        replicated = 10.0 * s * b * h
        attention = 2.0 * s * b * (h + 2 * kv) + 2.0 * s * b * h   # QKV output, context
        if self.rope:
            attention += 2.0 * s * b * (h + kv)                      # rotated q and k
        elif self.grouped_query:
            attention += 2.0 * s * b * h                             # q copied to head order
        mlp = (8.0 if self.swiglu else 4.0) * s * b * f
        return replicated + (attention + mlp + 5.0 * a * s * s * b) / t

    def input_activation_bytes(self, b: int) -> float:
        """Bytes of a stage's input (and output) activation: s b h fp16 values."""
        return 2.0 * self.seq_length * b * self.hidden_size

    def head_activation_bytes(self, b: int, t: int = 1) -> float:
        """Final norm input (fp16) plus the fp32 logits the loss keeps (1/t each).
        The same with RMSNorm (it keeps its input, as LayerNorm) and with an untied
        output layer (the same matmul of the same normalised input)."""
        s, h = self.seq_length, self.hidden_size
        return 2.0 * s * b * h + 4.0 * s * b * self.vocab_size / t

    def layer_elementwise_bytes(self, b: int) -> float:
        """Memory traffic of one layer's forward that tensor parallelism replicates:
        two LayerNorms (read + write) and two dropout + residual adds (two reads, a write
        and a mask), about 12 fp16 tensors of s b h values.  RMSNorm moves the same
        tensors; RoPE and SwiGLU's product act on per-rank heads and features, split by
        t like the matmuls, so they do not add to it."""
        return 24.0 * self.seq_length * b * self.hidden_size

    def describe(self) -> str:
        arch = ""
        if self.llama_options():
            parts = [self.normalization] if self.normalization != "LayerNorm" else []
            parts += ["RoPE"] if self.rope else []
            parts += ["SwiGLU"] if self.swiglu else []
            parts += [f"{self.num_query_groups} query groups"] if self.grouped_query else []
            parts += ["no linear biases"] if not self.add_bias_linear else []
            parts += ["QKV bias"] if self.add_qkv_bias else []
            parts += ["untied output"] if not self.tied_output else []
            arch = f", {', '.join(parts)}"
        return (f"{self.name or self.kind}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"ffn {self.ffn}, {self.num_attention_heads} heads, seq {self.seq_length}, "
                f"vocab {self.vocab_size}{arch}, {self.num_params / 1e9:.2f}B parameters")

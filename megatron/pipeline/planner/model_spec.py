"""Shape of a GPT/BERT model and its closed-form sizes: parameters, FLOPs, activations.

Counting conventions (all per microbatch of ``b`` samples of ``s`` tokens):

* FLOPs of one transformer layer's forward pass: 2 b s (4 h^2 + 2 h f) for the four
  weight matrices plus 4 b s^2 h for the two attention matmuls.  With f = 4h this is
  Megatron's 24 b s h^2 (1 + s / (6h)).  The backward pass costs twice the forward
  (Megatron's 72 b s h^2 (1 + s / (6h)) per layer per step = 3 x forward).
* Activation bytes of one layer kept for the backward pass, fp16, no recomputation,
  following Korthikanti et al. (2022), with tensor parallelism of size t and no
  sequence parallelism: s b h (10 + 8 / t) + 4 s b f / t + 5 a s^2 b / t.  With
  f = 4h and t = 1 this is s b h (34 + 5 a s / h).
* Input activation of a pipeline stage: s b h fp16 values = 2 s b h bytes.

Named presets (the paper's model sizes) live in ``presets.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MODEL_KINDS = ("gpt", "bert")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A GPT or BERT transformer as the planner sees it (keyword-only fields)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: Optional[int] = None
    """MLP width; None means 4 * hidden_size."""
    kind: str = "gpt"
    """'gpt' (causal LM, output layer tied to the embedding) or 'bert'."""
    name: str = ""

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
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)

    # ---------------------------------------------------------------- parameters
    @property
    def ffn(self) -> int:
        return int(self.ffn_hidden_size)  # type: ignore[arg-type]

    @property
    def params_per_layer(self) -> int:
        """QKV + output projection + two MLP matrices, with biases, + two LayerNorms."""
        h, f = self.hidden_size, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def layer_weight_bytes(self, bytes_per_param: float = 2.0) -> float:
        """Bytes of one layer's weights (fp16 by default)."""
        return self.params_per_layer * bytes_per_param

    @property
    def embedding_params(self) -> int:
        """Word + position (+ token-type for BERT) embeddings."""
        h = self.hidden_size
        extra = 2 * h if self.kind == "bert" else 0
        return self.vocab_size * h + self.seq_length * h + extra

    @property
    def head_params(self) -> int:
        """Parameters after the last layer, not counting the tied word embedding."""
        h = self.hidden_size
        final_ln = 2 * h
        if self.kind == "gpt":
            return final_ln
        # pooler, LM-head transform (dense + LayerNorm), LM output bias, NSP classifier
        return final_ln + (h * h + h) + (h * h + h + 2 * h) + self.vocab_size + (2 * h + 2)

    @property
    def num_params(self) -> int:
        """Logical parameter count (the tied output embedding counted once)."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    # ---------------------------------------------------------------- FLOPs
    def layer_forward_flops(self, b: int) -> float:
        h, f, s = self.hidden_size, self.ffn, self.seq_length
        return 2.0 * b * s * (4 * h * h + 2 * h * f) + 4.0 * b * s * s * h

    def head_forward_flops(self, b: int) -> float:
        """Logits (and BERT's LM-head transform) for one microbatch."""
        h, s = self.hidden_size, self.seq_length
        flops = 2.0 * b * s * h * self.vocab_size
        if self.kind == "bert":
            flops += 2.0 * b * s * h * h
        return flops

    # ---------------------------------------------------------------- activations
    def layer_activation_bytes(self, b: int, t: int = 1) -> float:
        """Bytes one layer keeps for its backward pass (fp16, no recompute)."""
        h, f, s, a = self.hidden_size, self.ffn, self.seq_length, self.num_attention_heads
        return s * b * h * (10.0 + 8.0 / t) + 4.0 * s * b * f / t + 5.0 * a * s * s * b / t

    def input_activation_bytes(self, b: int) -> float:
        """Bytes of a stage's input (and output) activation: s b h fp16 values."""
        return 2.0 * self.seq_length * b * self.hidden_size

    def head_activation_bytes(self, b: int, t: int = 1) -> float:
        """Final LayerNorm input (fp16) plus the fp32 logits the loss keeps (1/t each)."""
        s, h = self.seq_length, self.hidden_size
        return 2.0 * s * b * h + 4.0 * s * b * self.vocab_size / t

    def layer_elementwise_bytes(self, b: int) -> float:
        """Memory traffic of one layer's forward that tensor parallelism replicates:
        two LayerNorms (read + write) and two dropout + residual adds (two reads, a write
        and a mask), about 12 fp16 tensors of s b h values."""
        return 24.0 * self.seq_length * b * self.hidden_size

    def describe(self) -> str:
        return (f"{self.name or self.kind}: {self.num_layers} layers, hidden {self.hidden_size}, "
                f"ffn {self.ffn}, {self.num_attention_heads} heads, seq {self.seq_length}, "
                f"vocab {self.vocab_size}, {self.num_params / 1e9:.2f}B parameters")

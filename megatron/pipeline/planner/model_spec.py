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
* Activation bytes of one layer kept for the backward pass, fp16, no recomputation,
  following Korthikanti et al. (2022), with tensor parallelism of size t (sequence
  parallelism: the next item).  Term by term (bytes), for a GPT-2 block first:

    replicated on every tensor rank, 10 s b h: the inputs of the two norms (2 s b h
    each), of the QKV projection and of the first MLP matrix (2 s b h each), and the
    two dropout masks of the residual branches (s b h each, one byte per value) --
    all of them at the block's width h, whatever q and kv are;
    split over t: the QKV projection's output, whose q, k and v views the attention
    keeps, 2 s b (q + 2 kv); the attention context the output projection keeps (its
    input, the a heads' outputs side by side), 2 s b q; 4 s b f: the GeLU's input and
    output (the second matrix keeps the latter); and what the attention kernel keeps
    beyond q, k, v and its output (``score_bytes``), per query head whatever d is:
      - --attention-backend unfused or local (the explicit softmax; Megatron's fused
        softmax kernel, which the paper's runs used): 5 a s^2 b, the softmax output (2,
        kept in the values' dtype), its dropout mask (1) and dropout output (2);
      - auto, flash or fused (the trainer's default: torch's scaled_dot_product_attention
        runs flash attention or the memory-efficient kernel, which rebuild the scores in
        the backward pass): one fp32 log-sum-exp per query head and token, 4 a s b.
        (torch's CPU fallback with attention dropout keeps the unfused tensors.)

  With q = kv = h and the unfused backend this is Korthikanti's s b h (10 + 8 / t) +
  4 s b f / t + 5 a s^2 b / t (f = 4h, t = 1: s b h (34 + 5 a s / h)).

  The Llama-style options change it as follows (each derived from what the operations
  keep, and checked against the bytes the executor counts on the trainer's layers in
  tests/unit/test_planner_llama.py, head sizes d = h / a, 2 h / a and h / (2 a) among
  them):

  - --kv-channels d: only the widths above move.  The QKV output is (q + 2 kv) wide, the
    context q wide (the core attention returns a heads of d; the output projection
    keeps that as its input and maps it back to h), and every tensor the items below
    add is a whole number of heads of d (q for the queries, kv for the keys).  What
    the block keeps at width h -- the norms' and the two matrices' inputs, the
    residual dropout masks, the stage input -- and the per-head softmax terms do not
    depend on d.
  - grouped-query attention: kv = G d < q; the QKV output is 2 s b (q + 2 kv).  K and V
    enter the attention at their G heads (a kernel that reads each group for its a / G
    query heads, as ``scaled_dot_product_attention`` with ``enable_gqa``, the
    trainer's default backend, does; the explicit softmax of --attention-backend
    unfused/local repeats the key and value heads, and what its matmuls then keep
    depends on the layout: measured on CPU, 0 to 1.5 q-wide tensors more per token,
    not counted here -- profile such a model, tools/profile_model.py).  The softmax
    terms have a heads whatever G is.
    With 1 < G < a and no RoPE the queries are also copied out of the fused output into
    head order (they are not one strided view of it: each group's block in the output
    holds its queries, key and value, Megatron-LM's layout), and attention keeps that
    copy: + 2 s b q / t.  The QKV output itself stays whole because k and v are views
    of it.  With one group (multi-query attention) the queries of the single group are
    one strided view (no copy): nothing is added.
  - RoPE: the rotated q and k are new tensors, and attention keeps them instead of the
    projected ones, which still live on in the QKV output (v is a view of it): + 2 s b
    (q + kv) / t (this replaces the query copy of the previous item, which RoPE frees
    once it has rotated it); the same whatever share of a head --rotary-percent rotates
    (the rotated part and the rest are joined into one new tensor).  The rotation
    itself keeps only its cos and sin tables, s x rotated dimensions (of d) each, made
    once and shared by every layer and microbatch (no b factor, like the norms'
    per-token statistics: left out).
  - --qk-layernorm: the query and key norms (over d, before RoPE) keep their inputs,
    but these are the q and k views of the QKV output, already counted, except the
    query copy of grouped-query attention, which the query norm now keeps alive with
    RoPE too (+ 2 s b q / t where 1 < G < a).  Their outputs are new tensors: RoPE
    keeps only its tables, so with RoPE the rotated q and k are kept as before and the
    normalised ones are not; without RoPE attention keeps the normalised q and k
    instead of the views: + 2 s b (q + kv) / t, the RoPE term.  Their statistics, one
    (RMSNorm) or two (LayerNorm) per head and token, s b (a + G) / t values, are left
    out like the block norms' per-token ones.  (torch's composite RMSNorm outside CUDA
    also keeps the normalised q and k, see RMSNorm below.)
  - RoPE scaling (--use-rope-scaling): other angles, the same tensors: no change.
    Likewise --rotary-interleaved (other dimension pairs) and
    --rotary-seq-len-interpolation-factor (other positions): no change, so ModelSpec
    has no field for them.
  - --squared-relu: relu keeps its output, which the square reads too (one tensor),
    and the second matrix keeps the square: 4 s b f / t, as GeLU's input and output.
    --apply-residual-connection-post-layernorm: the residual adds read the norms'
    outputs, which the next matrices keep anyway: no change.  (Neither is a ModelSpec
    field; tests/unit/test_model_options.py checks the executor's count is unchanged.)
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

  All together, with rope, qk, gqa and swiglu 1 or 0, gqa = 1 when 1 < G < a (the
  queries are copied) and "or" / "and" on those 0/1 values:
      s b h 10 + [2 s b (q + 2 kv) + 2 s b q + (rope or qk) 2 s b (q + kv)
                  + (gqa and (qk or not rope)) 2 s b q + (4 + 4 swiglu) s b f
                  + score_bytes] / t.
* Sequence parallelism (``sequence_parallel``, --sequence-parallel; Korthikanti et al.
  section 4.2.2; only with t > 1, which must divide s -- with one tensor rank the
  trainer turns it off, and the counts here divide by t = 1).  Tensor parallelism
  leaves the parts of a block between its two parallel regions -- the norms, the
  residual dropouts and adds -- replicated on the t ranks, each holding the whole
  [s, b, h] sequence.  These parts act on each
  token alone, so the trainer splits them along the sequence instead: each rank holds
  s / t positions, [s/t, b, h], and the all-reduce that closes a parallel region
  becomes a reduce-scatter to those positions, the copy that opens one an all-gather
  of them (in the backward pass the other way round).  An all-gather and a
  reduce-scatter together move what one all-reduce moves, so the tensor-parallel
  communication is charged as before.  Left out: the second all-gather of a column-
  parallel linear's input in the backward pass, for its weight gradient (the trainer,
  as Megatron-LM, overlaps it with the input gradient's matmul), and the per-step sum
  over the tensor ranks of the gradients of the weights that now see s / t positions
  (the norms, the row-parallel biases: a few h per layer).  What changes, per term:

    the replicated 10 s b h of a layer: the norms' inputs (2 s b h / t each) and the
    residual dropout masks (s b h / t each) are the rank's positions; the column-
    parallel linears (QKV, the first MLP matrix) all-gather their input for the
    matmul but keep the rank's s / t positions for the backward pass, where they
    all-gather them again to form the weight gradient: 2 s b h / t each.  So the
    replicated term is 10 s b h / t, and with everything else already split the layer
    keeps 1 / t of the t = 1 count: Korthikanti's s b h (34 + 5 a s / h) / t for the
    explicit softmax (f = 4h, q = kv = h).  The Llama-style terms above are all / t
    already and do not move.
    the stage input and output (the point-to-point tensors, and the input a stage
    keeps per microbatch in flight): [s/t, b, h], 2 s b h / t.
    the head (``head_activation_bytes``): GPT's final norm input and output layer
    input are the rank's positions (the output layer all-gathers for its matmul),
    4 s b h / t; BERT's final norm input is the rank's positions too, 2 s b h / t,
    but its output is all-gathered to the whole sequence and the heads run
    replicated as without sequence parallelism, keeping 8 s b h.  The logits are
    unchanged.
    the elementwise work tensor parallelism replicates (``layer_elementwise_bytes``)
    runs on s / t positions per rank: / t.
    unchanged: BERT's padding mask (one per whole sequence, ``stage_mask_bytes``).
* BERT's padding mask, made once per stage forward and kept by its layers
  (``stage_mask_bytes``): [b, s, s] additive fp16 values for the fused kernels
  (2 b s^2) or bools for the explicit softmax (b s^2).  GPT's causal mask is the
  fused kernels' own (nothing kept); the explicit softmax reads one [s, s] bool tensor
  (``causal_mask_bytes``, s^2 bytes: the whole sequence on every tensor rank, with or
  without sequence parallelism), which a stage makes at its first forward pass and
  caches (``CoreAttention.prepare_mask``): every layer and microbatch shares it, and it
  lives as long as the stage, so it is charged once per stage, not per microbatch, and
  whatever the recomputation.  (The executor's saved-tensor counter finds it kept by
  two in-flight microbatches and charges it once too: ``StashTracker.shared``.)
* A float32 residual stream (``fp32_residual_connection``, --fp32-residual-connection,
  Megatron-LM's flag; the counts stay those of fp16/bf16 training).  The tensors of the
  stream are 4 bytes a value instead of 2: what crosses a stage boundary and what a
  stage keeps of its input (4 s b h, / t with sequence parallelism), and the inputs of
  the two norms of a layer (4 s b h each, replicated or split as before).  The norms'
  outputs reach the linear layers in the training dtype (the matrices keep those
  2-byte copies), the residual branches' outputs and dropout masks are unchanged, and
  the float32 sums are not kept (an add saves nothing): the replicated term is
  14 s b h in place of 10 s b h.  Likewise the last stage's final-norm input: GPT's head
  keeps 6 s b h (/ t with sequence parallelism) in place of 4, BERT's 4 s b h / split +
  8 s b h.  The tensor-parallel collectives move the sublayers' outputs and the norms'
  outputs, still 2 bytes a value, and so does the embedding's (cast after its sum).
  Left out, like the norms' per-token statistics: each norm's float32 copy of its
  weights (LayerNorm 2 h, RMSNorm h values per layer and microbatch).  Elementwise
  traffic: the norms read, and the residual adds read and write, float32 (6 of the 12
  tensors of ``layer_elementwise_bytes`` at 4 bytes).
* Selective recomputation (``Config.selective_recompute``, --recompute-granularity
  selective; Korthikanti et al. section 5): each layer's core attention is checkpointed,
  so the layer keeps its q, k, v and output as before but not ``score_bytes`` (the
  explicit softmax's 5 a s^2 b, or the fused kernels' log-sum-exp), and the backward
  pass runs ``core_attention_flops`` (4 b s^2 q) again.
* Input activation of a pipeline stage: s b h fp16 values = 2 s b h bytes (/ t with
  sequence parallelism; 4 s b h with a float32 residual stream).
* The last stage's head: ``head_activation_bytes``.

Named presets (the paper's model sizes, two Llama shapes and Qwen3-0.6B) live in
``presets.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

MODEL_KINDS = ("gpt", "bert")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
EXPLICIT_SOFTMAX_BACKENDS = ("unfused", "local")
"""The backends that keep the s x s probabilities (the others run sdpa's kernels)."""



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
    where the counts have 2 (``residual_bytes``; the module docstring's item).  Not the
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
    def query_copy(self) -> bool:
        """The trainer's attention copies the queries out of the fused QKV output into
        head order: with 1 < G < a (G = a is one query head per group, G = 1 one group:
        both a strided view)."""
        return 1 < int(self.num_query_groups) < self.num_attention_heads  # type: ignore[arg-type]

    @property
    def keeps_scores(self) -> bool:
        """The attention keeps its s x s probabilities (--attention-backend unfused or
        local) rather than rebuilding them in the backward pass (flash/memory-efficient
        kernels)."""
        return self.attention_backend in EXPLICIT_SOFTMAX_BACKENDS

    @property
    def residual_bytes(self) -> float:
        """Bytes of one value of the residual stream: 4 with fp32_residual_connection,
        else the training dtype's 2."""
        return 4.0 if self.fp32_residual_connection else 2.0

    def sequence_shards(self, t: int) -> int:
        """Ranks a sequence is split over outside the tensor-parallel regions on t tensor
        ranks: t with sequence parallelism (each holds s / t positions), else 1 (each
        tensor rank holds the whole sequence)."""
        return t if self.sequence_parallel else 1

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

    # ---------------------------------------------------------------- activations
    def layer_activation_bytes(self, b: int, t: int = 1) -> float:
        """Bytes one layer keeps for its backward pass on one of t tensor ranks (fp16, no
        recompute; the module docstring derives each term).  With ``sequence_parallel``
        the 10 s b h tensor parallelism replicates are split over the t ranks as well."""
        h, f, s = self.hidden_size, self.ffn, self.seq_length
        q, kv = self.q_size, self.kv_size
        # the two norms' inputs (the stream), the QKV and first MLP matrices' inputs, the
        # two residual dropout masks: 10 s b h, or 14 s b h with a float32 stream
        replicated = (2.0 * self.residual_bytes + 6.0) * s * b * h / self.sequence_shards(t)
        attention = 2.0 * s * b * (q + 2 * kv) + 2.0 * s * b * q   # QKV output, context
        if self.rope or self.qk_layernorm:
            attention += 2.0 * s * b * (q + kv)     # rotated (or normalised) q and k
        if self.query_copy and (self.qk_layernorm or not self.rope):
            attention += 2.0 * s * b * q            # q copied to head order, kept
        mlp = (8.0 if self.swiglu else 4.0) * s * b * f
        return replicated + (attention + mlp + self.score_bytes(b)) / t

    def score_bytes(self, b: int) -> float:
        """What the attention kernel keeps beyond q, k, v and its output, all heads (the
        module docstring): 5 a s^2 b for the explicit softmax, a fp32 log-sum-exp per
        query head and token (4 a s b) for flash/memory-efficient attention."""
        a, s = self.num_attention_heads, self.seq_length
        return 5.0 * a * s * s * b if self.keeps_scores else 4.0 * a * s * b

    def stage_mask_bytes(self, b: int) -> float:
        """The attention mask a stage makes once per microbatch and its layers keep:
        BERT's padding mask, or GPT's document mask with ``reset_attention_mask``
        (additive fp16 for the fused kernels, bool for the explicit softmax); none for a
        causal GPT."""
        if self.kind != "bert" and not self.reset_attention_mask:
            return 0.0
        s = self.seq_length
        return (1.0 if self.keeps_scores else 2.0) * b * s * s

    def causal_mask_bytes(self) -> float:
        """The [s, s] bool causal mask the explicit softmax of a causal GPT reads (module
        docstring): s^2 bytes, made once per stage and shared by its layers and
        microbatches; none for the fused kernels (their own causal kernel), BERT, or
        ``reset_attention_mask`` (the document mask of ``stage_mask_bytes`` replaces it)."""
        if self.kind != "gpt" or self.reset_attention_mask or not self.keeps_scores:
            return 0.0
        return float(self.seq_length) ** 2

    def input_activation_bytes(self, b: int, t: int = 1) -> float:
        """Bytes of a stage's input (and output) activation on one of t tensor ranks: s b
        h fp16 values (float32 with ``fp32_residual_connection``), the rank's s / t
        positions of them with ``sequence_parallel`` (what crosses a stage boundary and
        what a stage keeps of each microbatch's input)."""
        return (self.residual_bytes * self.seq_length * b * self.hidden_size
                / self.sequence_shards(t))

    def tensor_parallel_bytes(self, b: int) -> float:
        """Bytes one tensor-parallel collective moves: the whole sequence's s b h values
        of a sublayer's (or the embedding's) output, fp16 whatever the residual stream's
        dtype."""
        return 2.0 * self.seq_length * b * self.hidden_size

    def head_activation_bytes(self, b: int, t: int = 1) -> float:
        """What the last stage keeps after its layers (module docstring's conventions:
        fp16 values, per-token statistics left out).  GPT: the final norm's input and
        output (the output layer's input, replicated on the tensor ranks), 4 s b h, and
        the logits the loss keeps, 2 s b V / t -- the trainer's cross-entropy keeps them
        in the training dtype and a log-sum-exp per token, and forms float32 values
        only chunk by chunk (megatron/tensor_parallel/cross_entropy.py).  BERT's LM
        head adds a dense layer, its GeLU and a LayerNorm before the logits: the
        inputs of those three and of the output layer plus the final norm's input,
        10 s b h.  With ``fp32_logits`` the loss keeps a float32 copy instead: 4 s b V
        / t.  The same with RMSNorm (it keeps its input, as LayerNorm) and with an
        untied output layer (the same matmul of the same normalised input).

        ``sequence_parallel``: the final norm's input is the rank's s / t positions; so
        is GPT's output-layer input (all-gathered for the matmul only): 4 s b h / t.
        BERT all-gathers the final norm's output and runs its heads on the whole
        sequence, replicated as before: 2 s b h / t + 8 s b h.  The logits do not move.

        ``fp32_residual_connection``: the final norm's input is float32, 2 s b h more
        (/ t with sequence parallelism); its output is cast to the training dtype."""
        s, h = self.seq_length, self.hidden_size
        split = self.sequence_shards(t)
        norm_input = self.residual_bytes * s * b * h / split
        if self.kind == "bert":
            hidden = norm_input + 8.0 * s * b * h
        else:
            hidden = norm_input + 2.0 * s * b * h / split
        return hidden + (4.0 if self.fp32_logits else 2.0) * s * b * self.vocab_size / t

    def layer_elementwise_bytes(self, b: int, t: int = 1) -> float:
        """Memory traffic of one layer's forward that tensor parallelism replicates:
        two LayerNorms (read + write) and two dropout + residual adds (two reads, a write
        and a mask), about 12 fp16 tensors of s b h values.  RMSNorm moves the same
        tensors; RoPE and SwiGLU's product act on per-rank heads and features, split by
        t like the matmuls, so they do not add to it.  With ``sequence_parallel`` each of
        the t ranks runs them on its s / t positions only.  With
        ``fp32_residual_connection`` the 6 tensors of the stream (the norms' inputs, the
        adds' residual inputs and outputs) are float32: 36 s b h bytes."""
        per_value = 24.0 + 6.0 * (self.residual_bytes - 2.0)
        return per_value * self.seq_length * b * self.hidden_size / self.sequence_shards(t)

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

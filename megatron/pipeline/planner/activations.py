"""Activation bytes of a ``ModelSpec``: what a layer, a stage's input and the head keep
for the backward pass, and what they move (the mixin ``ActivationBytes``).

Symbols as in ``model_spec``: ``b`` samples of ``s`` tokens per microbatch, hidden size
h, MLP width f, a attention heads of d dimensions each, q = a d, G key/value heads and
kv = G d, V the padded vocabulary, t the tensor-parallel size.

Counting conventions (all per microbatch):

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
"""
from __future__ import annotations


class ActivationBytes:
    """Mixin of ``ModelSpec``: its activation byte counts (the module docstring derives
    each term from the fields of the model's shape and run options)."""

    @property
    def query_copy(self) -> bool:
        """The trainer's attention copies the queries out of the fused QKV output into
        head order: with 1 < G < a (G = a is one query head per group, G = 1 one group:
        both a strided view)."""
        return 1 < int(self.num_query_groups) < self.num_attention_heads  # type: ignore[arg-type]

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

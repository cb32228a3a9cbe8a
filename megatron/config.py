"""Typed configuration objects.

``megatron/arguments.py`` parses Megatron's command-line flags once and turns them into
these dataclasses.  Core code (model, optimizer, pipeline, training loop) receives the
config objects it needs explicitly and never reads global arguments.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from megatron.batch_schedule import BatchSchedule

PIPELINE_SCHEDULES = ("none", "gpipe", "flush", "2bw")

GRAD_DTYPE_SUPPORTED = hasattr(torch.Tensor, "grad_dtype")
"""Whether this torch lets a parameter's gradient have another dtype (torch >= 2.10)."""


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of a GPT/BERT transformer (the whole model, not one pipeline stage)."""

    num_layers: int
    """Number of transformer blocks in the whole model."""
    hidden_size: int
    """Width of the residual stream."""
    num_attention_heads: int
    """Attention heads per block (must divide hidden_size and be divisible by TP size)."""
    ffn_hidden_size: Optional[int] = None
    """Width of the MLP; defaults to 4 * hidden_size (with swiglu: 8/3 of hidden_size,
    rounded down to a multiple of 64, as Megatron-LM)."""
    seq_length: int = 1024
    """Tokens per sample."""
    max_position_embeddings: Optional[int] = None
    """Size of the learned position table; defaults to seq_length."""
    padded_vocab_size: int = 0
    """Vocabulary size after padding to a multiple of make_vocab_size_divisible_by * TP."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Std of the normal initialiser; output projections use std / sqrt(2 * num_layers)."""
    init_method_xavier_uniform: bool = False
    """--init-method-xavier-uniform: every weight matrix init_method_std would draw
    (embeddings, the four block matrices, output projections included, as Megatron-LM)
    is drawn from U(-a, a), a = sqrt(6 / (fan_in + fan_out)) of the FULL unsharded
    matrix, so that the model does not depend on the tensor-parallel size."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon."""
    openai_gelu: bool = False
    """GELU's tanh approximation (OpenAI GPT-2, Megatron's --openai-gelu) instead of exact."""
    params_dtype: torch.dtype = torch.float32
    """dtype of the model's (compute) weights: fp32, fp16, bf16 or float64 (tests)."""
    num_tokentypes: int = 0
    """Token-type embeddings (2 for BERT, 0 for GPT)."""
    recompute_granularity: Optional[str] = None
    """None, 'full' or 'selective'.  'full' without recompute_method means the pipeline
    stage recomputes its whole forward from the stashed stage input (the paper's scheme)."""
    recompute_method: Optional[str] = None
    """'uniform' or 'block': layer-level checkpointing inside a stage (Megatron's)."""
    recompute_num_layers: Optional[int] = None
    """Layers per checkpointed chunk (uniform) or number of checkpointed layers (block)."""
    compile_layers: bool = False
    """torch.compile every transformer layer (in place: parameter names do not change)."""
    attention_backend: str = "auto"
    """--attention-backend (Megatron-LM's names): 'auto', 'flash' or 'fused' run torch's
    ``scaled_dot_product_attention``, which picks a flash or memory-efficient kernel and
    keeps no [s, s] scores for the backward; 'unfused' or 'local' compute the softmax
    explicitly and keep its probabilities (2 bytes per score in fp16/bf16, as Megatron's
    fused softmax kernel), its dropout mask and output."""
    cross_entropy_loss_fusion: bool = False
    """The language-model loss through torch.compile: fused kernels, no float32 logits in
    memory (``vocab_parallel_cross_entropy(fused=True)``)."""
    normalization: str = "LayerNorm"
    """'LayerNorm' (weight and bias) or 'RMSNorm' (weight only; Llama's)."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (a max_position_embeddings x hidden table, GPT-2's) or 'rope'
    (rotary embedding of queries and keys, no table)."""
    rotary_base: int = 10000
    """RoPE's base: the rotation of dimension pair i is position / base^(2i / rotary dims)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that RoPE rotates (GPT-NeoX rotates 0.25)."""
    rope_scaling: bool = False
    """Llama 3.1's long-context RoPE frequencies (--use-rope-scaling)."""
    rope_scaling_factor: float = 8.0
    """How many times slower the low RoPE frequencies turn with rope_scaling (3.1: 8, 3.2: 32)."""
    rotary_interleaved: bool = False
    """RoPE rotates adjacent dimension pairs (2i, 2i + 1) of a head (GPT-J's and the
    original paper's layout) instead of the pairs (i, i + r/2) of Llama's "rotate half"."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Linear position interpolation: RoPE sees position p as p / factor, so a model
    trained on n tokens covers factor * n with the angles it knows.  None: no
    interpolation (factor 1)."""
    swiglu: bool = False
    """MLP = down(silu(gate(x)) * up(x)) instead of down(gelu(up(x)))."""
    squared_relu: bool = False
    """MLP = down(relu(up(x))^2) instead of down(gelu(up(x))) (Primer's activation;
    excludes swiglu)."""
    apply_residual_connection_post_layernorm: bool = False
    """Each block's two residuals start from the LayerNorm's output instead of its input:
    y = LN(x) + attn(LN(x)), then y' = LN2(y) + mlp(LN2(y)) (the original BERT's
    residual, Megatron-LM's flag); the default is GPT-2's x + attn(LN(x))."""
    fp32_residual_connection: bool = False
    """--fp32-residual-connection (Megatron-LM's flag): with fp16/bf16 weights the
    residual stream -- the embedding output, every layer's sums, the tensor sent between
    pipeline stages and the final norm's input -- is kept in float32 (``residual_dtype``).
    The norms read it in float32 (their weights cast up) and hand the linear layers,
    the output layer and BERT's heads their output in params_dtype; a sublayer's
    params_dtype output added to the float32 stream stays float32.  With
    apply_residual_connection_post_layernorm the residual is the norm's float32 output
    (the linear layers read its params_dtype copy).  No effect in fp32/fp64 training."""
    qk_layernorm: bool = False
    """Normalise every query and key head (over its head_dim, with ``normalization``)
    before RoPE (Qwen3, OLMo 2)."""
    kv_channels: Optional[int] = None
    """Size of one attention head (--kv-channels); None: hidden_size / num_attention_heads.
    Queries, keys and values are heads x kv_channels wide, which need not be hidden_size
    (Qwen3-0.6B: 16 heads of 128 in a hidden size of 1024)."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention: key/value heads (each shared by num_attention_heads /
    num_query_groups query heads).  None: one per query head (multi-head attention)."""
    add_bias_linear: bool = True
    """Biases on the four linear layers of every block (False: --disable-bias-linear)."""
    add_qkv_bias: bool = False
    """A bias on the query/key/value projection even without add_bias_linear (Qwen2's)."""
    untie_embeddings_and_output_weights: bool = False
    """GPT's output layer has its own weight instead of the word embedding's."""
    sequence_parallel: bool = False
    """--sequence-parallel: with tensor parallelism, the activations it would replicate
    (norms, residual dropout, the linear layers' inputs, stage boundaries) are split
    along the sequence instead, s/t positions per tensor rank.  Same results up to
    rounding and dropout's draws; off (ignored) with one tensor rank."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:  # Megatron-LM's default (arguments.py's)
            self.ffn_hidden_size = (int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.num_attention_heads > 0 \
                and self.hidden_size % self.num_attention_heads == 0:
            self.kv_channels = self.hidden_size // self.num_attention_heads

    @property
    def gelu_approximate(self) -> str:
        """``approximate`` argument of ``F.gelu``."""
        return "tanh" if self.openai_gelu else "none"

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (even; the rest pass unchanged)."""
        return int(self.kv_channels * self.rotary_percent) // 2 * 2

    @property
    def residual_dtype(self) -> torch.dtype:
        """dtype of the residual stream, of a stage's output and of the input a non-first
        pipeline stage receives: float32 with fp32_residual_connection in fp16/bf16
        training, else params_dtype."""
        if self.fp32_residual_connection and self.params_dtype in (torch.float16,
                                                                   torch.bfloat16):
            return torch.float32
        return self.params_dtype

    @property
    def uses_position_table(self) -> bool:
        return self.position_embedding_type == "learned_absolute"

    @property
    def stage_recompute(self) -> bool:
        """True when the pipeline executor should recompute whole stages."""
        return self.recompute_granularity == "full" and self.recompute_method is None


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is split into tensor x pipeline x data parallel ranks."""

    world_size: int = 1
    """Total number of ranks."""
    tensor_model_parallel_size: int = 1
    """t: ranks that split each layer's matrices."""
    pipeline_model_parallel_size: int = 1
    """d: pipeline depth (stages)."""
    pipeline_schedule: str = "flush"
    """One of none, gpipe, flush, 2bw."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Transformer layers of the first stage (None: an equal share)."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Transformer layers of the last stage (None: an equal share).  The other stages
    split the remaining layers evenly."""
    tbw_mitigation: str = "none"
    """--2bw-mitigation: none, predict, dc or warmup (megatron.optimizer.staleness)."""
    tbw_flush_warmup_iters: int = 0
    """--2bw-flush-warmup-iters: batches run under flush semantics before 2BW (warmup)."""
    tbw_dc_lambda: float = 1.0
    """--2bw-dc-lambda: weight of DC-ASGD's correction g*g*(W(t) - W(t-1)) (dc)."""
    distributed_backend: Optional[str] = None
    """'gloo' or 'nccl'; None picks nccl when CUDA is available, else gloo."""
    distributed_timeout_minutes: float = 10.0
    """How long a collective or p2p op may wait before the run fails with an error."""
    command_line: Optional[dict] = field(default=None, compare=False, repr=False)
    """This rank's validated flag values (``megatron.arguments.command_line_values``),
    compared across ranks at start-up; None skips the check.  Not a setting of the run:
    ``MegatronConfig.to_dict`` (what a checkpoint records) leaves it out."""

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        """Global layer numbers of pipeline stage ``pp_rank`` (this run's stage split)."""
        from megatron.model.utils import stage_layer_numbers

        return stage_layer_numbers(num_layers, self.pipeline_model_parallel_size, pp_rank,
                                   self.decoder_first_pipeline_num_layers,
                                   self.decoder_last_pipeline_num_layers)

    @property
    def data_parallel_size(self) -> int:
        """w: number of parallel pipelines (derived from the world size)."""
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(kw_only=True)
class PrecisionConfig:
    """Mixed precision and loss scaling."""

    fp16: bool = False
    bf16: bool = False
    fp64: bool = False
    """Everything in float64 (exactness tests and debugging)."""
    loss_scale: Optional[float] = None
    """Static loss scale; None means dynamic scaling (fp16 only)."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    fp32_master_weights: bool = True
    """Keep an fp32 copy for the optimizer when the model runs in fp16/bf16."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """Gradients of fp16/bf16 weights accumulate over microbatches, are averaged over
    data-parallel replicas and summed between tied-embedding stages in float32
    (``Tensor.grad_dtype``); Megatron-LM's flag, which ``--bf16`` turns on."""

    @property
    def grad_dtype(self) -> Optional[torch.dtype]:
        """dtype the weights' gradients accumulate in (None: the weights' own)."""
        if self.accumulate_allreduce_grads_in_fp32 and (self.fp16 or self.bf16):
            return torch.float32
        return None

    @property
    def params_dtype(self) -> torch.dtype:
        if self.fp16:
            return torch.float16
        if self.bf16:
            return torch.bfloat16
        if self.fp64:
            return torch.float64
        return torch.float32


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer, learning-rate schedule and gradient clipping."""

    optimizer: str = "adam"
    """'adam' (decoupled weight decay, as Megatron) or 'sgd'."""
    lr: float = 1e-4
    min_lr: float = 0.0
    decoupled_lr: Optional[float] = None
    """Peak learning rate of the input and output layers (Megatron-LM's --decoupled-lr):
    the first stage's word embedding and the last stage's output weight (untied, or its
    copy of the tied embedding) follow the schedule's shape between this and
    ``decoupled_min_lr``; None: every parameter follows ``lr``."""
    decoupled_min_lr: Optional[float] = None
    """Floor of the decoupled schedule (None: ``min_lr``)."""
    lr_warmup_init: float = 0.0
    """Learning rate the warmup starts from (Megatron-LM's --lr-warmup-init)."""
    lr_decay_style: str = "linear"
    """constant, linear, cosine, inverse-square-root or WSD."""
    lr_wsd_decay_style: str = "exponential"
    """Shape of the WSD anneal: exponential, linear, cosine or minus_sqrt."""
    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of the WSD anneal (the last ones of the decay); WSD only."""
    lr_wsd_decay_samples: Optional[int] = None
    """With lr_schedule_unit 'samples': samples of the WSD anneal."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays; defaults to train_iters."""
    lr_warmup_iters: float = 0
    """Iterations of LR warmup: a whole number, except from --lr-warmup-fraction, which
    Megatron-LM counts in samples (0.001 of 400 iterations is 0.4 of one, not none)."""
    lr_schedule_unit: str = "iterations"
    """'samples' for a --train-samples run (Megatron's sample-based schedule): the schedule
    counts consumed samples, so it stays right when --global-batch-size changes on resume."""
    lr_decay_samples: Optional[int] = None
    """With lr_schedule_unit 'samples': samples over which the LR decays."""
    lr_warmup_samples: Optional[float] = None
    """With lr_schedule_unit 'samples': warmup samples (fractional only from
    --lr-warmup-fraction, as Megatron-LM)."""
    weight_decay: float = 0.01
    start_weight_decay: Optional[float] = None
    """Weight decay at the start of the run (Megatron-LM's --start-weight-decay; None:
    ``weight_decay``)."""
    end_weight_decay: Optional[float] = None
    """Weight decay at the end of the run (None: ``weight_decay``)."""
    weight_decay_incr_style: str = "constant"
    """constant (``weight_decay`` throughout), linear or cosine: the decay rises from
    start to end over the whole run (``megatron.optimizer.lr_scheduler``)."""
    wd_incr_samples: Optional[int] = None
    """With lr_schedule_unit 'samples': samples of the weight-decay ramp (the run's
    --train-samples; in iterations the ramp is train_iters)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    override_opt_param_scheduler: bool = False
    """On resume keep this run's LR schedule where the checkpoint's differs."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume adopt the checkpoint's LR schedule (neither flag: a difference is an error)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state (Adam moments, SGD momentum, fp32 master weights) over
    the data-parallel ranks of each stage, each flat gradient bucket cut into equal
    segments (ZeRO stage 1; ``megatron.optimizer.sharding``)."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: leave the new weights' all-gathers in flight into
    the next forward pass, whose layers wait for their own buckets
    (``megatron.pipeline.param_gather``)."""
    ddp_bucket_size: Optional[int] = None
    """Parameters per data-parallel gradient bucket (None: 32 MiB of gradients)."""


SPLIT_PATH_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")
"""Megatron-LM's per-split dataset flags (train, valid, test): ``DataConfig``'s
``train_data_path``, ``valid_data_path`` and ``test_data_path``."""


@dataclass(kw_only=True)
class DataConfig:
    """Where training data and the tokenizer come from."""

    data_path: List[str] = field(default_factory=list)
    """Dataset prefixes, optionally preceded by weights: ['0.3', 'a', '0.7', 'b']."""
    train_data_path: List[str] = field(default_factory=list)
    """Megatron-LM's per-split datasets (instead of data_path and split): each split's own
    prefixes, in data_path's forms, used whole; an empty list: that split has none."""
    valid_data_path: List[str] = field(default_factory=list)
    test_data_path: List[str] = field(default_factory=list)
    split: str = "969, 30, 1"
    data_cache_path: Optional[str] = None
    num_workers: int = 2
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None
    """--vocab-size: NullTokenizer's data ids (its end-of-document id comes on top, as in
    Megatron-LM, so it has vocab_size + 1 ids)."""
    tokenizer_vocab_size: int = 0
    """The tokenizer's vocabulary before padding, set at start-up and recorded in
    checkpoints, so converters need no tokenizer files (0: not known, e.g. a checkpoint
    saved before it was recorded)."""
    make_vocab_size_divisible_by: int = 128
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    """GPT: positions restart after every end-of-document token (megatron.data.document_masks)."""
    reset_attention_mask: bool = False
    """GPT: attention stays inside each document of a sample."""
    mock_data: bool = False
    """Use a synthetic dataset of random tokens (tests, benchmarks)."""

    @property
    def split_data_paths(self) -> Optional[Tuple[List[str], List[str], List[str]]]:
        """(train, valid, test) prefixes of --train/--valid/--test-data-path, or None
        when none was given (data_path and split describe the data)."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(paths) else None

    def describe_split(self, s: int) -> str:
        """Where split ``s`` (0 train, 1 valid, 2 test) comes from, as flags, for
        messages: "--split '...', --data-path ..." or "--valid-data-path ..."."""
        if self.split_data_paths is None:
            return f"--split '{self.split}', --data-path {' '.join(self.data_path) or '-'}"
        flag = SPLIT_PATH_FLAGS[s]
        paths = self.split_data_paths[s]
        return f"{flag} {' '.join(paths)}" if paths else f"no {flag}"


@dataclass(frozen=True)
class TensorBoardOptions:
    """Which TensorBoard scalars a run writes: Megatron-LM's flags, with its defaults.

    ``log_interval`` (--tensorboard-log-interval): the per-iteration scalars (losses,
    learning-rate, batch-size, loss-scale, world-size, grad-norm, num-zeros, params-norm,
    weight-decay, mem-*, the per-phase timers) are written on iterations divisible by it.
    iteration-time and throughput go with the log line (--log-interval) and the
    validation scalars with each evaluation, as in Megatron-LM.
    ``queue_size`` (--tensorboard-queue-size): SummaryWriter's max_queue.
    ``timers`` (--log-timers-to-tensorboard): iteration-time, throughput and the
    per-phase times (``megatron.training_log.PHASE_TIMERS``).  ``batch_size``,
    ``world_size``, ``memory``, ``validation_ppl``: their scalars, off by default;
    ``learning_rate`` and ``loss_scale``: on by default (--no-log-...-to-tensorboard)."""

    log_interval: int = 1
    queue_size: int = 1000
    timers: bool = False
    batch_size: bool = False
    learning_rate: bool = True
    loss_scale: bool = True
    validation_ppl: bool = False
    memory: bool = False
    world_size: bool = False


@dataclass(frozen=True)
class ProfileOptions:
    """Megatron-LM's --profile window (``megatron.profiling.StepProfiler``): batches
    ``start`` <= t < ``end`` on global ``ranks``; ``pytorch``: torch.profiler traces under
    ``trace_dir``, else (CUDA) cudaProfilerStart/Stop with NVTX ranges for nsys."""

    start: int = 10
    end: int = 12
    ranks: Tuple[int, ...] = (0,)
    pytorch: bool = False
    trace_dir: Optional[str] = None


@dataclass(kw_only=True)
class TrainingConfig:
    """Batches, length of training, logging, evaluation and checkpoints."""

    calculate_per_token_loss: bool = False
    """GPT: mean over every loss token of the global batch (PipelineEngine.per_token_loss)."""

    micro_batch_size: int = 1
    global_batch_size: int = 1
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    batch_schedule: Optional[Tuple[Tuple[int, int], ...]] = None
    """(first consumed sample, global batch size) points of --rampup-batch-size or
    --step-batch-size-schedule (see megatron.batch_schedule); None: --global-batch-size
    throughout."""
    batch_schedule_source: str = ""
    seed: int = 1234
    data_parallel_random_init: bool = False
    """Data-parallel replica r seeds its dropout with seed + 10 r (Megatron-LM's flag);
    off: every replica draws the same masks.  Weights are identical either way."""
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: Optional[int] = None
    tensorboard_dir: Optional[str] = None
    tensorboard: TensorBoardOptions = field(default_factory=TensorBoardOptions)
    """Which scalars --tensorboard-dir gets (Megatron-LM's selection flags)."""
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    allow_unsafe_checkpoint: bool = False
    """Load old pickle (.pt) checkpoints, with torch.load(weights_only=True)."""
    skip_train: bool = False
    timeline_file: Optional[str] = None
    """Write every rank's traced pipeline actions to this JSON file (rank suffix added)."""
    max_consecutive_skipped_steps: int = 10
    """Stop the run after this many skipped (non-finite) steps in a row; 0: never."""
    exit_signal_handler: bool = False
    """SIGTERM: drain at the next batch boundary, save (with --save) and exit 0."""
    log_num_zeros_in_grad: bool = False
    """Count the zero gradient elements of every step (one more reduction per tensor)."""
    log_params_norm: bool = False
    """Log the norm of the weights each step's gradients were computed with (one more
    norm per tensor, summed in the optimizer's agreement: no extra collective)."""
    exit_duration_in_mins: Optional[float] = None
    """Once this many minutes have passed since the process started: stop at the next
    batch boundary every rank agrees on, save (with --save) and exit 0."""
    measure_memory_interval: int = 0
    """Saved-tensor hooks count the stash on batches divisible by this (0: only the first
    batch of each training segment; the counts of later batches are replayed, exactly)."""
    profile: Optional[ProfileOptions] = None
    """--profile: the profiled batches and ranks; None: no profiling."""
    manual_gc: bool = False
    """Python's automatic garbage collection off while training; collections at the same
    iterations on every rank instead (``megatron.manual_gc``)."""
    manual_gc_interval: int = 0
    """With manual_gc: a full collection after every this many iterations (0: none)."""
    manual_gc_eval: bool = True
    """With manual_gc: collect before and after each evaluation."""
    host_malloc_tuning: bool = True
    """CPU ranks: glibc's malloc keeps freed memory for reuse (megatron.initialize.
    tune_host_malloc); False leaves glibc's defaults."""

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Microbatches per batch of --global-batch-size (the end of any ramp-up)."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)

    def batch_sizes(self) -> Optional["BatchSchedule"]:
        """The changing batch size, or None when it is --global-batch-size throughout."""
        if self.batch_schedule is None:
            return None
        from megatron.batch_schedule import BatchSchedule
        return BatchSchedule(tuple(tuple(p) for p in self.batch_schedule),
                             self.batch_schedule_source)

    def batch_size_at(self, consumed_samples: int) -> int:
        """Global batch size of the iteration that starts after ``consumed_samples``."""
        schedule = self.batch_sizes()
        return (schedule.batch_size_at(consumed_samples) if schedule is not None
                else self.global_batch_size)

    def samples_after(self, iterations: int, consumed_samples: int) -> int:
        """Consumed samples after ``iterations`` more batches."""
        schedule = self.batch_sizes()
        return (schedule.samples_after(iterations, consumed_samples) if schedule is not None
                else consumed_samples + iterations * self.global_batch_size)


@dataclass(kw_only=True)
class MegatronConfig:
    """Everything, grouped; built once by arguments.py."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            out[f.name] = {k: (str(v) if isinstance(v, torch.dtype) else v)
                           for k, v in dataclasses.asdict(sub).items()
                           if k != "command_line"}
        return out

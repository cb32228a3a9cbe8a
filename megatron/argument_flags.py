"""The training flags (Megatron's names), one argparse group per concern.

``add_arguments(parser)`` adds every group to ``megatron.arguments.build_parser``'s
parser; the values are checked by ``megatron.argument_checks`` and turned into typed
configs by ``megatron.argument_configs``.  The choices of the flags that name a kind
(schedules, tokenizers, LR decay styles, attention backends) are the lists of the
modules that implement them.
"""
from __future__ import annotations

import argparse

from megatron.config import PIPELINE_SCHEDULES
from megatron.model.transformer import ATTENTION_BACKENDS
from megatron.optimizer.lr_scheduler import DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES
from megatron.optimizer.staleness import MITIGATIONS
from megatron.tokenizer.tokenizer import TOKENIZER_TYPES


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model", "size and initialisation of the transformer")
    g.add_argument("--num-layers", type=int, default=None, help="Transformer blocks in the whole model.")
    g.add_argument("--hidden-size", type=int, default=None, help="Width of the residual stream.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Width of the MLP (default: 4 x --hidden-size).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Attention heads per block.")
    g.add_argument("--seq-length", type=int, default=None, help="Tokens per sample.")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Size of the position-embedding table (default: --seq-length).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this x tensor-parallel size.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on residual branches.")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="Dropout on attention probabilities.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal initialiser.")
    g.add_argument("--init-method-xavier-uniform", action="store_true",
                   help="Draw every weight matrix (embeddings and output projections "
                        "included) from Xavier/Glorot's uniform distribution over the whole "
                        "unsharded matrix instead of N(0, --init-method-std^2).")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon",
                   type=float, default=1e-5,
                   help="Epsilon of LayerNorm / RMSNorm (--norm-epsilon: Megatron-LM's newer "
                        "name).")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm",
                   help="Normalisation of every block and the final one: LayerNorm (GPT-2, "
                        "BERT) or RMSNorm (Llama; weight only).")
    _add_position_args(g)
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLP: down(silu(gate(x)) * up(x)), the h -> ffn projection "
                        "doubled to [gate; up] (Llama).  --ffn-hidden-size then defaults to "
                        "Megatron-LM's 8/3 x --hidden-size rounded down to a multiple of 64.")
    g.add_argument("--squared-relu", action="store_true",
                   help="MLP activation relu(x)^2 instead of GeLU (not with --swiglu).")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="Take each residual from the LayerNorm's output instead of its "
                        "input, around both the attention and the MLP.")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="Normalise each query and key head over its dimensions (with "
                        "--normalization), before RoPE (Qwen3).")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Size of one attention head (default: --hidden-size / "
                        "--num-attention-heads); queries, keys and values are heads x this "
                        "wide (Qwen3-0.6B: 16 heads of 128 in a hidden size of 1024).")
    g.add_argument("--group-query-attention", action="store_true",
                   help="Grouped-query attention: --num-query-groups key/value heads, each "
                        "shared by --num-attention-heads / --num-query-groups query heads.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Key/value heads with --group-query-attention (must divide "
                        "--num-attention-heads and be divisible by "
                        "--tensor-model-parallel-size).")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="No biases on the four linear layers of every block (Llama).")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="Keep the query/key/value projection's bias with "
                        "--disable-bias-linear (Qwen2).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Give GPT's output layer its own weight instead of the word "
                        "embedding's (Llama; more parameters on the last stage).")
    g.add_argument("--openai-gelu", action="store_true",
                   help="Use GELU's tanh approximation, as OpenAI's GPT-2 weights (transformers' "
                        "'gelu_new'); default: exact GELU.")
    g.add_argument("--compile-layers", action="store_true",
                   help="torch.compile each transformer layer (opt-in; the first batch pays "
                        "the compilation, minutes on a CPU).")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   default="auto",
                   help="auto, flash, fused: torch's scaled_dot_product_attention, which picks "
                        "flash attention or the memory-efficient kernel for the device (it keeps "
                        "no seq x seq scores); unfused, local: the explicit softmax, which keeps "
                        "the attention probabilities, their dropout mask and output per layer.")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Compute the language-model loss with torch.compile'd kernels that "
                        "never write float32 logits to memory (opt-in; compiles on the first "
                        "batch; the gradient needs a second logits-sized buffer).")


def _add_position_args(g: argparse._ArgumentGroup) -> None:
    """The model group's position flags: a learned table or RoPE and its variants."""
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default="learned_absolute",
                   help="learned_absolute: a --max-position-embeddings x --hidden-size table "
                        "(GPT-2); rope: rotary embedding of queries and keys, no table (Llama).")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type",
                   action="store_const", const="rope",
                   help="Megatron-LM's older switch for --position-embedding-type rope.")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="Megatron-LM's switch that drops the learned position table: accepted "
                        "with RoPE, which has none (a model without positions is not built).")
    g.add_argument("--rotary-base", type=int, default=10000,
                   help="RoPE base (Llama 2: 10000, Llama 3: 500000).")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's dimensions RoPE rotates (the rest pass "
                        "unchanged; GPT-NeoX: 0.25).")
    g.add_argument("--use-rope-scaling", dest="rope_scaling", action="store_true",
                   help="Llama 3.1's long-context RoPE: frequencies slower than the 8192-token "
                        "context turn --rope-scaling-factor times slower (blended between "
                        "8192/4 and 8192 tokens of wavelength).")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="With --use-rope-scaling: 8 (Llama 3.1) or 32 (Llama 3.2).")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates adjacent dimension pairs (2i, 2i+1) of each head (GPT-J "
                        "style) instead of the pairs (i, i + half) of Llama's rotate-half.")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="Linear position interpolation for RoPE: positions are divided by "
                        "this factor (>= 1) before rotating, stretching the trained context "
                        "that many times.")


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("batches", "batch sizes and length of training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="Samples per microbatch on one pipeline (b).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step over all pipelines "
                        "(default: --micro-batch-size x data-parallel size).")
    g.add_argument("--train-iters", type=int, default=None, help="Optimizer steps to train for.")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Samples to train on (alternative to --train-iters).")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Grow the global batch from START to --global-batch-size in steps "
                        "of INCREMENT spread evenly over the first SAMPLES training samples "
                        "(Megatron-LM's GPT-3 scripts).  With --train-samples the run and its "
                        "LR schedule count samples; with --train-iters, iterations.")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="'T:B T:B ...'",
                   help="Global batch B from T consumed tokens on (samples without "
                        "--seq-length); T may end in K, M, B or T; the first T is 0, the last "
                        "B is the global batch size (Megatron-LM's; counted as "
                        "--rampup-batch-size is).")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism", "how ranks split into tensor x pipeline x data")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="Ranks that split each layer's matrices (t).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="With t > 1: split the activations tensor parallelism replicates "
                        "(norms, residual dropout, the linear layers' inputs, the tensors "
                        "between pipeline stages) along the sequence, s/t positions per "
                        "tensor rank (Korthikanti et al., 2022).  Same communication volume "
                        "(all-gather + reduce-scatter for each all-reduce); those "
                        "activations take 1/t of the memory.  Ignored with t = 1.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="Pipeline depth d: number of stages.  The data-parallel width w "
                        "(parallel pipelines) is world size / (t x d).")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Transformer layers on the first pipeline stage (default: an equal "
                        "share).  The first stage also runs the embedding; giving it fewer "
                        "layers balances the stages.  tools/plan.py prints a choice.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Transformer layers on the last pipeline stage (default: an equal "
                        "share); it also runs the LM head and the loss.  The other stages "
                        "split the remaining layers evenly.")
    g.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend (default: nccl with CUDA, else gloo).")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="How long a collective may wait before the run fails.")


def _add_pipeline_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline", "pipeline schedule (PipeDream-2BW paper)")
    g.add_argument(
        "--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="flush",
        help="none: inter-layer model parallelism without pipelining, one microbatch in "
             "flight at a time (the paper's baseline).  gpipe: GPipe, all m forwards then "
             "all m backwards, then a flush and one update; stashes activations of all m "
             "microbatches.  flush: PipeDream-Flush (1F1B with a flush per batch, "
             "Megatron's schedule): same semantics as gpipe, at most d microbatches "
             "stashed.  2bw: PipeDream-2BW, 1F1B without flushes and two weight versions "
             "per stage; updates use a 1-stale gradient, W(t+1) = W(t) - lr * grad f(W(t-1)); "
             "needs m >= d microbatches per batch.  With --pipeline-model-parallel-size 1 "
             "every schedule runs without a pipeline.")
    g.add_argument(
        "--2bw-mitigation", dest="tbw_mitigation", choices=MITIGATIONS, default="none",
        help="Opt-in correction of 2BW's 1-stale update that keeps its schedule and two "
             "weight buffers (needs --pipeline-schedule 2bw; docs/pipeline.md has the "
             "measurements).  predict: each batch runs on the optimizer's prediction of "
             "the weights its gradient is applied to (the next update with a zero "
             "gradient).  dc: delay-compensated gradient g + lambda*g*g*(W(t) - W(t-1)) "
             "(DC-ASGD).  warmup: flush semantics for the first --2bw-flush-warmup-iters "
             "iterations, then 2BW.")
    g.add_argument("--2bw-flush-warmup-iters", dest="tbw_flush_warmup_iters", type=int,
                   default=None,
                   help="Iterations run with flush semantics before 2BW starts "
                        "(--2bw-mitigation warmup; default half of the run's iterations, "
                        "--train-iters or those --train-samples gives: a tenth "
                        "left 2BW's loss gap almost whole, half ended within 1%% of "
                        "Flush's loss, docs/pipeline.md).")
    g.add_argument("--2bw-dc-lambda", dest="tbw_dc_lambda", type=float, default=1.0,
                   help="Weight lambda of the delay compensation (--2bw-mitigation dc).")


def _add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("precision", "mixed precision and loss scaling")
    g.add_argument("--fp16", action="store_true", help="Run the model in float16 with loss scaling.")
    g.add_argument("--bf16", action="store_true", help="Run the model in bfloat16.")
    g.add_argument("--fp64", action="store_true",
                   help="float64 everywhere (exactness tests and debugging).")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale (fp16); default: dynamic scaling.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="Starting value of the dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Floor of the dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="Steps without overflow before the dynamic scale doubles.")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="Overflows tolerated before the dynamic scale halves.")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Accumulate the fp16/bf16 weights' gradients over microbatches, "
                        "and all-reduce them, in float32 (on by default with --bf16, as in "
                        "Megatron-LM; needs torch >= 2.10 for Tensor.grad_dtype).")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="With --fp16/--bf16, keep the residual stream (embedding output, "
                        "layer sums, the tensors between pipeline stages) in float32; the "
                        "norms compute in float32 and hand the linear layers fp16/bf16. "
                        "No effect in fp32.")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Optimizer.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard the optimizer state (moments and fp32 master weights) over the "
                        "data-parallel replicas of each stage, each gradient bucket cut into "
                        "equal segments (ZeRO-1): gradients are reduce-scattered and the new "
                        "weights all-gathered after each step.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="With --use-distributed-optimizer: leave the all-gathers of the new "
                        "weights in flight after the step; each transformer layer of the next "
                        "forward pass waits only for the buckets holding its own weights.")
    g.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                   help="Parameters (elements) per data-parallel gradient bucket (default: "
                        "32 MiB of gradients). Smaller buckets start their reduction, and "
                        "with --overlap-param-gather their weight gathers, in finer steps.")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate (required to train).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Floor of the decayed learning rate.")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Peak learning rate of the input and output layers (the word "
                        "embedding and the output layer, or the tied embedding on both "
                        "ends), on the schedule of --lr: same warmup, decay style and "
                        "length. Other parameters follow --lr (Megatron-LM's flag).")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Floor of the decayed --decoupled-lr (default: --min-lr).")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear",
                   help="Learning-rate decay after warmup (inverse-square-root: max_lr * "
                        "sqrt(warmup / step); WSD: constant, then an anneal over the last "
                        "--lr-wsd-decay-iters of the decay).")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential",
                   help="Shape of the WSD anneal to --min-lr.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="Iterations of the WSD anneal, the last ones of the decay.")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="Samples of the WSD anneal (alternative to --lr-wsd-decay-iters).")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations over which the LR decays (default: --train-iters).")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples over which the LR decays (alternative to --lr-decay-iters).")
    g.add_argument("--lr-warmup-iters", type=int, default=None, help="Linear warmup iterations.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warmup as a fraction of the LR decay iterations.")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="Linear warmup in samples.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="Learning rate the linear warmup starts from, up to --lr (and "
                        "--decoupled-lr).")
    sched = g.add_mutually_exclusive_group()
    sched.add_argument("--override-opt_param-scheduler", action="store_true",
                       help="On --load, keep this run's learning-rate schedule (--lr, --min-lr, "
                            "--decoupled-lr, --decoupled-min-lr, warmup, decay length and "
                            "style) and weight decay (--weight-decay, --start-weight-decay, "
                            "--end-weight-decay, --weight-decay-incr-style) where it differs "
                            "from the "
                            "checkpoint's.  Without this or the next flag a difference is an "
                            "error (as in Megatron-LM).")
    sched.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                       help="On --load, take the checkpoint's learning-rate schedule and "
                            "weight decay.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="Weight decay at the start of the run (--weight-decay-incr-style "
                        "linear or cosine; default: --weight-decay).")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="Weight decay at the end of the run (default: --weight-decay).")
    g.add_argument("--weight-decay-incr-style", choices=WD_INCR_STYLES, default="constant",
                   help="How the weight decay goes from --start-weight-decay to "
                        "--end-weight-decay over the run: constant (--weight-decay "
                        "throughout), linear or cosine (Megatron-LM's).")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="Clip the global gradient norm to this value (0 disables).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    g.add_argument("--seed", type=int, default=1234, help="Random seed.")
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="Give each data-parallel replica its own dropout stream (seed + "
                        "10 x replica), as Megatron-LM's flag does; without it every "
                        "replica draws the same masks. Weights start identical either "
                        "way (each tensor is drawn from a key of seed, layer and name).")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="GPT: the loss (and its gradient) is the mean over every loss token "
                        "of the global batch, not the mean of per-microbatch means; "
                        "microbatches with more tokens (see --eod-mask-loss) weigh more.")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoints.")
    g.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer state.")
    g.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", help="Do not load RNG state.")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take the model's shape and tokenizer flags that the command line "
                        "does not give from the --load checkpoint's recorded config (read "
                        "from JSON: no tensors, no pickle).")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="With --load: stop with an error when the directory holds no "
                        "checkpoint, instead of training from initialised weights (a "
                        "mistyped path).")
    g.add_argument("--finetune", action="store_true",
                   help="Load only model weights and restart the iteration count at 0.")
    g.add_argument("--allow-unsafe-checkpoint", action="store_true",
                   help="Also load checkpoints in the old pickle (.pt) format (weights-only "
                        "unpickler with an allow-list); only for files you trust.")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    g.add_argument("--eval-iters", type=int, default=100, help="Batches per evaluation.")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Exit after an iteration divisible by this (drains the pipeline first).")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="Write TensorBoard logs here.")
    # Megatron-LM's selection of TensorBoard scalars (megatron/training_log.py writes them)
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="Write the per-iteration TensorBoard scalars (losses, learning rate, "
                        "loss scale, grad norm, ...) on iterations divisible by this.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000,
                   help="Events the TensorBoard writer queues before an add forces a flush "
                        "to disk (SummaryWriter's max_queue).")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Also write iteration-time, throughput and the per-phase times of the "
                        "logging rank's pipeline actions (forward-compute-time, "
                        "backward-compute-time, ..., optimizer-time).")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="Also write the global batch size (batch-size).")
    g.add_argument("--no-log-learning-rate-to-tensorboard", "--no-log-learnig-rate-to-tensorboard",
                   dest="log_learning_rate_to_tensorboard", action="store_false",
                   help="Do not write learning-rate (nor decoupled-learning-rate).  The second "
                        "spelling is Megatron-LM's own.")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", help="Do not write loss-scale.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Also write the validation perplexity ('lm loss validation ppl').")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Also write torch.cuda's memory counters (mem-reserved-bytes, "
                        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count); "
                        "a CPU run writes none and says so once.")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="Also write the number of ranks (world-size).")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="Count the zero gradient elements of each step over the model "
                        "replica (each parameter once) and log them as 'num zeros'.")
    g.add_argument("--log-params-norm", action="store_true",
                   help="Log the L2 norm of the weights each step's gradients were computed "
                        "with (under 2BW the previous version) as 'params norm'.")
    g.add_argument("--timeline-file", type=str, default=None,
                   help="Write traced pipeline actions as JSON (one file per rank) for "
                        "tools/draw_timeline.py: every action of the run, kept in memory "
                        "until its end, so meant for short runs; --profile traces a window "
                        "of a long one.")
    g.add_argument("--measure-memory-interval", type=int, default=0,
                   help="Count stashed activations with saved-tensor hooks on every batch "
                        "divisible by this (1: every batch); default 0: only the first batch "
                        "the run trains, later batches reuse its exact counts.")
    g.add_argument("--no-host-malloc-tuning", dest="host_malloc_tuning", action="store_false",
                   help="Leave glibc's malloc settings alone on CPU ranks.  By default a CPU "
                        "rank keeps freed memory for the next microbatch (mallopt: trim "
                        "threshold 1 GiB, mmap threshold 32 MiB) instead of faulting it in "
                        "again every step, about 10%% of a small model's forward.")
    g.add_argument("--skip-train", action="store_true", help="Only evaluate; do not train.")
    g.add_argument("--debug", action="store_true",
                   help="Show the traceback of user errors (bad flag, data, checkpoint) too; "
                        "same as MEGATRON_DEBUG=1.")


def _add_fault_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("faults", "non-finite steps and scheduler signals")
    g.add_argument("--max-consecutive-skipped-steps", type=int, default=10,
                   help="Stop the run with an error after this many optimizer steps in a row "
                        "were skipped for non-finite loss or gradients (fp16 overflow skips "
                        "count once a step has been applied).  0 disables the limit.  Under "
                        "2bw the check runs at pipeline drains, at least every 100 batches.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM finish the current batch, save a checkpoint (with --save) "
                        "and exit 0, as schedulers such as SLURM expect.  All ranks agree on "
                        "the signal at a batch boundary: after every batch, or about every "
                        "20 s of training under 2bw (each check drains its pipeline).")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Once this many minutes have passed since the process started, "
                        "stop at the next batch boundary all ranks agree on (as for "
                        "--exit-signal-handler), save a checkpoint (with --save) and exit 0: "
                        "set it below a scheduler's time limit.")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefixes (prefix.bin + prefix.idx), optionally weighted: "
                        "'0.3 a 0.7 b'.")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"Megatron-LM's per-split data: the {split} split's own prefixes "
                            f"(the --data-path forms), each used whole; replaces --data-path "
                            f"and --split." + (" Without it there is no evaluation."
                                               if split == "valid" else ""))
    g.add_argument("--mock-data", action="store_true",
                   help="Train on synthetic random tokens (no data files).")
    g.add_argument("--split", type=str, default="969, 30, 1",
                   help="Train, validation, test proportions, comma separated.")
    g.add_argument("--data-cache-path", type=str, default=None, help="Where to cache dataset indices.")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    g.add_argument("--vocab-file", type=str, default=None, help="Tokenizer vocabulary file.")
    g.add_argument("--merge-file", type=str, default=None, help="BPE merges file.")
    g.add_argument("--vocab-size", type=int, default=None, help="Vocabulary size for NullTokenizer.")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None, help="Tokenizer.")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="SentencePiece model file; for HuggingFaceTokenizer a tokenizer "
                        "directory (save_pretrained's) or a model name.")
    g.add_argument("--eod-mask-loss", action="store_true", help="Do not train on end-of-document tokens.")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="GPT: restart the position ids at 0 after every end-of-document "
                        "token of a sample.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="GPT: a token attends only to the earlier tokens of its own "
                        "document (end-of-document tokens end a document); costs a "
                        "[micro-batch, seq, seq] mask per microbatch and stage.")


def _add_recompute_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation recomputation")
    g.add_argument("--recompute-activations", action="store_true",
                   help="The paper's activation recomputation: each pipeline stage stashes only "
                        "its input and recomputes its whole forward pass before the backward "
                        "(same as --recompute-granularity full without --recompute-method).")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute whole layers/stages; selective: only attention internals.")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="Layer-level checkpointing inside a stage (needs --recompute-granularity "
                        "full): uniform chunks, or the first N layers of each stage.")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="Layers per chunk (uniform) or checkpointed layers per stage (block).")


def _add_profile_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profiling and jitter",
                                  "Megatron-LM's profiler window (megatron/profiling.py) and "
                                  "manual garbage collection")
    g.add_argument("--profile", action="store_true",
                   help="Profile batches --profile-step-start to --profile-step-end - 1 on "
                        "--profile-ranks: with --use-pytorch-profiler, torch.profiler writes "
                        "a trace per rank under --profile-dir or --tensorboard-dir; without "
                        "it (CUDA only) "
                        "the window is cudaProfilerStart/Stop with NVTX ranges, for nsys "
                        "profile --capture-range=cudaProfilerApi.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="With --profile: torch.profiler (CPU and CUDA activity, shapes, "
                        "stacks), a Chrome/TensorBoard trace per profiled rank.")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="First profiled batch (0-based iteration, as in the log).")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="Profiling stops once this many batches are done (exclusive).")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], metavar="RANK",
                   help="Global ranks that profile (default: 0).")
    g.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="Where --use-pytorch-profiler writes its traces (default: "
                        "--tensorboard-dir, Megatron-LM's place; this one needs no "
                        "tensorboard package).")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's automatic garbage collection off while training and "
                        "collect after the same iterations on every rank instead "
                        "(--manual-gc-interval, evaluations), not whenever one rank's "
                        "allocation counters say.")
    g.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                   help="With --manual-gc: collect after every N iterations (0: only around "
                        "evaluations).")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="With --manual-gc: do not collect before and after each evaluation.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the trainer's flag groups to ``parser``, in ``--help`` order."""
    for add in (_add_model_args, _add_batch_args, _add_parallel_args, _add_pipeline_args,
                _add_precision_args, _add_optimizer_args, _add_checkpoint_args,
                _add_logging_args, _add_data_args, _add_recompute_args, _add_fault_args,
                _add_profile_args):
        add(parser)

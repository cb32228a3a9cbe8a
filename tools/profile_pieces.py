"""The pieces and stages tools/profile_model.py times, run as the trainer runs them: the
first stage's embedding (``EmbeddingPiece``), the last stage's head and loss
(``HeadPiece``), a chain of transformer layers (``profile_pieces``) and whole
``GPTModel`` stages through ``pretrain_gpt.forward_step`` (``profile_stages``), on
microbatches ``pretrain_gpt.get_batch`` builds (``make_batch``; the document masks of
--reset-attention-mask under ``document_task``)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.pipeline.planner.measure import (measure, trainer_grad_dtype,
                                               weight_storage_ptrs, widen_grads)

# the end-of-document id of the profiled batches with --reset-attention-mask (any id:
# only the number of documents a sample holds could change a cost, not which id ends them)
EOD = 0
# stage kind -> (pre_process, post_process) of the GPTModel stage timed whole
STAGE_KINDS = {"whole": (True, True), "first": (True, False), "middle": (False, False),
               "last": (False, True)}


class EmbeddingPiece(nn.Module):
    """First-stage piece: tokens of a microbatch -> [s, b, h] (the model's Embedding)."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        super().__init__()
        from megatron.model.language_model import Embedding
        from megatron.tensor_parallel import TPInfo
        self.embedding = Embedding(config, TPInfo.single(), seed=seed)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.embedding(batch["tokens"], batch["position_ids"])


class HeadPiece(nn.Module):
    """Last-stage piece: final norm -> logits (tied word embedding, or the untied output
    layer) -> per-token cross-entropy -> ``pretrain_gpt.loss_func``, the same calls
    ``GPTModel`` makes."""

    def __init__(self, config: ModelConfig, seed: int = 1234) -> None:
        super().__init__()
        from megatron.model.language_model import embedding_init_key
        from megatron.model.transformer import fp32_residual, layer_norm
        from megatron.tensor_parallel import ColumnParallelLinear, TPInfo, init_method_normal
        # the final norm reads the residual stream (in float32 with a float32 stream) and
        # hands the output layer its output in params_dtype, as ``ParallelTransformer``
        self.final_layernorm = layer_norm(config, stream=True)
        self.compute_dtype = config.params_dtype if fp32_residual(config) else None
        self.fused = config.cross_entropy_loss_fusion
        self.word_embeddings: Optional[nn.Parameter] = None
        self.output_layer: Optional[nn.Module] = None
        if config.untie_embeddings_and_output_weights:
            # GPTModel's own output layer: a head weight of the last stage
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, tp=TPInfo.single(), bias=False,
                init_method=init_method_normal(config.init_method_std),
                params_dtype=config.params_dtype,
                init_key=embedding_init_key(seed).child("output_layer"))
        else:
            # Stands for the word embedding (first stage's or the last stage's tied
            # copy); it is not counted as a head weight (see ``tied_embedding_*``).
            self.word_embeddings = nn.Parameter(
                torch.randn(config.padded_vocab_size, config.hidden_size,
                            dtype=config.params_dtype) * config.init_method_std)

    def own_parameters(self) -> List[nn.Parameter]:
        own = list(self.final_layernorm.parameters())
        return own + (list(self.output_layer.parameters()) if self.output_layer else [])

    def forward(self, hidden: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        from megatron.model.language_model import parallel_lm_logits
        from megatron.tensor_parallel import TPInfo, vocab_parallel_cross_entropy
        from pretrain_gpt import loss_func
        tp = TPInfo.single()
        normed = self.final_layernorm(hidden)
        if self.compute_dtype is not None:
            normed = normed.to(self.compute_dtype)
        if self.output_layer is not None:
            logits, _ = self.output_layer(normed)
        else:
            logits = parallel_lm_logits(normed, self.word_embeddings, tp)
        losses = vocab_parallel_cross_entropy(logits, batch["labels"].transpose(0, 1), tp,
                                              inplace_backward=True, fused=self.fused)
        loss, _ = loss_func(batch["loss_mask"], losses.transpose(0, 1).contiguous())
        return loss


def sample_text(config: ModelConfig, b: int, generator: torch.Generator) -> torch.Tensor:
    """b samples of s+1 token ids as the data loader hands them over, each cut by a few
    end-of-document ids (``EOD``: every quarter of a sample, at a per-sample offset) into
    documents, which only --reset-attention-mask reads."""
    s = config.seq_length
    text = torch.randint(0, config.padded_vocab_size, (b, s + 1), generator=generator)
    step = max(2, (s + 1) // 4)
    for i in range(b):
        text[i, (step // 2 + i) % step::step] = EOD
    return text


def make_batch(config: ModelConfig, b: int, device: torch.device,
               generator: torch.Generator) -> Dict[str, torch.Tensor]:
    """A microbatch as ``pretrain_gpt.get_batch`` builds it from b samples of s+1 ids
    (with ``document_task(True)`` in effect, its document mask too)."""
    from pretrain_gpt import get_batch
    return get_batch({"text": sample_text(config, b, generator)}, device)


@contextlib.contextmanager
def document_task(reset_attention_mask: bool) -> Iterator[None]:
    """``pretrain_gpt.GPTTask``'s document-boundary settings as the trainer sets them for
    --reset-attention-mask (positions and the loss mask as without the flag), or with no
    boundary flag; the previous settings are restored afterwards."""
    from pretrain_gpt import GPTTask
    keys = ("eod", "eod_mask_loss", "reset_position_ids", "reset_attention_mask")
    saved = {k: getattr(GPTTask, k) for k in keys}
    GPTTask.eod = EOD if reset_attention_mask else None
    GPTTask.eod_mask_loss = GPTTask.reset_position_ids = False
    GPTTask.reset_attention_mask = reset_attention_mask
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(GPTTask, k, v)


def profile_pieces(config: ModelConfig, blocks: nn.ModuleList, embedding: nn.Module,
                   head: HeadPiece, micro_batch_sizes: Sequence[int], device: torch.device,
                   warmup: int, repeat: int, per_sync: int, seed: int) -> List[Dict[str, Any]]:
    """One row per microbatch size: the chain of ``blocks`` (per block), the embedding
    and the head measured on batches of ``make_batch`` (the document settings in effect:
    ``document_task``)."""
    from megatron.model.transformer import RotaryEmbedding
    dtype, s, h = config.params_dtype, config.seq_length, config.hidden_size
    # the residual stream: the blocks' input and output, the embedding's output and the
    # head's input (float32 with --fp32-residual-connection), and their gradients
    stream = config.residual_dtype
    stream_bytes = torch.empty((), dtype=stream).element_size()
    # RoPE's cos/sin tables, made once as a stage makes them for all its layers (in
    # params_dtype, whatever the stream's): left out of the block count (as weights are)
    # and recorded once per stage instead
    rotary = (RotaryEmbedding(config)(s, device, dtype)
              if config.position_embedding_type == "rope" else None)
    rotary_ptrs = {t.untyped_storage().data_ptr() for t in rotary} if rotary else set()
    rotary_bytes = sum(t.untyped_storage().nbytes() for t in rotary) if rotary else 0
    core = blocks[0].self_attention.core_attention

    def run_blocks(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        for layer in blocks:
            x = layer(x, mask, rotary)
        return x

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in sorted(set(int(x) for x in micro_batch_sizes)):
        batch = make_batch(config, b, device, gen)
        # the attention mask as a stage makes it from the batch's for all its layers:
        # causal, the explicit softmax's one [s, s] bool tensor shared by every
        # microbatch (none for the fused kernels); with --reset-attention-mask the
        # microbatch's document mask, [b, 1, s, s] (bool for the explicit softmax,
        # additive in params_dtype for the fused kernels).  Left out of the block count
        # like the tables: the profile records what it measured, and the planner
        # charges that once per stage
        mask = core.prepare_mask(batch["attention_mask"], dtype, s, device)
        mask_ptrs = {mask.untyped_storage().data_ptr()} if mask is not None else set()
        x = torch.randn(s, b, h, dtype=stream, device=device, requires_grad=True)
        grad = torch.randn(s, b, h, dtype=stream, device=device)

        def push(out: torch.Tensor) -> None:
            torch.autograd.backward(out, grad_tensors=grad)

        def push_loss(out: torch.Tensor) -> None:
            torch.autograd.backward(out)

        row: Dict[str, Any] = {"micro_batch_size": b,
                               "stage_input_bytes": s * b * h * stream_bytes,
                               "data_bytes": b * (s + 1) * 8}
        if rotary:
            row["rotary_table_bytes"] = rotary_bytes
        if batch["attention_mask"] is not None:
            row["attention_mask_bytes"] = mask.untyped_storage().nbytes()
        row["block"] = measure(lambda: run_blocks(x, mask), push, blocks,
                               weight_storage_ptrs(blocks) | rotary_ptrs | mask_ptrs,
                               device, warmup, repeat, per_sync, units=len(blocks))
        row["embedding"] = measure(lambda: embedding(batch), push, embedding,
                                   weight_storage_ptrs(embedding), device, warmup, repeat,
                                   per_sync)
        row["head"] = measure(lambda: head(x, batch), push_loss, head,
                              weight_storage_ptrs(head), device, warmup, repeat, per_sync)
        rows.append(row)
    return rows


def profile_stages(config: ModelConfig, rows: List[Dict[str, Any]], chain: int,
                   device: torch.device, warmup: int, repeat: int, per_sync: int,
                   seed: int) -> None:
    """Time a ``GPTModel`` stage of ``chain`` layers of each kind through the trainer's
    ``forward_step`` and loss function; adds ``row["stages"][kind]`` to every row.  One
    stage model lives at a time (a GPU that holds the pieces holds it)."""
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo
    from pretrain_gpt import forward_step

    s, h = config.seq_length, config.hidden_size
    gen = torch.Generator().manual_seed(seed + 1)
    for row in rows:
        row["stages"] = {}
    for kind, (pre, post) in STAGE_KINDS.items():
        # layer numbers as in a pipeline of 3 such stages (one for the whole model)
        start = 0 if pre else chain if not post else 2 * chain
        stage_config = dataclasses.replace(config, num_layers=chain if pre and post else 3 * chain)
        model = GPTModel(stage_config, TPInfo.single(), pre_process=pre, post_process=post,
                         layer_numbers=range(start, start + chain), seed=seed).to(device)
        model.train()
        widen_grads(model, trainer_grad_dtype(config))
        for row in rows:
            b = row["micro_batch_size"]
            # what the data loader hands the executor: token ids on the host
            data = {"text": sample_text(config, b, gen)}
            # what the previous stage sends, and the gradient the next one returns: the
            # residual stream (float32 with --fp32-residual-connection)
            x = torch.randn(s, b, h, dtype=config.residual_dtype, device=device,
                            requires_grad=True)
            grad = torch.randn(s, b, h, dtype=config.residual_dtype, device=device)

            def run(model=model, data=data, x=x, pre=pre, post=post) -> torch.Tensor:
                if not pre:
                    model.set_input_tensor(x)
                out, loss_fn = forward_step(iter([data]), model)
                return loss_fn(out)[0] if post else out

            def push(out: torch.Tensor, post=post, grad=grad) -> None:
                torch.autograd.backward(out, grad_tensors=None if post else grad)

            row["stages"][kind] = {"layers": chain, **measure(
                run, push, model, weight_storage_ptrs(model), device, warmup, repeat,
                per_sync)}
        del model

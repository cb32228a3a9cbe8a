"""Column/row-parallel linear layers and the vocab-parallel embedding.

Weights are stored as [out, in] (torch's convention).  Partitioned parameters carry
``tensor_model_parallel = True`` with ``partition_dim`` / ``partition_stride``; replicated
ones (the row-parallel bias) carry ``tensor_model_parallel = False``.

Both linear layers return ``(output, bias)`` like Megatron: ``bias`` is None unless
``skip_bias_add`` asked the caller to add it (so it can be fused with what follows).

With ``sequence_parallel`` (--sequence-parallel) the activations between the linear
layers are split along the sequence: a column-parallel layer all-gathers its [s/t, b, h]
input (and keeps only the s/t rows for its backward, gathering them again there), a
row-parallel layer reduce-scatters its output to [s/t, b, h] instead of all-reducing it.
Its replicated bias then sees s/t of the tokens on each rank: it is marked
``sequence_parallel = True`` and the trainer sums its gradient over the tensor ranks.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.tensor_parallel.mappings import (copy_to_tp_region, gather_from_tp_region,
                                               gather_rows, reduce_from_tp_region,
                                               reduce_scatter_rows,
                                               reduce_scatter_to_sequence_parallel_region,
                                               scatter_to_tp_region)
from megatron.tensor_parallel.param_init import (InitKey, InitMethod, init_method_normal,
                                                 partitioned_tensor,
                                                 set_tensor_model_parallel_attributes)
from megatron.tensor_parallel.utils import TPInfo, divide, vocab_range

_DEFAULT_KEY = InitKey(seed=0, layer_number=0)


def _zeros(n: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(n, dtype=dtype))


class _LinearGatheredRows(torch.autograd.Function):
    """F.linear(all-gather of x along dim 0, weight, bias), keeping only x -- this rank's
    s/t rows -- for the backward, which gathers it again for the weight's gradient and
    reduce-scatters the input's gradient (the sum over ranks of each rank's partial
    product, of which this rank's rows are its input's gradient).  Keeping the gathered
    input instead would keep t times the bytes: sequence parallelism's memory saving
    rests on this (Korthikanti et al., 2022, section 4.2.2).

    The backward overlaps its communication with its matmuls, as Megatron-LM does: the
    gather runs while the input's gradient is formed, the reduce-scatter of that
    gradient while the weight's is."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias = tp, bias is not None
        return F.linear(gather_rows(x, tp), weight, bias)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_w:  # every rank starts the same collectives in the same order
            full, gathering = gather_rows(x, ctx.tp, async_op=True)
        if need_x:
            grad_x, scattering = reduce_scatter_rows(grad.matmul(weight), ctx.tp,
                                                     async_op=True)
        flat_grad = grad.reshape(-1, grad.size(-1))
        if need_b and ctx.has_bias:
            grad_b = flat_grad.sum(dim=0)
        if need_w:
            gathering.wait()
            grad_w = flat_grad.t().matmul(full.reshape(-1, full.size(-1)))
        if need_x:
            scattering.wait()
        return grad_x, grad_w, grad_b, None


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor,
                                bias: Optional[torch.Tensor], tp: TPInfo) -> torch.Tensor:
    """A column-parallel matmul of the sequence-parallel x [s/t, b, in]: the output is
    [s, b, out/t] (every position, this rank's columns)."""
    if not tp.is_parallel:
        return F.linear(x, weight, bias)
    return _LinearGatheredRows.apply(x, weight, bias, tp)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: rank i computes Y_i = X A_i + b_i.

    ``gather_output`` concatenates the partitions so every rank sees the full Y;
    otherwise the output stays partitioned for a following RowParallelLinear.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TPInfo, bias: bool = True,
                 gather_output: bool = False, init_method: Optional[InitMethod] = None,
                 skip_bias_add: bool = False, params_dtype: torch.dtype = torch.float32,
                 init_key: InitKey = _DEFAULT_KEY, stride: int = 1,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.is_parallel
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, tp.size, "ColumnParallelLinear output size")
        divide(output_size, tp.size * stride, "ColumnParallelLinear output size / stride")
        self.gather_output = gather_output
        if gather_output and stride != 1:
            raise ValueError("ColumnParallelLinear: gather_output needs stride 1")
        self.skip_bias_add = skip_bias_add
        init_method = init_method or init_method_normal(0.02)
        self.weight = nn.Parameter(partitioned_tensor(
            (output_size, input_size), init_key.child("weight"), init_method, params_dtype,
            partition_dim=0, rank=tp.rank, size=tp.size, stride=stride))
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = _zeros(self.output_size_per_partition, params_dtype)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        add_bias = self.bias is not None and not self.skip_bias_add
        bias = self.bias if add_bias else None
        if self.sequence_parallel:
            out = linear_with_sequence_gather(x, self.weight, bias, self.tp)
        else:
            out = F.linear(copy_to_tp_region(x, self.tp), self.weight, bias)
        if self.gather_output:
            out = gather_from_tp_region(out, self.tp)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows and X by columns: Y = sum_i X_i A_i + b.

    The bias is replicated and added once, after the all-reduce.
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TPInfo, bias: bool = True,
                 input_is_parallel: bool = True, init_method: Optional[InitMethod] = None,
                 skip_bias_add: bool = False, params_dtype: torch.dtype = torch.float32,
                 init_key: InitKey = _DEFAULT_KEY, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.sequence_parallel = sequence_parallel and tp.is_parallel
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel")
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, tp.size, "RowParallelLinear input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        init_method = init_method or init_method_normal(0.02)
        self.weight = nn.Parameter(partitioned_tensor(
            (output_size, input_size), init_key.child("weight"), init_method, params_dtype,
            partition_dim=1, rank=tp.rank, size=tp.size))
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        if bias:
            self.bias = _zeros(output_size, params_dtype)
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            if self.sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        partial = F.linear(x, self.weight)
        out = (reduce_scatter_to_sequence_parallel_region(partial, self.tp)
               if self.sequence_parallel else reduce_from_tp_region(partial, self.tp))
        if self.bias is not None and not self.skip_bias_add:
            return out + self.bias, None
        return out, self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; each rank looks up the ids it owns."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPInfo,
                 init_method: Optional[InitMethod] = None,
                 params_dtype: torch.dtype = torch.float32,
                 init_key: InitKey = _DEFAULT_KEY) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, tp.rank, tp.size)
        init_method = init_method or init_method_normal(0.02)
        self.weight = nn.Parameter(partitioned_tensor(
            (num_embeddings, embedding_dim), init_key.child("weight"), init_method,
            params_dtype, partition_dim=0, rank=tp.rank, size=tp.size))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of the lookup: the rows of the ids it owns, zero elsewhere
        (the sum over ranks is the embedding)."""
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(self.partial(ids), self.tp)

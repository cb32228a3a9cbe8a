"""Layout-independent parameter initialisation.

Tests compare a single-process model, a tensor-parallel model and a model cut into
pipeline stages step for step, so every parameter must start from the same values in
all of them.  The rule: the FULL (unpartitioned) tensor is a pure function of
(seed, global layer number, parameter name).  It is drawn on CPU from a dedicated
``torch.Generator`` seeded by a hash of that triple, in float32 (float64 when the model
runs in float64), cast to the parameter dtype, and only then sliced to this rank's
partition.  No global RNG is touched, so building a model never shifts dropout streams.

On a GPU the draw runs on the device instead (the trainer builds the model inside
``with torch.device("cuda:N")``): the generator is a CUDA generator with the same
seed, so the values are still a pure function of the key and the same on every rank
(with the same GPU model), but they differ from the CPU's, and no 3 s of CPU
``normal_`` precede a GPT-345M run.  CPU runs draw exactly as before.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

InitMethod = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a full CPU tensor in place, drawing only from the given generator."""

EMBEDDING_LAYER = -1
"""Layer number used in the init key of embedding and output-layer parameters."""


@dataclass(frozen=True)
class InitKey:
    """Identity of a parameter for initialisation: (seed, global layer, dotted name)."""

    seed: int
    layer_number: int
    name: str = ""

    def child(self, name: str) -> "InitKey":
        full = f"{self.name}.{name}" if self.name else name
        return InitKey(self.seed, self.layer_number, full)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        # Python's hash() is salted per process; sha256 gives every rank the same seed.
        text = f"{self.seed}|{self.layer_number}|{self.name}".encode()
        value = int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & ((1 << 63) - 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(value)
        return gen


def init_method_normal(std: float) -> InitMethod:
    """N(0, std^2) initialiser."""
    def init_(tensor: torch.Tensor, generator: torch.Generator) -> None:
        tensor.normal_(mean=0.0, std=std, generator=generator)
    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, (std / sqrt(2 L))^2): output projections, so residual sums keep their scale."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def init_method_xavier_uniform() -> InitMethod:
    """Glorot/Xavier uniform: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), the fans
    of the tensor it fills: [out, in] for a linear weight, [rows, dim] for a table.
    ``full_tensor`` hands it the FULL unpartitioned weight, so the bound is that of
    the whole matrix and a tensor-parallel model equals the single-rank one (drawing
    each rank's slice on its own would widen the bound as t grows)."""
    def init_(tensor: torch.Tensor, generator: torch.Generator) -> None:
        if tensor.dim() < 2:
            raise ValueError(f"xavier_uniform needs a matrix, got shape {tuple(tensor.shape)}")
        receptive = math.prod(tensor.shape[2:])
        fan_in, fan_out = tensor.size(1) * receptive, tensor.size(0) * receptive
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        tensor.uniform_(-bound, bound, generator=generator)
    return init_


def full_tensor(shape: Sequence[int], key: InitKey, init_method: InitMethod,
                dtype: torch.dtype) -> torch.Tensor:
    """The unpartitioned initial value of parameter ``key`` (``dtype``), drawn on the
    current default device (``with torch.device(...)``; CPU unless the caller set one)."""
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    device = init_device()
    tensor = torch.empty(tuple(shape), dtype=draw_dtype, device=device)
    init_method(tensor, key.generator(device))
    return tensor.to(dtype)


def init_device() -> torch.device:
    """Where parameters are drawn: torch's default device (a ``with torch.device(..)``
    block sets it), so a model built inside such a block never touches the CPU."""
    return torch.get_default_device()


def partitioned_tensor(shape: Sequence[int], key: InitKey, init_method: InitMethod,
                       dtype: torch.dtype, partition_dim: int, rank: int,
                       size: int, stride: int = 1) -> torch.Tensor:
    """This rank's slice (along ``partition_dim``) of the full initial value: the
    contiguous ``rank``-th of ``size`` pieces, or with ``stride`` > 1 its piece of each
    of the ``stride`` equal sections (see ``shard``)."""
    full = full_tensor(shape, key, init_method, dtype)
    if size == 1:
        return full
    return shard(full, partition_dim, rank, size, stride).clone()


def shard(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split ``size`` ways along ``dim`` (a view when
    stride is 1).  ``stride`` s > 1: ``full`` is s equal sections side by side (SwiGLU's
    [gate; up]) and the rank holds its slice of each, in order: pieces
    rank, rank + size, ... of the size * s equal pieces (Megatron's partition_stride)."""
    if stride == 1:
        return torch.chunk(full, size, dim=dim)[rank]
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def unshard(parts: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The inverse of ``shard``: the full tensor from every rank's part, in rank order."""
    if stride == 1:
        return torch.cat(list(parts), dim=dim)
    split = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([split[r][i] for i in range(stride) for r in range(len(parts))], dim=dim)


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         partition_dim: int, stride: int = 1) -> None:
    """Flags read by the optimizer and grad-norm code to tell partitions from replicas."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


def mark_replicated_parameters(module: torch.nn.Module) -> None:
    """Give every parameter without tensor-parallel flags the 'replicated' flags."""
    for param in module.parameters():
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, False, -1, 1)

"""Weight buffers of one pipeline stage: one for flush/gpipe/none, two for 2BW.

A buffer is a list of ``nn.Parameter`` objects, one per parameter slot of the stage's
module.  ``install(j)`` points every slot of the module at buffer j's parameters.  The
swap replaces Parameter objects (not their ``.data``), so a microbatch whose forward ran
with buffer j keeps using buffer j's tensors in its backward even if another buffer is
installed in between, and its gradients accumulate in buffer j's ``.grad``.

2BW rule (global batch t, 0-indexed): batch t runs on buffer t % 2, which holds weight
version max(t - 1, 0).  When batch t's gradients are complete, buffer t % 2 is
overwritten with W(t+1) = W(t) - lr * update(grad of batch t), W(t) being the other
buffer.  At most two versions exist at any time and no third copy is made.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

import torch
from torch import nn

_COPIED_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "shared",
                 "shared_embedding", "sequence_parallel", "is_embedding_or_output_parameter")


def _clone_param(p: nn.Parameter) -> nn.Parameter:
    q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
    for attr in _COPIED_ATTRS:
        if hasattr(p, attr):
            setattr(q, attr, getattr(p, attr))
    return q


def grad_dtype_of(p: torch.Tensor) -> torch.dtype:
    """dtype of ``p``'s gradient: its ``grad_dtype`` where set (float32 gradients of bf16
    weights under --accumulate-allreduce-grads-in-fp32), else its own dtype."""
    dtype = getattr(p, "grad_dtype", None)
    return p.dtype if dtype is None else dtype


def zero_grad_like(p: torch.Tensor) -> torch.Tensor:
    """A zero gradient for ``p`` (a parameter no microbatch produced a gradient for)."""
    return torch.zeros_like(p, dtype=grad_dtype_of(p))


@torch.no_grad()
def set_grad_dtype(params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
    """The floating-point ``params`` of another dtype get gradients of ``dtype``: autograd
    casts each microbatch's gradient and accumulates in ``dtype`` (``Tensor.grad_dtype``,
    torch >= 2.10).  A gradient already present is cast."""
    for p in params:
        if not p.requires_grad or not p.is_floating_point() or p.dtype == dtype:
            continue
        g = p.grad
        p.grad = None
        p.grad_dtype = dtype
        if g is not None:
            p.grad = g.to(dtype)


class WeightBuffers:
    """Holds ``num_buffers`` versions of a module's parameters and swaps them in."""

    def __init__(self, module: nn.Module, num_buffers: int) -> None:
        if num_buffers not in (1, 2):
            raise ValueError("a stage holds one or two weight buffers")
        self.module = module
        # Group slots by parameter identity so a parameter registered twice (tied
        # weights inside one stage) stays tied in every buffer.
        slots: Dict[int, List[Tuple[nn.Module, str]]] = defaultdict(list)
        first: Dict[int, nn.Parameter] = {}
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is None:
                    continue
                slots[id(p)].append((mod, name))
                first.setdefault(id(p), p)
        order = [id(p) for p in module.parameters()]
        self._slots = [slots[i] for i in order]
        base = [first[i] for i in order]
        self.buffers: List[List[nn.Parameter]] = [base]
        for _ in range(num_buffers - 1):
            self.buffers.append([_clone_param(p) for p in base])
        self.installed = 0

    @property
    def slots(self) -> List[List[Tuple[nn.Module, str]]]:
        """Per parameter (in ``params(j)`` order): the (module, attribute) places it is
        registered at."""
        return self._slots

    @property
    def num_buffers(self) -> int:
        return len(self.buffers)

    def install(self, j: int) -> None:
        if j == self.installed:
            return
        for slot, p in zip(self._slots, self.buffers[j]):
            for mod, name in slot:
                mod._parameters[name] = p
        self.installed = j

    def params(self, j: int) -> List[nn.Parameter]:
        return self.buffers[j]

    def set_grad_dtype(self, dtype: torch.dtype) -> None:
        """``set_grad_dtype`` on every buffer's parameters."""
        for buf in self.buffers:
            set_grad_dtype(buf, dtype)

    def bytes_per_buffer(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.buffers[0])

    def storage_ptrs(self) -> set:
        """data_ptrs of every buffer's storage (to exclude weights from activation counts)."""
        return {p.untyped_storage().data_ptr() for buf in self.buffers for p in buf}

    @torch.no_grad()
    def copy_buffer(self, src: int, dst: int) -> None:
        if src != dst:
            for a, b in zip(self.buffers[dst], self.buffers[src]):
                a.copy_(b)

    @torch.no_grad()
    def sync_all_from(self, src: int) -> None:
        for j in range(self.num_buffers):
            self.copy_buffer(src, j)

    def zero_grads(self, j: int) -> None:
        for p in self.buffers[j]:
            p.grad = None

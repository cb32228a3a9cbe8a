"""``--overlap-param-gather``: the next forward pass waits for new weights layer by layer.

With the distributed optimizer a step ends with one all-gather per gradient bucket that
brings every replica's share of the new weights (``megatron.optimizer.sharding.
WeightGather``).  Waited for at once, they sit between the step and the next forward
pass.  Left in flight, each transformer layer waits, in a forward pre-hook, only for the
buckets holding its own parameters, so the gathers of later layers overlap the compute
of earlier ones, as Megatron-LM's flag does.

Which parameters a layer reads is known from the module tree: a layer (an element of an
``nn.ModuleList``, the stage's transformer layers) uses only the parameters registered
under it.  A parameter registered elsewhere (embeddings, the final norm, the output
layer, the tied word-embedding copy the head reads functionally) may be read from
anywhere in the stage's forward, so its bucket is waited for before the forward starts
(``GatherHooks.wait_outside``, called by the engine).  The all-gathers start in the order
these waits come: the buckets outside the layers first, then layer by layer.

Compiled layers (``--compile-layers``) get no hook: a hook runs inside the compiled call
and would break its graph; every bucket is then waited for before the forward.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Set

from torch import nn

from megatron.optimizer.sharding import WeightGather
from megatron.pipeline.weights import WeightBuffers


class GatherHooks:
    """Forward pre-hooks on ``model``'s layers that wait for their buckets' gathers."""

    def __init__(self, model: nn.Module, weights: WeightBuffers, gather: WeightGather) -> None:
        self.gather = gather
        units = _layers(model)
        if any(getattr(u, "_compiled_call_impl", None) is not None for u in units):
            units = []
        owner: Dict[int, nn.Module] = {}
        for u in units:
            for mod in u.modules():
                owner[id(mod)] = u
        bucket_of = {i: b for b, bucket in enumerate(gather.shard.buckets)
                     for i in bucket.params}
        outside: Set[int] = set()
        inside: Dict[int, Set[int]] = defaultdict(set)
        for i, slot in enumerate(weights.slots):
            where = {owner.get(id(mod)) for mod, _ in slot}
            if len(where) == 1 and None not in where:
                inside[id(next(iter(where)))].add(bucket_of[i])
            else:
                outside.add(bucket_of[i])
        # descending bucket index within a group: the buckets follow the backward pass
        self.outside: List[int] = sorted(outside, reverse=True)
        order = list(self.outside)
        self.per_layer: List[List[int]] = []
        self._handles = []
        for u in units:
            mine = [b for b in sorted(inside.get(id(u), ()), reverse=True)
                    if b not in outside]
            self.per_layer.append(mine)
            order += [b for b in mine if b not in order]
            if mine:
                self._handles.append(u.register_forward_pre_hook(self._waiter(mine)))
        order += [b for b in range(len(gather.shard.buckets) - 1, -1, -1) if b not in order]
        gather.set_order(order)

    def _waiter(self, buckets: List[int]):
        gather = self.gather

        def hook(module: nn.Module, args) -> None:
            if gather.pending:
                gather.wait(buckets)
        return hook

    def wait_outside(self) -> None:
        """Before a forward pass: the buckets no layer's hook waits for."""
        if self.gather.pending:
            self.gather.wait(self.outside if self._handles else None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _layers(model: nn.Module) -> List[nn.Module]:
    """The elements of ``model``'s outermost ``nn.ModuleList``s, in module order."""
    out: List[nn.Module] = []
    seen: Set[int] = set()
    for mod in model.modules():
        if id(mod) in seen:
            continue
        if isinstance(mod, nn.ModuleList):
            for child in mod:
                out.append(child)
            for sub in mod.modules():
                seen.add(id(sub))
    return out


def gather_hooks(model: nn.Module, weights: WeightBuffers,
                 optimizer) -> Optional[GatherHooks]:
    """The hooks when ``optimizer`` leaves its weight all-gathers in flight, else None."""
    gather: Optional[WeightGather] = getattr(optimizer, "gather", None)
    if gather is None or not gather.overlap:
        return None
    return GatherHooks(model, weights, gather)

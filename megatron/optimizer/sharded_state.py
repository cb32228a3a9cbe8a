"""The distributed optimizer's state in the unsharded checkpoint format.

With ``--use-distributed-optimizer`` a rank holds torch optimizer state for its pieces
only (``megatron.optimizer.sharding``), numbered in its own order.  Checkpoints hold the
whole state numbered as the unsharded optimizer numbers it, so a run may resume with or
without the flag, or with another data-parallel size.  ``UnshardedFormat.gather`` builds
that state on every rank (collective over the data-parallel group); ``local`` cuts this
rank's pieces back out of it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.optimizer.sharding import OptimizerShard, Piece, all_gather_flat


def elementwise(name: str, value: Any, numel: int) -> bool:
    """Whether an optimizer state entry holds one number per weight (Adam's moments, SGD's
    momentum) rather than one per tensor (the step count)."""
    return torch.is_tensor(value) and name != "step" and value.numel() == numel


class UnshardedFormat:
    """Converts one rank's per-piece optimizer state to and from the unsharded format.

    ``full_order``: the unsharded optimizer's numbering, the parameter index of each
    member of each torch param group in order (decay group, then no-decay, each cut into
    runs of one learning rate under --decoupled-lr: ``megatron.optimizer.param_groups``,
    whose ``GroupLayout`` joins them again for the checkpoint);
    ``unit_param``: the parameter each of this rank's main parameters (pieces) belongs
    to; ``shapes``: the stage's parameter shapes."""

    def __init__(self, shard: OptimizerShard, full_order: List[List[int]],
                 shapes: Sequence[Tuple[int, ...]], device: torch.device) -> None:
        self.shard = shard
        self.pieces: List[Piece] = shard.pieces()
        self.unit_param = [pc.param for pc in self.pieces]
        self.full_order = full_order
        self.shapes = list(shapes)
        self.device = device
        self.pieces_by_bucket: List[List[Tuple[int, Piece]]] = [[] for _ in shard.buckets]
        for k, pc in enumerate(self.pieces):
            self.pieces_by_bucket[pc.bucket].append((k, pc))

    def local_order(self) -> List[List[int]]:
        """Main-parameter (piece) indices of this rank's torch param groups, in order."""
        return [[k for k, i in enumerate(self.unit_param) if i in members]
                for members in map(set, self.full_order)]

    def gather(self, torch_state: Dict[str, Any], masters: Optional[List[Any]]):
        """This rank's torch state (per piece) and masters -> every parameter's, whole,
        numbered as the unsharded optimizer numbers them (collective over the
        data-parallel group).  Elementwise tensors (moments, momentum) travel as the
        weights do, one all-gather per bucket; what else a parameter's state holds (the
        step count) comes from the owner of its first element."""
        sh, pieces = self.shard, self.pieces
        order = [k for group in self.local_order() for k in group]
        by_piece = {order[j]: st for j, st in torch_state["state"].items()}
        heads: Dict[int, List[Tuple[str, bool, Any]]] = {}
        for k, st in by_piece.items():
            pc = pieces[k]
            if pc.start == 0:  # (name, elementwise, dtype or value)
                heads[pc.param] = [
                    (name, True, v.dtype) if elementwise(name, v, pc.numel)
                    else (name, False, v.cpu() if torch.is_tensor(v) else v)
                    for name, v in st.items()]
        parts: List[Any] = [None] * sh.size
        dist.all_gather_object(parts, heads, group=sh.group)
        for part in parts:
            heads.update(part)
        full: Dict[int, Dict[str, Any]] = {i: {} for i in heads}
        names = sorted({name for head in heads.values() for name, ew, _ in head if ew})
        for name in names:
            dtypes = {i: d for i, head in heads.items() for n, ew, d in head if ew and n == name}
            got = self._gather_flat(lambda k: by_piece.get(k, {}).get(name), dtypes)
            for i, tensor in got.items():
                full[i][name] = tensor
        for i, head in heads.items():  # in the state's own order of names
            full[i] = {name: (full[i][name] if ew else
                              value.to(self.device) if torch.is_tensor(value) else value)
                       for name, ew, value in head}
        full_masters = None
        if masters is not None:
            got = self._gather_flat(lambda k: masters[k],
                                    {i: torch.float32 for i in range(len(self.shapes))})
            full_masters = [got[i] for i in range(len(self.shapes))]
        full_ids = {i: k for k, i in enumerate(i for g in self.full_order for i in g)}
        groups = []
        for saved, members in zip(torch_state["param_groups"], self.full_order):
            groups.append({**saved, "params": [full_ids[i] for i in members]})
        state = {full_ids[i]: full[i] for i in sorted(full, key=lambda i: full_ids[i])}
        return {"state": state, "param_groups": groups}, full_masters

    def _gather_flat(self, local: Callable[[int], Optional[torch.Tensor]],
                     dtypes: Dict[int, torch.dtype]) -> Dict[int, torch.Tensor]:
        """Whole tensors, shaped as their parameters, of the parameters in ``dtypes``
        (index -> dtype) from every rank's pieces (``local(k)``: piece k's tensor, or
        None): one all-gather per bucket that holds any of them."""
        sh = self.shard
        out: Dict[int, torch.Tensor] = {}
        for b, bucket in enumerate(sh.buckets):
            wanted = [i for i in bucket.params if i in dtypes]
            if not wanted:
                continue
            dtype = dtypes[wanted[0]]
            seg = torch.zeros(sh.segment(b), dtype=dtype, device=self.device)
            for k, pc in self.pieces_by_bucket[b]:
                t = local(k) if pc.param in dtypes else None
                if t is not None:
                    seg[pc.at:pc.at + pc.numel].copy_(t.reshape(-1))
            whole = torch.empty(bucket.padded, dtype=dtype, device=self.device)
            all_gather_flat(whole, seg, group=sh.group)
            for i, off in zip(bucket.params, bucket.offsets):
                if i in dtypes:
                    n = sh.numels[i]
                    out[i] = whole[off:off + n].view(self.shapes[i]).clone()
        return out

    def local(self, full: Dict[str, Any]) -> Dict[str, Any]:
        """An unsharded torch state dict -> this rank's pieces, in its own numbering."""
        groups = full.get("param_groups", [])
        if len(groups) != len(self.full_order) or any(
                len(g["params"]) != len(members) for g, members in zip(groups, self.full_order)):
            raise ValueError("optimizer checkpoint: its parameter groups do not match this "
                             "stage's (decay, no-decay) groups")
        local, local_groups, j = {}, [], 0
        for saved, members, mine in zip(groups, self.full_order, self.local_order()):
            by_main = dict(zip(members, saved["params"]))
            ids = []
            for k in mine:
                pc = self.pieces[k]
                st = full["state"].get(by_main[pc.param])
                if st is not None:
                    numel = self.shard.numels[pc.param]
                    local[j] = {name: (v.reshape(-1)[pc.start:pc.stop].clone()
                                       if elementwise(name, v, numel) else v)
                                for name, v in st.items()}
                ids.append(j)
                j += 1
            local_groups.append({**saved, "params": ids})
        return {"state": local, "param_groups": local_groups}

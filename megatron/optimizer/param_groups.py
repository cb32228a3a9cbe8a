"""The torch param groups of one stage, and their checkpoint format.

Weight decay splits a stage's parameters into two groups, as Megatron-LM does: matrices
are decayed, biases and norm weights (1-D) are not (``wd_mult`` 1 and 0: a weight decay
that changes during training, ``--weight-decay-incr-style``, is set on the groups at
every step as the scheduled value times it).  Checkpoints hold the optimizer
state in those two groups (decay, then no-decay), each listing its members in model
order; ``megatron.checkpoint_convert`` and the distributed optimizer's unsharded format
read it so.

``--decoupled-lr`` (Megatron-LM's) gives the input and output layers a learning rate of
their own, and torch takes one rate per group, so each weight-decay group is cut further
into runs: maximal stretches of consecutive members that share a rate.  The runs keep
the members' order, so torch numbers every parameter as it would without the cut; the
checkpoint format is unchanged (``to_saved`` joins the runs of a group again,
``from_saved`` cuts them out), and a run may resume from a checkpoint written with or
without the flag, or before it existed.

Which parameters are decoupled: Megatron-LM marks ``is_embedding_or_output_parameter``
on the first stage's word embedding and on the last stage's output-layer weight; with
tied embeddings on more than one stage that weight is the last stage's copy of the word
embedding, and with one stage the word embedding (the output layer has no weight of its
own).  The position and token-type embeddings, the output layer's bias and the final
norm follow --lr.  The models here (megatron/model/gpt_model.py, bert_model.py) set the
same attribute; BERT's last stage marks its copy of the tied embedding whenever it holds
one, so that both copies take the same update.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

DECOUPLED_ATTR = "is_embedding_or_output_parameter"


def is_embedding_or_output(param: torch.Tensor) -> bool:
    return bool(getattr(param, DECOUPLED_ATTR, False))


@dataclass(frozen=True)
class GroupLayout:
    """A stage's torch param groups: runs of its weight-decay groups (see the module
    docstring).  Every list has one entry per torch group, in torch's order."""

    members: List[List[int]]
    """The stage's parameter indices in each torch group, in model order."""
    weight_decay: List[float]
    decoupled: List[bool]
    """Whether the group follows the decoupled learning rate."""
    saved: List[int]
    """The checkpoint group (0: the first weight-decay group present, 1: the next) each
    torch group belongs to; non-decreasing."""
    wd_mult: Optional[List[float]] = None
    """Each group's share of a scheduled weight decay (Megatron-LM's ``wd_mult``; see
    ``wd_mults``): 1.0 for the decayed matrices, 0.0 for biases and norms."""

    @property
    def wd_mults(self) -> List[float]:
        """``wd_mult``, or where it was not given (``plain``) 1.0 for each group with a
        non-zero ``weight_decay`` and 0.0 for the others."""
        if self.wd_mult is not None:
            return list(self.wd_mult)
        return [1.0 if wd else 0.0 for wd in self.weight_decay]

    @classmethod
    def build(cls, params: Sequence[torch.Tensor], weight_decay: float,
              decoupled_lr: bool = False) -> "GroupLayout":
        """Decay matrices only; with ``decoupled_lr`` the marked parameters get groups of
        their own (weight decay unchanged)."""
        decay = [i for i, p in enumerate(params) if p.ndim >= 2]
        no_decay = [i for i, p in enumerate(params) if p.ndim < 2]
        members: List[List[int]] = []
        wds: List[float] = []
        flags: List[bool] = []
        saved: List[int] = []
        mults: List[float] = []
        kept = [(ids, wd, mult) for ids, wd, mult in ((decay, weight_decay, 1.0),
                                                      (no_decay, 0.0, 0.0)) if ids]
        for k, (ids, wd, mult) in enumerate(kept):
            for i in ids:
                flag = decoupled_lr and is_embedding_or_output(params[i])
                if members and saved[-1] == k and flags[-1] == flag:
                    members[-1].append(i)
                    continue
                members.append([i])
                wds.append(wd)
                flags.append(flag)
                saved.append(k)
                mults.append(mult)
        return cls(members, wds, flags, saved, mults)

    @classmethod
    def plain(cls, members: List[List[int]], weight_decay: List[float]) -> "GroupLayout":
        """Groups that are their own checkpoint groups, none decoupled."""
        n = len(members)
        return cls(members, list(weight_decay), [False] * n, list(range(n)))

    @property
    def any_decoupled(self) -> bool:
        return any(self.decoupled)

    @property
    def is_plain(self) -> bool:
        return self.saved == list(range(len(self.members)))

    def to_saved(self, torch_state: Dict[str, Any]) -> Dict[str, Any]:
        """A torch state dict in these groups -> the checkpoint's groups (the runs of a
        weight-decay group joined; its hyper-parameters, learning rate included, from
        its first run that follows --lr, else its first)."""
        if self.is_plain:
            return torch_state
        groups: List[Dict[str, Any]] = []
        for k, (group, flag) in enumerate(zip(torch_state["param_groups"], self.decoupled)):
            if k == 0 or self.saved[k] != self.saved[k - 1]:
                groups.append({**group, "params": list(group["params"])})
                first_decoupled = flag
                continue
            if first_decoupled and not flag:  # the hyper-parameters of the --lr run
                groups[-1] = {**group, "params": groups[-1]["params"]}
                first_decoupled = False
            groups[-1]["params"].extend(group["params"])
        return {**torch_state, "param_groups": groups}

    def from_saved(self, saved_state: Dict[str, Any]) -> Dict[str, Any]:
        """The checkpoint's groups -> these groups (each run with its group's
        hyper-parameters; the learning rate is set again at every step)."""
        if self.is_plain:
            return saved_state
        saved = saved_state.get("param_groups", [])
        sizes = [0] * (self.saved[-1] + 1 if self.saved else 0)
        for k, ids in zip(self.saved, self.members):
            sizes[k] += len(ids)
        if [len(g["params"]) for g in saved] != sizes:
            raise ValueError(f"optimizer checkpoint: its parameter groups hold "
                             f"{[len(g['params']) for g in saved]} parameters, this stage's "
                             f"(decay, no-decay) groups {sizes}")
        groups, taken = [], [0] * len(sizes)
        for k, ids in zip(self.saved, self.members):
            at = taken[k]
            groups.append({**saved[k], "params": list(saved[k]["params"][at:at + len(ids)])})
            taken[k] += len(ids)
        return {**saved_state, "param_groups": groups}

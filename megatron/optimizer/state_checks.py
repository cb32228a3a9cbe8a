"""Checks of a saved optimizer state against the stage about to load it.

``MegatronOptimizer.load_state_dict`` runs them before torch reads anything:
``check_saved_meta`` compares the description ``state_dict`` wrote (optimizer, parameter
shapes, fp32 masters) with this stage's, and ``check_saved_tensors`` compares every
saved moment, step count and fp32 master with the parameter it belongs to.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch


def check_saved_meta(sd: Dict[str, Any], name: str, shapes: List[tuple],
                     use_masters: bool) -> None:
    """``sd`` was written by ``MegatronOptimizer.state_dict`` for an optimizer ``name``
    over parameters of ``shapes``, with fp32 masters where ``use_masters`` needs them."""
    meta = sd.get("meta")
    if meta is None:
        raise ValueError("optimizer checkpoint state has no 'meta' entry (not written by "
                         "MegatronOptimizer.state_dict)")
    if meta["optimizer"] != name:
        raise ValueError(f"optimizer checkpoint was saved with --optimizer "
                         f"{meta['optimizer']}, this run uses {name}")
    saved = [tuple(s) for s in meta["shapes"]]
    if saved != shapes:
        raise ValueError(f"optimizer checkpoint holds {len(saved)} parameters "
                         f"{_first_difference(saved, shapes)}; this stage has "
                         f"{len(shapes)}: is the parallel layout (tensor/pipeline "
                         f"sizes) or model shape different?")
    if use_masters and sd.get("fp32_masters") is None:
        raise ValueError("optimizer checkpoint has no fp32 master weights (saved without "
                         "mixed precision): load with --no-load-optim, or call "
                         "reload_model_params after loading the model weights")


def check_saved_tensors(torch_state: Dict[str, Any], masters: Optional[Sequence[Any]],
                        members: Sequence[Sequence[int]], shapes: List[tuple]) -> None:
    """Every saved moment and fp32 master has its parameter's shape, and every step
    count is one finite number >= 0.  torch's load_state_dict checks none of it, and
    the fused kernels then read and write past the ends of a smaller tensor (a
    crafted or damaged checkpoint corrupted the heap), while ``copy_`` would
    broadcast one saved value over a whole master weight.

    ``torch_state``: the unsharded torch state in this stage's groups, whose parameter
    indices are ``members`` (``GroupLayout.members``); ``shapes``: each parameter's."""
    state = torch_state.get("state", {})
    groups = torch_state.get("param_groups", [])
    if len(groups) != len(members):
        raise ValueError(f"optimizer checkpoint: {len(groups)} parameter groups, this "
                         f"stage's optimizer has {len(members)}")
    for group, ids in zip(groups, members):
        for saved_id, i in zip(group["params"], ids):
            entry = state.get(saved_id, {})
            if not isinstance(entry, dict):
                raise ValueError(f"optimizer checkpoint: the state of parameter {i} is "
                                 f"{type(entry).__name__}, expected a dict of tensors")
            for key, value in entry.items():
                if key == "step":
                    step = value.item() if (isinstance(value, torch.Tensor)
                                            and value.numel() == 1) else value
                    if isinstance(step, bool) or not isinstance(step, (int, float)) \
                            or not math.isfinite(step) or step < 0:
                        raise ValueError(f"optimizer checkpoint: parameter {i}'s step is "
                                         f"{value!r}, expected one finite number >= 0")
                elif value is not None and (  # SGD without momentum keeps None
                        not isinstance(value, torch.Tensor)
                        or tuple(value.shape) != shapes[i]):
                    got = (tuple(value.shape) if isinstance(value, torch.Tensor)
                           else type(value).__name__)
                    raise ValueError(f"optimizer checkpoint: parameter {i}'s {key} is "
                                     f"{got}, expected a tensor of its shape "
                                     f"{shapes[i]}")
    if masters is not None:
        if len(masters) != len(shapes):
            raise ValueError(f"optimizer checkpoint holds {len(masters)} fp32 master "
                             f"weights, this stage has {len(shapes)} parameters")
        for i, (m, shape) in enumerate(zip(masters, shapes)):
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != shape:
                got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(f"optimizer checkpoint: fp32 master weight {i} is {got}, "
                                 f"expected {shape}")


def _first_difference(saved: List[tuple], ours: List[tuple]) -> str:
    for i, (a, b) in enumerate(zip(saved, ours)):
        if a != b:
            return f"(parameter {i}: saved {a}, here {b})"
    return ""


_GROUP_FLAGS = (("betas", 0, "--adam-beta1"), ("betas", 1, "--adam-beta2"),
                ("eps", None, "--adam-eps"), ("momentum", None, "--sgd-momentum"))
"""Hyper-parameters torch's ``load_state_dict`` takes from the saved param groups (the
learning rate and weight decay are set again at every step), and their flags."""


def group_flag_values(groups: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """{flag: value} of the ``_GROUP_FLAGS`` the optimizer's param groups hold (every
    group is built from the same flags: the first that holds the key gives it)."""
    out: Dict[str, Any] = {}
    for key, index, flag in _GROUP_FLAGS:
        group = next((g for g in groups if key in g), None)
        if group is not None:
            value = group[key]
            out[flag] = float(value[index] if index is not None else value)
    return out


def kept_from_checkpoint(ours: Dict[str, Any], loaded: Dict[str, Any]) -> List[str]:
    """The flags whose value the loaded state replaced, each with both values: as in
    Megatron-LM, a resumed optimizer keeps the checkpoint's betas, eps and momentum."""
    return [f"{flag} {loaded[flag]!r} (this run gives {ours[flag]!r})"
            for flag in ours if flag in loaded and loaded[flag] != ours[flag]]

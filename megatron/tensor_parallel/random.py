"""Random-number streams for dropout under tensor parallelism, and their replay.

Two streams, as Megatron:
  * the default torch generator, seeded identically on every rank of a tensor group:
    dropout on replicated activations (embeddings, residual branches) must draw the
    same mask on all of them;
  * the tracker's "model-parallel" stream, seeded ``seed + 2718 + tp_rank``: dropout on
    partitioned activations (attention probabilities of this rank's heads) must differ.

Code that must replay a forward pass bit for bit (the pipeline executor when it
recomputes a stage, activation checkpointing, checkpoint save/load) captures every
stream with ``get_rng_state()`` and puts them back with ``set_rng_state()``.

The tracker swaps its state into the default generator of its device type: the CPU
generator when seeded for a CPU device, the current CUDA generator for a CUDA device.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Union

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718


def _device_type(device: Union[str, torch.device, None]) -> str:
    return torch.device(device).type if device is not None else "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in around a block of code."""

    def __init__(self) -> None:
        self._states: Dict[str, torch.Tensor] = {}
        self._device_type = "cpu"

    def reset(self) -> None:
        self._states = {}

    def add(self, name: str, seed: int, device: Union[str, torch.device, None] = None) -> None:
        """Create stream ``name`` seeded with ``seed`` on ``device``'s generator."""
        if name in self._states:
            raise ValueError(f"RNG tracker: stream {name!r} already exists (call reset() first)")
        device_type = _device_type(device)
        if self._states and device_type != self._device_type:
            raise ValueError(f"RNG tracker: streams on {self._device_type} and "
                             f"{device_type} cannot be mixed")
        self._device_type = device_type
        saved = _get_state(device_type)
        if device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = _get_state(device_type)
        _set_state(device_type, saved)

    def has(self, name: str) -> bool:
        return name in self._states

    def get_states(self) -> dict:
        """Copy of every stream (and the device type they belong to)."""
        return {"device_type": self._device_type,
                "states": {k: v.clone() for k, v in self._states.items()}}

    def set_states(self, states: dict) -> None:
        self._device_type = states["device_type"]
        self._states = {k: v.clone() for k, v in states["states"].items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block drawing from stream ``name``; the default stream is untouched."""
        if name not in self._states:
            raise RuntimeError(
                f"RNG tracker: stream {name!r} was never seeded; call "
                f"megatron.tensor_parallel.model_parallel_seed(seed, tp_rank, device) "
                f"before running a model with attention dropout")
        saved = _get_state(self._device_type)
        _set_state(self._device_type, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self._device_type)
            _set_state(self._device_type, saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (one model per process, as Megatron)."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int = 0,
                        device: Union[str, torch.device, None] = None) -> None:
    """Seed the default generators with ``seed`` and the TP stream with seed+2718+tp_rank.

    Callers add any per-pipeline-stage offset to ``seed`` themselves.
    """
    torch.manual_seed(seed)  # CPU and every CUDA device
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank, device)


def get_rng_state() -> dict:
    """Everything dropout draws from: CPU, CUDA (if available) and the tracker."""
    cuda: Optional[torch.Tensor] = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda, "tracker": _TRACKER.get_states()}


def set_rng_state(state: dict) -> None:
    """Restore what ``get_rng_state`` captured."""
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    _TRACKER.set_states(state["tracker"])


class _TrackerReplay:
    """Context pair for torch.utils.checkpoint: the recomputation sees the tracker as
    the original forward did, and afterwards the tracker continues where it was."""

    def __init__(self) -> None:
        self._snapshot: Optional[dict] = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        self._snapshot = _TRACKER.get_states()
        yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        current = _TRACKER.get_states()
        _TRACKER.set_states(self._snapshot)
        try:
            yield
        finally:
            _TRACKER.set_states(current)


def checkpoint(function, *args, **kwargs):
    """Non-reentrant activation checkpointing that also replays the tracker's streams."""
    replay = _TrackerReplay()
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False,
        context_fn=lambda: (replay.forward(), replay.recompute()), **kwargs)

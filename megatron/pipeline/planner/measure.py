"""How tools/profile_model.py measures a piece of a model on a device: the bytes autograd
saves for the backward pass (the pipeline executor's ``StashTracker``), forward and
backward times (median of timed runs, after warm-up ones), the trainer's optimizer step
over a piece's parameters, and the model of a stage's step those steps give
(``optimizer_step_model``).  ``megatron.pipeline.planner.profile`` reads what they
measured."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron.config import ModelConfig, OptimizerConfig, PrecisionConfig
from megatron.pipeline.memory import StashTracker


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_storage_ptrs(module: nn.Module) -> set:
    """Storages of a module's parameters (left out of activation counts, as the engine)."""
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def param_count(module: nn.Module) -> Tuple[int, int]:
    """(parameters, bytes) of a module."""
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def saved_activation_bytes(run: Callable[[], Any], weight_ptrs: set) -> Tuple[Any, int]:
    """Run ``run()`` and count the bytes autograd saves for backward during it
    (``megatron.pipeline.memory.StashTracker``: distinct storages, weights excluded)."""
    tracker = StashTracker(weight_ptrs)
    with tracker.counting(0):
        out = run()
    return out, tracker.in_flight.get(0, 0)


def trainer_grad_dtype(config: ModelConfig) -> Optional[torch.dtype]:
    """The dtype the trainer's gradients of ``config``'s weights accumulate in by
    default: float32 under bf16 (``--bf16`` turns --accumulate-allreduce-grads-in-fp32
    on), else the weights' own (None)."""
    from megatron.config import GRAD_DTYPE_SUPPORTED
    if config.params_dtype == torch.bfloat16 and GRAD_DTYPE_SUPPORTED:
        return torch.float32
    return None


def widen_grads(module: nn.Module, grad_dtype: Optional[torch.dtype]) -> None:
    """Gradients of ``module`` accumulate in ``grad_dtype`` (as the trainer's do): the
    backward pays the same cast per parameter."""
    from megatron.pipeline.weights import set_grad_dtype
    if grad_dtype is not None:
        set_grad_dtype(module.parameters(), grad_dtype)


def measure(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None],
            module: nn.Module, weight_ptrs: set, device: torch.device, warmup: int,
            repeat: int, per_sync: int = 1, units: int = 1) -> Dict[str, Any]:
    """Median forward/backward time, counted stash bytes (identical every run) and,
    on CUDA, the allocator's view of the forward.  ``units``: ``forward`` runs that many
    identical pieces in a chain; times, stash bytes and allocator bytes are per piece
    (the chain's divided by ``units``).

    The stash is counted in passes of its own, before the timed runs: the saved-tensor
    hooks do Python work per saved tensor, which inside the timed region swamped the
    forward time of a block on a GPU (the same 1.30 ms at b=1 and b=8 on an H100).

    ``per_sync`` > 1 (the CUDA default): each timed sample runs that many forwards back
    to back, then their backwards, with one synchronisation per phase, and divides.  The
    trainer never synchronises between layers, so the host queues kernels while the GPU
    runs earlier ones; one synchronised forward per sample times the host's launch work
    and the GPU's work one after the other, which overstated an H100's step by 1.3-1.7x
    (bench/planner_validation.py --cuda)."""
    fwd, bwd, fwd_cpu, bwd_cpu, counts = [], [], [], [], set()
    cuda_stats: Dict[str, int] = {}
    for _ in range(2):  # twice: the count must not depend on the run
        for p in module.parameters():
            p.grad = None
        out, nbytes = saved_activation_bytes(forward, weight_ptrs)
        counts.add(nbytes)
        backward(out)
        del out
    if device.type == "cuda":  # the allocator's view of one forward, untimed
        for p in module.parameters():
            p.grad = None
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = forward()
        _sync(device)
        cuda_stats = {"cuda_forward_peak_bytes": torch.cuda.max_memory_allocated(device) - base,
                      "cuda_retained_bytes": torch.cuda.memory_allocated(device) - base}
        backward(out)
        del out
        # queued forwards keep their activations until their backwards: stay within half
        # of the free memory (a 16 GB card profiling a large head at b=8 queues fewer)
        free, _ = torch.cuda.mem_get_info(device)
        per_sync = max(1, min(per_sync, int(0.5 * free)
                              // max(1, cuda_stats["cuda_forward_peak_bytes"])))
    for i in range(warmup + repeat):
        for p in module.parameters():
            p.grad = None
        _sync(device)
        c0, t0 = time.thread_time(), time.perf_counter()
        outs = [forward() for _ in range(per_sync)]
        _sync(device)
        c1, t1 = time.thread_time(), time.perf_counter()
        for out in reversed(outs):
            backward(out)
        _sync(device)
        c2, t2 = time.thread_time(), time.perf_counter()
        if i >= warmup:
            fwd.append((t1 - t0) / per_sync)
            bwd.append((t2 - t1) / per_sync)
            fwd_cpu.append((c1 - c0) / per_sync)
            bwd_cpu.append((c2 - c1) / per_sync)
        del outs
    if len(counts) != 1:
        raise RuntimeError(f"saved-activation bytes changed between runs: {sorted(counts)}")
    stash = counts.pop()
    if stash % units:
        raise RuntimeError(f"a chain of {units} identical pieces saved {stash} bytes, not a "
                           f"multiple of {units}")
    per = lambda xs: [x / units for x in xs]  # noqa: E731
    fwd, bwd, fwd_cpu, bwd_cpu = per(fwd), per(bwd), per(fwd_cpu), per(bwd_cpu)
    cuda_stats = {k: v // units for k, v in cuda_stats.items()}
    out = {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
           "forward_cpu_s": statistics.median(fwd_cpu),
           "backward_cpu_s": statistics.median(bwd_cpu),
           "stash_bytes": stash // units, "forward_samples_s": fwd, "backward_samples_s": bwd,
           "runs_per_sync": per_sync, **cuda_stats}
    if units > 1:
        out["chained"] = units
    return out


def optimizer_step_time(params: Sequence[nn.Parameter], config: ModelConfig,
                        optimizer: str, warmup: int, repeat: int,
                        device: torch.device) -> Tuple[float, float]:
    """Median (wall, thread CPU) seconds of the trainer's optimizer step over ``params``
    (fake gradients)."""
    from megatron.optimizer import get_megatron_optimizer
    dtype = config.params_dtype
    prec = PrecisionConfig(fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16,
                           fp64=dtype == torch.float64, loss_scale=1.0)
    params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=optimizer), prec, params)
    grad_dtype = trainer_grad_dtype(config) or dtype
    for p in params:
        p.grad_dtype = grad_dtype
    times, cpu = [], []
    for i in range(warmup + repeat):
        for p in params:
            p.grad = torch.full_like(p, 1e-3, dtype=grad_dtype)
        _sync(device)
        c0, t0 = time.thread_time(), time.perf_counter()
        opt.step(grads_from=params, write_to=params, base=params, lr=1e-4)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return statistics.median(times), statistics.median(cpu)


def optimizer_step_model(calls: Dict[str, float], chain: int) -> Dict[str, float]:
    """A stage's optimizer step as ``fixed + sum of its pieces' marginal costs``, from
    steps timed over each piece's parameters alone (``calls``; ``"blocks"``: the chain of
    ``chain`` blocks).  The trainer runs one step over a whole stage; on a GPU a step's
    launches and statistics cost about the same for one block as for 24 (an H100 steps
    one GPT-345M block in 0.99 ms), so summing per-piece calls overstated a 24-layer
    stage's step by about 20 ms.  The chain separates the two: per block
    (T(chain) - T(1)) / (chain - 1), fixed = T(1) - per block; every other piece costs
    its call minus the fixed part.  With one block in the chain nothing separates them:
    fixed 0 and each piece its whole call (the sum, as before)."""
    if chain > 1 and "blocks" in calls:
        per_block = max((calls["blocks"] - calls["block"]) / (chain - 1), 0.0)
        fixed = max(calls["block"] - per_block, 0.0)
    else:
        per_block, fixed = calls["block"], 0.0
    out = {"fixed": fixed, "block": per_block}
    for key in ("embedding", "head", "tied_embedding"):
        out[key] = max(calls[key] - fixed, 0.0)
    return out

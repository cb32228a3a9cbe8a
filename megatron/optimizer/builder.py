"""Build one stage's ``MegatronOptimizer`` from the optimizer and precision arguments.

``get_megatron_optimizer`` decides what the update runs on (fp32 master copies of half
precision weights, or the weights themselves), plans the distributed optimizer's shard,
makes one main parameter per model parameter or per owned piece, puts them in the
stage's weight-decay groups (``megatron.optimizer.param_groups``) and picks the torch
optimizer and the loss scaler.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from megatron.optimizer.optimizer import MegatronOptimizer
from megatron.optimizer.param_groups import GroupLayout
from megatron.optimizer.sharding import Piece, flat_view, plan_shard

OPTIMIZERS = ("adam", "sgd")
_HALF = (torch.float16, torch.bfloat16)


def get_megatron_optimizer(opt_cfg: Any, prec_cfg: Any, params: Sequence[nn.Parameter],
                           model_groups: Any = None, tp_rank: int = 0, *,
                           log_num_zeros: bool = False,
                           grads_to_none: bool = True,
                           log_params_norm: bool = False,
                           dp_group: Any = None) -> MegatronOptimizer:
    """Build the optimizer for one stage; ``params`` is the stage's (first) weight buffer.

    ``model_groups``: process group over the tensor x pipeline ranks of one model replica
    (None in a single process).  ``tp_rank`` decides who counts replicated parameters.
    ``dp_group``: the stage's data-parallel group (None: one replica), over which the
    replicas agree to skip a step and ``opt_cfg.use_distributed_optimizer`` shards the
    state.
    """
    params = list(params)
    if not params:
        raise ValueError("get_megatron_optimizer: the stage has no parameters")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("get_megatron_optimizer: a parameter appears twice in params")
    if opt_cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, "
                         f"got {opt_cfg.optimizer!r}")
    if prec_cfg.fp16 and prec_cfg.bf16:
        raise ValueError("--fp16 and --bf16 are mutually exclusive")
    use_masters = prec_cfg.fp32_master_weights and any(p.dtype in _HALF for p in params)
    shard = None
    if getattr(opt_cfg, "use_distributed_optimizer", False):
        shard = plan_shard(params, dp_group, getattr(prec_cfg, "grad_dtype", None),
                           getattr(opt_cfg, "ddp_bucket_size", None))
    # one main parameter per model parameter, or per piece this rank owns
    units: List[Tuple[int, Optional[Piece]]] = (
        [(pc.param, pc) for pc in shard.pieces()] if shard is not None
        else [(i, None) for i in range(len(params))])

    def weights(i: int, pc: Optional[Piece]) -> torch.Tensor:
        # p.data, not p.detach(): a detached tensor shares p's autograd version counter,
        # so updates that MegatronOptimizer._step_in_buffer writes into ANOTHER buffer
        # (main.data is re-pointed under 2BW) would bump this buffer's version and fail
        # the saved-tensor check of a microbatch in flight on it.
        return params[i].data if pc is None else flat_view(params[i].data, pc)

    if use_masters:
        main = [nn.Parameter(weights(i, pc).to(torch.float32, copy=True)) for i, pc in units]
    else:
        main = [nn.Parameter(weights(i, pc)) for i, pc in units]

    # Decay matrices only: biases and LayerNorm weights (1-D) are not decayed; with
    # --decoupled-lr the input and output layers' weights get groups of their own
    # (``megatron.optimizer.param_groups``).  The groups are those of the whole stage;
    # a distributed optimizer's hold its own pieces, each in its parameter's group.
    layout = GroupLayout.build(params, opt_cfg.weight_decay,
                               getattr(opt_cfg, "decoupled_lr", None) is not None)
    groups = []
    for ids, wd in zip(layout.members, layout.weight_decay):
        members = set(ids)
        groups.append({"params": [m for m, (i, _) in zip(main, units) if i in members],
                       "weight_decay": wd})
    if opt_cfg.optimizer == "adam":
        # torch's fused kernel, on CUDA and on the CPU alike: one call for all tensors.
        # On the CPU a one-off timing of the 32 tensors of a small GPT stage gave 0.50 ms
        # per step against 1.40 ms for the default per-tensor loop (its effect on a whole
        # step is in bench/pipeline_schedules.py).  It agrees with the loop to rounding
        # (tests/unit/test_optimizer.py::test_fused_adam_agrees_with_torch_default_loop).
        kwargs = {"fused": True}
        torch_opt: torch.optim.Optimizer = torch.optim.AdamW(
            groups, lr=opt_cfg.lr, betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
            eps=opt_cfg.adam_eps, **kwargs)
    else:
        torch_opt = torch.optim.SGD(groups, lr=opt_cfg.lr, momentum=opt_cfg.sgd_momentum)

    if prec_cfg.fp16 and prec_cfg.loss_scale is None:
        scaler: GradScaler = DynamicGradScaler(
            prec_cfg.initial_loss_scale, prec_cfg.min_loss_scale, growth_factor=2.0,
            backoff_factor=0.5, growth_interval=prec_cfg.loss_scale_window,
            hysteresis=prec_cfg.hysteresis)
    elif (prec_cfg.fp16 or prec_cfg.bf16) and prec_cfg.loss_scale is not None:
        # Megatron-LM: --loss-scale is a constant scale under --bf16 as well (bf16 needs
        # none by default); an fp32 run has no scaler (arguments warn)
        scaler = ConstantGradScaler(prec_cfg.loss_scale)
    else:
        scaler = ConstantGradScaler(1.0)
    opt = MegatronOptimizer(torch_opt, main, params, scaler=scaler, use_masters=use_masters,
                            skip_on_nonfinite=bool(prec_cfg.fp16), clip_grad=opt_cfg.clip_grad,
                            model_groups=model_groups, tp_rank=tp_rank,
                            log_num_zeros=log_num_zeros, grads_to_none=grads_to_none,
                            name=opt_cfg.optimizer, log_params_norm=log_params_norm,
                            shard=shard, layout=layout, dp_group=dp_group)
    if opt.gather is not None:
        opt.gather.overlap = bool(getattr(opt_cfg, "overlap_param_gather", False))
    return opt

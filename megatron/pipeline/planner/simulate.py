"""Run a planner configuration through the event simulator (``megatron.pipeline.simulator``).

The closed forms of ``cost_model`` assume a steady state; the simulator executes the
real action lists of ``megatron.pipeline.schedules`` (fill, drain, step barriers, the
order of sends and receives).  Both use the same per-stage costs:

* F / B of stage i: ``StageCost.forward_s`` / ``backward_s`` (recompute included);
* a send or a receive across boundary i -> i+1 occupies its stage for one transfer
  of s b h fp16 values (s b h / t with sequence parallelism: ``CostModel.boundary_bytes``)
  over that boundary's link, so a stage pays, per microbatch and per boundary, an
  activation and a gradient: the cost model's p2p time;
* REDUCE_GRADS: the stage's all-reduce time, except for 2bw when the cost model lets
  the next batch's compute hide it (Appendix A's max_i max(m slot_i, AR_i)): then it
  costs nothing on the stage and ``simulated_batch_time`` takes the longest all-reduce
  as a lower bound on the batch time;
* STEP: a barrier across stages (as in the simulator), then the stage's optimizer
  update ``StageCost.step_s`` (0 with closed-form costs; measured with a profile).

``profile=Profile.load(path)`` (``profile.py``) prices F, B and STEP from measurements.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

from .cost_model import Config, CostModel, CostOptions, StageCost
from .hardware import HardwareSpec, Links
from .model_spec import ModelSpec

if TYPE_CHECKING:
    from .profile import Profile


def _simulator():
    try:
        from megatron.pipeline import schedules, simulator
    except ImportError as exc:  # the simulator is a separate module of the project
        raise ImportError("planner.simulate needs megatron.pipeline.simulator and "
                          f"megatron.pipeline.schedules: {exc}") from exc
    return schedules, simulator


def action_cost(config: Config, stages: Sequence[StageCost], links: Links,
                activation_bytes: float, options: CostOptions) -> Callable:
    """Cost function over actions for ``simulator.simulate``."""
    from megatron.pipeline.actions import Op
    hide_reduce = config.schedule == "2bw" and options.overlap_grad_reduce_2bw
    hop: List[float] = [activation_bytes / bw for bw in links.boundary]  # boundary i -> i+1

    def cost(a) -> float:
        s = stages[a.stage]
        if a.op is Op.FORWARD:
            return s.forward_s
        if a.op is Op.BACKWARD:
            return s.backward_s
        if a.op in (Op.SEND_ACT, Op.RECV_GRAD):
            return hop[a.stage]
        if a.op in (Op.RECV_ACT, Op.SEND_GRAD):
            return hop[a.stage - 1]
        if a.op is Op.REDUCE_GRADS:
            # Hidden: it runs beside the next batch (simulated_batch_time bounds the
            # batch by its length, as the simulator has no asynchronous collectives).
            # Otherwise what is left after the last backward (the executor's bucket
            # hooks overlap the rest of the data-parallel part with it).
            return 0.0 if hide_reduce else s.dp_exposed_s + (s.allreduce_s - s.dp_allreduce_s)
        if a.op is Op.STEP:
            return s.step_s
        return 0.0
    return cost


def simulate_config(config: Config, model: ModelSpec, hardware: HardwareSpec, *,
                    num_batches: int = 1, options: CostOptions = CostOptions(),
                    profile: Optional["Profile"] = None):
    """``SimResult`` of ``num_batches`` batches of one pipeline of ``config``
    (profile-based costs when ``profile`` is given)."""
    schedules, simulator = _simulator()
    cm = CostModel(model, hardware, options, profile)
    stages = cm.stage_costs(config)
    est = cm.estimate(config)
    schedule = schedules.build_schedule(config.schedule, config.d, config.m, num_batches)
    cost = action_cost(config, stages, est.links, cm.boundary_bytes(config), options)
    # the executor defers 2BW's step agreement until batch b+2 (no per-step barrier)
    return simulator.simulate(schedule, cost, comm_latency=0.0,
                              deferred_steps=config.schedule == "2bw")


def simulated_batch_time(config: Config, model: ModelSpec, hardware: HardwareSpec, *,
                         options: CostOptions = CostOptions(), batches: int = 3,
                         profile: Optional["Profile"] = None) -> float:
    """Steady-state seconds per batch: makespan(batches + 1) - makespan(batches), so
    2bw's one-off fill and drain drop out as they do in the closed form.  A hidden
    (asynchronous) all-reduce still needs its own duration per batch."""
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    short = simulate_config(config, model, hardware, num_batches=batches, options=options,
                            profile=profile)
    longer = simulate_config(config, model, hardware, num_batches=batches + 1,
                             options=options, profile=profile)
    per_batch = longer.makespan - short.makespan
    if config.schedule == "2bw" and options.overlap_grad_reduce_2bw:
        # what the executor cannot hide (the simulator has no asynchronous collectives):
        # the closed form's term, so both price the same waits
        stages = CostModel(model, hardware, options, profile).stage_costs(config)
        if not options.appendix_a_2bw:
            per_batch += CostModel.exposed_allreduce_2bw(stages, config.m)
        per_batch = max(per_batch, max(s.allreduce_s for s in stages))
    return per_batch

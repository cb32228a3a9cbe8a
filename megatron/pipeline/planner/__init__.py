"""PipeDream-2BW planner: closed-form cost model (paper Appendix A) and Algorithm 1.

    from megatron.pipeline.planner import best_plan, command_line, get_model, get_hardware
    row = best_plan(get_model("gpt-2.2b"), get_hardware("p3.16xlarge"), 64, 512)
    print(command_line(row, get_model("gpt-2.2b")))

Modules: ``model_spec`` (sizes, FLOPs), ``activations`` (its activation bytes),
``hardware`` (clusters, links), ``cost_model`` (THROUGHPUT(.) / MEMORY(.)), ``presets``
(named models/clusters), ``search`` (Algorithm 1, command line), ``simulate`` (the same
costs through the event simulator of ``megatron.pipeline.simulator``); ``profile`` (the
measured costs tools/profile_model.py writes, timed with ``measure``).
"""
from .cost_model import SCHEDULES, Config, CostModel, CostOptions, Estimate, StageCost
from .hardware import HardwareSpec
from .model_spec import ModelSpec
from .presets import HARDWARE_PRESETS, MODEL_PRESETS, get_hardware, get_model
from .search import PlanningError, PlanRow, best_plan, command_line, format_table, search

__all__ = [
    "SCHEDULES", "Config", "CostModel", "CostOptions", "Estimate", "StageCost",
    "HardwareSpec", "ModelSpec", "HARDWARE_PRESETS", "MODEL_PRESETS", "get_hardware",
    "get_model", "PlanningError", "PlanRow", "best_plan", "command_line", "format_table",
    "search",
]

"""PipeDream-2BW, PipeDream-Flush, GPipe and no-pipelining schedules.

* ``actions``/``schedules``: each stage's ordered action list, as data.
* ``validate``/``simulator``: checks and cost-model runs of those lists, no processes.
* ``engine``: runs one rank's list on real process groups (``PipelineEngine``).
* ``weights``: the one or two weight buffers of a stage (2BW's double buffering).
* ``p2p``: non-blocking sends and blocking receives between neighbouring stages.
* ``memory``: measured stashed-activation and weight-version counters.
* ``planner``: cost model and search over (w, d, b, recompute, schedule).
"""
SCHEDULES = ("none", "gpipe", "flush", "2bw")

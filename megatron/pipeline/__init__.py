"""PipeDream-2BW, PipeDream-Flush, GPipe and no-pipelining schedules.

* ``actions``/``schedules``: each stage's ordered action list, as data.
* ``validate``/``simulator``: checks and cost-model runs of those lists, no processes.
* ``engine``: runs one rank's list on real process groups (``PipelineEngine``),
  dispatching each action to its handler.
* ``stage_plan``: the stage's list of each segment shape, built once (``StagePlans``).
* ``update``: the gradient sums and optimizer steps those handlers start (``Updater``).
* ``weights``: the one or two weight buffers of a stage (2BW's double buffering).
* ``grad_reduction``/``param_gather``: bucketed data-parallel gradient reduction
  overlapped with the backward pass, and the distributed optimizer's weight gathers.
* ``p2p``: non-blocking sends and blocking receives between neighbouring stages.
* ``memory``: measured stashed-activation and weight-version counters.
* ``trace``/``timeline_plot``: the executor's and simulator's timeline events and
  their drawing (``tools/draw_timeline.py``).
* ``planner``: cost model and search over (w, d, b, recompute, schedule).
"""
SCHEDULES = ("none", "gpipe", "flush", "2bw")

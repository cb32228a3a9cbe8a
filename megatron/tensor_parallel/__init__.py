"""Tensor (intra-layer) model parallelism: Megatron's column/row split of each layer."""
from megatron.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding,
                                             linear_with_sequence_gather)
from megatron.tensor_parallel.mappings import (copy_to_tp_region, gather_from_tp_region,
                                               gather_from_sequence_parallel_region,
                                               reduce_from_tp_region,
                                               reduce_scatter_to_sequence_parallel_region,
                                               scatter_to_sequence_parallel_region,
                                               scatter_to_tp_region)
from megatron.tensor_parallel.param_init import (InitKey, InitMethod, init_method_normal,
                                                 init_method_xavier_uniform,
                                                 mark_replicated_parameters,
                                                 scaled_init_method_normal)
from megatron.tensor_parallel.random import (RNGStatesTracker, checkpoint, get_rng_state,
                                             get_rng_tracker, model_parallel_seed,
                                             set_rng_state)
from megatron.tensor_parallel.utils import TPInfo, divide, split_along_last_dim

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "copy_to_tp_region", "reduce_from_tp_region",
    "gather_from_tp_region", "scatter_to_tp_region", "linear_with_sequence_gather",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "InitKey", "InitMethod", "init_method_normal",
    "init_method_xavier_uniform", "scaled_init_method_normal", "mark_replicated_parameters",
    "RNGStatesTracker",
    "checkpoint", "get_rng_state", "set_rng_state", "get_rng_tracker",
    "model_parallel_seed", "TPInfo", "divide", "split_along_last_dim",
]

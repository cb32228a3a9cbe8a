"""A GPT built with every compatible new block option at once -- --squared-relu,
--init-method-xavier-uniform, --rotary-interleaved, --rotary-seq-len-interpolation-factor,
--apply-residual-connection-post-layernorm (with RoPE and grouped-query attention) --
on 2 gloo tensor ranks has the single-process model's initial weights, loss, gradients
and logits (float64), also cut into 2 pipeline stages and with sequence parallelism.
"""
from __future__ import annotations

from tests.dist_utils import run_distributed
from tests.distributed.test_sequence_parallel import _gpt_variant
from tests.distributed.test_tensor_parallel import _check_variant, _tp

OPTIONS = dict(squared_relu=True, init_method_xavier_uniform=True,
               position_embedding_type="rope", rotary_interleaved=True,
               rotary_seq_len_interpolation_factor=4.0,
               apply_residual_connection_post_layernorm=True, num_query_groups=2)


def _worker(rank: int, world_size: int) -> bool:
    tp = _tp(rank, world_size)
    _check_variant(tp, pp=1, tied=True, recompute=OPTIONS)
    _check_variant(tp, pp=2, tied=False, recompute={**OPTIONS, "rotary_percent": 0.5})
    _check_variant(tp, pp=1, tied=False,
                   recompute={**OPTIONS, "recompute_granularity": "selective"})
    # sequence parallelism: the norms' partial gradients summed over ranks, as the trainer
    _gpt_variant(tp, 2, "all new options, sequence parallel", tied=False, **OPTIONS)
    return True


def test_all_new_options_tp2_match_single_process():
    results = run_distributed(_worker, world_size=2)
    assert results == [True, True], results

"""QA pass 58: tensor (t = 2) and sequence parallelism against the one-process model and
Megatron-LM's semantics, on 2 gloo ranks in float64.

* Vocab-parallel cross-entropy and embedding with a padded vocabulary: targets and ids on
  both sides of the shard boundary and in the padding rows (which, as in Megatron-LM,
  take part in the softmax: nothing is masked), chunked one row at a time, by default
  and through --cross-entropy-loss-fusion's kernels.
* Block options the earlier t = 2 tests leave out -- --add-qkv-bias without other biases,
  --kv-channels other than hidden / heads with --rotary-percent 0.5, --qk-layernorm with
  RMSNorm and grouped-query attention of one group per rank -- give the one-process
  loss and gradients, with and without --sequence-parallel.
* Trainer: with attention dropout alone, t = 2 with --sequence-parallel draws the masks
  of t = 2 without it (both from the tensor-parallel stream, as in Megatron-LM), and
  with every dropout on, a --sequence-parallel run resumed from its checkpoint (which
  holds each tensor rank's tracker stream) continues bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.tensor_parallel import (InitKey, TPInfo, VocabParallelEmbedding,
                                      vocab_parallel_cross_entropy)
from tests.dist_utils import run_distributed
from tests.distributed.gpt_harness import TINY, train_configs
from tests.distributed.test_sequence_parallel import _gpt_variant
from tests.distributed.test_tensor_parallel import _close, _gather, _tp

TRUE_VOCAB, PADDED = 13, 16      # 13 ids padded to 16 rows: rank 0 holds 0..7, rank 1 8..15


def _vocab_checks(tp: TPInfo) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 4, PADDED, generator=gen, dtype=torch.float64) * 20
    # both sides of the boundary (7 | 8), the ends, the last real id and padding rows
    target = torch.tensor([[7, 8, 0, 15], [12, 13, 7, 8], [1, 9, 14, 6]])
    upstream = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, PADDED), target.view(-1), reduction="none").view(3, 4)
    (ref * upstream).sum().backward()
    for kw in (dict(chunk_rows=1), dict(inplace_backward=True), dict(fused=True)):
        part = logits.chunk(2, dim=-1)[tp.rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(part.clone() if kw.get("inplace_backward")
                                            else part, target, tp, **kw)
        (loss * upstream).sum().backward()
        _close(loss, ref.detach(), f"cross-entropy loss {kw}")
        _close(part.grad, full.grad.chunk(2, dim=-1)[tp.rank], f"cross-entropy grad {kw}")

    key = InitKey(3, 0, "table")
    ids = torch.tensor([[7, 8, 0, 15, 12], [8, 7, 13, 1, 9]])
    single = VocabParallelEmbedding(PADDED, 4, tp=TPInfo.single(), params_dtype=torch.float64,
                                    init_key=key)
    par = VocabParallelEmbedding(PADDED, 4, tp=tp, params_dtype=torch.float64, init_key=key)
    out_s, out_p = single(ids), par(ids)
    _close(out_p, out_s, "embedding output at the boundary")
    (out_s * out_s.detach()).sum().backward()
    (out_p * out_p.detach()).sum().backward()
    _close(_gather(par.weight.grad, tp, 0), single.weight.grad, "embedding grad")


VARIANTS = [
    ("qkv bias only", dict(add_bias_linear=False, add_qkv_bias=True)),
    ("kv-channels 6, RoPE 50%", dict(kv_channels=6, position_embedding_type="rope",
                                     rotary_percent=0.5)),
    ("qk-layernorm, RMSNorm, 2 groups", dict(qk_layernorm=True, normalization="RMSNorm",
                                             num_query_groups=2)),
]


def _model_worker(rank: int, world_size: int) -> bool:
    tp = _tp(rank, world_size)
    _vocab_checks(tp)
    from tests.distributed.test_tensor_parallel import _check_variant
    for what, options in VARIANTS:
        _check_variant(tp, pp=1, tied=True, recompute=options)       # t = 2
        _gpt_variant(tp, 1, f"{what}, sequence parallel", tied=False, **options)
    return True


def test_vocab_edges_and_block_options_match_single_process():
    assert run_distributed(_model_worker, world_size=2, timeout=300) == [True, True]


def _argv(*extra: str, hidden: str = "0.2", attention: str = "0.2", iters: str = "3"):
    base = list(TINY)
    base[base.index("--hidden-dropout") + 1] = hidden
    base[base.index("--attention-dropout") + 1] = attention
    base[base.index("--train-iters") + 1] = iters
    return base + ["--tensor-model-parallel-size", "2", "--pipeline-schedule", "flush", *extra]


def test_dropout_streams_and_resume_under_sequence_parallelism(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    sp = ["--sequence-parallel"]
    configs = [("attn_sp", _argv(*sp, hidden="0", iters="2"), None),
               ("attn_plain", _argv(hidden="0", iters="2"), None),
               ("full", _argv(*sp), None),
               ("first", _argv(*sp, "--save", ckpt, "--exit-interval", "2"), None),
               ("second", _argv(*sp, "--load", ckpt), None)]
    res = run_distributed(train_configs, 2, args=(configs,), timeout=300)[0]
    a, b = res["attn_sp"], res["attn_plain"]
    assert sorted(a["losses"]) == [1, 2]
    for it, loss in b["losses"].items():
        assert abs(a["losses"][it] - loss) < 1e-12, (it, a["losses"][it], loss)
    full, first, second = (res[k]["losses"] for k in ("full", "first", "second"))
    assert sorted(first) == [1, 2] and sorted(second) == [3]
    assert first[1] == full[1] and first[2] == full[2]
    assert second[3] == full[3], (second[3], full[3])

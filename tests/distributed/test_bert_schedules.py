"""BERT under every pipeline schedule, in float64 on two gloo ranks.

* flush, gpipe and none with d = 2 and plain data parallelism (d = 1, w = 2) give the
  same losses, step for step, as single-process training;
* tensor parallelism (t = 2) gives the same losses too;
* 2BW matches them on the first batch, then trains on 1-stale weights, and resumes
  from a checkpoint exactly;
* a checkpoint saved with d = 2 loads (tools/checkpoint_util.py) into a one-stage model
  that reproduces the pipeline's evaluation loss and the d = 1 run's weights.
"""
from __future__ import annotations

import os
from typing import Dict

import pytest
import torch

from tests.distributed.test_bert_harness import ROOT, pp_args, spawn_all

def _eval_loss_of(model, valid_samples: int) -> Dict[str, float]:
    """The trainer's end-of-training evaluation (1 batch = 4 microbatches of 2), by hand."""
    import pretrain_bert
    from megatron.data.bert_dataset import BertVocabInfo, MaskingConfig, MockBertDataset
    from megatron.data.samplers import collate_samples
    from megatron.tokenizer.tokenizer import NullTokenizer

    ds = MockBertDataset(valid_samples, 16, BertVocabInfo.from_tokenizer(NullTokenizer(96)),
                         MaskingConfig(), seed=7 + 1)
    sums: Dict[str, float] = {}
    model.eval()
    with torch.no_grad():
        for mb in range(4):
            batch = collate_samples([ds[2 * mb], ds[2 * mb + 1]])
            out, loss_fn = pretrain_bert.forward_step(iter([batch]), model)
            for k, v in loss_fn(out)[1].items():
                sums[k] = sums.get(k, 0.0) + float(v) / 4
    return sums


@pytest.fixture(scope="module")
def runs():
    return spawn_all(), ROOT


@pytest.fixture(scope="module")
def single_process():
    torch.set_num_threads(1)
    import pretrain_bert

    torch.manual_seed(0)
    result = pretrain_bert.main(pp_args(1, "flush"))
    return {k: v for k, v in result.losses.items()}


def test_flush_gpipe_none_and_data_parallel_equal_single_process(runs, single_process):
    results, _ = runs
    last = results[-1]
    assert sorted(single_process) == [1, 2, 3]
    for name in ("d2_flush", "d2_gpipe", "d2_none", "d1_w2", "t2", "t2_sp"):
        losses = last[name]["losses"]
        assert sorted(losses) == [1, 2, 3], name
        for it, ref in single_process.items():
            for key in ("lm loss", "sop loss"):
                assert losses[it][key] == pytest.approx(ref[key], rel=1e-10, abs=1e-12), \
                    (name, it, key)
    # the losses must actually move, or the comparison proves little
    assert single_process[3]["lm loss"] != pytest.approx(single_process[1]["lm loss"], rel=1e-6)


def test_2bw_uses_stale_weights(runs, single_process):
    results, _ = runs
    bw = results[-1]["d2_2bw"]
    assert bw["versions"] == [0, 0, 1]
    assert bw["losses"][1]["lm loss"] == pytest.approx(single_process[1]["lm loss"], rel=1e-10)
    # batch 2 runs on W(0) under 2BW but on W(1) under flush
    assert bw["losses"][2]["lm loss"] != pytest.approx(single_process[2]["lm loss"], rel=1e-9)


def test_2bw_resumes_exactly(runs):
    last = runs[0][-1]
    first, resumed, whole = last["2bw_first"], last["2bw_resumed"], last["d2_2bw"]
    assert sorted(first["losses"]) == [1, 2] and sorted(resumed["losses"]) == [3]
    for it, losses in list(first["losses"].items()) + list(resumed["losses"].items()):
        for key, value in losses.items():
            assert value == pytest.approx(whole["losses"][it][key], rel=1e-10), (it, key)
    assert resumed["versions"] == [1]


def test_pipeline_checkpoint_loads_into_one_stage_model(runs):
    from megatron.config import ModelConfig
    from megatron.model.bert_model import BertModel
    from megatron.tensor_parallel import TPInfo
    from tools.checkpoint_util import load_into_stage, merge_checkpoint, read_checkpoint

    results, root = runs
    assert sorted(os.listdir(root / "d2" / "iter_0000003")) == ["manifest.json",
                                                                 "mp_rank_00_000",
                                                                 "mp_rank_00_001"]
    d2 = merge_checkpoint(read_checkpoint(str(root / "d2")))
    d1 = merge_checkpoint(read_checkpoint(str(root / "d1")))
    assert sorted(d2) == sorted(d1)
    for name in d1:
        torch.testing.assert_close(d2[name], d1[name], rtol=1e-9, atol=1e-12, msg=name)
    cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                      padded_vocab_size=128, num_tokentypes=2, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.float64)
    model = BertModel(cfg, TPInfo.single(), seed=123)
    load_into_stage(model, str(root / "d2"), layer_offset=0, tp_rank=0, tp_size=1)
    expected = results[-1]["d2_flush"]["eval"][3]
    got = _eval_loss_of(model, valid_samples=8 * 2)
    for key in ("lm loss", "sop loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-10), key

"""Pretraining sampler order, exact resumption, and the data loader."""
import numpy as np
import pytest
import torch

from megatron.data.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.data.samplers import (MegatronPretrainingSampler, build_pretraining_data_loader,
                                    collate_samples)


def _all_ranks(total, consumed, mbs, dp, drop_last=True):
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp, drop_last))
            for r in range(dp)]


def test_global_batch_order():
    ranks = _all_ranks(total=26, consumed=0, mbs=2, dp=3)
    # Six consecutive indices per step; rank r holds the r-th pair of them.
    assert ranks[0][:2] == [[0, 1], [6, 7]]
    assert ranks[1][:2] == [[2, 3], [8, 9]]
    assert ranks[2][:2] == [[4, 5], [10, 11]]
    steps = len(ranks[0])
    assert steps == 26 // 6 == len(MegatronPretrainingSampler(26, 0, 2, 0, 3))
    flat = [i for s in range(steps) for r in range(3) for i in ranks[r][s]]
    assert flat == list(range(steps * 6))


def test_no_drop_last_keeps_ranks_in_step():
    ranks = _all_ranks(total=10, consumed=0, mbs=2, dp=3, drop_last=False)
    assert [len(r) for r in ranks] == [2, 2, 2]
    assert [r[-1] for r in ranks] == [[6, 7], [8, 9], []]
    assert len(MegatronPretrainingSampler(10, 0, 2, 0, 3, drop_last=False)) == 2


@pytest.mark.parametrize("mbs,dp,steps_done", [(1, 1, 3), (2, 2, 1), (3, 2, 4), (2, 4, 2)])
def test_resume_equals_uninterrupted(mbs, dp, steps_done):
    total = 100
    full = _all_ranks(total, 0, mbs, dp)
    resumed = _all_ranks(total, steps_done * mbs * dp, mbs, dp)
    for r in range(dp):
        assert resumed[r] == full[r][steps_done:]


def test_resume_after_whole_global_batches():
    # Checkpoints are taken at global-batch boundaries, which are multiples of
    # mbs * dp: resuming after 3 global batches of 4 microbatches each.
    mbs, dp, m = 2, 2, 4
    full = _all_ranks(200, 0, mbs, dp)
    resumed = _all_ranks(200, 3 * m * mbs * dp, mbs, dp)
    assert all(resumed[r] == full[r][3 * m:] for r in range(dp))


@pytest.mark.parametrize("kwargs,match", [
    (dict(total_samples=0, consumed_samples=0), "no samples"),
    (dict(total_samples=10, consumed_samples=10), "consumed_samples"),
    (dict(total_samples=10, consumed_samples=0, micro_batch_size=0), "--micro-batch-size"),
    (dict(total_samples=10, consumed_samples=0, data_parallel_rank=2), "data_parallel_rank"),
])
def test_sampler_bad_input(kwargs, match):
    args = dict(micro_batch_size=1, data_parallel_rank=0, data_parallel_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MegatronPretrainingSampler(**args)


def test_collate():
    batch = collate_samples([{"text": np.arange(4)}, {"text": np.arange(4) + 10}])
    assert batch["text"].dtype == torch.int64
    assert batch["text"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]


def test_data_loader_matches_direct_indexing_and_resumes():
    torch.set_num_threads(1)
    ds = MockGPTDataset(40, 8, 100, seed=0)
    loader = build_pretraining_data_loader(ds, 8, micro_batch_size=2, dp_rank=1, dp_size=2,
                                           num_workers=0)
    batches = list(loader)
    assert len(batches) == (40 - 8) // 4
    for step, batch in enumerate(batches):
        first = 8 + step * 4 + 2  # rank 1's slice of each group of 4
        expected = np.stack([ds[first]["text"], ds[first + 1]["text"]])
        assert batch["text"].shape == (2, 9)
        np.testing.assert_array_equal(batch["text"].numpy(), expected)
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None


def test_data_loader_with_worker_process_over_indexed_data(tmp_path):
    torch.set_num_threads(1)
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    for d in range(20):
        b.add_item(np.arange(d, d + 13))
        b.end_document()
    b.finalize(str(tmp_path / "d.idx"))
    ds = GPTDataset("train", IndexedDataset(str(tmp_path / "d")), np.arange(20), 16, 10,
                    seed=0, data_cache_path=str(tmp_path / "cache"))
    loader = build_pretraining_data_loader(ds, 0, 4, 0, 1, num_workers=1)
    got = torch.cat([b["text"] for b in loader]).numpy()
    np.testing.assert_array_equal(got, np.stack([ds[i]["text"] for i in range(16)]))

"""C++ index builders (helpers.cpp) against the pure-Python references and brute force."""
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data import helpers
from megatron.data.dataset_utils import build_blending_indices_py, build_sample_idx_py


def _brute_force_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Locate token k * seq_length of the concatenated stream by listing every token."""
    locations = [(pos, off) for pos, d in enumerate(doc_idx) for off in range(sizes[d])]
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    rows = [(0, 0)] + [locations[k * seq_length] for k in range(1, num_samples + 1)]
    return np.array(rows, dtype=np.int64)


def _random_case(rng):
    n_docs = int(rng.integers(1, 12))
    sizes = rng.integers(0, 15, n_docs).astype(np.int32)
    if rng.random() < 0.3:
        sizes[rng.integers(0, n_docs)] = 0  # empty documents inside the stream
    if sizes.sum() == 0:
        sizes[0] = 1
    docs = np.arange(n_docs)
    num_epochs = int(rng.integers(1, 4))
    doc_idx = np.concatenate([rng.permutation(docs) for _ in range(num_epochs)]).astype(np.int32)
    seq_length = int(rng.integers(1, 3 * int(sizes.sum()) + 2))
    return sizes, doc_idx, seq_length, num_epochs, int(sizes.sum())


def test_sample_idx_hand_example():
    # Stream: [a0 a1 a2] [] [c0 c1 c2 c3 c4] [d0 d1], twice.  seq_length 4.
    sizes = np.array([3, 0, 5, 2], np.int32)
    doc_idx = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int64)
    expected = [[0, 0], [2, 1], [3, 0], [4, 2], [6, 3]]
    assert helpers.build_sample_idx(sizes, doc_idx, 4, 2, 10).tolist() == expected
    assert build_sample_idx_py(sizes, doc_idx, 4, 2, 10).tolist() == expected


@pytest.mark.parametrize("seed", range(8))
def test_sample_idx_cpp_equals_python_and_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        args = _random_case(rng)
        cpp = helpers.build_sample_idx(*args)
        py = build_sample_idx_py(*args)
        assert cpp.dtype == py.dtype == np.int32
        np.testing.assert_array_equal(cpp, py)
        np.testing.assert_array_equal(py, _brute_force_sample_idx(*args))


@pytest.mark.parametrize("sizes,seq_length", [
    ([1], 1),                # one token per sample boundary
    ([5, 5, 5], 5),          # boundaries land exactly on document ends
    ([10], 9),               # one document, exactly one sample
    ([0, 0, 7, 0], 3),       # empty documents at both ends
    ([2, 3], 100),           # sequence much longer than an epoch: many epochs
])
def test_sample_idx_edge_cases(sizes, seq_length):
    sizes = np.array(sizes, np.int32)
    tokens = int(sizes.sum())
    num_epochs = max(1, -(-(seq_length * 2 + 1) // tokens))
    doc_idx = np.tile(np.arange(len(sizes)), num_epochs)
    args = (sizes, doc_idx, seq_length, num_epochs, tokens)
    cpp = helpers.build_sample_idx(*args)
    np.testing.assert_array_equal(cpp, build_sample_idx_py(*args))
    np.testing.assert_array_equal(cpp, _brute_force_sample_idx(*args))
    assert cpp.shape[0] - 1 == (num_epochs * tokens - 1) // seq_length


def test_sample_idx_errors():
    sizes = np.array([4, 4], np.int32)
    with pytest.raises(RuntimeError, match="ran out of documents"):
        helpers.build_sample_idx(sizes, np.array([0, 1]), 3, 2, 8)  # claims 2 epochs, has 1
    with pytest.raises(RuntimeError, match="outside sizes"):
        helpers.build_sample_idx(sizes, np.array([0, 5]), 3, 1, 8)
    with pytest.raises(ValueError, match="positive"):
        helpers.build_sample_idx(sizes, np.array([0, 1]), 0, 1, 8)


@pytest.mark.parametrize("seed", range(6))
def test_blending_cpp_equals_python(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(10):
        n = int(rng.integers(1, 6))
        weights = rng.random(n)
        if n > 1 and rng.random() < 0.3:
            weights[rng.integers(0, n)] = 0.0
        weights = weights / weights.sum()
        size = int(rng.integers(0, 400))
        di, dsi = helpers.build_blending_indices(weights, size)
        pdi, pdsi = build_blending_indices_py(weights, size)
        assert di.dtype == pdi.dtype == np.uint8 and dsi.dtype == pdsi.dtype == np.int64
        np.testing.assert_array_equal(di, pdi)
        np.testing.assert_array_equal(dsi, pdsi)
        # Every prefix tracks the weights closely (the greedy choice keeps each
        # dataset within two samples of its share; a plain round-robin over a skewed
        # mixture would not), and each dataset's samples are taken in order 0, 1, ...
        for j in range(n):
            picks = np.flatnonzero(di == j)
            np.testing.assert_array_equal(dsi[picks], np.arange(picks.size))
            counts = np.cumsum(di == j)
            target = weights[j] * np.arange(1, size + 1)
            assert np.all(np.abs(counts - target) < 2.0)
            if weights[j] == 0:
                assert picks.size == 0


def test_blending_never_draws_zero_weight_datasets():
    # After one sample from each of the two halves every error is exactly 0, a tie the
    # zero-weight dataset 0 would win by index if it were considered at all.
    for fn in (helpers.build_blending_indices, build_blending_indices_py):
        di, _ = fn(np.array([0.0, 0.5, 0.5]), 50)
        assert 0 not in di.tolist()
        assert np.bincount(di, minlength=3).tolist() == [0, 25, 25]
        with pytest.raises(ValueError, match="positive"):
            fn(np.array([0.0, 0.0]), 3)


def test_blending_many_datasets_uses_int32():
    weights = np.full(300, 1 / 300)
    di, dsi = helpers.build_blending_indices(weights, 900)
    pdi, pdsi = build_blending_indices_py(weights, 900)
    assert di.dtype == pdi.dtype == np.int32
    np.testing.assert_array_equal(di, pdi)
    assert np.bincount(di, minlength=300).tolist() == [3] * 300


def test_missing_compiler_error_names_it(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(helpers.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        helpers._find_compiler()


def test_compiles_once_on_first_use_by_concurrent_processes(tmp_path):
    """Source-checkout path: two "ranks" start together on an empty cache; one compiles
    under the lock, the other waits and loads the very same library file."""
    code = ("import os, numpy as np\n"
            "from megatron.data import helpers\n"
            "m = helpers._load_from_cache()\n"
            "print(m.__file__, os.stat(m.__file__).st_ino)\n"
            "print(m.build_sample_idx(np.array([3], np.int32), np.array([0]), 1, 1, 3)"
            ".tolist())\n")
    env = dict(os.environ, MEGATRON_HELPERS_CACHE=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err
    first_lines = [out.strip().splitlines() for out, _ in outputs]
    for lines in first_lines:
        assert lines[0].startswith(str(tmp_path))
        assert lines[1] == "[[0, 0], [0, 1], [0, 2]]"
    assert first_lines[0][0] == first_lines[1][0]  # same path and inode: built once
    leftovers = [f for f in os.listdir(os.path.dirname(first_lines[0][0].split()[0]))
                 if ".tmp" in f]
    assert leftovers == []

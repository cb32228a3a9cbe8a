"""Device choice per backend, the nccl one-GPU-per-local-rank check, the CPU precision
warning (megatron/initialize.py), all without a GPU: torch.cuda is monkeypatched."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.arguments import ArgumentError, parse_and_validate
from megatron.initialize import (check_gpus_for_local_ranks, half_matmul_slowdown,
                                 precision_warning, resolve_backend, select_device)

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "128",
        "--pipeline-model-parallel-size", "2"]


def test_gloo_ranks_stay_on_cpu_even_with_cuda_visible():
    assert select_device("gloo", 1, cuda_available=True, device_count=8) == torch.device("cpu")


def test_nccl_ranks_take_their_local_gpu():
    assert select_device("nccl", 3, cuda_available=True, device_count=8) == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        select_device("nccl", 0, cuda_available=False, device_count=0)


def test_existing_process_group_decides_the_backend():
    # a test harness made a gloo group: its ranks must not pick nccl's CUDA device
    assert resolve_backend(None, "gloo") == "gloo"
    assert resolve_backend("nccl", "gloo") == "gloo"
    assert resolve_backend("gloo", None) == "gloo"


def test_default_backend_follows_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend(None, None) == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend(None, None) == "gloo"


def test_more_nccl_ranks_than_gpus_is_one_line():
    check_gpus_for_local_ranks("nccl", 1, 1)
    check_gpus_for_local_ranks("gloo", 4, 1)
    with pytest.raises(ArgumentError) as err:
        check_gpus_for_local_ranks("nccl", 2, 1)
    msg = str(err.value)
    assert "\n" not in msg
    assert "2 ranks" in msg and "1 GPU(s)" in msg and "--distributed-backend gloo" in msg


def _fake_gpus(monkeypatch, count: int, local_world_size: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))


@pytest.mark.parametrize("backend", [[], ["--distributed-backend", "nccl"]])
def test_launch_with_too_few_gpus_stops_before_process_groups(monkeypatch, capsys, backend):
    _fake_gpus(monkeypatch, count=1, local_world_size=2)
    with pytest.raises(SystemExit) as exc:
        parse_and_validate(BASE + backend, world_size=2)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --distributed-backend nccl needs one GPU")
    assert "--distributed-backend gloo" in err[0]


def test_gloo_launch_on_one_gpu_is_fine(monkeypatch):
    _fake_gpus(monkeypatch, count=1, local_world_size=2)
    _, cfg = parse_and_validate(BASE + ["--distributed-backend", "gloo"], world_size=2)
    assert cfg.parallel.distributed_backend == "gloo"
    _fake_gpus(monkeypatch, count=2, local_world_size=2)
    parse_and_validate(BASE, world_size=2)


def test_fp16_on_cpu_warns_with_the_measured_cost():
    msg = precision_warning(torch.float16, torch.device("cpu"), 437.0)
    assert msg.startswith("warning: --fp16 on a CPU device") and "437.0x" in msg
    assert "\n" not in msg
    assert precision_warning(torch.float16, torch.device("cuda", 0), 437.0) is None
    assert precision_warning(torch.float32, torch.device("cpu"), 1.0) is None
    # bf16 only warns where it measured slow
    assert precision_warning(torch.bfloat16, torch.device("cpu"), 1.1) is None
    assert "--bf16" in precision_warning(torch.bfloat16, torch.device("cpu"), 30.0)


def test_slowdown_probe_measures_something():
    assert half_matmul_slowdown(torch.float16, size=16, reps=1) > 0


def test_weights_are_drawn_on_the_default_device(monkeypatch):
    from megatron.tensor_parallel.param_init import InitKey, full_tensor

    seen = []
    monkeypatch.setattr(InitKey, "generator",
                        lambda self, device="cpu": seen.append(torch.device(device)))
    with torch.device("meta"):  # stands for "cuda:N": no CPU tensor, no CPU generator
        t = full_tensor((4, 3), InitKey(1, 0, "w"), lambda x, g: None, torch.bfloat16)
    assert t.device.type == "meta" and t.dtype == torch.bfloat16
    assert seen == [torch.device("meta")]


def test_cpu_initial_values_are_unchanged():
    from megatron.tensor_parallel.param_init import InitKey, full_tensor, init_method_normal

    key = InitKey(1234, 3, "mlp.dense_h_to_4h.weight")
    expected = torch.empty(8, 5).normal_(0.0, 0.02, generator=key.generator())
    got = full_tensor((8, 5), key, init_method_normal(0.02), torch.float32)
    assert got.device.type == "cpu" and torch.equal(got, expected)


def test_to_device_is_a_no_op_on_cpu():
    from megatron.initialize import to_device

    t = torch.arange(6, dtype=torch.int32)
    assert to_device(t, torch.device("cpu")) is t


def test_compile_layers_compiles_each_layer_in_place(monkeypatch):
    from megatron.config import ModelConfig
    from megatron.model import GPTModel
    from megatron.tensor_parallel import TPInfo

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                      padded_vocab_size=64)
    plain = GPTModel(cfg, TPInfo.single(), seed=3)
    cfg.compile_layers = True
    model = GPTModel(cfg, TPInfo.single(), seed=3)
    assert compiled == list(model.encoder.layers)
    assert list(model.state_dict()) == list(plain.state_dict())  # checkpoints unchanged


def test_trainer_prints_the_fp16_warning_once_on_rank_0(monkeypatch, capsys):
    from types import SimpleNamespace

    from megatron import initialize, training_setup as training

    monkeypatch.setattr(initialize, "half_matmul_slowdown", lambda dtype: 12.5)
    cfg = SimpleNamespace(model=SimpleNamespace(params_dtype=torch.float16))
    training._warn_precision(cfg, SimpleNamespace(rank=0), torch.device("cpu"))
    training._warn_precision(cfg, SimpleNamespace(rank=1), torch.device("cpu"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fp16 on a CPU device" in err[0] and "12.5x" in err[0]


_MALLINFO = r'''
import ctypes, sys
from megatron.initialize import tune_host_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
tuned = sys.argv[1] == "tuned" and tune_host_malloc()
blocks = [libc.malloc(1 << 20) for _ in range(64)]   # a microbatch's activations
during = libc.mallinfo2()
for b in blocks:
    libc.free(b)
after = libc.mallinfo2()
print(int(tuned), during.hblkhd >> 20, after.fordblks >> 20)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("mode", ["tuned", "default"])
def test_host_malloc_tuning_keeps_freed_memory_for_the_next_microbatch(mode):
    """With the tuning, 64 MiB of 1 MiB blocks come from the heap and stay there after
    free (the next microbatch reuses them without page faults); with glibc's defaults
    they are mmapped and handed back to the OS.  A fresh process for each: mallopt is
    process-wide."""
    import ctypes
    try:
        ctypes.CDLL(None).mallinfo2
    except AttributeError:
        pytest.skip("not glibc >= 2.33 (no mallinfo2)")
    out = subprocess.run([sys.executable, "-c", _MALLINFO, mode], capture_output=True,
                         text=True, cwd=REPO, timeout=120, check=True).stdout.split()
    tuned, mmapped_mib, kept_free_mib = (int(x) for x in out)
    if mode == "tuned":
        assert tuned == 1
        assert mmapped_mib < 64 and kept_free_mib >= 64
    else:
        assert mmapped_mib >= 64 and kept_free_mib < 64


def test_no_host_malloc_tuning_flag_reaches_the_config():
    assert parse_and_validate(BASE, world_size=2)[1].training.host_malloc_tuning is True
    off = parse_and_validate(BASE + ["--no-host-malloc-tuning"], world_size=2)[1]
    assert off.training.host_malloc_tuning is False

"""The MFU denominators of bench/throughput.py: a device variant never gets its family's
peak (an H100 NVL is not an SXM H100; AWS's A10G is not an A10)."""
from __future__ import annotations

import pytest

from bench.throughput import _peak_flops


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12),
    ("NVIDIA A10", 125e12), ("NVIDIA A10G", None), ("NVIDIA L4", 121e12),
    ("Tesla V100-SXM2-16GB", 125e12), ("Tesla T4", 65e12), ("NVIDIA GeForce RTX 4090", None)])
def test_peak_by_device_name(name, peak):
    assert _peak_flops(name) == peak

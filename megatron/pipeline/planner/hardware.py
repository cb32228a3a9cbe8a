"""Cluster descriptions and the link (bandwidth) each kind of traffic crosses.

A ``HardwareSpec`` is what the planner knows about a cluster: servers of
``gpus_per_server`` accelerators, their memory, their arithmetic rate and two
bandwidths (inside a server, between servers).  ``Topology`` places a
(t, w, d) configuration on it with the project's rank order

    rank = tp_rank + t * (dp_rank + w * pp_rank)          (megatron/parallel_state.py)

so tensor groups are packed first, then the data-parallel replicas of a stage, then
pipeline stages; it answers which bandwidth a tensor-parallel all-reduce, a
data-parallel all-reduce or a stage-to-stage transfer sees.

Bandwidth model (the paper's bwdth_width / bwdth_depth, Appendix A, made concrete):
a group whose ranks all live in one server uses ``intra_server_bandwidth``; a group
that spans servers goes through each server's network interface, which is shared by
every group of the same kind with a member in that server that also leaves it
(``inter_server_bandwidth`` is per server, not per GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Tuple

import numpy as np

GB = 1e9
GiB = float(2 ** 30)


@dataclass(frozen=True)
class HardwareSpec:
    """One homogeneous cluster of servers with identical accelerators."""

    name: str
    gpus_per_server: int
    """Accelerators per server (G); servers are filled in rank order."""
    gpu_memory_bytes: float
    """Memory of one accelerator as sold (e.g. 16 GiB for a V100-16GB)."""
    peak_flops: float
    """Datasheet dense half-precision rate, for reference only (not used in timing)."""
    achieved_flops: float
    """Sustained rate of a training step at large microbatches (compute efficiency)."""
    intra_server_bandwidth: float
    """Bytes/s one GPU can push to another GPU of its server (NVLink/NVSwitch)."""
    inter_server_bandwidth: float
    """Bytes/s one server can push to another server (its network interfaces, total)."""
    memory_bandwidth: float = 0.0
    """Bytes/s of device memory: prices the elementwise work tensor parallelism does not
    split (LayerNorm, dropout, residual adds).  0 ignores that work."""
    reserved_memory_bytes: float = 1.0 * GiB
    """Memory not available to the model: CUDA context, allocator fragmentation."""
    half_efficiency_tokens: float = 0.0
    """Kernel-efficiency curve: a microbatch of n = b * s tokens runs at
    achieved_flops * n / (n + half_efficiency_tokens).  0 disables the curve."""
    note: str = ""
    """Where the numbers come from."""
    bf16: bool = False
    """The accelerator computes bfloat16 at its half-precision rate (Ampere and later):
    planned commands then train in --bf16, which needs no loss scaling, not --fp16."""

    def __post_init__(self) -> None:
        if self.gpus_per_server < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_server must be >= 1")
        for attr in ("gpu_memory_bytes", "achieved_flops", "intra_server_bandwidth",
                     "inter_server_bandwidth"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"hardware {self.name!r}: {attr} must be > 0")

    @property
    def usable_memory_bytes(self) -> float:
        return self.gpu_memory_bytes - self.reserved_memory_bytes

    def flops_rate(self, tokens_per_microbatch: float) -> float:
        """Arithmetic rate for a microbatch of that many tokens (larger is faster)."""
        n = float(tokens_per_microbatch)
        return self.achieved_flops * n / (n + self.half_efficiency_tokens)

    def with_overrides(self, **kwargs: float) -> "HardwareSpec":
        """Copy with some fields replaced (used by the CLI flags)."""
        return replace(self, **kwargs)


P3_16XLARGE = HardwareSpec(
    name="p3.16xlarge",
    gpus_per_server=8,
    gpu_memory_bytes=16 * GiB,
    peak_flops=125e12,
    achieved_flops=45e12,  # replaced by the calibrated value in presets.py
    intra_server_bandwidth=150 * GB,
    inter_server_bandwidth=25e9 / 8,
    memory_bandwidth=900 * GB,
    reserved_memory_bytes=1.0 * GiB,
    half_efficiency_tokens=256.0,
    note=("AWS p3.16xlarge as in the paper (section 5): 8 x V100-SXM2 16 GB. "
          "Intra-server 150 GB/s: six NVLink2 links x 25 GB/s per direction per GPU "
          "(assumption, an upper bound: the hybrid cube-mesh has no direct link between "
          "some GPU pairs). Inter-server 25 Gbit/s per instance (AWS specification). "
          "Achieved compute calibrated to the paper's own statement of ~45 TFLOP/s on "
          "the 355M GPT at 8 x 512 tokens per microbatch; the efficiency curve "
          "(half speed at 256 tokens) is our assumption."),
)

DGX_A100 = HardwareSpec(
    name="dgx-a100",
    bf16=True,
    gpus_per_server=8,
    gpu_memory_bytes=80 * GiB,
    peak_flops=312e12,
    achieved_flops=150e12,
    intra_server_bandwidth=300 * GB,
    inter_server_bandwidth=8 * 200e9 / 8,
    memory_bandwidth=2039 * GB,
    reserved_memory_bytes=2.0 * GiB,
    half_efficiency_tokens=512.0,
    note=("NVIDIA DGX A100 80GB: NVSwitch 600 GB/s bidirectional = 300 GB/s per "
          "direction; 8 x 200 Gbit/s HDR InfiniBand per server. Achieved 150 TFLOP/s "
          "(~48% of bf16 peak) is an assumption typical of Megatron runs."),
)

H100_SXM = HardwareSpec(
    name="h100-sxm",
    bf16=True,
    gpus_per_server=8,
    gpu_memory_bytes=80 * GiB,
    peak_flops=989e12,
    achieved_flops=400e12,
    intra_server_bandwidth=450 * GB,
    inter_server_bandwidth=8 * 400e9 / 8,
    memory_bandwidth=3350 * GB,
    reserved_memory_bytes=2.0 * GiB,
    half_efficiency_tokens=1024.0,
    note=("One 8 x H100-SXM 80GB server (HGX): NVLink4 900 GB/s bidirectional = 450 GB/s "
          "per direction; 8 x 400 Gbit/s NICs if several are used. Achieved 400 TFLOP/s "
          "(~40% of dense bf16 peak) is an assumption."),
)

CPU = HardwareSpec(
    name="cpu",
    gpus_per_server=64,
    gpu_memory_bytes=8 * GiB,
    peak_flops=2e11,
    achieved_flops=5e10,
    intra_server_bandwidth=5 * GB,
    inter_server_bandwidth=10e9 / 8,
    memory_bandwidth=20 * GB,
    reserved_memory_bytes=0.5 * GiB,
    half_efficiency_tokens=0.0,
    note=("Local runs: one process per 'GPU' on one host, gloo over shared memory "
          "(~5 GB/s), 8 GiB per process, 50 GFLOP/s per process: rough guesses."),
)

def ring_allreduce_time(num_bytes: float, group_size: int, bandwidth: float) -> float:
    """Ring all-reduce: each member sends and receives 2 (n - 1) / n of the buffer."""
    if group_size <= 1 or num_bytes <= 0:
        return 0.0
    return 2.0 * (group_size - 1) / group_size * num_bytes / bandwidth


@dataclass(frozen=True)
class Links:
    """Bandwidth seen by each kind of traffic of one (t, w, d) placement."""

    tensor: float
    """Per tensor-parallel all-reduce ring."""
    data: float
    """Per data-parallel all-reduce ring (replicas of one stage)."""
    boundary: Tuple[float, ...]
    """Per stage boundary i -> i+1 (d - 1 entries), for one activation transfer."""
    tensor_crosses_servers: bool
    data_crosses_servers: bool
    boundary_crosses_servers: Tuple[bool, ...]
    embedding: float
    """Between first and last stage (tied word-embedding gradient sync)."""


def crossing_load(servers: np.ndarray) -> np.ndarray:
    """Per leading index: the most groups that leave one server through its NIC.

    ``servers[..., g, k]`` is the server of member k of group g.  A group crosses when
    its members sit in more than one server; every server it touches counts it once.
    0 means no group crosses (all traffic stays on the intra-server links).
    """
    lead = servers.shape[:-2]
    flat = servers.reshape((-1,) + servers.shape[-2:])
    s = np.sort(flat, axis=-1)
    distinct = np.ones(s.shape, dtype=bool)
    distinct[..., 1:] = s[..., 1:] != s[..., :-1]
    crosses = s[..., 0] != s[..., -1]
    mask = distinct & crosses[..., None]
    nserv = int(s.max()) + 1
    rows = np.broadcast_to(np.arange(flat.shape[0])[:, None, None], s.shape)
    counts = np.bincount((rows * nserv + s)[mask], minlength=flat.shape[0] * nserv)
    return counts.reshape(flat.shape[0], nserv).max(axis=1).reshape(lead)


def _bandwidth(load: int, intra: float, inter: float) -> float:
    return intra if load == 0 else inter / load


@lru_cache(maxsize=4096)
def placement_links(t: int, w: int, d: int, gpus_per_server: int, intra: float,
                    inter: float) -> Links:
    """Which link each traffic crosses for rank = tp + t * (dp + w * pp)."""
    # rank = tp + t * (dp + w * pp)  <=>  arange(N).reshape(d, w, t)[pp, dp, tp]
    server = np.arange(t * w * d).reshape(d, w, t) // gpus_per_server
    tensor_load = int(crossing_load(server.reshape(1, d * w, t))[0])
    data_load = int(crossing_load(server.transpose(0, 2, 1).reshape(1, d * t, w))[0])
    if d > 1:
        pairs = np.stack([server[:-1].reshape(d - 1, w * t), server[1:].reshape(d - 1, w * t)], -1)
        bound_load = [int(x) for x in crossing_load(pairs)]
    else:
        bound_load = []
    emb = np.stack([server[0].reshape(w * t), server[-1].reshape(w * t)], -1)
    emb_load = int(crossing_load(emb[None])[0])
    return Links(tensor=_bandwidth(tensor_load, intra, inter),
                 data=_bandwidth(data_load, intra, inter),
                 boundary=tuple(_bandwidth(x, intra, inter) for x in bound_load),
                 tensor_crosses_servers=tensor_load > 0, data_crosses_servers=data_load > 0,
                 boundary_crosses_servers=tuple(x > 0 for x in bound_load),
                 embedding=_bandwidth(emb_load, intra, inter))


def describe_links(links: Links, t: int, w: int, d: int) -> str:
    """One line saying which link each kind of traffic of a placement crosses."""
    def where(crosses: bool, bw: float) -> str:
        return f"{'between servers' if crosses else 'inside a server'} at {bw / GB:.3g} GB/s"
    parts = []
    if t > 1:
        parts.append(f"tensor all-reduce {where(links.tensor_crosses_servers, links.tensor)}")
    if w > 1:
        parts.append(f"data-parallel all-reduce {where(links.data_crosses_servers, links.data)}")
    if d > 1:
        crossing = [bw for bw, x in zip(links.boundary, links.boundary_crosses_servers) if x]
        text = f"{len(crossing)} of {d - 1} stage boundaries cross servers"
        if crossing:
            text += f" (slowest {min(crossing) / GB:.3g} GB/s per transfer)"
        parts.append(text)
    return "; ".join(parts) or "single GPU: no communication"


def links_for(hardware: HardwareSpec, t: int, w: int, d: int) -> Links:
    """``placement_links`` for a hardware preset (cached on plain numbers)."""
    return placement_links(t, w, d, hardware.gpus_per_server,
                           hardware.intra_server_bandwidth, hardware.inter_server_bandwidth)


def num_servers(hardware: HardwareSpec, num_gpus: int) -> int:
    return max(1, math.ceil(num_gpus / hardware.gpus_per_server))

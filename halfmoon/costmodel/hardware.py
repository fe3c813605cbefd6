"""Accelerator specs: peak dense compute, HBM bandwidth, memory, network per GPU.

Figures are vendor datasheet peaks for one GPU (SXM parts); the cost models apply their
own efficiency factors. Conventions:

- compute is *dense* bf16 TFLOP/s. The H100/H800/H200 datasheets also print 1,979 TFLOP/s,
  which assumes 2:4 structured sparsity: LLM serving never gets it, so it is not used.
- ``memory_gb`` is the marketed capacity read as decimal gigabytes (1e9 bytes). The real
  devices hold slightly more (an "80 GB" A100 has 80 GiB); being conservative here only
  shortens the KV capacity estimate by a few percent.
- ``nic_gbps_per_gpu`` is the RDMA bandwidth *per GPU* in gigabits per second. Serving
  nodes pair each GPU with a NIC, so an instance of ``k`` GPUs owns ``k`` NICs' worth. The
  Mooncake paper's A800 nodes have 800 Gbps per 8-GPU node (100 Gbps per GPU, ~100 GB/s
  per node); its H800 clusters have 8x400 Gbps per node. A100/H100/H200 use the DGX
  layouts (8x200 Gbps HDR for A100, 8x400 Gbps NDR for H100/H200).
- A800 and H800 are the export variants of A100 and H100: only their NVLink bandwidth is
  cut (400 GB/s), which matters for tensor-parallel all-reduce inside a node but not for
  these per-instance estimates, so their compute and memory figures equal the originals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from halfmoon.core.errors import HalfmoonError


@dataclass(frozen=True)
class GPUSpec:
    """Peak figures of one accelerator (see the module docstring for units and sources)."""

    name: str
    bf16_dense_tflops: float
    hbm_tbps: float
    memory_gb: float
    nic_gbps_per_gpu: float

    def __post_init__(self) -> None:
        for field_name in ("bf16_dense_tflops", "hbm_tbps", "memory_gb", "nic_gbps_per_gpu"):
            value = getattr(self, field_name)
            if not value > 0:
                raise ValueError(f"GPUSpec {self.name!r}: {field_name} must be > 0, got {value}")

    @property
    def peak_flops_per_s(self) -> float:
        """Dense bf16 peak in FLOP/s."""
        return self.bf16_dense_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        """HBM bandwidth in bytes/s."""
        return self.hbm_tbps * 1e12

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes (decimal GB, see the module docstring)."""
        return self.memory_gb * 1e9

    @property
    def nic_bytes_per_s(self) -> float:
        """RDMA bandwidth attached to one GPU, in bytes/s (gigabits / 8)."""
        return self.nic_gbps_per_gpu * 1e9 / 8


def _build_registry() -> Mapping[str, GPUSpec]:
    specs = (
        GPUSpec("a800", bf16_dense_tflops=312, hbm_tbps=2.0, memory_gb=80, nic_gbps_per_gpu=100),
        GPUSpec("a100", bf16_dense_tflops=312, hbm_tbps=2.0, memory_gb=80, nic_gbps_per_gpu=200),
        GPUSpec("h100", bf16_dense_tflops=989, hbm_tbps=3.35, memory_gb=80, nic_gbps_per_gpu=400),
        GPUSpec("h800", bf16_dense_tflops=989, hbm_tbps=3.35, memory_gb=80, nic_gbps_per_gpu=400),
        GPUSpec("h200", bf16_dense_tflops=989, hbm_tbps=4.8, memory_gb=141, nic_gbps_per_gpu=400),
    )
    return MappingProxyType({spec.name: spec for spec in specs})


#: Known accelerators by canonical name (read-only).
GPUS: Mapping[str, GPUSpec] = _build_registry()


def _normalise(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    for prefix in ("nvidia-", "nvidia"):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    # "a100-80gb", "h100-sxm" -> the base part; the registry holds SXM 80 GB parts.
    return key.split("-", 1)[0]


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """The spec for ``name`` (case-insensitive; ``NVIDIA A100-80GB`` works), or a
    :class:`HalfmoonError` listing the known names. A :class:`GPUSpec` is returned as is."""
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise HalfmoonError(f"GPU name must be a string, got {name!r}")
    spec = GPUS.get(_normalise(name))
    if spec is None:
        raise HalfmoonError(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(GPUS))}")
    return spec

"""First-principles (roofline) cost model, FAST'25's prefill FLOP formula and the
cache-vs-recompute break-even bandwidth.

An instance is ``num_gpus`` GPUs running one replica with tensor parallelism, so compute,
HBM bandwidth, memory and NICs all add up across the group. Each estimate is
``max(compute time, memory time) + fixed overhead``: a forward pass cannot finish before
its FLOPs are done nor before its bytes have streamed through HBM.

FLOPs of one forward pass over ``n`` new tokens after ``c`` cached ones:

- dense: ``2 * N_non_embedding * n`` (a multiply-add per weight per token), plus the LM
  head for the one position whose logits are sampled;
- attention: ``4 * L * d_attn * pairs`` (QK^T and PV, 2 FLOPs each per query-key pair per
  head dimension), ``pairs = n*c + n*(n+1)/2`` (causal, see ``causal_attention_pairs``).

Bytes: the weights once (``ModelSpec.step_weight_read_bytes``), the KV of the context read
once, the KV of the new tokens written once. Activations stay on chip and are ignored.

What is not modelled: tensor-parallel all-reduce (folded into the efficiencies), chunked
prefill (a prefill is one pass), pipeline parallelism (``costmodel/pipeline.py``
schedules a chunked pipeline over instances built on this model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from halfmoon.costmodel.base import (
    causal_attention_pairs,
    check_amount,
    check_count,
    check_counts,
    check_fraction,
    check_positive,
)
from halfmoon.costmodel.hardware import GPUSpec, get_gpu
from halfmoon.costmodel.models import ModelSpec, get_model

#: FAST'25 Table 1 coefficients of the prefill FLOP formula ``l*(a*n^2*d + b*n*d^2)``.
FAST25_A = 4.0
FAST25_B = 22.0


@dataclass(frozen=True)
class RooflineCostModel:
    """Roofline estimates for ``num_gpus`` GPUs of type ``gpu`` serving ``model``.

    Default efficiency factors (fractions of the datasheet peak actually reached):

    - ``compute_efficiency=0.55``: model FLOPs utilisation of a long prefill with 8-way
      tensor parallelism; large-GEMM kernels reach 70-80% of peak, attention kernels and
      the TP all-reduces bring a whole pass to the 50-60% that serving engines report.
    - ``memory_efficiency=0.75``: share of HBM bandwidth a decode step streams at; copy
      benchmarks reach ~90%, real decode kernels (small GEMVs, paged attention) 70-80%.
    - ``network_efficiency=0.8``: RDMA goodput versus line rate; the paper's transfer engine
      moves 87 GB/s on 4x200 Gbps (87%) and 190 GB/s on 8x400 Gbps (95%), and halfmoon's
      transfers are smaller and less batched, so 0.8 is a slightly cautious figure.
    - ``memory_usable_fraction=0.9``: memory left after the runtime (CUDA context,
      activations, fragmentation), the same default as vLLM's ``gpu_memory_utilization``.
    - ``prefill_overhead_s=0.003`` / ``decode_overhead_s=0.001``: per pass costs that do
      not scale with work (scheduling, sampling, kernel launches over 80 layers; a decode
      step runs under CUDA graphs and pays less).
    - ``network_latency_s=2e-5``: set-up cost of one RDMA transfer (a few round trips).

    Efficiency 1 and zero overheads give the ideal (peak) estimates.
    """

    model: ModelSpec
    gpu: GPUSpec
    num_gpus: int = 8
    compute_efficiency: float = 0.55
    memory_efficiency: float = 0.75
    network_efficiency: float = 0.8
    memory_usable_fraction: float = 0.9
    prefill_overhead_s: float = 0.003
    decode_overhead_s: float = 0.001
    network_latency_s: float = 2e-5
    kv_bytes_per_token: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int):
            raise ValueError(f"num_gpus must be an integer, got {self.num_gpus!r}")
        if self.num_gpus <= 0:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
        check_fraction("compute_efficiency", self.compute_efficiency)
        check_fraction("memory_efficiency", self.memory_efficiency)
        check_fraction("network_efficiency", self.network_efficiency)
        check_fraction("memory_usable_fraction", self.memory_usable_fraction)
        check_amount("prefill_overhead_s", self.prefill_overhead_s)
        check_amount("decode_overhead_s", self.decode_overhead_s)
        check_amount("network_latency_s", self.network_latency_s)
        # A plain attribute (not a property) so the CostModel protocol holds exactly.
        object.__setattr__(self, "kv_bytes_per_token", self.model.kv_bytes_per_token)

    @property
    def flops_per_s(self) -> float:
        """Achieved compute of the whole instance (peak x efficiency)."""
        return self.num_gpus * self.gpu.peak_flops_per_s * self.compute_efficiency

    @property
    def memory_bytes_per_s(self) -> float:
        """Achieved HBM bandwidth of the whole instance."""
        return self.num_gpus * self.gpu.hbm_bytes_per_s * self.memory_efficiency

    @property
    def link_bytes_per_s(self) -> float:
        """Achieved network bandwidth of the instance (one NIC per GPU)."""
        return self.num_gpus * self.gpu.nic_bytes_per_s * self.network_efficiency

    def prefill_flops(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """FLOPs of one prefill pass (dense + causal attention + one row of logits)."""
        n = check_count("num_new_tokens", num_new_tokens)
        if n == 0:
            return 0.0
        pairs = causal_attention_pairs(n, num_cached_tokens)
        m = self.model
        dense = 2.0 * m.num_non_embedding_params * n + 2.0 * m.vocab_size * m.hidden_size
        return dense + 4.0 * m.num_layers * m.attention_dim * pairs

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Seconds to prefill ``num_new_tokens`` after ``num_cached_tokens`` cached tokens."""
        n = check_count("num_new_tokens", num_new_tokens)
        c = check_count("num_cached_tokens", num_cached_tokens)
        if n == 0:
            return 0.0
        compute_s = self.prefill_flops(n, c) / self.flops_per_s
        read_bytes = self.model.step_weight_read_bytes + (c + n) * self.kv_bytes_per_token
        memory_s = read_bytes / self.memory_bytes_per_s
        return max(compute_s, memory_s) + self.prefill_overhead_s

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        """Seconds for one decode step: memory-bound on weights + KV, unless the batch is so
        large that the FLOPs dominate."""
        b = check_count("batch_size", batch_size)
        ctx = check_count("total_context_tokens", total_context_tokens)
        if b == 0:
            return 0.0
        compute_s, memory_s = self._decode_terms(b, ctx)
        return max(compute_s, memory_s) + self.decode_overhead_s

    def decode_step_times_s(
        self, batch_sizes: np.ndarray, total_context_tokens: np.ndarray
    ) -> np.ndarray:
        """:meth:`decode_step_time_s` of many batches at once: the same float operations
        in the same order, so the same values."""
        b = check_counts("batch_sizes", batch_sizes)
        ctx = check_counts("total_context_tokens", total_context_tokens)
        compute_s, memory_s = self._decode_terms(b, ctx)
        return np.where(b == 0, 0.0, np.maximum(compute_s, memory_s) + self.decode_overhead_s)

    def _decode_terms(self, b: Any, ctx: Any) -> tuple[Any, Any]:
        """(compute, memory) seconds of a decode step of ``b`` sequences reading ``ctx``
        tokens of KV: numbers, or arrays of them (the same operations either way)."""
        m = self.model
        dense = 2.0 * (m.num_non_embedding_params + m.vocab_size * m.hidden_size) * b
        attention = 4.0 * m.num_layers * m.attention_dim * ctx
        compute_s = (dense + attention) / self.flops_per_s
        moved_bytes = m.step_weight_read_bytes + (ctx + b) * self.kv_bytes_per_token
        return compute_s, moved_bytes / self.memory_bytes_per_s

    def transfer_time_s(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` over the instance's NICs (latency + size/bandwidth)."""
        size = check_amount("num_bytes", num_bytes)
        if size == 0:
            return 0.0
        return self.network_latency_s + size / self.link_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit in ``usable_fraction`` of the group's memory after weights
        (0 when the weights alone do not fit)."""
        usable = self.num_gpus * self.gpu.memory_bytes * self.memory_usable_fraction
        return max(0, int((usable - self.model.weight_bytes) // self.kv_bytes_per_token))


def build_cost_model(
    model: str | ModelSpec, gpu: str | GPUSpec, num_gpus: int = 8, **efficiencies: float
) -> RooflineCostModel:
    """A :class:`RooflineCostModel` from registry names; ``efficiencies`` are passed on
    (``compute_efficiency=...``, ``decode_overhead_s=...``); unknown keywords are an error."""
    allowed = {
        "compute_efficiency",
        "memory_efficiency",
        "network_efficiency",
        "memory_usable_fraction",
        "prefill_overhead_s",
        "decode_overhead_s",
        "network_latency_s",
    }
    unknown = sorted(set(efficiencies) - allowed)
    if unknown:
        raise ValueError(
            f"unknown cost-model option(s) {', '.join(unknown)}; choose from {', '.join(sorted(allowed))}"
        )
    return RooflineCostModel(get_model(model), get_gpu(gpu), num_gpus, **efficiencies)


def fast25_prefill_flops(
    model: str | ModelSpec, num_tokens: int, a: float = FAST25_A, b: float = FAST25_B
) -> float:
    """FAST'25 Table 1's prefill FLOPs ``l * (a*n^2*d + b*n*d^2)`` for ``n = num_tokens``
    (``l`` layers, ``d`` hidden size). Coarser than :meth:`RooflineCostModel.prefill_flops`:
    attention counted non-causally, ``b`` folds the projections and MLP of a 70B shape."""
    spec = get_model(model)
    n = float(check_count("num_tokens", num_tokens))
    d = float(spec.hidden_size)
    return spec.num_layers * (a * n * n * d + b * n * d * d)


def fast25_prefill_time_s(
    model: str | ModelSpec, gpu: str | GPUSpec, num_gpus: int, num_tokens: int
) -> float:
    """Ideal (peak-compute) prefill seconds by :func:`fast25_prefill_flops`."""
    gpus = check_positive("num_gpus", check_count("num_gpus", num_gpus))
    return fast25_prefill_flops(model, num_tokens) / (gpus * get_gpu(gpu).peak_flops_per_s)


def break_even_bandwidth_bytes_per_s(
    model: str | ModelSpec,
    gpu: str | GPUSpec,
    num_gpus: int,
    prefix_tokens: int,
    compute_efficiency: float = 1.0,
    a: float = FAST25_A,
    b: float = FAST25_B,
) -> float:
    """Link bandwidth above which loading a cached prefix beats recomputing it (FAST'25).

    Loading ``p`` tokens of KV costs ``2*l*p*(d/gqa)*s / B`` seconds (K and V of
    ``d/gqa`` values per layer, ``s`` bytes each, over bandwidth ``B``); recomputing them
    costs ``l*(a*p^2*d + b*p*d^2) / G`` (FLOPs over compute ``G``). Reuse wins when::

        B / G > 2*d*s / (gqa * (a*p*d + b*d^2))

    so the break-even is ``B = G * 2ds / (gqa*(a*p*d + b*d^2))``. ``G`` is the group's peak
    times ``compute_efficiency``; ``d`` is the hidden size and ``gqa`` heads per KV head.
    """
    spec = get_model(model)
    p = check_count("prefix_tokens", prefix_tokens)
    if p == 0:
        raise ValueError("prefix_tokens must be > 0 for a break-even bandwidth")
    gpus = check_positive("num_gpus", check_count("num_gpus", num_gpus))
    compute = (
        gpus
        * get_gpu(gpu).peak_flops_per_s
        * check_fraction("compute_efficiency", compute_efficiency)
    )
    d = float(spec.hidden_size)
    ratio = 2.0 * d * spec.dtype_bytes / (spec.gqa_ratio * (a * p * d + b * d * d))
    return compute * ratio

"""Roofline model: the paper's ideal prefill and break-even figures, shape, errors."""

from __future__ import annotations

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel import (
    CostModel,
    RooflineCostModel,
    break_even_bandwidth_bytes_per_s,
    build_cost_model,
    causal_attention_pairs,
    fast25_prefill_flops,
    fast25_prefill_time_s,
    get_gpu,
    get_model,
)

IDEAL = {
    "compute_efficiency": 1.0,
    "memory_efficiency": 1.0,
    "network_efficiency": 1.0,
    "prefill_overhead_s": 0.0,
    "decode_overhead_s": 0.0,
    "network_latency_s": 0.0,
}


@pytest.fixture
def a800_70b() -> RooflineCostModel:
    return build_cost_model("llama2-70b", "a800", 8)


def test_fast25_formula_by_hand() -> None:
    # l*(a*n^2*d + b*n*d^2) with l=80, d=8192, a=4, b=22 and n=d: 80 * 26 * 8192^3.
    assert fast25_prefill_flops("llama2-70b", 8192) == 80 * 26 * 8192**3
    assert fast25_prefill_flops("llama2-70b", 1, a=1, b=0) == 80 * 8192


def test_ideal_prefill_of_8k_tokens_on_8xa800_is_about_half_a_second() -> None:
    fast25_s = fast25_prefill_time_s("llama2-70b", "a800", 8, 8192)
    assert fast25_s == pytest.approx(0.5, rel=0.2)
    roofline_s = build_cost_model("llama2-70b", "a800", 8, **IDEAL).prefill_time_s(8192)
    assert roofline_s == pytest.approx(0.5, rel=0.2)
    assert roofline_s == pytest.approx(fast25_s, rel=0.2)


@pytest.mark.parametrize(("model", "gpu", "expected_gb_s"), [
    ("llama2-70b", "a800", 6.0),
    ("llama3-70b", "h800", 19.0),
])  # fmt: skip
def test_break_even_bandwidth_at_8k_prefix(model: str, gpu: str, expected_gb_s: float) -> None:
    bandwidth = break_even_bandwidth_bytes_per_s(model, gpu, 8, 8192)
    assert bandwidth / 1e9 == pytest.approx(expected_gb_s, rel=0.15)


def test_break_even_falls_with_longer_prefixes_and_rises_with_compute() -> None:
    short = break_even_bandwidth_bytes_per_s("llama2-70b", "a800", 8, 1024)
    long = break_even_bandwidth_bytes_per_s("llama2-70b", "a800", 8, 65536)
    assert long < short
    assert break_even_bandwidth_bytes_per_s("llama2-70b", "h800", 8, 8192) > (
        break_even_bandwidth_bytes_per_s("llama2-70b", "a800", 8, 8192)
    )
    with pytest.raises(ValueError, match="prefix_tokens must be > 0"):
        break_even_bandwidth_bytes_per_s("llama2-70b", "a800", 8, 0)


def test_causal_pairs() -> None:
    assert causal_attention_pairs(1, 0) == 1
    assert causal_attention_pairs(4, 0) == 10  # 1 + 2 + 3 + 4
    assert causal_attention_pairs(2, 10) == 11 + 12
    with pytest.raises(ValueError, match="num_cached_tokens must be >= 0"):
        causal_attention_pairs(1, -1)


def test_prefill_grows_with_new_and_cached_tokens(a800_70b: RooflineCostModel) -> None:
    by_new = [a800_70b.prefill_time_s(n) for n in (256, 1024, 4096, 16384, 65536)]
    assert by_new == sorted(by_new) and len(set(by_new)) == len(by_new)
    by_cached = [a800_70b.prefill_time_s(1024, c) for c in (0, 8192, 32768, 131072)]
    assert by_cached == sorted(by_cached) and len(set(by_cached)) == len(by_cached)
    # Attention is quadratic: the extra cost of a 128k prefix is large, not marginal.
    assert by_cached[-1] > 2 * by_cached[0]


def test_prefill_of_cached_remainder_is_cheaper_than_full_prefill(
    a800_70b: RooflineCostModel,
) -> None:
    full = a800_70b.prefill_time_s(32768)
    assert a800_70b.prefill_time_s(32768 - 19200, 19200) < full
    assert a800_70b.prefill_time_s(0, 19200) == 0.0


def test_short_prefill_is_memory_bound_long_prefill_compute_bound(
    a800_70b: RooflineCostModel,
) -> None:
    weights_s = get_model("llama2-70b").step_weight_read_bytes / a800_70b.memory_bytes_per_s
    assert a800_70b.prefill_time_s(1) == pytest.approx(weights_s + 0.003, rel=1e-3)
    compute_s = a800_70b.prefill_flops(8192) / a800_70b.flops_per_s
    assert a800_70b.prefill_time_s(8192) == pytest.approx(compute_s + 0.003, rel=1e-9)


def test_decode_step_grows_with_batch_and_context(a800_70b: RooflineCostModel) -> None:
    by_context = [a800_70b.decode_step_time_s(8, ctx) for ctx in (0, 10_000, 100_000, 1_000_000)]
    assert by_context == sorted(by_context) and len(set(by_context)) == len(by_context)
    by_batch = [a800_70b.decode_step_time_s(b, 100_000) for b in (1, 16, 256, 4096)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == len(by_batch)
    assert a800_70b.decode_step_time_s(0, 0) == 0.0


def test_decode_step_is_weights_plus_kv_over_bandwidth(a800_70b: RooflineCostModel) -> None:
    spec = get_model("llama2-70b")
    ctx = 64 * 8192
    expected = (spec.step_weight_read_bytes + (ctx + 64) * spec.kv_bytes_per_token) / (
        8 * 2.0e12 * 0.75
    ) + 0.001
    assert a800_70b.decode_step_time_s(64, ctx) == pytest.approx(expected, rel=1e-9)
    # A 70B decode step on 8xA800 takes ~10-30 ms: the paper's 100 ms TBT SLO is reachable.
    assert 0.01 < a800_70b.decode_step_time_s(64, ctx) < 0.05


def test_transfer_time(a800_70b: RooflineCostModel) -> None:
    # 8 x 100 Gbps = 100 GB/s line rate, 80 GB/s at 0.8 efficiency.
    assert a800_70b.link_bytes_per_s == pytest.approx(80e9)
    assert a800_70b.transfer_time_s(40 * 1024**3) == pytest.approx(2e-5 + 40 * 1024**3 / 80e9)
    assert a800_70b.transfer_time_s(0) == 0.0
    ideal = build_cost_model("llama2-70b", "a800", **IDEAL)
    assert ideal.transfer_time_s(6400 * ideal.kv_bytes_per_token) == pytest.approx(0.021, rel=0.01)


def test_kv_capacity(a800_70b: RooflineCostModel) -> None:
    spec = get_model("llama2-70b")
    expected = int((8 * 80e9 * 0.9 - spec.weight_bytes) // spec.kv_bytes_per_token)
    assert a800_70b.kv_capacity_tokens() == expected
    assert 1_000_000 < expected < 1_500_000
    # One A800 cannot even hold the 70B weights: no room for KV.
    assert build_cost_model("llama2-70b", "a800", 1).kv_capacity_tokens() == 0
    assert build_cost_model("llama2-70b", "h200", 8).kv_capacity_tokens() > expected


def test_faster_gpu_is_faster() -> None:
    a800 = build_cost_model("llama3-70b", "a800")
    h800 = build_cost_model("llama3-70b", "h800")
    assert h800.prefill_time_s(8192) < a800.prefill_time_s(8192)
    assert h800.decode_step_time_s(32, 200_000) < a800.decode_step_time_s(32, 200_000)


def test_satisfies_protocol_and_exposes_kv_bytes(a800_70b: RooflineCostModel) -> None:
    assert isinstance(a800_70b, CostModel)
    assert a800_70b.kv_bytes_per_token == 327_680


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.prefill_time_s(-1),
        lambda m: m.prefill_time_s(10, -5),
        lambda m: m.decode_step_time_s(-1, 10),
        lambda m: m.decode_step_time_s(1, -10),
        lambda m: m.transfer_time_s(-1.0),
        lambda m: m.transfer_time_s(float("nan")),
        lambda m: m.prefill_time_s(1.5),
    ],
)
def test_bad_inputs_raise_value_error(a800_70b: RooflineCostModel, call) -> None:
    with pytest.raises(ValueError, match="must be"):
        call(a800_70b)


def test_bad_construction() -> None:
    with pytest.raises(HalfmoonError, match="unknown GPU"):
        build_cost_model("llama2-70b", "tpu-v9")
    with pytest.raises(HalfmoonError, match="unknown model"):
        build_cost_model("llama-9", "a800")
    with pytest.raises(ValueError, match="unknown cost-model option"):
        build_cost_model("llama2-70b", "a800", mfu=0.5)
    with pytest.raises(ValueError, match=r"compute_efficiency must be in \(0, 1\]"):
        build_cost_model("llama2-70b", "a800", compute_efficiency=1.5)
    with pytest.raises(ValueError, match="num_gpus must be >= 1"):
        RooflineCostModel(get_model("tiny"), get_gpu("a100"), num_gpus=0)

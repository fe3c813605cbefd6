"""The paper's worked scheduling example with the constant-rate model."""

from __future__ import annotations

import pytest

from halfmoon.costmodel import CostModel, ThroughputCostModel


@pytest.fixture
def example() -> ThroughputCostModel:
    return ThroughputCostModel.paper_example()


def test_worked_example_ttfts(example: ThroughputCostModel) -> None:
    prompt = 32768
    queue_s = 0.5
    cached = {"P1": 19200, "P2": 9600, "P3": 0, "P4": 12800}
    ttft = {p: queue_s + example.prefill_time_s(prompt - c, c) for p, c in cached.items()}
    assert example.prefill_time_s(prompt - 19200, 19200) == pytest.approx(6.784)
    assert ttft == pytest.approx({"P1": 7.284, "P2": 12.084, "P3": 16.884, "P4": 10.484})
    # P4 fetching the 6,400 tokens it lacks from P1: 2,000 MiB over 100 GB/s ~ 20 ms.
    fetch_s = example.transfer_time_s(6400 * example.kv_bytes_per_token)
    assert fetch_s == pytest.approx(0.02, rel=0.05)
    # 0.5 + 0.021 + 6.784 = 7.305; the notes round it to "~7.32".
    p4_fetch_ttft = queue_s + fetch_s + example.prefill_time_s(prompt - 19200, 19200)
    assert p4_fetch_ttft == pytest.approx(7.32, abs=0.02)
    assert ttft["P1"] < p4_fetch_ttft < ttft["P4"]
    assert min(ttft, key=ttft.__getitem__) == "P1"


def test_block_of_16_tokens_is_5_mib(example: ThroughputCostModel) -> None:
    assert 16 * example.kv_bytes_per_token == 5 * 1024**2


def test_decode_and_capacity(example: ThroughputCostModel) -> None:
    assert isinstance(example, CostModel)
    assert example.decode_step_time_s(0, 0) == 0.0
    assert example.decode_step_time_s(1, 0) == pytest.approx(0.0125)
    assert example.decode_step_time_s(4, 1_000_000) == pytest.approx(0.0125 + 0.027)
    assert example.kv_capacity_tokens() == 1_300_000
    assert example.transfer_time_s(0) == 0.0


def test_custom_rates_and_errors() -> None:
    model = ThroughputCostModel(1000.0, 4096, 1e9, link_latency_s=0.001, kv_capacity_tokens=10)
    assert model.prefill_time_s(500, 10_000) == pytest.approx(0.5)
    assert model.transfer_time_s(1e9) == pytest.approx(1.001)
    assert model.kv_capacity_tokens() == 10
    assert "prefill_tokens_per_s=1000.0" in repr(model)
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        ThroughputCostModel(0.0, 4096, 1e9)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        model.prefill_time_s(-3)
    with pytest.raises(ValueError, match="total_context_tokens must be >= 0"):
        model.decode_step_time_s(1, -1)

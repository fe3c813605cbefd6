"""The paper's worked scheduling example (paper-facts.md), reproduced exactly."""

import pytest

from halfmoon.conductor import BlockStored, ConductorConfig, LoadReport
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request


def test_paper_worked_example(make_conductor):
    conductor = make_conductor(
        num_prefill=4,
        num_decode=2,
        policy="kvcache-centric",
        early_reject="snapshot",
        slo=SLOConfig(ttft_s=10.0, tbt_s=0.1),
        kvcache_balancing_threshold=0.1,
    )
    hashes = tuple(range(1, 2049))  # 32,768 tokens in 16-token blocks
    for instance, num_blocks in (("P1", 1200), ("P2", 600), ("P3", 0), ("P4", 800)):
        for h in hashes[:num_blocks]:
            conductor.handle(BlockStored(block_hash=h, instance_id=instance))
        # T_queue = 0.5 s everywhere: 1,000 queued tokens at 2,000 tok/s
        conductor.handle(LoadReport(instance, queued_prefill_tokens=1000))
    capacity = 1_000_000
    conductor.handle(
        LoadReport("D1", num_running=6, context_tokens=600_000, kv_capacity_tokens=capacity)
    )
    conductor.handle(
        LoadReport("D2", num_running=3, context_tokens=300_000, kv_capacity_tokens=capacity)
    )

    request = Request("R", 0.0, 32768, 512, block_hashes=hashes, block_size_tokens=16)
    decision = conductor.schedule(request)

    assert decision.accepted, decision.explain()
    assert decision.prefill.instance_id == "P1"
    assert decision.prefill.cache_source == "P1"
    assert decision.prefill.ttft_s == pytest.approx(7.284, abs=1e-9)
    assert decision.decode.instance_id == "D2"

    local = {c.instance_id: c for c in decision.candidates if not c.is_remote}
    assert local["P1"].cached_tokens == 19200
    assert local["P2"].ttft_s == pytest.approx(12.084)
    assert local["P3"].ttft_s == pytest.approx(16.884)
    assert local["P4"].ttft_s == pytest.approx(10.484)
    over_slo = {i for i, c in local.items() if c.ttft_s > 10.0}
    assert over_slo == {"P2", "P3", "P4"}

    remote = {c.instance_id: c for c in decision.candidates if c.is_remote}
    p4 = remote["P4"]
    assert p4.cache_source == "P1"
    assert p4.transfer_s == pytest.approx(6400 * 320 * 1024 / 100e9)  # ~21 ms
    assert p4.ttft_s == pytest.approx(7.32, abs=0.02)
    assert "P1" in decision.explain() and "D2" in decision.explain()


def test_worked_example_rejects_when_slo_tighter(make_conductor):
    conductor = make_conductor(
        num_prefill=1, num_decode=1, early_reject="snapshot", slo=SLOConfig(ttft_s=5.0, tbt_s=0.1)
    )
    request = Request("R", 0.0, 32768, 512, block_hashes=tuple(range(2048)), block_size_tokens=16)
    decision = conductor.schedule(request)
    assert not decision.accepted
    assert "TTFT" in decision.reject_reason and "5s SLO" in decision.reject_reason
    assert decision.reject_code == "ttft"
    assert ConductorConfig().early_reject == "none"

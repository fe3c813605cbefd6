"""The chunked-pipeline (CPP) prefill estimate."""

from __future__ import annotations

import pytest

from halfmoon.costmodel import (
    ThroughputCostModel,
    build_cost_model,
    cpp_prefill_estimate,
    cpp_prefill_time_s,
    hidden_bytes_per_token,
    pipeline_chunks,
)

CHUNK = 1024


@pytest.fixture(scope="module")
def roofline():
    return build_cost_model("llama2-70b", "a800", 8)


def _chunked_single_s(cm, new: int, cached: int, chunk: int) -> float:
    total, done = 0.0, cached
    for size in pipeline_chunks(new, chunk):
        total += cm.prefill_time_s(size, done)
        done += size
    return total


def test_chunks_cover_the_prompt():
    assert pipeline_chunks(2500, 1024) == (1024, 1024, 452)
    assert pipeline_chunks(2048, 1024) == (1024, 1024)
    assert pipeline_chunks(0, 1024) == ()
    with pytest.raises(ValueError, match="chunk_tokens"):
        pipeline_chunks(10, 0)


@pytest.mark.parametrize("new,cached", [(300, 0), (8192, 0), (40_000, 8192), (131_072, 0)])
def test_one_stage_is_the_chunked_single_instance_prefill(roofline, new, cached):
    hidden = hidden_bytes_per_token(roofline)
    expected = _chunked_single_s(roofline, new, cached, CHUNK)
    assert cpp_prefill_time_s(roofline, 1, new, cached, CHUNK, hidden) == pytest.approx(
        expected, rel=1e-12
    )


@pytest.mark.parametrize("stages", [2, 4])
def test_long_prompts_approach_one_over_k(roofline, stages):
    hidden = hidden_bytes_per_token(roofline)
    single = cpp_prefill_time_s(roofline, 1, 131_072, 0, CHUNK, hidden)
    piped = cpp_prefill_time_s(roofline, stages, 131_072, 0, CHUNK, hidden)
    assert single / stages < piped < 1.06 * single / stages


def test_short_prompts_lose_to_a_single_instance(roofline):
    hidden = hidden_bytes_per_token(roofline)
    for new in (100, 300, 500):
        single = cpp_prefill_time_s(roofline, 1, new, 0, CHUNK, hidden)
        for stages in (2, 4):
            assert cpp_prefill_time_s(roofline, stages, new, 0, CHUNK, hidden) > single


def test_recurrence_by_hand():
    """Rate 1,000 tok/s, 2 stages, 1,000-token chunks, 1 s hand-off per chunk: stage time
    0.5 s; stage 1 starts each chunk after its hand-off, so the hand-offs show."""
    cm = ThroughputCostModel(1000.0, 1, 1000.0)  # transfer: bytes / 1,000 B/s
    est = cpp_prefill_estimate(cm, 2, 3000, 0, 1000, hidden_bytes_per_token=1)
    # stage 0: chunks end 0.5, 1.0, 1.5; stage 1: start 1.5 (0.5 + 1 s), ends 2.0,
    # next chunk ready at 2.0 -> 2.5, then 3.0.
    assert est.stage_start_s == pytest.approx((0.0, 1.5))
    assert est.stage_end_s == pytest.approx((1.5, 3.0))
    assert est.stage_busy_s == pytest.approx((1.5, 1.5))
    assert est.ttft_s == pytest.approx(3.0)
    assert est.last_chunk_stage_s == pytest.approx(0.5)


def test_inputs_are_checked(roofline):
    with pytest.raises(ValueError, match="num_stages"):
        cpp_prefill_time_s(roofline, 0, 100, 0, CHUNK, 16384)
    with pytest.raises(ValueError, match="num_new_tokens|num_tokens"):
        cpp_prefill_time_s(roofline, 2, -1, 0, CHUNK, 16384)
    assert cpp_prefill_time_s(roofline, 2, 0, 100, CHUNK, 16384) == 0.0


def test_hidden_bytes(roofline):
    assert hidden_bytes_per_token(roofline) == 8192 * 2
    assert hidden_bytes_per_token(roofline, 123) == 123
    with pytest.raises(ValueError, match="cpp_hidden_bytes_per_token"):
        hidden_bytes_per_token(ThroughputCostModel(1000.0, 1, 1.0))

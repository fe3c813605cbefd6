"""Invariants of any simulated run, on random small workloads (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from halfmoon.core.request import Request

BLOCK = 512


@st.composite
def workloads(draw) -> list[Request]:
    """A few requests drawing prefixes from a small pool, so caches hit and evict."""
    num = draw(st.integers(1, 12))
    prefixes = [tuple(range(1000 * p, 1000 * p + 8)) for p in range(3)]
    requests, t, fresh = [], 0.0, 10**6
    for i in range(num):
        t += draw(st.floats(0.0, 3.0))
        length = draw(st.integers(1, 6 * BLOCK))
        num_blocks = -(-length // BLOCK)
        shared = prefixes[draw(st.integers(0, 2))][: draw(st.integers(0, num_blocks))]
        hashes = shared + tuple(range(fresh, fresh + num_blocks - len(shared)))
        fresh += num_blocks
        requests.append(Request(f"r{i}", t, length, draw(st.integers(1, 40)), hashes, BLOCK))
    return requests


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=workloads(),
    cluster=st.sampled_from(["1P1D", "2P1D", "2P2D", "1M", "2M"]),
    policy=st.sampled_from(["random", "load-balance", "cache-aware", "kvcache-centric"]),
    early_reject=st.sampled_from(["none", "snapshot", "predict"]),
    capacity_blocks=st.sampled_from([2, 6, None]),
    chunked=st.booleans(),
)
def test_every_request_is_accounted_for(
    run_sim, requests, cluster, policy, early_reject, capacity_blocks, chunked
) -> None:
    capacity = None if capacity_blocks is None else capacity_blocks * BLOCK
    result, sim = run_sim(
        cluster,
        requests,
        policy=policy,
        early_reject=early_reject,
        cache_capacity_tokens=capacity,
        coupled_cache_capacity_tokens=capacity,
        coupled_chunked_prefill=chunked,
        coupled_token_budget=700,
        prefill_chunk_tokens=1000 if chunked else None,
        kv_capacity_tokens=8 * BLOCK,
    )
    assert len(result.records) == len(requests)
    for request, record in zip(requests, result.records, strict=True):
        assert record.request_id == request.request_id
        if record.rejected:
            assert not record.token_times_s and record.reject_reason
            continue
        assert len(record.token_times_s) == request.output_length
        assert record.finish_s == record.token_times_s[-1]
        assert record.prefill_done_s is not None
        assert record.prefill_done_s <= record.token_times_s[0]
        assert 0 <= record.cached_tokens < request.input_length
    hashes = {h for request in requests for h in request.block_hashes}
    for iid, instance in {**sim.prefill, **sim.coupled}.items():
        cache = instance.cache
        if cache is None:
            continue
        for h in hashes:
            assert sim.conductor.index.holds(iid, h) == (h in cache)

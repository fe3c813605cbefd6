"""The simulated disaggregated cluster, checked by hand against the cost model."""

import pytest

from halfmoon.core.config import SLOConfig
from halfmoon.costmodel.roofline import build_cost_model
from halfmoon.sim.network import kv_stream_tail_s

BLOCK = 512  # the conftest's requests and cost model
KV_BYTES_PER_TOKEN = 320 * 1024
LINK_BYTES_PER_S = 100e9


def _records(result):
    return {record.request_id: record for record in result.records}


def test_one_request_on_1p1d_by_hand(run_sim, make_request) -> None:
    """TTFT = prefill + the layer-wise transfer tail; each TBT = one decode step."""
    request = make_request("r", 0.0, 4000, 4)
    result, _ = run_sim("1P1D", [request])
    record = result.records[0]

    compute_s = 4000 / 2000.0
    new_xfer_s = 4000 * KV_BYTES_PER_TOKEN / LINK_BYTES_PER_S
    tail_s = compute_s + new_xfer_s / 80 - compute_s  # fast link: last layer's share
    assert tail_s == pytest.approx(kv_stream_tail_s(compute_s, 0.0, new_xfer_s, 80))
    assert record.prefill_done_s == pytest.approx(compute_s)
    assert record.ttft_s == pytest.approx(compute_s + tail_s, abs=1e-12)
    steps = [0.0125 + 2.7e-8 * (4000 + k) for k in (1, 2, 3)]
    assert record.tbt_gaps_s == pytest.approx(steps, abs=1e-12)
    assert record.finish_s == record.token_times_s[-1]
    assert len(record.token_times_s) == 4
    assert result.report["num_completed"] == 1
    assert result.report["num_wasted_prefill"] == 0
    assert result.report["cluster"] == "1P1D"
    assert result.report["policy"] == "kvcache-centric"


def test_prefix_cache_hit_reduces_ttft(run_sim, make_request) -> None:
    shared = list(range(1, 9))  # 8 full blocks = 4096 tokens
    first = make_request("a", 0.0, 4600, 2, prefix=shared)
    second = make_request("b", 10.0, 4600, 2, prefix=shared)
    result, _ = run_sim("1P1D", [first, second])
    a, b = _records(result)["a"], _records(result)["b"]
    assert a.cached_tokens == 0
    assert b.cached_tokens == 8 * BLOCK
    assert b.ttft_s < a.ttft_s
    assert b.prefill_done_s - b.arrival_s == pytest.approx((4600 - 8 * BLOCK) / 2000.0)
    assert result.report["cache_hit_ratio"] == pytest.approx(8 * BLOCK / 9200)


def test_cache_capacity_evictions_reach_the_conductor(run_sim, make_request) -> None:
    requests = [
        make_request(
            f"r{i}", 2.0 * i, 3 * BLOCK + 100, 2, prefix=[100 + 10 * (i % 3) + j for j in range(3)]
        )
        for i in range(9)
    ]
    result, sim = run_sim("2P1D", requests, cache_capacity_tokens=4 * BLOCK, cache_policy="lru")
    hashes = {h for request in requests for h in request.block_hashes}
    evicted = 0
    for iid, instance in sim.prefill.items():
        assert len(instance.cache) <= 4
        evicted += instance.cache.num_evicted
        for h in hashes:
            assert sim.conductor.index.holds(iid, h) == (h in instance.cache), (iid, h)
    assert evicted > 0
    assert result.report["num_completed"] == 9


def test_remote_prefix_is_fetched_and_replicated(run_sim, make_request) -> None:
    prefix = list(range(1, 21))  # 20 blocks, 10,240 tokens
    requests = [
        make_request("a", 0.0, 20 * BLOCK + 100, 2, prefix=prefix),  # caches X on P1
        make_request("long", 6.0, 40_000, 2),  # keeps P1 busy for 20 s
        make_request("b", 7.0, 20 * BLOCK + 100, 2, prefix=prefix),
    ]
    result, sim = run_sim("2P1D", requests)
    b = _records(result)["b"]
    assert result.report["num_remote_fetches"] == 1
    assert b.cached_tokens == 20 * BLOCK
    fetch_s = 20 * BLOCK * KV_BYTES_PER_TOKEN / LINK_BYTES_PER_S
    assert b.prefill_done_s - b.arrival_s == pytest.approx(fetch_s + 100 / 2000.0)
    assert all(sim.conductor.index.holds("P2", h) for h in prefix)
    assert all(h in sim.prefill["P2"].cache for h in prefix)


def test_chunked_prefill(run_sim, make_request) -> None:
    request = make_request("r", 0.0, 5000, 2)
    plain, _ = run_sim("1P1D", [request])
    chunked, _ = run_sim("1P1D", [request], prefill_chunk_tokens=1024)
    # a linear cost model: the same compute either way
    assert chunked.records[0].prefill_done_s == pytest.approx(plain.records[0].prefill_done_s)
    roofline = build_cost_model("llama2-70b", "a800", 8)
    plain, _ = run_sim("1P1D", [request], model=roofline)
    chunked, _ = run_sim("1P1D", [request], model=roofline, prefill_chunk_tokens=1024)
    # each chunk re-streams the weights and pays the per-pass overhead
    assert chunked.records[0].prefill_done_s > plain.records[0].prefill_done_s


def test_decode_kv_capacity_makes_requests_wait(run_sim, make_request) -> None:
    requests = [make_request(f"r{i}", 0.0, 1000, 10) for i in range(2)]
    result, _ = run_sim("2P1D", requests, kv_capacity_tokens=1500)
    a, b = _records(result)["r0"], _records(result)["r1"]
    # both prefills end at 0.5 s; the second joins only when the first leaves
    assert b.token_times_s[0] == pytest.approx(a.finish_s)
    assert result.report["num_completed"] == 2


def test_request_larger_than_decode_memory_is_refused_after_prefill(run_sim, make_request) -> None:
    result, _ = run_sim("1P1D", [make_request("big", 0.0, 2000, 10)], kv_capacity_tokens=1000)
    record = result.records[0]
    assert record.rejected and record.prefill_done_s is not None
    assert "capacity" in record.reject_reason
    assert result.report["num_wasted_prefill"] == 1
    assert result.report["num_refused_after_prefill"] == 1


def test_slo_config_travels_to_report(run_sim, make_request) -> None:
    slo = SLOConfig(ttft_s=1.0, tbt_s=0.05, tbt_metric="p90")
    result, _ = run_sim("1P1D", [make_request("r", 0.0, 4000, 4)], slo=slo)
    assert result.report["slo"] == {"ttft_s": 1.0, "tbt_s": 0.05, "tbt_metric": "p90"}
    assert result.report["slo_attainment"] == 0.0  # TTFT 2 s > 1 s
    assert result.report["num_wasted_prefill"] == 1


def _fetch_behind_a_queue(make_request):
    """P1 caches a 20-block prefix, then runs a long prompt; P2 is busy until 8.5 s when
    ``b`` arrives (7.0 s) wanting P1's prefix, and ``c``, a short fresh prompt, comes at
    7.5 s; both go to P2, ``b`` fetching the prefix from P1."""
    prefix = list(range(1, 21))  # 20 blocks, 10,240 tokens
    return [
        make_request("a", 0.0, 20 * BLOCK + 100, 2, prefix=prefix),  # caches it on P1
        make_request("long", 6.0, 40_000, 2),  # keeps P1 busy for 20 s
        make_request("busy", 6.5, 4000, 2),  # keeps P2 busy until 8.5 s
        make_request("b", 7.0, 20 * BLOCK + 100, 2, prefix=prefix),
        make_request("c", 7.5, 100, 2),
    ]


#: 1 GB/s: the 20-block fetch takes 3.36 s, longer than b's wait for P2 (1.5 s).
SLOW_LINK_BYTES_PER_S = 1e9


@pytest.mark.parametrize("mode", ["queued", "overlap"])
def test_a_prefix_fetch_runs_after_or_beside_the_queue(run_sim, make_request, mode) -> None:
    """queued (the paper's): b's fetch starts when P2 is free, holding P2 (c waits for
    it); overlap (halfmoon's workers): it starts when b arrives, P2 runs c while it lasts,
    and b joins P2's queue once its prefix is there."""
    from halfmoon.costmodel.throughput import ThroughputCostModel

    model = ThroughputCostModel(2000.0, KV_BYTES_PER_TOKEN, SLOW_LINK_BYTES_PER_S)
    result, sim = run_sim("2P1D", _fetch_behind_a_queue(make_request), model=model,
                          prefix_fetch=mode)  # fmt: skip
    records = _records(result)
    b, c = records["b"], records["c"]
    assert result.report["num_remote_fetches"] == 1
    assert result.report["prefix_fetch"] == mode
    assert b.cached_tokens == 20 * BLOCK
    fetch_s = 20 * BLOCK * KV_BYTES_PER_TOKEN / SLOW_LINK_BYTES_PER_S
    busy_end_s = 6.5 + 4000 / 2000.0
    if mode == "queued":  # the fetch also waits for busy's hand-off tail on P2's link
        tail_s = 4000 * KV_BYTES_PER_TOKEN / SLOW_LINK_BYTES_PER_S / 80
        assert b.prefill_done_s == pytest.approx(busy_end_s + tail_s + fetch_s + 100 / 2000.0)
        assert c.prefill_done_s == pytest.approx(b.prefill_done_s + 100 / 2000.0)
    else:
        assert c.prefill_done_s == pytest.approx(busy_end_s + 100 / 2000.0)
        assert b.prefill_done_s == pytest.approx(7.0 + fetch_s + 100 / 2000.0)
    assert all(h in sim.prefill["P2"].cache for h in range(1, 21))


def test_the_instances_can_fetch_otherwise_than_the_conductor_estimates(
    run_sim, make_request
) -> None:
    """``instance_prefix_fetch`` sets how the simulated instances fetch apart from the
    Conductor's estimate: overlapping instances under the paper's estimate."""
    from halfmoon.costmodel.throughput import ThroughputCostModel

    model = ThroughputCostModel(2000.0, KV_BYTES_PER_TOKEN, SLOW_LINK_BYTES_PER_S)
    result, sim = run_sim("2P1D", _fetch_behind_a_queue(make_request), model=model,
                          instance_prefix_fetch="overlap")  # fmt: skip
    assert sim.conductor.config.prefix_fetch == "queued"
    assert result.report["prefix_fetch"] == "overlap"
    b = _records(result)["b"]
    fetch_s = 20 * BLOCK * KV_BYTES_PER_TOKEN / SLOW_LINK_BYTES_PER_S
    assert b.prefill_done_s == pytest.approx(7.0 + fetch_s + 100 / 2000.0)


def test_a_prefill_only_request_ends_on_its_prefill_instance(run_sim, make_request) -> None:
    """An embedding (``prefill_only``): answered when its prefill ends, no KV streamed,
    nothing placed on the decode instance (even with no decode pool room for it)."""
    import dataclasses

    embed = dataclasses.replace(make_request("e", 0.0, 4000, 1), prefill_only=True)
    chat = make_request("c", 0.0, 1000, 4)
    result, sim = run_sim("1P1D", [embed, chat])
    e, c = _records(result)["e"], _records(result)["c"]
    assert e.prefill_done_s == pytest.approx(4000 / 2000.0)  # first in the queue
    assert e.ttft_s == pytest.approx(e.prefill_done_s) and e.finish_s == e.prefill_done_s
    assert len(e.token_times_s) == 1 and not e.rejected
    assert len(c.token_times_s) == 4 and c.prefill_done_s == pytest.approx(5000 / 2000.0)
    assert result.report["num_completed"] == 2
    assert sim.conductor.num_placements == 0
    sim.conductor.check_integrity()

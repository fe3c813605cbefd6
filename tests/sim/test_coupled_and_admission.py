"""Coupled (vLLM-like) instances, early rejection, decode refusal and wasted prefill."""

import pytest

from halfmoon.core.config import SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel.throughput import ThroughputCostModel
from halfmoon.sim.config import ClusterSpec, SimConfig
from halfmoon.workload.datasets import generate_dataset


def _records(result):
    return {record.request_id: record for record in result.records}


def _stall_workload(make_request):
    # a short request decoding for a while, then a 10-second prompt arrives
    return [make_request("short", 0.0, 1000, 200), make_request("long", 1.0, 20_000, 2)]


def test_coupled_prefill_priority_stalls_decodes(run_sim, make_request) -> None:
    result, sim = run_sim("1M", _stall_workload(make_request))
    short = _records(result)["short"]
    assert max(short.tbt_gaps_s) >= 20_000 / 2000.0 - 1e-9  # stalled for the whole prefill
    assert sim.coupled["M1"].stalled_s == pytest.approx(10.0)
    assert result.report["tbt_s"]["p99"] > 0.1


def test_disaggregated_decodes_are_not_stalled(run_sim, make_request) -> None:
    result, _ = run_sim("1P1D", _stall_workload(make_request))
    short = _records(result)["short"]
    assert max(short.tbt_gaps_s) < 0.02


def test_coupled_chunked_prefill_bounds_the_stall(run_sim, make_request) -> None:
    result, _ = run_sim(
        "1M", _stall_workload(make_request), coupled_chunked_prefill=True, coupled_token_budget=512
    )
    records = _records(result)
    assert max(records["short"].tbt_gaps_s) < 0.3  # one mixed step: <= 511 prompt tokens
    assert records["long"].prefill_done_s > 11.0  # the prompt itself goes slower
    assert result.report["num_completed"] == 2


def test_coupled_by_hand_and_prefix_caching(run_sim, make_request) -> None:
    shared = list(range(1, 5))  # 4 blocks
    requests = [
        make_request("a", 0.0, 2100, 3, prefix=shared),
        make_request("b", 5.0, 2100, 3, prefix=shared),
    ]
    result, sim = run_sim("1M", requests)
    a, b = _records(result)["a"], _records(result)["b"]
    assert a.ttft_s == pytest.approx(2100 / 2000.0)  # no transfer: the first token is local
    assert a.tbt_gaps_s == pytest.approx([0.0125 + 2.7e-8 * (2100 + k) for k in (1, 2)])
    assert b.cached_tokens == 4 * 512
    assert b.ttft_s == pytest.approx((2100 - 4 * 512) / 2000.0)
    assert all(sim.conductor.index.holds("M1", h) for h in shared)
    no_cache, _ = run_sim("1M", requests, coupled_prefix_caching=False)
    assert _records(no_cache)["b"].cached_tokens == 0


@pytest.mark.parametrize("router", ["round-robin", "least-load", "cache-aware"])
def test_coupled_routers_spread_work(run_sim, make_request, router: str) -> None:
    requests = [make_request(f"r{i}", 0.0, 4000, 2) for i in range(4)]
    result, sim = run_sim("2M", requests, coupled_router=router)
    assert result.report["policy"] == router
    assert result.report["num_completed"] == 4
    assert all(m.num_prefill_steps > 0 for m in sim.coupled.values())


def test_early_rejection_of_ttft_misses(run_sim, make_request) -> None:
    requests = [make_request(f"r{i}", 0.0, 8000, 2) for i in range(3)]  # 4 s prefill each
    slo = SLOConfig(ttft_s=5.0, tbt_s=0.1)
    none, _ = run_sim("1P1D", requests, slo=slo, early_reject="none")
    assert none.report["num_wasted_prefill"] == 2  # TTFT ~8 s and ~12 s: prefilled for nothing
    assert none.report["num_rejected"] == 0
    snap, _ = run_sim("1P1D", requests, slo=slo, early_reject="snapshot")
    assert snap.report["num_wasted_prefill"] == 0
    assert snap.report["num_rejected_early"] == 2
    assert all("TTFT" in r.reject_reason for r in snap.records if r.rejected)
    assert all(r.prefill_done_s is None for r in snap.records if r.rejected)


def _decode_bound():
    # a decode step of 10 ms + 10 us per context token: 9,000 tokens reach 100 ms
    return ThroughputCostModel(2000.0, 320 * 1024, 100e9, 0.01, 1e-5)


def test_decode_refusal_wastes_prefill_and_prediction_avoids_it(run_sim, make_request) -> None:
    requests = [make_request(f"r{i}", 0.0, 4000, 3) for i in range(3)]
    slo = SLOConfig(ttft_s=30.0, tbt_s=0.1)
    model = _decode_bound()
    none, _ = run_sim("3P1D", requests, slo=slo, model=model, early_reject="none")
    refused = [r for r in none.records if r.rejected]
    assert len(refused) == 1 and refused[0].prefill_done_s is not None
    assert "TBT" in refused[0].reject_reason
    assert none.report["num_refused_after_prefill"] == 1
    assert none.report["num_wasted_prefill"] == 1
    # the snapshot sees an empty decode batch at t=0 and admits all three
    snap, _ = run_sim("3P1D", requests, slo=slo, model=model, early_reject="snapshot")
    assert snap.report["num_refused_after_prefill"] == 1
    # prediction counts the two requests that will join before the third's prefill ends
    pred, _ = run_sim("3P1D", requests, slo=slo, model=model, early_reject="predict")
    assert pred.report["num_rejected_early"] == 1
    assert pred.report["num_wasted_prefill"] == 0
    assert pred.report["num_completed"] == 2


def test_decode_guard_wait_and_off(run_sim, make_request) -> None:
    requests = [make_request(f"r{i}", 0.0, 4000, 3) for i in range(3)]
    slo = SLOConfig(ttft_s=30.0, tbt_s=0.1)
    wait, _ = run_sim("3P1D", requests, slo=slo, model=_decode_bound(), decode_tbt_guard="wait")
    assert wait.report["num_completed"] == 3
    records = _records(wait)
    # r2 joins only once r0 has left: three at once would exceed the 100 ms step
    assert records["r2"].token_times_s[0] >= records["r0"].finish_s
    assert max(gap for r in wait.records for gap in r.tbt_gaps_s) <= 0.1
    off, _ = run_sim("3P1D", requests, slo=slo, model=_decode_bound(), decode_tbt_guard="off")
    assert off.report["num_completed"] == 3
    assert off.report["tbt_s"]["p90"] > 0.1  # all three in one batch: over the SLO


def test_same_seed_same_report(run_sim) -> None:
    requests = generate_dataset("leval", 6.0, 80, seed=1)
    first, _ = run_sim("3P2D", requests, policy="random", seed=7, cache_capacity_tokens=200_000)
    again, _ = run_sim("3P2D", requests, policy="random", seed=7, cache_capacity_tokens=200_000)
    assert first.report == again.report
    assert [r.token_times_s for r in first.records] == [r.token_times_s for r in again.records]
    other, _ = run_sim("3P2D", requests, policy="random", seed=8, cache_capacity_tokens=200_000)
    assert other.report != first.report


def test_time_scale_and_max_requests(run_sim) -> None:
    requests = generate_dataset("arxiv", 1.0, 20, seed=0)
    fast, _ = run_sim("2P1D", requests, time_scale=2.0, max_requests=10)
    assert fast.report["num_requests"] == 10
    assert fast.records[9].arrival_s == pytest.approx(requests[9].arrival_time_s / 2.0)


def test_first_token_at_kv_arrival_moves_the_wait_into_the_first_gap(run_sim, make_request):
    """Live, the prefill worker sends the first token once its KV is across; a request
    that then waits for the running decode step shows it in its first gap."""
    requests = [make_request(f"r{i}", 0.0, 4000, 3) for i in range(2)]
    slo = SLOConfig(ttft_s=30.0, tbt_s=10.0)
    runs = {
        at: _records(
            run_sim("2P1D", requests, slo=slo, model=_decode_bound(), first_token_at=at)[0]
        )  # fmt: skip
        for at in ("join", "kv")
    }
    join, kv = runs["join"], runs["kv"]
    # Both prefills end together; r0 joins an idle decode at once, r1 after r0's step.
    assert kv["r0"].token_times_s == join["r0"].token_times_s
    assert kv["r1"].token_times_s[0] == pytest.approx(kv["r0"].token_times_s[0], abs=1e-3)
    assert join["r1"].token_times_s[0] > kv["r1"].token_times_s[0] + 0.04  # waited a step
    assert kv["r1"].token_times_s[1:] == join["r1"].token_times_s[1:]
    assert kv["r1"].tbt_gaps_s[0] > join["r1"].tbt_gaps_s[0] + 0.04
    with pytest.raises(HalfmoonError, match="first_token_at"):
        SimConfig(ClusterSpec.parse("1P1D"), first_token_at="prefill")


def test_prediction_wastes_fewer_prefills_when_decode_binds(run_sim) -> None:
    """Decode-bound (one decode instance, 20 ms TBT, 16k prompts taking 4 s of prefill,
    512-token outputs): the snapshot admits requests whose prefill ends on a batch that
    has filled up meanwhile; the prediction counts who joins and leaves by then."""
    requests = generate_dataset("longctx-16k", 2.0, 200, seed=0)
    slo = SLOConfig(ttft_s=30.0, tbt_s=0.02)
    runs = {
        mode: run_sim("10P1D", requests, slo=slo, early_reject=mode)[0].report
        for mode in ("none", "snapshot", "predict")
    }
    none, snap, pred = runs["none"], runs["snapshot"], runs["predict"]
    assert snap["num_refused_after_prefill"] > 0  # decode does bind
    assert none["num_wasted_prefill"] > snap["num_wasted_prefill"] > 2 * pred["num_wasted_prefill"]
    assert pred["goodput_rps"] > snap["goodput_rps"]
    load = pred["decode_load"]  # sampled at arrivals, at most once a second
    assert 50 <= load["num_samples"] <= 100 and 0 < load["step_ms_mean"] <= 20.0
    assert load["batch_mean"] > 1 and 0 < load["step_cv_window"] <= load["step_cv"] + 0.1

import dataclasses

import pytest

from halfmoon.conductor import (
    BlockStored,
    Conductor,
    ConductorConfig,
    Decision,
    DecodeStarted,
    PrefillFinished,
    PrefillStarted,
    RejectCode,
    RequestFinished,
)
from halfmoon.core.clock import ManualClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request


def _req(rid, num_blocks, first=0, t=0.0, out=8):
    hashes = tuple(range(first, first + num_blocks))
    return Request(rid, t, num_blocks * 16, out, block_hashes=hashes, block_size_tokens=16)


def _cache(conductor, instance, hashes):
    for h in hashes:
        conductor.handle(BlockStored(block_hash=h, instance_id=instance))


def test_cache_aware_picks_longest_prefix(make_conductor):
    c = make_conductor(num_prefill=3, policy="cache-aware")
    _cache(c, "P2", range(10))
    _cache(c, "P3", range(5))
    d = c.schedule(_req("r", 20))
    assert d.prefill.instance_id == "P2" and d.prefill.cached_tokens == 160


def test_load_balance_ignores_cache_and_spreads(make_conductor):
    c = make_conductor(num_prefill=2, policy="load-balance")
    _cache(c, "P1", range(10))
    first = c.schedule(_req("a", 20))
    second = c.schedule(_req("b", 20))
    assert {first.prefill.instance_id, second.prefill.instance_id} == {"P1", "P2"}
    assert second.prefill.queue_s == 0.0


def test_kvcache_centric_trades_cache_for_queue(make_conductor):
    c = make_conductor(num_prefill=2, policy="kvcache-centric", kvcache_balancing_threshold=1.0)
    _cache(c, "P1", range(10))
    # Load P1 with 5 s of queued work; a 10-block hit saves only 160 tokens (0.08 s).
    c.schedule(_req("big", 625, first=1000))  # 10,000 tokens -> P2 is empty too; goes first
    busy = c.schedule(_req("big2", 625, first=5000)).prefill.instance_id
    d = c.schedule(_req("r", 20))
    assert d.prefill.instance_id != busy or d.prefill.queue_s == 0
    assert d.prefill.ttft_s == min(x.ttft_s for x in d.candidates)


def test_remote_prefix_threshold(make_conductor):
    c = make_conductor(num_prefill=2, policy="kvcache-centric", kvcache_balancing_threshold=0.5)
    _cache(c, "P1", range(8))
    d = c.schedule(_req("r", 20))
    # P1 holds 8/20 blocks: P2 missing 40% of the prompt < 50% threshold -> no remote option
    assert not any(x.is_remote for x in d.candidates)
    c2 = make_conductor(num_prefill=2, policy="kvcache-centric", kvcache_balancing_threshold=0.2)
    _cache(c2, "P1", range(8))
    d2 = c2.schedule(_req("r", 20))
    remote = [x for x in d2.candidates if x.is_remote]
    assert [(x.instance_id, x.cache_source, x.cached_tokens) for x in remote] == [("P2", "P1", 128)]


def test_remote_choice_plans_replication(make_conductor):
    c = make_conductor(num_prefill=2, policy="kvcache-centric", kvcache_balancing_threshold=0.0)
    _cache(c, "P1", range(30))
    c.schedule(_req("busy", 1000, first=10_000))  # 16,000 tokens: 8 s on P2 or P1
    d = c.schedule(_req("r", 40))
    assert d.accepted
    if d.prefill.is_remote:
        (plan,) = [p for p in d.replications if p.reason == "remote prefix"]
        assert plan.source == "P1" and plan.target == d.prefill.instance_id
        assert plan.block_hashes == tuple(range(30))


def test_random_is_deterministic_for_seed(make_conductor, paper_cost_model):
    import random

    def picks(seed):
        c = Conductor(
            ConductorConfig(policy="random", block_size_tokens=16),
            paper_cost_model,
            ManualClock(),
            random.Random(seed),
        )
        for i in range(4):
            c.add_prefill_instance(f"P{i}")
        c.add_decode_instance("D", kv_capacity_tokens=10**9)
        return [c.schedule(_req(f"r{k}", 4)).prefill.instance_id for k in range(12)]

    assert picks(1) == picks(1)
    assert len(set(picks(1))) > 1


def test_unknown_policy_and_modes(paper_cost_model):
    with pytest.raises(ValueError, match="unknown policy 'best'"):
        Conductor(ConductorConfig(policy="best"), paper_cost_model, ManualClock())
    with pytest.raises(ValueError, match="early-reject"):
        ConductorConfig(early_reject="maybe")
    with pytest.raises(ValueError, match="coupled router"):
        Conductor(ConductorConfig(coupled_router="x"), paper_cost_model, ManualClock())


def test_queue_drains_with_lifecycle_events(make_conductor):
    clock = ManualClock()
    c = make_conductor(num_prefill=1, clock=clock)
    c.schedule(_req("a", 125))  # 2,000 tokens -> 1 s
    c.schedule(_req("b", 125, first=500))
    assert c.queue_s("P1") == pytest.approx(2.0)
    c.handle(PrefillStarted("P1", "a"))
    clock.advance(0.25)
    assert c.queue_s("P1") == pytest.approx(1.75)
    c.handle(PrefillFinished("P1", "a"))
    assert c.queue_s("P1") == pytest.approx(1.0)
    c.handle(DecodeStarted("D1", "a"))
    clock.advance(3.0)
    c.handle(RequestFinished("D1", "a"))
    assert c.decode_time_estimate_s == pytest.approx(3.0)
    c.handle(RequestFinished("D1", "b"))  # aborted while queued
    assert c.queue_s("P1") == 0.0


def test_no_instances_rejects(paper_cost_model):
    c = Conductor(ConductorConfig(block_size_tokens=16), paper_cost_model, ManualClock())
    d = c.schedule(_req("r", 2))
    assert not d.accepted and "no prefill or decode" in d.reject_reason
    assert d.reject_code == RejectCode.NO_INSTANCE


def test_decode_chosen_by_load(make_conductor):
    c = make_conductor(num_prefill=1, num_decode=2)
    first = c.schedule(_req("a", 200)).decode.instance_id
    second = c.schedule(_req("b", 10, first=900)).decode.instance_id
    assert first != second


def test_snapshot_and_predict_tbt_rejection(make_conductor):
    slo = SLOConfig(ttft_s=100.0, tbt_s=0.0126)  # base step 12.5 ms + 27 ns/token
    for mode in ("snapshot", "predict"):
        c = make_conductor(
            num_prefill=1, num_decode=1, early_reject=mode, slo=slo, decode_time_estimate_s=1000.0
        )
        ok = c.schedule(_req("small", 10))
        assert ok.accepted, ok.reject_reason
        c.handle(PrefillFinished("P1", "small"))
        c.handle(DecodeStarted("D1", "small"))
        big = c.schedule(_req("big", 250, first=100))  # 4,000 tokens: +0.1 ms per step
        assert not big.accepted and "TBT" in big.reject_reason
        assert big.reject_code == RejectCode.TBT


def test_predict_sees_departures_before_prefill_ends(make_conductor):
    """A decode that ends before the new request's prefill is done does not count."""
    slo = SLOConfig(ttft_s=100.0, tbt_s=0.01265)  # old alone: 12.608 ms; old + new: 12.694 ms
    c = make_conductor(
        num_prefill=1, num_decode=1, early_reject="predict", slo=slo, decode_time_estimate_s=0.5
    )
    assert c.schedule(_req("old", 250)).accepted
    c.handle(PrefillFinished("P1", "old"))
    c.handle(DecodeStarted("D1", "old"))
    # 3,200-token prompt: 1.6 s of prefill; "old" leaves after 0.5 s by t_d -> accepted
    assert c.schedule(_req("new", 200, first=1000)).accepted
    snap = make_conductor(num_prefill=1, num_decode=1, early_reject="snapshot", slo=slo)
    assert snap.schedule(_req("old", 250)).accepted
    snap.handle(PrefillFinished("P1", "old"))
    snap.handle(DecodeStarted("D1", "old"))
    assert not snap.schedule(_req("new", 200, first=1000)).accepted


def test_hot_spot_replication(make_conductor):
    c = make_conductor(
        num_prefill=3,
        policy="cache-aware",
        hot_min_requests=3,
        hot_window_s=10.0,
        hot_max_replicas=2,
    )
    _cache(c, "P1", range(4))
    plans = []
    for k in range(4):
        plans += [
            p for p in c.schedule(_req(f"r{k}", 6)).replications if p.reason.startswith("hot")
        ]
    assert len(plans) == 1
    assert plans[0].source == "P1" and plans[0].target in {"P2", "P3"}
    assert plans[0].block_hashes == (0, 1, 2, 3)


def test_coupled_routers(paper_cost_model):
    for router in ("round-robin", "least-load", "cache-aware"):
        c = Conductor(
            ConductorConfig(coupled_router=router, block_size_tokens=16),
            paper_cost_model,
            ManualClock(),
        )
        c.add_coupled_instance("M1", kv_capacity_tokens=10**6)
        c.add_coupled_instance("M2", kv_capacity_tokens=10**6)
        _cache(c, "M2", range(5))
        picks = [c.route_coupled(_req(f"r{k}", 8)).prefill.instance_id for k in range(2)]
        if router == "round-robin":
            assert picks == ["M1", "M2"]
        elif router == "cache-aware":
            assert picks[0] == "M2"
        else:
            assert picks[0] != picks[1]
        assert c.prefill_instances == () and c.coupled_instances == ("M1", "M2")


def test_coupled_ties_go_round_and_a_hit_weighs_against_its_queue(paper_cost_model):
    """kvcache-centric routing of coupled instances: idle instances with no hit take
    turns (not always the first), a cached prefix attracts the request, and a long queue
    behind the hit sends it elsewhere (cache-aware would still pick the hit)."""
    c = Conductor(ConductorConfig(coupled_router="kvcache-centric", block_size_tokens=16),
                  paper_cost_model, ManualClock())  # fmt: skip
    for iid in ("M1", "M2"):
        c.add_coupled_instance(iid, kv_capacity_tokens=10**6)
    picks = []
    for k in range(4):
        d = c.route_coupled(_req(f"tie{k}", 2, first=100 * k))
        picks.append(d.prefill.instance_id)
        c.release(d.request_id)
    assert sorted(picks) == ["M1", "M1", "M2", "M2"]
    _cache(c, "M2", range(40))
    assert c.route_coupled(_req("hit", 41)).prefill.instance_id == "M2"
    for k in range(8):  # queues grow; every choice is the least estimated TTFT
        d = c.route_coupled(_req(f"r{k}", 41 if k % 2 else 200, first=0 if k % 2 else 1000 * k))
        assert d.prefill.ttft_s == min(p.ttft_s for p in d.candidates)
        assert {p.instance_id for p in d.candidates} == {"M1", "M2"}


def test_coupled_placement_rejects_early_when_the_slo_cannot_be_met(paper_cost_model):
    c = Conductor(
        ConductorConfig(coupled_router="kvcache-centric", block_size_tokens=16,
                        early_reject="snapshot", slo=SLOConfig(ttft_s=0.5, tbt_s=10.0)),
        paper_cost_model, ManualClock(),
    )  # fmt: skip
    c.add_coupled_instance("M1", kv_capacity_tokens=10**6)
    decisions = [c.route_coupled(_req(f"r{k}", 40, first=1000 * k)) for k in range(8)]
    rejected = [d for d in decisions if not d.accepted]
    assert decisions[0].accepted and rejected, [d.prefill.ttft_s for d in decisions]
    assert all(d.reject_code is not None and "TTFT" in d.reject_reason for d in rejected)


def test_explain_lists_every_candidate(make_conductor):
    c = make_conductor(num_prefill=3)
    d = c.schedule(_req("r", 4))
    text = d.explain()
    for iid in ("P1", "P2", "P3", "D1"):
        assert iid in text


def test_removing_an_instance_drops_its_requests_bookings_elsewhere(make_conductor):
    c = make_conductor(num_prefill=2, num_decode=1)
    d = c.schedule(_req("r", 125))  # 2,000 tokens booked on a prefill and on D1
    assert d.accepted
    c.remove_instance(d.prefill.instance_id)
    other = "P2" if d.prefill.instance_id == "P1" else "P1"
    assert c.queue_s(other) == 0.0
    again = c.schedule(_req("r~1", 125))  # the retry sees an empty decode instance
    assert again.decode.num_running == 1 and again.decode.context_tokens == 2000


def test_a_full_decode_kv_is_rejected_with_its_code(make_conductor):
    c = make_conductor(num_prefill=1, num_decode=1, early_reject="snapshot",
                       slo=SLOConfig(ttft_s=100.0, tbt_s=10.0))  # fmt: skip
    c._decode["D1"].kv_capacity_tokens = 1000  # noqa: SLF001 - a small pool
    d = c.schedule(_req("big", 100))  # 1,600 prompt tokens
    assert not d.accepted and d.reject_code == RejectCode.KV_FULL
    assert "decode KV full" in d.reject_reason


@pytest.mark.parametrize("early_reject", ["snapshot", "predict"])
def test_prompt_booking_holds_a_request_s_prompt_not_its_max_tokens(make_conductor, early_reject):
    """``decode_kv_booking``: "output" (the simulator's) holds prompt + output_length
    against the decode pool, "prompt" (live: output_length is a max_tokens bound, and the
    engines preempt) only the prompt and first token, so requests that each may grow to
    most of the pool are admitted side by side, as vLLM admits them."""
    slo = SLOConfig(ttft_s=100.0, tbt_s=10.0)
    for booking, admitted in (("output", 1), ("prompt", 3)):
        c = make_conductor(num_prefill=1, num_decode=1, early_reject=early_reject, slo=slo,
                           decode_kv_booking=booking)  # fmt: skip
        c._decode["D1"].kv_capacity_tokens = 1000  # noqa: SLF001 - a small pool
        # 160 prompt tokens each, up to 800 output tokens: 960 of the 1,000
        decisions = [c.schedule(_req(f"r{i}", 10, first=100 * i, out=800)) for i in range(3)]
        assert [d.accepted for d in decisions].count(True) == admitted, booking
        assert all(d.reject_code in ("", RejectCode.KV_FULL) for d in decisions)
    # a prompt that does not fit is refused either way
    big = c.schedule(_req("big", 60, first=900))  # 960 prompt tokens beside 3 x 160
    assert not big.accepted and big.reject_code == RejectCode.KV_FULL
    with pytest.raises(ValueError, match="decode KV booking"):
        make_conductor(decode_kv_booking="all")


def test_decision_is_keyword_only(make_conductor):
    with pytest.raises(TypeError):
        Decision("r1", "random", False, None, None)  # type: ignore[misc]
    rejected = Decision(request_id="r1", policy="random", accepted=False, prefill=None, decode=None)
    assert rejected.reject_reason == "" and rejected.replications == () and rejected.why == ""
    decision = make_conductor().schedule(_req("r2", 4))
    assert decision.accepted and decision.reject_reason == "" and decision.decode_candidates


def test_a_request_placed_again_after_a_failure_is_never_rejected_early(paper_cost_model):
    """A failed-over request was admitted once: a 429 now would break the client's stream.
    The same requests, new, are rejected (TTFT over its SLO, decode KV full)."""
    c = Conductor(
        ConductorConfig(block_size_tokens=16, early_reject="snapshot",
                        slo=SLOConfig(ttft_s=0.5, tbt_s=10.0)),
        paper_cost_model, ManualClock(),
    )  # fmt: skip
    c.add_prefill_instance("P1")
    c.add_decode_instance("D1", kv_capacity_tokens=3000)
    first = c.schedule(_req("r0", 40))
    assert first.accepted
    for k in range(1, 6):
        new = _req(f"r{k}", 40, first=1000 * k)
        refused = c.schedule(new)
        assert not refused.accepted and refused.reject_code in (RejectCode.TTFT, RejectCode.KV_FULL)
        again = dataclasses.replace(new, request_id=f"r{k}~1", admitted=True)
        placed = c.schedule(again)
        assert placed.accepted and placed.decode.instance_id == "D1", placed.reject_reason
    c.add_coupled_instance("M1", kv_capacity_tokens=100)  # coupled routing: the same rule
    big = _req("m", 40, first=99_000)
    assert not c.route_coupled(big).accepted
    assert c.route_coupled(dataclasses.replace(big, admitted=True)).accepted


@pytest.mark.parametrize("early_reject", ["snapshot", "predict"])
def test_a_prefill_only_request_books_no_decode_instance(make_conductor, early_reject):
    """An embedding is answered by the instance that computes it: a full decode pool does
    not refuse it, it books nothing there (nor a hand-off on the links), and its prefill
    worker's RequestFinished ends it."""
    c = make_conductor(num_prefill=1, num_decode=1, early_reject=early_reject,
                       slo=SLOConfig(ttft_s=100.0, tbt_s=10.0), link_backlog=True)  # fmt: skip
    c._decode["D1"].kv_capacity_tokens = 1000  # noqa: SLF001 - a small pool
    embed = dataclasses.replace(_req("e", 100), prefill_only=True)  # 1,600 prompt tokens
    d = c.schedule(embed)
    assert d.accepted and d.prefill.instance_id == "P1", d.reject_reason
    dstate = c._decode["D1"]  # noqa: SLF001
    assert "e" not in dstate.incoming and dstate.committed_tokens == 0
    assert c.queue_s("P1") > 0
    c.check_integrity()
    assert not c.schedule(_req("big", 100)).accepted  # the same prompt to decode: no room
    c.handle(RequestFinished("P1", "e"))
    assert c.num_placements == 0 and c.queue_s("P1") == 0.0
    c.check_integrity()
    # a TTFT beyond the SLO refuses it still
    slow = make_conductor(num_prefill=1, num_decode=1, early_reject=early_reject,
                          slo=SLOConfig(ttft_s=0.01, tbt_s=10.0))  # fmt: skip
    refused = slow.schedule(embed)
    assert not refused.accepted and refused.reject_code == RejectCode.TTFT


@pytest.mark.parametrize("early_reject", ["none", "snapshot", "predict"])
def test_a_prefill_only_request_needs_no_decode_instance(make_conductor, early_reject):
    """An embedding's decision names no decode instance and evaluates none; a cluster
    whose decode instances are all gone still places it (a generation it refuses)."""
    c = make_conductor(num_prefill=2, num_decode=1, early_reject=early_reject)
    embed = dataclasses.replace(_req("e", 4), prefill_only=True)
    d = c.schedule(embed, exhaustive=True)
    assert d.accepted and d.decode is None and d.decode_candidates == (), d
    assert d.num_decode_candidates == 0 and d.why.endswith("; prefill only"), d.why
    assert "e" not in c._decode["D1"].incoming  # noqa: SLF001
    c.handle(RequestFinished(d.prefill.instance_id, "e"))
    c.remove_instance("D1")
    assert not c.schedule(_req("g", 4)).accepted
    again = c.schedule(dataclasses.replace(_req("e2", 4), prefill_only=True))
    assert again.accepted and again.decode is None
    assert "request e2" in again.explain()
    c.check_integrity()

"""CPP group candidates in the Conductor (chunked pipeline parallelism)."""

import pytest

from halfmoon.conductor import (
    BlockStored,
    ConductorConfig,
    DecodeStarted,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.conductor.cpp import cpp_groups
from halfmoon.core.request import Request
from halfmoon.costmodel import cpp_prefill_estimate

HIDDEN = 16384  # LLaMA2-70B: 8,192 x bf16
CPP = {"cpp_stages": 2, "cpp_chunk_tokens": 1024, "cpp_hidden_bytes_per_token": HIDDEN}


def _req(rid, num_blocks, first=0, t=0.0, out=8):
    hashes = tuple(range(first, first + num_blocks))
    return Request(rid, t, num_blocks * 16, out, block_hashes=hashes, block_size_tokens=16)


def test_groups_are_disjoint_consecutive_tuples():
    ids = ["P1", "P2", "P3", "P4", "P5"]
    assert cpp_groups(ids, 2) == [("P1", "P2"), ("P3", "P4")]
    assert cpp_groups(ids, 4) == [("P1", "P2", "P3", "P4")]
    assert cpp_groups(ids, 1) == [] and cpp_groups(ids, 6) == []


def test_long_prompt_goes_to_a_group_and_books_every_member(make_conductor, paper_cost_model):
    c = make_conductor(num_prefill=4, **CPP)
    d = c.schedule(_req("r", 1000))  # 16,000 tokens: 8 s alone at 2,000 tok/s
    est = cpp_prefill_estimate(paper_cost_model, 2, 16_000, 0, 1024, HIDDEN)
    assert d.prefill.group == ("P1", "P2")
    assert d.prefill.prefill_s == pytest.approx(est.ttft_s)
    assert d.prefill.ttft_s < min(x.ttft_s for x in d.candidates if not x.group)
    assert [x.group for x in d.candidates if x.group] == [("P1", "P2"), ("P3", "P4")]
    assert "*P1+P2" in d.explain()
    assert c.queue_s("P1") == pytest.approx(est.stage_end_s[0])
    assert c.queue_s("P2") == pytest.approx(est.stage_end_s[1])
    assert c.queue_s("P3") == 0.0
    # The next long prompt sees P1/P2 busy and takes the other group.
    assert c.schedule(_req("s", 1000, first=5000)).prefill.group == ("P3", "P4")
    c.check_integrity()
    for iid in ("P1", "P2"):
        c.handle(PrefillStarted(iid, "r"))
        c.handle(PrefillFinished(iid, "r"))
    c.handle(RequestFinished("D1", "r"))
    assert c.queue_s("P1") == c.queue_s("P2") == 0.0
    c.check_integrity()


def test_short_prompts_get_no_group(make_conductor):
    c = make_conductor(num_prefill=4, **CPP)  # cpp_min_tokens 2048 by default
    d = c.schedule(_req("r", 100))  # 1,600 tokens
    assert not any(x.group for x in d.candidates) and not d.prefill.group


def test_group_only_when_it_lowers_ttft(make_conductor):
    # One-chunk prompt: the pipeline cannot overlap and pays a hand-off.
    c = make_conductor(num_prefill=2, cpp_min_tokens=0, **CPP)
    d = c.schedule(_req("r", 30))
    assert any(x.group for x in d.candidates)
    assert not d.prefill.group
    # A long prompt with one member busy: the group waits for it, a free instance wins.
    c = make_conductor(num_prefill=3, **CPP)
    c.schedule(_req("busy", 5000, first=90_000))  # 80k tokens on the P1+P2 group
    d = c.schedule(_req("r", 1000))
    assert d.prefill.instance_id == "P3" and not d.prefill.group


def test_group_fetches_its_layers_share_of_a_remote_prefix(make_conductor, paper_cost_model):
    """Each member fetches its layers' half of the prefix from P3; both halves leave over
    P3's one link, one after the other (as the simulator books them), so the fetch takes
    the whole prefix's link time, not half of it."""
    c = make_conductor(num_prefill=3, kvcache_balancing_threshold=0.1, **CPP)
    for h in range(500):
        c.handle(BlockStored(block_hash=h, instance_id="P3"))
    d = c.schedule(_req("r", 1000))
    remote = [x for x in d.candidates if x.group and x.cache_source == "P3"]
    assert len(remote) == 1 and remote[0].is_remote
    half = paper_cost_model.transfer_time_s(500 * 16 * paper_cost_model.kv_bytes_per_token / 2)
    assert remote[0].transfer_s == pytest.approx(2 * half)
    assert remote[0].cached_tokens == 8000
    assert not any(p.reason == "remote prefix" for p in d.replications if d.prefill.group)


def test_a_member_holding_the_prefix_sends_the_other_its_share(make_conductor, paper_cost_model):
    c = make_conductor(num_prefill=2, kvcache_balancing_threshold=0.1, **CPP)
    for h in range(500):
        c.handle(BlockStored(block_hash=h, instance_id="P1"))
    for h in range(100):
        c.handle(BlockStored(block_hash=h, instance_id="P2"))
    d = c.schedule(_req("r", 1000))
    (remote,) = [x for x in d.candidates if x.group and x.transfer_s > 0]
    assert remote.cache_source == "P1" and remote.cached_tokens == 8000
    kv = paper_cost_model.kv_bytes_per_token
    assert remote.transfer_s == pytest.approx(paper_cost_model.transfer_time_s(400 * 16 * kv / 2))


def _linked_conductor(link_bytes_per_s: float, kv_bytes_per_token: int):
    from halfmoon.conductor import Conductor
    from halfmoon.core.clock import ManualClock
    from halfmoon.costmodel.throughput import ThroughputCostModel

    cost_model = ThroughputCostModel(2000.0, kv_bytes_per_token, link_bytes_per_s)
    config = ConductorConfig(
        block_size_tokens=16, kvcache_balancing_threshold=0.1, link_backlog=True, **CPP
    )
    c = Conductor(config, cost_model, ManualClock())
    for iid in ("P1", "P2", "P3"):
        c.add_prefill_instance(iid)
    c.add_decode_instance("D1", kv_capacity_tokens=1_000_000)
    return c, cost_model


def test_a_group_fetch_waits_for_the_links_and_is_booked(paper_cost_model):
    """With link books a group's fetch waits for the source's link, its members are held
    through it, and both shares are booked on the source's link."""
    c, cm = _linked_conductor(1e10, paper_cost_model.kv_bytes_per_token)
    for h in range(500):
        c.handle(BlockStored(block_hash=h, instance_id="P3"))
    half = cm.transfer_time_s(500 * 16 * cm.kv_bytes_per_token / 2)
    links = c._links  # noqa: SLF001
    assert links is not None
    links.reserve(0.0, 0.5, "P3", "D1")  # P3's link is busy for another 0.5 s
    d = c.schedule(_req("r", 1000))
    (remote,) = [x for x in d.candidates if x.group and x.cache_source == "P3"]
    assert remote.transfer_s == pytest.approx(0.5 + 2 * half)  # waits, then both halves
    assert d.prefill.group == ("P1", "P2") and d.prefill.cache_source == "P3"
    est = cpp_prefill_estimate(cm, 2, 16_000 - 8000, 8000, 1024, HIDDEN)
    assert c.queue_s("P1") == pytest.approx(remote.transfer_s + est.stage_end_s[0])
    assert c.queue_s("P2") == pytest.approx(remote.transfer_s + est.stage_end_s[1])
    assert links.free_at_s("P3") == pytest.approx(0.5 + 2 * half)
    assert links.free_at_s("P1") == pytest.approx(0.5 + half)  # P1's share went first
    c.check_integrity()


def test_group_hand_offs_the_compute_cannot_hide_are_booked(paper_cost_model):
    """Each stage streams its layers' KV to decode while it computes; on a slow link what
    its compute cannot hide is left on the member's and decode's links at its end."""
    c, cm = _linked_conductor(3e8, paper_cost_model.kv_bytes_per_token)
    d = c.schedule(_req("r", 1000))  # 16,000 new tokens
    assert d.prefill.group == ("P1", "P2")
    est = cpp_prefill_estimate(cm, 2, 16_000, 0, 1024, HIDDEN)
    share_s = cm.transfer_time_s(16_000 * cm.kv_bytes_per_token / 2)
    links = c._links  # noqa: SLF001
    assert links is not None
    tails = [share_s - (est.stage_end_s[s] - est.stage_start_s[s]) for s in range(2)]
    assert min(tails) > 0  # link-bound
    p1_end = est.stage_end_s[0] + tails[0]
    assert links.free_at_s("P1") == pytest.approx(p1_end)
    # P2's tail waits for D1 where P1's still holds it.
    p2_end = max(est.stage_end_s[1], p1_end) + tails[1]
    assert links.free_at_s("P2") == pytest.approx(p2_end)
    assert links.free_at_s("D1") == pytest.approx(p2_end)
    c.check_integrity()


@pytest.mark.parametrize(
    "field,value", [("cpp_stages", 0), ("cpp_chunk_tokens", 0), ("cpp_min_tokens", -1)]
)
def test_config_is_checked(field, value):
    with pytest.raises(ValueError, match=field):
        ConductorConfig(**{field: value})


def test_removing_a_stage_drops_the_group_requests_bookings(make_conductor):
    c = make_conductor(num_prefill=2, num_decode=1, **CPP)
    d = c.schedule(_req("r", 1000))
    assert d.prefill.group == ("P1", "P2")
    c.remove_instance("P2")  # the second stage died: the retry must not see r's bookings
    assert c.queue_s("P1") == 0.0
    again = c.schedule(_req("r~1", 1000))
    assert again.accepted and again.decode.num_running == 1
    assert again.prefill.instance_id == "P1" and not again.prefill.group
    c.check_integrity()


def test_events_of_requests_placed_elsewhere_book_nothing(make_conductor):
    """Workers report requests this Conductor never placed (placed by its predecessor, or
    by the gateway while it was away): they must not become bookings. Before, a
    DecodeStarted of such a request left an orphan running entry for ever."""
    c = make_conductor(num_prefill=2, num_decode=1, **CPP)
    c.handle(PrefillStarted("P1", "stranger"))
    c.handle(DecodeStarted("D1", "stranger"))
    assert not c._decode["D1"].running  # noqa: SLF001
    c.check_integrity()
    c.handle(RequestFinished("D1", "stranger"))
    c.check_integrity()


def test_release_drops_every_booking_once(make_conductor):
    """A request that ends without a worker's RequestFinished (failed before dispatch,
    refused, hung up on) is released by its gateway: group members and decode alike."""
    c = make_conductor(num_prefill=2, num_decode=1, **CPP)
    assert c.schedule(_req("r", 1000)).prefill.group == ("P1", "P2")
    assert c.schedule(_req("s", 10, first=7000)).accepted
    assert c.num_placements == 2
    assert c.release("r") and not c.release("r") and not c.release("never-placed")
    assert c.queue_s("P2") == 0.0 and c.num_placements == 1
    c.check_integrity()
    c.handle(PrefillStarted("P1", "s"))
    c.handle(DecodeStarted("D1", "s"))
    assert c.release("s") and c.num_placements == 0
    assert c.queue_s("P1") == 0.0
    c.check_integrity()
    # A broken invariant is named.
    c.schedule(_req("t", 10, first=9000))
    c._decode["D1"].incoming.clear()  # noqa: SLF001 - corrupt on purpose
    with pytest.raises(AssertionError, match="t: neither"):
        c.check_integrity()

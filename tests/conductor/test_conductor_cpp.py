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
    c = make_conductor(num_prefill=3, kvcache_balancing_threshold=0.1, **CPP)
    for h in range(500):
        c.handle(BlockStored(block_hash=h, instance_id="P3"))
    d = c.schedule(_req("r", 1000))
    remote = [x for x in d.candidates if x.group and x.cache_source == "P3"]
    assert len(remote) == 1 and remote[0].is_remote
    expected = paper_cost_model.transfer_time_s(500 * 16 * paper_cost_model.kv_bytes_per_token / 2)
    assert remote[0].transfer_s == pytest.approx(expected)
    assert remote[0].cached_tokens == 8000
    assert not any(p.reason == "remote prefix" for p in d.replications if d.prefill.group)


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

"""The Conductor's link books (``link_backlog``): planned transfers hold both links, and
a fetch is priced by its wait for them."""

import pytest

from halfmoon.conductor import BlockStored, Conductor, ConductorConfig
from halfmoon.conductor.links import Link, LinkBook, reserve_transfer
from halfmoon.core.clock import ManualClock
from halfmoon.core.request import Request
from halfmoon.costmodel.throughput import PAPER_KV_BYTES_PER_TOKEN, ThroughputCostModel
from halfmoon.sim.network import Nic

BLOCK = 16
#: 2,000 tokens/s of prefill over a 100 MB/s link: a prompt's KV (320 KiB/token) takes
#: 3.3 ms per token to send and 0.5 ms to compute, so every hand-off is link-bound.
SLOW_LINK = ThroughputCostModel(2000.0, PAPER_KV_BYTES_PER_TOKEN, 1e8)


def test_a_transfer_waits_for_both_links_and_holds_both() -> None:
    book = LinkBook()
    assert book.reserve(1.0, 2.0, "P1", "D1") == 3.0
    assert book.free_at_s("P1") == book.free_at_s("D1") == 3.0
    assert book.wait_s(0.5, "P2", "D1") == 2.5 and book.wait_s(4.0, "P2", "D1") == 0.0
    # Ready at 2, but D1 is busy until 3: P2 -> D1 runs 3..4, and P1 stays at 3.
    assert book.reserve(2.0, 1.0, "P2", "D1") == 4.0
    assert book.free_at_s("P2") == 4.0 and book.free_at_s("P1") == 3.0
    # Nothing to send, or nothing crossing a link, books nothing.
    assert book.reserve(9.0, 0.0, "P1", "D1") == 9.0 and book.free_at_s("P1") == 3.0
    assert book.reserve(9.0, 5.0, "P1", "P1") == 9.0 and book.wait_s(0.0, "P1", "P1") == 0.0
    assert book.state(3.5) == {"P1": 0.0, "D1": 0.5, "P2": 0.5}
    book.forget("D1")
    assert book.free_at_s("D1") == 0.0


def test_the_simulator_books_on_the_same_links() -> None:
    a, b = Nic(), Link()
    assert reserve_transfer(0.0, 1.5, a, b) == 1.5 and a.free_at_s == b.free_at_s == 1.5


#: 0.25 ms per token on the link, half the compute's: a fetch of a prefix pays, and the
#: hand-off of a mostly cached prompt is link-bound.
MID_LINK = ThroughputCostModel(
    2000.0, PAPER_KV_BYTES_PER_TOKEN, 4 * PAPER_KV_BYTES_PER_TOKEN / 1e-3
)


def _conductor(
    link_backlog: bool, cost_model=SLOW_LINK, prefix_blocks: int = 10, fetch: str = "queued"
) -> Conductor:
    config = ConductorConfig(
        block_size_tokens=BLOCK, kvcache_balancing_threshold=0.0, link_backlog=link_backlog,
        prefix_fetch=fetch,
    )  # fmt: skip
    conductor = Conductor(config, cost_model, ManualClock())
    for iid in ("P1", "P2"):
        conductor.add_prefill_instance(iid)
    conductor.add_decode_instance("D1", kv_capacity_tokens=1_000_000)
    for h in range(prefix_blocks):  # P1 holds the prefix
        conductor.handle(BlockStored(h, instance_id="P1"))
    return conductor


def _remote(decision):
    (fetch,) = [c for c in decision.candidates if c.is_remote]
    return fetch


@pytest.mark.parametrize("exhaustive", [False, True])
def test_a_fetch_waits_behind_the_hand_off_booked_on_its_source(exhaustive) -> None:
    priced, idle = _conductor(True), _conductor(False)
    first = Request("r0", 0.0, 160, 4, tuple(range(1000, 1010)), BLOCK)
    prefix = Request("r1", 0.0, 320, 4, tuple(range(20)), BLOCK)
    for c in (priced, idle):
        assert c.schedule(first, exhaustive=exhaustive).prefill.instance_id == "P1"
    # r0's hand-off on P1 and D1: 160 tokens computed in 0.08 s, sent in 0.524 s.
    send_s = SLOW_LINK.transfer_time_s(160 * PAPER_KV_BYTES_PER_TOKEN)
    assert priced._links.free_at_s("P1") == pytest.approx(send_s)
    assert priced._links.free_at_s("D1") == pytest.approx(send_s)
    fetch_s = SLOW_LINK.transfer_time_s(160 * PAPER_KV_BYTES_PER_TOKEN)
    # Without the books the fetch from P1 to idle P2 is priced as on an idle link; with
    # them it starts once P1's link is free.
    assert _remote(idle.schedule(prefix, exhaustive=exhaustive)).transfer_s == fetch_s
    fetch = _remote(priced.schedule(prefix, exhaustive=exhaustive))
    assert fetch.instance_id == "P2" and fetch.queue_s == 0.0
    assert fetch.transfer_s == pytest.approx(send_s + fetch_s)


def test_a_booked_fetch_holds_both_links_and_the_fetching_instance() -> None:
    c = _conductor(True, MID_LINK, prefix_blocks=100)
    busy = Request("r0", 0.0, 1600, 4, tuple(range(1000, 1100)), BLOCK)
    assert c.schedule(busy).prefill.instance_id == "P1"  # 0.8 s of work on P1
    # P1's 1,600-token prefix and one block more: fetching it to P2 (0.4 s) beats
    # waiting 0.8 s at P1.
    request = Request("r1", 0.0, 1616, 4, tuple(range(101)), BLOCK)
    chosen = c.schedule(request).prefill
    assert chosen.instance_id == "P2" and chosen.cache_source == "P1"
    fetch_s = MID_LINK.transfer_time_s(1600 * PAPER_KV_BYTES_PER_TOKEN)
    assert chosen.queue_s == 0.0 and chosen.transfer_s == pytest.approx(fetch_s)
    links = c._links
    assert links.free_at_s("P1") == pytest.approx(fetch_s)
    # P2's queue counts the fetch and the prefill; its hand-off (the prompt's KV, less
    # what streams during the prefill) is booked on P2 and D1 after both.
    assert c.queue_s("P2") == pytest.approx(chosen.transfer_s + chosen.prefill_s)
    stream_s = MID_LINK.transfer_time_s(1616 * PAPER_KV_BYTES_PER_TOKEN)
    assert links.free_at_s("P2") == pytest.approx(chosen.ttft_s + stream_s - chosen.prefill_s)
    assert links.free_at_s("D1") == links.free_at_s("P2")
    # A second fetch from P1 now waits for both links.
    free_s = max(links.free_at_s("P1"), links.free_at_s("P2"))
    again = Request("r2", 0.0, 1616, 4, tuple(range(100)) + (5000,), BLOCK)
    fetch = _remote(c.schedule(again, exhaustive=True))
    assert fetch.instance_id == "P2" and free_s > fetch.queue_s
    assert fetch.transfer_s == pytest.approx(free_s - fetch.queue_s + fetch_s)


def test_an_overlapping_fetch_starts_now_and_does_not_hold_the_instance() -> None:
    """``prefix_fetch="overlap"``: the fetch runs while the fetching instance's queue
    does: TTFT = max(queue, fetch) + prefill, the fetch booked on the links from now, and
    the instance's queue counting only the prefill."""
    c = _conductor(True, MID_LINK, prefix_blocks=100, fetch="overlap")
    p2_busy = Request("r0", 0.0, 400, 4, tuple(range(2000, 2025)), BLOCK)
    p1_busy = Request("r1", 0.0, 1600, 4, tuple(range(1000, 1100)), BLOCK)
    assert c.schedule(p1_busy).prefill.instance_id == "P1"  # 0.8 s of work on P1
    assert c.schedule(p2_busy).prefill.instance_id == "P2"  # 0.2 s on P2
    fetch_s = MID_LINK.transfer_time_s(1600 * PAPER_KV_BYTES_PER_TOKEN)  # 0.4 s
    links = c._links
    # The hand-offs stream behind their prefills (half the compute's time): no backlog.
    assert links.free_at_s("P1") == links.free_at_s("P2") == 0.0
    request = Request("r2", 0.0, 1616, 4, tuple(range(101)), BLOCK)
    decision = c.schedule(request)
    chosen = decision.prefill
    assert chosen.instance_id == "P2" and chosen.cache_source == "P1" and chosen.overlap
    assert "ttft_s = max(queue_s, xfer_s) + prefill_s" in decision.explain()
    assert chosen.queue_s == pytest.approx(0.2) and chosen.transfer_s == pytest.approx(fetch_s)
    assert chosen.ttft_s == max(chosen.queue_s, chosen.transfer_s) + chosen.prefill_s
    assert c.queue_s("P2") == pytest.approx(chosen.queue_s + chosen.prefill_s)
    assert links.free_at_s("P1") == pytest.approx(fetch_s)  # booked from now, not from 0.2 s
    # The same placement estimated the paper's way waits for the queue, then fetches.
    queued = _conductor(True, MID_LINK, prefix_blocks=100)
    for r in (p1_busy, p2_busy):
        queued.schedule(r)
    paper = _remote(queued.schedule(request, exhaustive=True))
    assert not paper.overlap and paper.instance_id == "P2"
    assert paper.ttft_s == paper.queue_s + paper.transfer_s + paper.prefill_s > chosen.ttft_s

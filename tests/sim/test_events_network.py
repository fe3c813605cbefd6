"""The event loop's ordering and the KV transfer arithmetic."""

import pytest

from halfmoon.core.clock import ManualClock
from halfmoon.sim.events import Event, EventLoop
from halfmoon.sim.network import Nic, kv_stream_tail_s, reserve_transfer
from halfmoon.sim.prefill import chunk_sizes


def test_events_fire_in_time_then_scheduling_order() -> None:
    clock = ManualClock()
    loop = EventLoop(clock)
    fired: list[tuple[str, float]] = []

    def action(name: str, successors: tuple[Event, ...] = ()):
        def run():
            fired.append((name, clock.now()))
            return successors

        return run

    later = Event(3.0, action("successor"))
    loop.schedule(
        [Event(2.0, action("b")), Event(1.0, action("a", (later,))), Event(2.0, action("c"))]
    )
    assert loop.run() == 4
    assert fired == [("a", 1.0), ("b", 2.0), ("c", 2.0), ("successor", 3.0)]
    assert clock.now() == 3.0 and len(loop) == 0


def test_run_until_leaves_later_events() -> None:
    clock = ManualClock()
    loop = EventLoop(clock)
    loop.schedule([Event(1.0, lambda: ()), Event(5.0, lambda: ())])
    assert loop.run(until_s=2.0) == 1
    assert len(loop) == 1


def test_event_in_the_past_is_refused() -> None:
    clock = ManualClock(10.0)
    with pytest.raises(ValueError, match="past"):
        EventLoop(clock).schedule([Event(9.0, lambda: ())])


def test_tail_fast_link_is_last_layer_share() -> None:
    # compute 2 s over 80 layers, new KV needs 0.08 s of link: the last layer's share.
    assert kv_stream_tail_s(2.0, 0.0, 0.08, 80) == pytest.approx(0.001)


def test_tail_slow_link_is_excess_of_transfer() -> None:
    # transfer (3 s) longer than compute (1 s): link-bound from the first layer on.
    assert kv_stream_tail_s(1.0, 0.0, 3.0, 10) == pytest.approx(1.0 / 10 + 3.0 - 1.0)
    # a big cached prefix makes the whole transfer the bound
    assert kv_stream_tail_s(1.0, 5.0, 0.5, 10) == pytest.approx(5.5 - 1.0)


def test_tail_is_never_negative_and_checks_layers() -> None:
    assert kv_stream_tail_s(0.0, 0.0, 0.0, 80) == 0.0
    with pytest.raises(ValueError):
        kv_stream_tail_s(1.0, 0.0, 0.1, 0)


def test_nic_reservations_queue() -> None:
    a, b, c = Nic(), Nic(), Nic()
    assert reserve_transfer(1.0, 2.0, a, b) == 3.0
    assert reserve_transfer(1.5, 1.0, c, b) == 4.0  # b is busy until 3.0
    assert reserve_transfer(0.0, 1.0, c, c) == 5.0  # local: waits, occupies nothing
    assert c.free_at_s == 4.0


def test_chunk_sizes() -> None:
    assert chunk_sizes(1000, None) == [1000]
    assert chunk_sizes(1000, 400) == [400, 400, 200]
    assert chunk_sizes(800, 400) == [400, 400]
    assert chunk_sizes(300, 400) == [300]

"""Queue estimates under the priority scheduling policy: what a request of a priority
waits for (PrefillState, PrefillLoads), the share of more urgent work (UrgentShare), and
the Conductor's placements and rejections with them."""

import math
import random

import numpy as np
import pytest

from halfmoon.conductor import PrefillStarted
from halfmoon.conductor.loads import PrefillLoads
from halfmoon.conductor.priorities import MAX_SHARE, WHOLE_QUEUE, QueueView, UrgentShare
from halfmoon.conductor.state import PrefillState
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel.throughput import ThroughputCostModel

CM = ThroughputCostModel(1000.0, 1024, 1e9)
BLOCK = 16


def _docstring_state():
    """The class docstring's example: B (0, in service), C (5), D (0), E (-1), each
    announced on arrival as live workers do."""
    state = PrefillState("P1", CM)
    for t, (rid, seconds, priority) in enumerate(
        [("B", 4.0, 0), ("C", 2.0, 5), ("D", 3.0, 0), ("E", 1.0, -1)]
    ):
        state.add(rid, seconds, 100, priority=priority)
        state.start(rid, float(t))
    return state


def test_a_request_waits_for_the_bookings_served_before_it():
    state = _docstring_state()
    now = 1.5  # 1.5 s of work done since the busy mark (t = 0)
    assert state.queue_s(now) == pytest.approx(10.0 - 1.5)  # every booking
    assert state.queue_s(now, 5) == pytest.approx(10.0 - 1.5)  # nothing comes after it
    assert state.queue_s(now, 0) == pytest.approx(8.0 - 1.5)  # C comes after it
    assert state.queue_s(now, -1) == pytest.approx(5.0 - 1.5)  # B (in service) and E
    assert state.queue_s(now, -2) == pytest.approx(4.0 - 1.5)  # only B, in service
    assert state.in_service() == "B" and state.max_priority == 5


def test_the_report_counts_without_the_bookings_behind():
    state = _docstring_state()
    state.report(20_000, 1.5)  # 20 s of reported work: more than the 10 s booked
    assert state.queue_s(1.5) == pytest.approx(20.0)
    assert state.queue_s(1.5, 0) == pytest.approx(18.0)  # less C
    assert state.queue_s(1.5, -2) == pytest.approx(14.0)  # less C, D, E


def test_priority_zero_everywhere_is_the_fcfs_estimate_bit_for_bit():
    rng = random.Random(3)
    state = PrefillState("P1", CM)
    for i in range(20):
        state.add(f"r{i}", rng.uniform(0.1, 3.0), 10)
        if rng.random() < 0.5:
            state.start(f"r{i}", rng.uniform(0, 2))
    state.report(1500, 0.5)
    for now in (0.0, 0.7, 1.9, 3.3):
        assert state.queue_s(now) == state.queue_s(now, 0) == state.queue_s(now, None)
    assert not state.priority_of and state.max_priority == 0


def test_finished_bookings_forget_their_priority():
    state = _docstring_state()
    for rid in ("C", "E"):
        state.finish(rid, 2.0)
    assert state.priority_of == {} and state.max_priority == 0
    for rid in ("B", "D"):
        state.finish(rid, 3.0)
    assert state.max_priority == -math.inf


@pytest.mark.parametrize("seed", range(8))
def test_loads_give_each_state_its_own_estimate_bit_for_bit(seed):
    rng = random.Random(seed)
    states = [PrefillState(f"P{i}", CM) for i in range(6)]
    loads = PrefillLoads(states)
    n = 0
    for _ in range(60):
        state = rng.choice(states)
        roll = rng.random()
        if roll < 0.5:
            n += 1
            state.add(f"r{n}", rng.uniform(0.1, 4.0), 10, priority=rng.choice([0, 0, -1, 2, 7]))
        elif roll < 0.7 and state.pending_s:
            state.start(rng.choice(list(state.pending_s)), rng.uniform(0, 5))
        elif roll < 0.85 and state.pending_s:
            state.finish(rng.choice(list(state.pending_s)), rng.uniform(0, 5))
        else:
            state.report(rng.randint(0, 3000), rng.uniform(0, 5))
        now = rng.uniform(0, 6)
        for priority in (None, -2, -1, 0, 2, 9):
            want = [s.queue_s(now, priority) for s in states]
            assert loads.queue_s(now, priority).tolist() == want


def test_urgent_share_stays_idle_without_priorities():
    share = UrgentShare(window_s=10.0)
    for t in range(5):
        share.placed(float(t), 0, 5.0)
    assert not share.active and share.share(5.0, 3, 2) == 0.0
    assert share.view(5.0, 0, 2) == QueueView(0, 1.0)


def test_urgent_share_counts_more_urgent_work_over_its_window():
    share = UrgentShare(window_s=10.0)
    share.placed(0.0, -1, 4.0)  # activates it
    share.placed(1.0, 0, 6.0)
    share.placed(2.0, 3, 2.0)
    # Two instances: 20 s of their time in the window.
    assert share.share(5.0, -1, 2) == 0.0  # nothing more urgent than -1
    assert share.share(5.0, 0, 2) == pytest.approx(4.0 / 20)
    assert share.share(5.0, 3, 2) == pytest.approx(10.0 / 20)
    assert share.share(5.0, 9, 2) == pytest.approx(12.0 / 20)
    view = share.view(5.0, 3, 2)
    assert view.priority == 3 and view.stretch == pytest.approx(1 / (1 - 0.5))
    # The -1 placement leaves the window at t = 10, the 0 one at 11.
    assert share.share(10.5, 3, 2) == pytest.approx(6.0 / 20)
    assert share.share(11.0, 3, 2) == 0.0 and share.share(11.0, 9, 2) == pytest.approx(0.1)
    share.placed(11.0, -1, 1000.0)
    assert share.share(11.0, 0, 2) == MAX_SHARE


def test_a_view_stretches_the_wait_it_sees():
    state = _docstring_state()
    loads = PrefillLoads([state])
    view = QueueView(0, 2.0)
    assert view.state_s(state, 1.5) == pytest.approx(2 * (8.0 - 1.5))
    assert view.loads_s(loads, 1.5).tolist() == [view.state_s(state, 1.5)]
    assert WHOLE_QUEUE.state_s(state, 1.5) == state.queue_s(1.5)


def _busy(conductor, num=6, length=64 * BLOCK):
    """Fill both prefill instances with normal requests (announced on arrival)."""
    for i in range(num):
        d = conductor.schedule(Request(f"n{i}", 0.0, length, 8, (), BLOCK))
        assert d.accepted
        conductor.handle(PrefillStarted(d.prefill.instance_id, f"n{i}"))


def test_an_urgent_request_is_placed_by_its_own_wait(make_conductor):
    aware = make_conductor()
    blind = make_conductor(priority_estimates=False)
    for c in (aware, blind):
        _busy(c)
    urgent = Request("u", 0.0, 4 * BLOCK, 8, (), BLOCK, priority=-1)
    normal = Request("m", 0.0, 4 * BLOCK, 8, (), BLOCK)
    got, whole = aware.schedule(urgent), blind.schedule(urgent)
    # It waits for the one in service only, where the blind estimate counts all three.
    assert got.prefill.queue_s < whole.prefill.queue_s / 2
    assert aware.schedule(normal).prefill.queue_s > got.prefill.queue_s
    aware.check_integrity()


def test_urgent_requests_are_admitted_where_the_queue_would_reject_them(make_conductor):
    slo = SLOConfig(ttft_s=0.07, tbt_s=10.0)
    aware = make_conductor(early_reject="snapshot", slo=slo)
    blind = make_conductor(early_reject="snapshot", slo=slo, priority_estimates=False)
    for c in (aware, blind):
        _busy(c, num=4, length=4 * BLOCK)  # 0.032 s each, two per instance
    urgent = Request("u", 0.0, 2 * BLOCK, 8, (), BLOCK, priority=-1)
    assert aware.schedule(urgent).accepted
    assert not blind.schedule(urgent).accepted
    assert not aware.schedule(Request("m", 0.0, 2 * BLOCK, 8, (), BLOCK)).accepted


def test_more_urgent_placements_stretch_a_later_normal_wait(make_conductor):
    c = make_conductor()
    _busy(c, num=2)
    before = c.schedule(Request("m1", 0.0, 4 * BLOCK, 8, (), BLOCK)).prefill.queue_s
    for i in range(5):
        assert c.schedule(Request(f"u{i}", 0.0, 64 * BLOCK, 8, (), BLOCK, priority=-1)).accepted
    aware = c.schedule(Request("m2", 0.0, 4 * BLOCK, 8, (), BLOCK))
    whole = c._prefill[aware.prefill.instance_id].queue_s(c.clock.now(), 0)
    assert aware.prefill.queue_s > whole > before  # stretched beyond what is booked
    assert np.isfinite(aware.prefill.queue_s)


def test_the_conductor_says_what_it_placed_per_priority(make_conductor):
    c = make_conductor()
    assert c.priorities == {
        "estimates": True, "window_s": 60.0, "placed_prefill_s": {}, "urgent_share": {}
    }  # fmt: skip
    c.schedule(Request("m0", 0.0, 4 * BLOCK, 8, (), BLOCK))  # before any priority: not kept
    c.schedule(Request("u", 0.0, 4 * BLOCK, 8, (), BLOCK, priority=-1))
    c.schedule(Request("m1", 0.0, 4 * BLOCK, 8, (), BLOCK))
    shown = c.priorities
    assert list(shown["placed_prefill_s"]) == ["-1", "0"]
    assert shown["urgent_share"] == {"-1": 0.0, "0": pytest.approx(0.032 / (60 * 2))}

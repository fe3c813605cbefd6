"""Decode durations predicted from the prompt's first block (lengths.py), and the
prediction's use of them (early_reject="predict" with decode_time_by_prefix)."""

import random

import numpy as np

from halfmoon.conductor import DecodeStarted, PrefillFinished, RequestFinished
from halfmoon.conductor.admission import DecodeTimes
from halfmoon.conductor.lengths import PrefixDurations, prefix_root
from halfmoon.core.clock import ManualClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request


def _req(rid, num_blocks, first=0, out=8):
    hashes = tuple(range(first, first + num_blocks))
    return Request(rid, 0.0, num_blocks * 16, out, block_hashes=hashes, block_size_tokens=16)


def test_the_median_of_the_last_durations_of_a_first_block():
    durations = PrefixDurations(keep=3, max_roots=2)
    assert durations.predict(7) is None and durations.predict(None) is None
    for d in (1.0, 5.0, 2.0, 9.0):  # keeps the last 3: 5, 2, 9
        durations.observe(7, d)
    assert durations.predict(7) == 5.0
    durations.observe(8, 3.0)
    durations.observe(7, 4.0)  # 7 used last: 8 is the least recently used
    durations.observe(9, 1.0)
    assert len(durations) == 2 and durations.predict(8) is None
    assert durations.predict(7) == 4.0 and durations.predict(9) == 1.0


def test_the_root_is_the_first_full_block():
    assert prefix_root(_req("r", 3, first=40)) == 40
    short = Request("s", 0.0, 10, 4, block_hashes=(5,), block_size_tokens=16)
    assert prefix_root(short) is None  # no full block


def _finish_one(c, clock, rid, first, decode_s):
    """Place, join and finish a request after ``decode_s`` of decoding."""
    assert c.schedule(_req(rid, 10, first=first)).accepted
    c.handle(PrefillFinished("P1", rid))
    c.handle(DecodeStarted("D1", rid))
    clock.advance(decode_s)
    c.handle(RequestFinished("D1", rid))


def test_the_conductor_learns_and_books_a_prediction(make_conductor):
    clock = ManualClock()
    c = make_conductor(num_prefill=1, clock=clock, early_reject="predict",
                       decode_time_by_prefix=True)  # fmt: skip
    _finish_one(c, clock, "a", first=100, decode_s=2.0)
    _finish_one(c, clock, "b", first=100, decode_s=4.0)
    assert c.schedule(_req("c", 10, first=100)).accepted  # same first block
    assert c.schedule(_req("d", 10, first=500)).accepted  # a first block never seen
    assert c._decode["D1"].predicted_s == {"c": 3.0}
    c.check_integrity()
    c.handle(RequestFinished("D1", "c"))
    c.handle(RequestFinished("D1", "d"))
    assert c._decode["D1"].predicted_s == {} and not c._root_of
    off = make_conductor(num_prefill=1, clock=clock, early_reject="predict")
    _finish_one(off, clock, "a", first=100, decode_s=2.0)
    assert off.schedule(_req("c", 10, first=100)).accepted
    assert off._decode["D1"].predicted_s == {}


def test_a_running_request_is_weighed_by_its_own_prefix(make_conductor):
    """Learned durations 2, 2 s (first block 100) and 4, 4 s (first block 900): the
    durations of all give a request of block 100 decoding for 1.5 s even odds of still
    decoding 1.6 s later (when the new request's prefill ends); scaled so that their
    median is its own prefix's 2 s, none (it ends by 2 s), so the forecast batch is
    smaller by one."""
    slo = SLOConfig(ttft_s=100.0, tbt_s=1.0)
    batches = {}
    for by_prefix in (False, True):
        clock = ManualClock()
        c = make_conductor(num_prefill=1, clock=clock, early_reject="predict", slo=slo,
                           decode_time_by_prefix=by_prefix)  # fmt: skip
        for rid, first, decode_s in (("a1", 100, 2.0), ("a2", 100, 2.0), ("b1", 900, 4.0),
                                     ("b2", 900, 4.0)):  # fmt: skip
            _finish_one(c, clock, rid, first, decode_s)
        assert c.schedule(_req("old", 10, first=100)).accepted
        c.handle(PrefillFinished("P1", "old"))
        c.handle(DecodeStarted("D1", "old"))
        clock.advance(1.5)
        d = c.schedule(_req("new", 200, first=2000))  # 1.6 s of prefill
        batches[by_prefix] = d.decode.num_running
        c.check_integrity()
    assert batches == {False: 2, True: 1}
    assert c._decode["D1"].predicted_s["old"] == 2.0


def test_own_stay_probabilities_match_one_by_one():
    times = DecodeTimes(window=8)
    rng = random.Random(4)
    ages = [rng.uniform(0, 6) for _ in range(40)]
    spans = [rng.uniform(0, 3) for _ in range(40)]
    t_d = [rng.choice([0.0, 0.5, 2.0, 7.0]) for _ in range(40)]
    for learned in ([], [1.0, 2.0, 3.0, 9.0]):
        for d in learned:
            times.observe(d)
        want = [
            times.own_stay_probability(a, h, t) for a, h, t in zip(ages, spans, t_d, strict=True)
        ]
        got = times.own_stay_probabilities(np.array(ages), np.array(spans), np.array(t_d))
        assert got.tolist() == want
    assert times.median_s == 2.5

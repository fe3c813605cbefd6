"""Early rejection with prediction: who stays, who joins, and what they generated."""

import pytest

from halfmoon.conductor import DecodeStarted, PrefillFinished, RejectCode, RequestFinished
from halfmoon.conductor.admission import DecodeTimes
from halfmoon.core.clock import ManualClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request


def _req(rid, num_blocks, first=0, out=8):
    hashes = tuple(range(first, first + num_blocks))
    return Request(rid, 0.0, num_blocks * 16, out, block_hashes=hashes, block_size_tokens=16)


def test_uniform_t_d_before_observations_and_when_configured():
    learned = DecodeTimes()
    assert learned.stay_probability(0.0, 5.0, fallback_s=3.0) == 0.0  # ends at 3 s < 5 s
    assert learned.stay_probability(0.0, 2.0, fallback_s=3.0) == 1.0
    configured = DecodeTimes(1.0)
    configured.observe(50.0)  # a configured t_d is not learned
    assert configured.mean_s == 1.0
    assert configured.stay_probability(0.5, 1.0, fallback_s=99.0) == 0.0
    # older than t_d and still decoding: not assumed gone (the old rule dropped it)
    assert configured.stay_probability(4.0, 1.0, fallback_s=99.0) == 1.0


def test_learned_survival_is_conditional_on_age():
    times = DecodeTimes(window=10)
    for d in range(1, 11):  # 1, 2, ..., 10 s
        times.observe(float(d))
    assert times.stay_probability(5.0, 2.0, 0.0) == pytest.approx(3 / 5)  # D > 7 | D > 5
    assert times.stay_probability(0.0, 0.5, 0.0) == 1.0
    assert times.stay_probability(12.0, 1.0, 0.0) == 1.0  # older than all: no evidence
    times.observe(100.0)  # the window drops the oldest sample (1 s)
    assert times.stay_probability(0.0, 2.0, 0.0) == pytest.approx(9 / 10)
    assert times.mean_s is not None and times.mean_s > 1.0


def _old_running(make_conductor, slo, t_d, age_s):
    clock = ManualClock()
    c = make_conductor(
        num_prefill=1, clock=clock, early_reject="predict", slo=slo, decode_time_estimate_s=t_d
    )
    assert c.schedule(_req("old", 250)).accepted  # 4,000 tokens
    c.handle(PrefillFinished("P1", "old"))
    c.handle(DecodeStarted("D1", "old"))
    clock.advance(age_s)
    return c


def test_predict_counts_a_request_older_than_t_d_and_its_tokens(make_conductor):
    # step 12.5 ms + 27 ns/token: new alone (3,200) 12.586 ms, with old (4,000 + ~520
    # generated) 12.708 ms
    slo = SLOConfig(ttft_s=100.0, tbt_s=0.01265)
    c = _old_running(make_conductor, slo, t_d=1.0, age_s=5.0)
    d = c.schedule(_req("new", 200, first=1000))  # 1.6 s of prefill
    assert not d.accepted and d.reject_code == RejectCode.TBT
    assert d.decode.num_running == 2
    generated = d.decode.context_tokens - 4000 - 3200
    assert 6.6 / 0.0127 < generated < 6.6 / 0.0125  # one token per step since it joined


def test_predict_lets_a_young_request_leave_by_t_d(make_conductor):
    slo = SLOConfig(ttft_s=100.0, tbt_s=0.01265)
    c = _old_running(make_conductor, slo, t_d=1.0, age_s=0.2)  # leaves at 1 s < 1.8 s
    d = c.schedule(_req("new", 200, first=1000))
    assert d.accepted and d.decode.num_running == 1


def test_predict_lets_a_placed_request_join_and_leave(make_conductor):
    """Incoming requests join when their prefill ends, and a short decode is gone again
    by the time a long prefill ends."""
    slo = SLOConfig(ttft_s=100.0, tbt_s=0.0128)  # b alone 12.716 ms, with a 12.824 ms
    clock = ManualClock()
    c = make_conductor(
        num_prefill=2, clock=clock, early_reject="predict", slo=slo, decode_time_estimate_s=0.5
    )
    assert c.schedule(_req("a", 250)).accepted  # on P1: done at 2 s, gone by 2.5 s
    d = c.schedule(_req("b", 500, first=1000))  # on P2: 8,000 tokens, done at 4 s
    assert d.accepted and d.decode.num_running == 1
    snapshot = make_conductor(num_prefill=2, early_reject="snapshot", slo=slo)
    assert snapshot.schedule(_req("a", 250)).accepted
    # the snapshot's choice of decode instance counts "a" as it is now (booked there)
    assert snapshot.schedule(_req("b", 500, first=1000)).decode.num_running == 2
    c.handle(RequestFinished("D1", "a"))
    c.check_integrity()

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halfmoon.core.config import SLOConfig
from halfmoon.metrics import (
    RequestRecord,
    effective_request_capacity,
    goodput_rps,
    meets_slo,
    num_meeting_slo,
    observation_window_s,
    rate_meeting,
    share_meeting,
    slo_attainment,
)
from halfmoon.metrics.slo import within_slo


def test_meets_slo_per_request(run, slo):
    # A and H meet both; B misses TTFT; C misses TBT (top10mean 0.4); D..G did not complete.
    assert [meets_slo(r, slo) for r in run] == [
        True,
        False,
        False,
        False,
        False,
        False,
        False,
        True,
    ]


def test_tbt_metric_changes_the_verdict(run):
    p90 = SLOConfig(ttft_s=2.0, tbt_s=0.1, tbt_metric="p90")
    assert meets_slo(run[2], p90)  # C's p90 is 0.075
    assert num_meeting_slo(run, p90) == 3


def test_limits_are_inclusive():
    record = RequestRecord("r", 0.0, 1, 3, [2.0, 2.5, 3.0], 3.0)
    assert meets_slo(record, SLOConfig(ttft_s=2.0, tbt_s=0.5))
    assert not meets_slo(record, SLOConfig(ttft_s=1.999, tbt_s=0.5))
    assert not meets_slo(record, SLOConfig(ttft_s=2.0, tbt_s=0.499))


def test_attainment_counts_rejected_and_errored_as_misses(run, slo):
    assert slo_attainment(run, slo) == 2 / 8
    assert effective_request_capacity(run, slo) == slo_attainment(run, slo)
    assert slo_attainment([], slo) is None


def test_goodput_with_given_and_default_duration(run, slo):
    assert goodput_rps(run, slo, duration_s=10.0) == pytest.approx(0.2)
    # first arrival 0.0 (A), last observation 8.0 (G's token)
    assert observation_window_s(run) == pytest.approx(8.0)
    assert goodput_rps(run, slo) == pytest.approx(2 / 8.0)


def test_goodput_undefined_or_bad_duration(slo):
    instant = [RequestRecord("r", 1.0, 1, 1, [1.0], 1.0)]
    assert goodput_rps(instant, slo) is None
    assert goodput_rps([], slo) is None
    assert observation_window_s([]) is None
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        goodput_rps(instant, slo, duration_s=0.0)


def test_window_ends_at_the_last_finish_in_a_normal_run():
    done = [
        RequestRecord("a", 1.0, 1, 1, [2.0], 2.5),
        RequestRecord("b", 2.0, 1, 1, [3.0], 6.0),
        RequestRecord("c", 3.0, 1, 1, [4.0], 5.0),
    ]
    assert observation_window_s(done) == 5.0


@st.composite
def simple_records(draw):
    arrival_s = draw(st.floats(0, 100))
    gaps = draw(st.lists(st.floats(0, 1), max_size=30))
    first_s = arrival_s + draw(st.floats(0, 10))
    times = [first_s]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(
        "r", arrival_s, 10, len(times), times, times[-1], rejected=draw(st.booleans())
    )


@settings(derandomize=True, deadline=None)
@given(st.lists(simple_records(), min_size=1, max_size=20), st.floats(0.01, 5), st.floats(0.01, 1))
def test_looser_slo_never_lowers_attainment(records, ttft_s, tbt_s):
    tight = SLOConfig(ttft_s=ttft_s, tbt_s=tbt_s)
    loose = SLOConfig(ttft_s=ttft_s * 2, tbt_s=tbt_s * 2)
    tight_share = slo_attainment(records, tight)
    assert 0.0 <= tight_share <= slo_attainment(records, loose) <= 1.0


def test_count_arithmetic_helpers(slo):
    assert share_meeting(3, 4) == 0.75 and share_meeting(0, 0) is None
    assert rate_meeting(5, 2.0) == 2.5
    assert rate_meeting(5, 0.0, given=False) is None
    with pytest.raises(ValueError, match="duration_s must be > 0, got -1"):
        rate_meeting(5, -1.0)
    assert within_slo(2.0, 0.1, slo) and not within_slo(2.0, 0.11, slo)


def test_goodput_window_is_the_offered_window_not_the_drain(slo):
    """Four requests one second apart, all within the SLO, the last finishing 20 s
    after it arrived: goodput is the offered rate (1 req/s), not 4 / 23 s."""
    from halfmoon.metrics import goodput_window_s, offered_rps, offered_window_s

    records = [RequestRecord(f"r{i}", float(i), 1, 2, [i + 0.5, i + 0.55], i + 0.55)
               for i in range(3)]  # fmt: skip
    records.append(RequestRecord("slow", 3.0, 1, 2, [4.0, 4.05], 23.0))
    assert observation_window_s(records) == pytest.approx(23.0)
    assert offered_window_s(records) == pytest.approx(4.0)  # 3 s span = 3 of 4 gaps
    assert goodput_window_s(records) == pytest.approx(4.0)
    assert offered_rps(records) == pytest.approx(1.0)
    assert goodput_rps(records, slo) == pytest.approx(1.0)
    late = [*records[:3], RequestRecord("late", 3.0, 1, 2, [9.0, 9.05], 9.05)]  # TTFT 6 s
    assert goodput_rps(late, slo) == pytest.approx(0.75)  # attainment x offered rate


def test_goodput_window_without_an_arrival_span(slo):
    """One request, or a burst arriving at once: the observation window."""
    from halfmoon.metrics import goodput_window_s, offered_rps, offered_window_s

    burst = [RequestRecord(f"r{i}", 0.0, 1, 1, [1.0 + i], 1.0 + i) for i in range(3)]
    assert offered_window_s(burst) is None and offered_rps(burst) is None
    assert goodput_window_s(burst) == pytest.approx(3.0)
    assert goodput_rps(burst, slo) == pytest.approx(2 / 3.0)  # r2: TTFT 3 s misses
    assert offered_window_s(burst[:1]) is None

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halfmoon.metrics import (
    RequestRecord,
    percentiles,
    request_tbt_s,
    tbt_from_gaps_s,
    tbt_gaps_s,
    tbt_p90,
    tbt_top10mean,
)

gap_lists = st.lists(
    st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=200,
)


def test_gaps_are_consecutive_differences():
    assert tbt_gaps_s([1.0, 1.5, 1.75, 2.75]) == [0.5, 0.25, 1.0]
    assert tbt_gaps_s([3.0]) == []
    assert tbt_gaps_s([]) == []


def test_gaps_reject_time_going_backwards():
    with pytest.raises(ValueError, match="backwards at token 2"):
        tbt_gaps_s([1.0, 2.0, 1.5])


def test_p90_interpolates_linearly():
    # sorted 0.25, 0.5, 1.0; rank 0.9 * 2 = 1.8 -> 0.5 + 0.8 * 0.5
    assert tbt_p90([0.5, 0.25, 1.0]) == pytest.approx(0.9)
    # 18 x 0.05, 0.3, 0.5: rank 0.9 * 19 = 17.1 -> 0.05 + 0.1 * (0.3 - 0.05)
    assert tbt_p90([0.05] * 18 + [0.3, 0.5]) == pytest.approx(0.075)


def test_top10mean_of_twenty_gaps_takes_the_two_longest():
    gaps = [0.05] * 9 + [0.5] + [0.05] * 9 + [0.3]
    assert tbt_top10mean(gaps) == pytest.approx(0.4)


def test_top10mean_count_is_exact_ceiling():
    # 0.1 * 30 rounds up to 4 in floating point; the definition says 3 gaps.
    gaps = [0.01] * 27 + [0.9, 0.6, 0.3]
    assert tbt_top10mean(gaps) == pytest.approx(0.6)
    # 11 gaps -> ceil(1.1) = 2 gaps; 5 gaps -> at least one gap, the longest.
    assert tbt_top10mean([0.1] * 9 + [0.7, 0.5]) == pytest.approx(0.6)
    assert tbt_top10mean([0.2, 0.1, 0.4, 0.3, 0.0]) == pytest.approx(0.4)


def test_no_gaps_means_zero_tbt():
    assert tbt_p90([]) == 0.0
    assert tbt_top10mean([]) == 0.0
    single = RequestRecord("r", 0.0, 10, 1, [0.5], 0.5)
    assert request_tbt_s(single, "p90") == 0.0
    assert request_tbt_s(single, "top10mean") == 0.0


def test_request_tbt_by_metric():
    times = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.9]
    record = RequestRecord("r", 0.0, 10, 11, times, 1.9)
    assert request_tbt_s(record, "top10mean") == pytest.approx(1.0)
    assert request_tbt_s(record, "p90") == pytest.approx(0.1 + 0.1 * 0.9)
    assert tbt_from_gaps_s(record.tbt_gaps_s, "top10mean") == request_tbt_s(record, "top10mean")
    with pytest.raises(ValueError, match="unknown tbt metric 'p99'"):
        request_tbt_s(record, "p99")


def test_percentiles_exact_values():
    result = percentiles([4.0, 1.0, 3.0, 2.0])
    assert list(result) == ["mean", "p50", "p90", "p99"]
    assert result["mean"] == 2.5
    assert result["p50"] == 2.5
    assert result["p90"] == pytest.approx(3.7)
    assert result["p99"] == pytest.approx(3.97)
    assert percentiles([1.0, 5.0], qs=(99.9,), include_max=True) == {
        "mean": 3.0,
        "p99.9": pytest.approx(4.996),
        "max": 5.0,
    }


def test_percentiles_of_nothing_are_none():
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert percentiles(iter([]), include_max=True)["max"] is None


def test_percentiles_return_plain_floats():
    result = percentiles(np.array([1, 2, 3], dtype=np.int64))
    assert all(type(value) is float for value in result.values())


@pytest.mark.parametrize(
    "values,qs,msg",
    [
        ([1.0, math.nan], (50,), "not finite"),
        ([math.inf], (50,), "not finite"),
        ([1.0], (101,), "outside"),
    ],
)
def test_percentiles_bad_input(values, qs, msg):
    with pytest.raises(ValueError, match=msg):
        percentiles(values, qs=qs)


@settings(derandomize=True, deadline=None)
@given(gap_lists)
def test_tbt_definitions_are_bounded(gaps):
    mean = sum(gaps) / len(gaps)
    assert tbt_top10mean(gaps) >= mean - 1e-9 * max(1.0, mean)
    assert min(gaps) <= tbt_p90(gaps) <= max(gaps)
    assert tbt_top10mean(gaps) <= max(gaps)


@settings(derandomize=True, deadline=None)
@given(gap_lists)
def test_percentiles_are_ordered(values):
    result = percentiles(values, include_max=True)
    assert min(values) <= result["p50"] <= result["p90"] <= result["p99"] <= result["max"]
    assert result["max"] == max(values)


@settings(derandomize=True, deadline=None)
@given(gap_lists)
def test_p90_matches_numpy_linear_percentile(gaps):
    assert tbt_p90(gaps) == pytest.approx(float(np.percentile(gaps, 90)), rel=1e-12, abs=1e-300)

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halfmoon.core.config import SLOConfig
from halfmoon.metrics import (
    REPORT_KEYS,
    RequestRecord,
    cache_hit_ratio,
    goodput_rps,
    meets_slo,
    percentiles,
    request_tbt_s,
    slo_attainment,
    summarize,
)

EXPECTED_KEYS = [
    "num_requests",
    "num_completed",
    "num_rejected",
    "num_errors",
    "num_wasted_prefill",
    "ttft_s",
    "tbt_s",
    "itl_s",
    "e2e_s",
    "slo_attainment",
    "goodput_rps",
    "offered_rps",
    "cache_hit_ratio",
    "duration_s",
    "slo",
]
STAT_KEYS = ["mean", "p50", "p90", "p99"]


def test_report_keys_exactly(run, slo):
    report = summarize(run, slo)
    assert list(REPORT_KEYS) == EXPECTED_KEYS
    assert list(report) == EXPECTED_KEYS
    for key in ("ttft_s", "tbt_s", "itl_s", "e2e_s"):
        assert list(report[key]) == STAT_KEYS
    assert report["slo"] == {"ttft_s": 2.0, "tbt_s": 0.1, "tbt_metric": "top10mean"}
    json.dumps(report, allow_nan=False)


def test_report_counts(run, slo):
    report = summarize(run, slo)
    assert report["num_requests"] == 8
    assert report["num_completed"] == 4  # A, B, C, H
    assert report["num_rejected"] == 2  # D, F
    assert report["num_errors"] == 1  # E
    assert report["num_wasted_prefill"] == 4  # B, C, E, F (A met its SLO)
    p90_report = summarize(run, SLOConfig(ttft_s=2.0, tbt_s=0.1, tbt_metric="p90"))
    assert p90_report["num_wasted_prefill"] == 3  # C meets the SLO by p90


def test_report_latencies(run, slo):
    report = summarize(run, slo)
    # TTFTs of A, B, C, H: 1.0, 3.0, 1.0, 0.5 -> sorted 0.5, 1, 1, 3
    assert report["ttft_s"] == pytest.approx({"mean": 1.375, "p50": 1.0, "p90": 2.4, "p99": 2.94})
    # top10mean TBTs: A 0.05, B 0.05, C 0.4, H 0 (single token)
    assert report["tbt_s"] == pytest.approx(
        {"mean": 0.125, "p50": 0.05, "p90": 0.295, "p99": 0.3895}
    )
    # 10 + 2 + 20 gaps pooled, summing to 0.5 + 0.1 + 1.7
    assert report["itl_s"]["mean"] == pytest.approx(2.3 / 32)
    assert report["itl_s"]["p50"] == pytest.approx(0.05)
    # e2e: A 1.5, B 3.1, C 2.7, H 0.5
    assert report["e2e_s"]["mean"] == pytest.approx((1.5 + 3.1 + 2.7 + 0.5) / 4)


def test_report_rates(run, slo):
    report = summarize(run, slo)
    assert report["slo_attainment"] == 0.25
    assert report["duration_s"] == pytest.approx(8.0)
    assert report["goodput_rps"] == pytest.approx(0.25)
    # non-rejected: cached 50 + 100 + 100 of 100 + 100 + 200 + 100 + 100 + 100 prompt tokens
    assert report["cache_hit_ratio"] == pytest.approx(250 / 700)
    given = summarize(run, slo, duration_s=10)
    assert given["duration_s"] == 10.0 and given["goodput_rps"] == pytest.approx(0.2)


def test_cache_hit_ratio_without_admitted_tokens():
    assert cache_hit_ratio([]) is None
    assert cache_hit_ratio([RequestRecord("r", 0.0, 5, 1, rejected=True)]) is None


def test_extra_entries_are_appended(run, slo):
    report = summarize(run, slo, extra={"policy": "kvcache-centric", "cluster": "8P8D"})
    assert list(report) == [*EXPECTED_KEYS, "policy", "cluster"]
    assert report["policy"] == "kvcache-centric"


@pytest.mark.parametrize(
    "extra,msg",
    [
        ({"slo_attainment": 1.0}, "would overwrite slo_attainment"),
        ({"ratio": float("nan")}, "not valid JSON"),
        ({"when": object()}, "not valid JSON"),
    ],
)
def test_bad_extra_entries(run, slo, extra, msg):
    with pytest.raises(ValueError, match=msg):
        summarize(run, slo, extra=extra)


def test_empty_run_is_valid_json(slo):
    report = summarize([], slo)
    assert list(report) == EXPECTED_KEYS
    assert report["num_requests"] == 0 and report["ttft_s"]["p99"] is None
    assert report["slo_attainment"] is None and report["goodput_rps"] is None
    json.dumps(report, allow_nan=False)


def test_all_rejected_run(slo):
    records = [RequestRecord(f"r{i}", float(i), 10, 1, rejected=True) for i in range(4)]
    report = summarize(records, slo)
    assert report["num_rejected"] == 4 and report["num_completed"] == 0
    assert report["slo_attainment"] == 0.0 and report["goodput_rps"] == 0.0
    assert report["duration_s"] == 3.0 and report["cache_hit_ratio"] is None
    json.dumps(report, allow_nan=False)


@st.composite
def mixed_records(draw):
    arrival_s = draw(st.floats(0, 50))
    gaps = draw(st.lists(st.floats(0, 0.5), max_size=40))
    times = [arrival_s + draw(st.floats(0, 5))]
    for gap in gaps:
        times.append(times[-1] + gap)
    fate = draw(st.sampled_from(["done", "rejected", "error", "running"]))
    return RequestRecord(
        "r",
        arrival_s,
        input_length=100,
        output_length=len(times),
        token_times_s=[] if fate == "rejected" else times,
        finish_s=times[-1] if fate == "done" else None,
        rejected=fate == "rejected",
        error="boom" if fate == "error" else "",
        prefill_done_s=times[0] if draw(st.booleans()) else None,
        cached_tokens=draw(st.integers(0, 100)),
    )


@settings(derandomize=True, deadline=None, max_examples=60)
@given(st.lists(mixed_records(), max_size=15), st.sampled_from(["p90", "top10mean"]))
def test_report_agrees_with_the_single_metric_functions(records, metric):
    slo = SLOConfig(ttft_s=2.0, tbt_s=0.2, tbt_metric=metric)
    report = summarize(records, slo)
    assert report["slo_attainment"] == slo_attainment(records, slo)
    assert report["goodput_rps"] == goodput_rps(records, slo)
    wasted = [r for r in records if r.prefill_done_s is not None and not meets_slo(r, slo)]
    assert report["num_wasted_prefill"] == len(wasted)
    tbts = [request_tbt_s(r, metric) for r in records if r.completed]
    assert report["tbt_s"] == percentiles(tbts)
    json.dumps(report, allow_nan=False)

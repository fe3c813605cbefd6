import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halfmoon.metrics import RequestRecord, records_from_json, records_to_json


def test_ttft_gaps_e2e_and_completion(run):
    a, b, _, d, e, _, g, h = run
    assert b.ttft_s == pytest.approx(3.0)
    assert b.tbt_gaps_s == pytest.approx([0.05, 0.05])
    assert b.e2e_s == pytest.approx(3.1)
    assert h.ttft_s == 0.5 and h.tbt_gaps_s == [] and h.e2e_s == 0.5
    assert d.ttft_s is None and d.e2e_s is None
    assert [r.completed for r in run] == [True, True, True, False, False, False, False, True]
    # a finish time without any token is not a normal completion
    assert not RequestRecord("x", 0.0, 1, 1, [], 1.0).completed


def test_records_fill_in_as_a_request_runs():
    record = RequestRecord("r", 2.0, 10, 2)
    assert record.ttft_s is None and not record.completed
    record.token_times_s.append(2.5)
    record.token_times_s.append(2.75)
    record.finish_s = 2.75
    assert record.ttft_s == 0.5 and record.tbt_gaps_s == [0.25] and record.completed


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"input_length": -1}, "lengths must be >= 0"),
        ({"cached_tokens": 11}, "cached_tokens=11 outside"),
        ({"token_times_s": [0.5]}, r"token_times_s\[0\]=0.5 is before arrival_s=1.0"),
        ({"token_times_s": [2.0, 1.5]}, "backwards"),
        ({"finish_s": math.inf}, "finish_s is not a finite number"),
        ({"prefill_done_s": 0.0}, "prefill_done_s=0.0 is before"),
    ],
)
def test_record_rejects_bad_values(kwargs, msg):
    base = {"request_id": "r", "arrival_s": 1.0, "input_length": 10, "output_length": 4}
    with pytest.raises(ValueError, match=msg):
        RequestRecord(**{**base, **kwargs})


def test_json_round_trip(run):
    items = records_to_json(run)
    text = json.dumps(items, allow_nan=False)
    assert records_from_json(json.loads(text)) == run
    assert items[3]["reject_reason"] == "ttft"


def test_from_json_optional_fields_default():
    (record,) = records_from_json(
        [{"request_id": "r", "arrival_s": 0, "input_length": 5, "output_length": 1}]
    )
    assert record.token_times_s == [] and record.finish_s is None and record.cached_tokens == 0


@pytest.mark.parametrize(
    "item,msg",
    [
        ([1, 2], "record 1: expected an object, got list"),
        (
            {"request_id": "r", "arrival_s": 0.0},
            "record 1: missing field.*input_length, output_length",
        ),
        (
            {"request_id": "r", "arrival_s": 0, "input_length": 1, "output_length": 1, "ttft": 1},
            "record 1: unknown field.*ttft",
        ),
        (
            {"request_id": "r", "arrival_s": 0, "input_length": "x", "output_length": 1},
            "record 1:",
        ),
        (
            {
                "request_id": "r",
                "arrival_s": 5,
                "input_length": 1,
                "output_length": 1,
                "token_times_s": [4.0],
            },
            "record 1: .*before arrival",
        ),
    ],
)
def test_from_json_names_the_bad_record(item, msg):
    good = {"request_id": "ok", "arrival_s": 0.0, "input_length": 1, "output_length": 1}
    with pytest.raises(ValueError, match=msg):
        records_from_json([good, item])


times = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def records(draw):
    arrival_s = draw(times)
    offsets = sorted(draw(st.lists(times, max_size=20)))
    token_times_s = [arrival_s + offset for offset in offsets]
    input_length = draw(st.integers(0, 10_000))
    return RequestRecord(
        request_id=draw(st.text("abc-1", max_size=8)),
        arrival_s=arrival_s,
        input_length=input_length,
        output_length=draw(st.integers(0, 10_000)),
        token_times_s=token_times_s,
        finish_s=token_times_s[-1] if token_times_s and draw(st.booleans()) else None,
        rejected=draw(st.booleans()),
        error=draw(st.sampled_from(["", "boom"])),
        cached_tokens=draw(st.integers(0, input_length)),
    )


@settings(derandomize=True, deadline=None)
@given(st.lists(records(), max_size=5))
def test_json_round_trip_property(items):
    assert records_from_json(json.loads(json.dumps(records_to_json(items)))) == items

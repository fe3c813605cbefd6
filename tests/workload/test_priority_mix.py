"""``--priority-mix``: parsing, and the seeded draw of each request's priority."""

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.workload.priority import parse_priority_mix, with_priorities


def test_pairs_parse_in_order() -> None:
    assert parse_priority_mix("-1:0.1, 5:0.25") == ((-1, 0.1), (5, 0.25))
    assert parse_priority_mix("3:1") == ((3, 1.0),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-1", "VALUE:FRACTION"),
        ("x:0.1", "VALUE:FRACTION"),
        ("-1:abc", "VALUE:FRACTION"),
        ("-1:0", "(0, 1]"),
        ("-1:1.2", "(0, 1]"),
        ("0:0.5", "priority 0"),
        ("2:0.1,2:0.2", "twice"),
        ("1:0.7,2:0.4", "sum"),
    ],
)
def test_bad_mixes_name_the_flag(text: str, message: str) -> None:
    with pytest.raises(HalfmoonError, match="--priority-mix") as info:
        parse_priority_mix(text)
    assert message in str(info.value)


def test_draws_are_seeded_and_follow_the_fractions() -> None:
    requests = [Request(f"r{i}", float(i), 10, 2) for i in range(4000)]
    mix = parse_priority_mix("-1:0.1,4:0.3")
    first = [r.priority for r in with_priorities(requests, mix, seed=7)]
    assert first == [r.priority for r in with_priorities(requests, mix, seed=7)]
    assert first != [r.priority for r in with_priorities(requests, mix, seed=8)]
    assert first.count(-1) == pytest.approx(400, abs=80)
    assert first.count(4) == pytest.approx(1200, abs=120)
    assert set(first) == {-1, 0, 4}

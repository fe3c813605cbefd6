"""Cluster spec strings and simulator configuration checks."""

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.sim import ClusterSpec, SimConfig


@pytest.mark.parametrize(
    ("text", "prefill", "decode", "coupled"),
    [
        ("8P8D", 8, 8, 0),
        ("3P1D", 3, 1, 0),
        ("10P10D", 10, 10, 0),
        ("16M", 0, 0, 16),
        ("4M", 0, 0, 4),
        ("3p1d", 3, 1, 0),
        (" 2P 1D ", 2, 1, 0),
    ],
)
def test_parse_valid(text: str, prefill: int, decode: int, coupled: int) -> None:
    spec = ClusterSpec.parse(text)
    assert (spec.num_prefill, spec.num_decode, spec.num_coupled) == (prefill, decode, coupled)
    assert spec.coupled == bool(coupled)
    assert ClusterSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["8X", "0P1D", "1P0D", "", "0M", "8P8D4M", "P8D", "-1M", "8P"])
def test_parse_invalid_is_one_line_error(text: str) -> None:
    with pytest.raises(HalfmoonError) as info:
        ClusterSpec.parse(text)
    assert "\n" not in str(info.value)
    assert "cluster" in str(info.value)


def test_str_round_trip() -> None:
    assert str(ClusterSpec(num_prefill=8, num_decode=8)) == "8P8D"
    assert str(ClusterSpec(num_coupled=16)) == "16M"


@pytest.mark.parametrize(
    "options",
    [
        {"prefill_chunk_tokens": 0},
        {"cache_capacity_tokens": -1},
        {"cache_policy": "fifo"},
        {"decode_tbt_guard": "maybe"},
        {"time_scale": 0.0},
        {"time_scale": float("nan")},
        {"max_requests": 0},
        {"max_batch_size": 0},
        {"num_layers": 0},
        {"coupled_token_budget": 0},
    ],
)
def test_sim_config_rejects_bad_values(options: dict) -> None:
    with pytest.raises(HalfmoonError):
        SimConfig(ClusterSpec.parse("1P1D"), **options)

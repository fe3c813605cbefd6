"""Trace statistics and cache replay: exact small cases and the shared public trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from halfmoon.core.eviction import PrefixCache
from halfmoon.core.request import Request
from halfmoon.workload.datasets import generate_dataset
from halfmoon.workload.stats import length_summary, replay_cache, trace_stats
from halfmoon.workload.trace import iter_trace

SHARED_TRACE = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "synthetic_trace.jsonl"
)


def _req(i: int, t_s: float, blocks: tuple[int, ...], output_length: int = 10) -> Request:
    return Request(f"r{i}", t_s, 512 * len(blocks), output_length, blocks)


def _small_trace() -> list[Request]:
    return [
        _req(0, 0.0, (1, 2, 3), 5),
        _req(1, 1.0, (1, 2, 4), 10),
        _req(2, 2.5, (5,), 20),
        _req(3, 4.0, (1, 2, 3, 6), 40),
    ]


def test_trace_stats_exact() -> None:
    stats = trace_stats(iter(_small_trace()))
    assert set(stats) == {
        "num_requests",
        "duration_s",
        "rate_rps",
        "input_tokens",
        "output_tokens",
        "unique_blocks",
        "hit_ratio_infinite",
    }
    assert stats["num_requests"] == 4
    assert stats["duration_s"] == 4.0
    assert stats["rate_rps"] == 1.0
    assert stats["unique_blocks"] == 6
    # Hits: 0, 2 (1,2), 0, 3 (1,2,3) out of 3 + 3 + 1 + 4 blocks.
    assert stats["hit_ratio_infinite"] == pytest.approx(5 / 11)
    outputs = [5, 10, 20, 40]
    assert stats["output_tokens"] == {
        "mean": 18.75,
        "p50": float(np.percentile(outputs, 50)),
        "p90": float(np.percentile(outputs, 90)),
        "p99": float(np.percentile(outputs, 99)),
        "max": 40,
    }
    assert stats["input_tokens"]["max"] == 2048


def test_hit_stops_at_first_miss() -> None:
    # Block 2 of the second request is resident but follows a miss: it does not count.
    stats = trace_stats([_req(0, 0.0, (1, 2)), _req(1, 0.0, (9, 2))])
    assert stats["hit_ratio_infinite"] == 0.0
    assert stats["rate_rps"] is None  # zero span


def test_length_summary_rejects_empty() -> None:
    with pytest.raises(ValueError, match="no lengths"):
        length_summary([])


def test_stats_of_empty_stream() -> None:
    with pytest.raises(ValueError, match="trace is empty"):
        trace_stats([])


def test_requests_out_of_order_are_rejected() -> None:
    backwards = [_req(0, 2.0, (1,)), _req(1, 1.0, (2,))]
    with pytest.raises(ValueError, match="arrival order"):
        trace_stats(backwards)
    with pytest.raises(ValueError, match="arrival order"):
        replay_cache(backwards, "lru", [10])


def test_replay_cache_lru_exact() -> None:
    trace = [_req(0, 0.0, (1, 2, 3)), _req(1, 1.0, (1, 2, 4)), _req(2, 2.0, (1, 2, 3))]
    result = replay_cache(trace, "lru", [3, 0, None])
    # Capacity 3: the second request evicts 3, so the third hits only 1, 2 -> 4 of 9 blocks.
    assert result == {
        "policy": "lru",
        "results": [
            {"capacity_blocks": 3, "hit_ratio": pytest.approx(4 / 9)},
            {"capacity_blocks": 0, "hit_ratio": 0.0},
            {"capacity_blocks": None, "hit_ratio": pytest.approx(5 / 9)},
        ],
    }


@pytest.mark.parametrize("policy", ["lru", "lfu", "length-aware"])
def test_one_pass_matches_separate_caches(policy: str) -> None:
    requests = generate_dataset("leval", 1.0, 120, seed=5)
    capacities = [50, 200, 600]
    result = replay_cache(requests, policy, capacities)
    total = sum(len(r.block_hashes) for r in requests)
    for capacity, item in zip(capacities, result["results"], strict=True):
        cache = PrefixCache(capacity, policy)
        hits = sum(cache.access(r.block_hashes) for r in requests)
        assert item == {"capacity_blocks": capacity, "hit_ratio": hits / total}
    ratios = [item["hit_ratio"] for item in result["results"]]
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]


@pytest.mark.parametrize(
    ("policy", "capacities", "message"),
    [
        ("mru", [10], "unknown eviction policy 'mru'"),
        ("lru", [-1], "capacity must be an integer >= 0"),
        ("lru", [1.5], "capacity must be an integer >= 0"),
        ("lru", [True], "capacity must be an integer >= 0"),
        ("lru", [], "at least one capacity"),
    ],
)
def test_replay_cache_bad_arguments(policy: str, capacities: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replay_cache(_small_trace(), policy, capacities)


@pytest.fixture(scope="module")
def shared_trace() -> Path:
    assert SHARED_TRACE.is_file(), f"public trace expected at {SHARED_TRACE}"
    return SHARED_TRACE


def test_shared_trace_stats(shared_trace: Path) -> None:
    stats = trace_stats(iter_trace(shared_trace))
    assert stats["num_requests"] == 3993
    assert stats["duration_s"] == pytest.approx(1022.025)
    assert stats["input_tokens"]["mean"] == pytest.approx(15325, abs=1)
    assert stats["input_tokens"]["max"] == 191378
    assert stats["hit_ratio_infinite"] == pytest.approx(0.64, abs=0.02)


def test_shared_trace_lru_curve(shared_trace: Path) -> None:
    result = replay_cache(iter_trace(shared_trace), "lru", [1000, 10000, 50000])
    low, mid, high = (item["hit_ratio"] for item in result["results"])
    assert low < mid < high
    assert high == pytest.approx(0.64, abs=0.02)

"""A hand-made run of eight requests whose every metric is worked out by hand below.

id  arrival  what happened                                   prefill_done  cached/input
A   0.0      11 tokens from 1.0, gaps 0.05; meets everything   0.9          50/100
B   1.0      first token at 4.0 (TTFT 3.0 > 2.0), 2 gaps 0.05  3.9           0/100
C   2.0      first token 3.0, 20 gaps: 18 x 0.05, 0.3, 0.5     2.9         100/200
             (top10mean 0.4 misses 0.1; p90 0.075 meets)
D   3.0      rejected before prefill                            -             0/1000
E   4.0      2 tokens, then an error; never finished            6.0           0/100
F   6.0      rejected after prefill                             7.0         500/1000
G   7.0      one token at 8.0, still running                    -             0/100
H   5.0      a single token at 5.5 (TTFT 0.5, TBT 0)            -           100/100
"""

from __future__ import annotations

import itertools

import pytest

from halfmoon.core.config import SLOConfig
from halfmoon.metrics import RequestRecord

C_GAPS_S = [0.05] * 9 + [0.3] + [0.05] * 9 + [0.5]


def times_from(first_s: float, gaps_s: list[float]) -> list[float]:
    """Token times starting at ``first_s`` separated by ``gaps_s``."""
    return list(itertools.accumulate(gaps_s, initial=first_s))


@pytest.fixture
def slo() -> SLOConfig:
    return SLOConfig(ttft_s=2.0, tbt_s=0.1, tbt_metric="top10mean")


@pytest.fixture
def run() -> list[RequestRecord]:
    a_times = times_from(1.0, [0.05] * 10)
    b_times = times_from(4.0, [0.05, 0.05])
    c_times = times_from(3.0, C_GAPS_S)
    return [
        RequestRecord(
            "A", 0.0, 100, 11, a_times, a_times[-1], prefill_done_s=0.9, cached_tokens=50
        ),
        RequestRecord("B", 1.0, 100, 3, b_times, b_times[-1], prefill_done_s=3.9),
        RequestRecord(
            "C", 2.0, 200, 21, c_times, c_times[-1], prefill_done_s=2.9, cached_tokens=100
        ),
        RequestRecord("D", 3.0, 1000, 8, [], rejected=True, reject_reason="ttft"),
        RequestRecord("E", 4.0, 100, 8, [6.0, 6.1], error="decode worker died", prefill_done_s=6.0),
        RequestRecord(
            "F",
            6.0,
            1000,
            8,
            [],
            rejected=True,
            reject_reason="tbt",
            prefill_done_s=7.0,
            cached_tokens=500,
        ),
        RequestRecord("G", 7.0, 100, 8, [8.0]),
        RequestRecord("H", 5.0, 100, 1, [5.5], 5.5, cached_tokens=100),
    ]

"""Latency arithmetic: inter-token gaps, a request's TBT by either definition, percentiles.

Two definitions of one request's TBT (time between tokens) are in use:

- ``p90``: the 90th percentile of the request's gaps, linear interpolation between
  order statistics (numpy's default), as in the arXiv version of the Mooncake paper.
- ``top10mean``: the mean of the request's longest 10% of gaps, ``ceil(n / 10)`` gaps and
  at least one, as in the FAST'25 version.

A request with fewer than two tokens has no gap; its TBT is 0 under both definitions
(nothing was waited for between tokens, so it cannot break a TBT limit).

Gaps are between token *arrivals*: tokens that came at the same time (several from one
engine step, as speculative decoding's accepted drafts, or one streamed chunk holding
several) are one arrival, as vLLM counts inter-token latency once per step; counting
each would add gaps of zero that no client waited.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from halfmoon.metrics.records import RequestRecord

DEFAULT_QUANTILES = (50, 90, 99)


def tbt_gaps_s(token_times_s: Sequence[float]) -> list[float]:
    """Gaps between consecutive token arrivals (tokens at the same time are one arrival:
    the module docstring); empty for fewer than two arrivals.

    Raises ValueError if the times go backwards (they must come from one clock).
    """
    gaps = [later - earlier for earlier, later in pairwise(token_times_s)]
    if gaps and min(gaps) < 0:
        index = next(i for i, gap in enumerate(gaps) if gap < 0)
        raise ValueError(
            f"token times go backwards at token {index + 1}: "
            f"{token_times_s[index + 1]} < {token_times_s[index]}"
        )
    return [gap for gap in gaps if gap > 0]


def tbt_p90(gaps_s: Sequence[float]) -> float:
    """90th percentile of the gaps, interpolating linearly between order statistics
    (numpy's default method); 0.0 when there are none.

    Computed in plain Python: called once per request, where numpy's per-call overhead
    dominated report time. Agrees with ``numpy.percentile(gaps, 90)`` to rounding.
    """
    if len(gaps_s) == 0:
        return 0.0
    ordered = sorted(gaps_s)
    # rank 0.9 * (n - 1) lies between ordered[lower] and ordered[lower + 1]
    rank = 0.9 * (len(ordered) - 1)
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = rank - lower
    low, high = ordered[lower], ordered[upper]
    # Interpolate from the nearer end, as numpy does, to keep rounding small.
    if fraction >= 0.5:
        return float(high - (high - low) * (1.0 - fraction))
    return float(low + (high - low) * fraction)


def tbt_top10mean(gaps_s: Sequence[float]) -> float:
    """Mean of the longest 10% of the gaps (FAST'25); 0.0 when there are none.

    The count is ``ceil(n / 10)``, at least 1, in integer arithmetic (``0.1 * 30`` is
    3.0000000000000004 in floating point and would round up to 4).
    """
    num_gaps = len(gaps_s)
    if num_gaps == 0:
        return 0.0
    num_top = max(1, -(-num_gaps // 10))
    # Plain sorted() beats numpy on the few hundred gaps of one request.
    return float(sum(sorted(gaps_s)[num_gaps - num_top :]) / num_top)


_TBT_FUNCTIONS = {"p90": tbt_p90, "top10mean": tbt_top10mean}


def tbt_from_gaps_s(gaps_s: Sequence[float], metric: str) -> float:
    """A TBT by ``metric`` (``p90`` or ``top10mean``) from gaps already computed."""
    try:
        function = _TBT_FUNCTIONS[metric]
    except KeyError:
        raise ValueError(
            f"unknown tbt metric {metric!r}; choose from {', '.join(_TBT_FUNCTIONS)}"
        ) from None
    return function(gaps_s)


def request_tbt_s(record: RequestRecord, metric: str) -> float:
    """One request's TBT by ``metric`` (``p90`` or ``top10mean``); 0.0 with < 2 tokens."""
    return tbt_from_gaps_s(record.tbt_gaps_s, metric)


def percentiles(
    values: Iterable[float],
    qs: Sequence[float] = DEFAULT_QUANTILES,
    include_max: bool = False,
) -> dict[str, float | None]:
    """Mean and percentiles of ``values``: keys ``mean``, ``p{q}`` for each q (``p50``,
    ``p90``, ``p99`` by default, ``p99.9`` for 99.9) and ``max`` if asked.

    Percentiles interpolate linearly (numpy's default). With no values every entry is
    None (JSON ``null``), never NaN, so reports stay valid JSON. Raises ValueError for a
    quantile outside [0, 100] or a value that is NaN or infinite.
    """
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {q} is outside [0, 100]")
    data = np.asarray(list(values), dtype=float)
    keys = ["mean"] + [f"p{q:g}" for q in qs] + (["max"] if include_max else [])
    if data.size == 0:
        return dict.fromkeys(keys)
    if not np.all(np.isfinite(data)):
        bad = data[~np.isfinite(data)][0]
        raise ValueError(f"cannot summarise a value that is not finite ({bad})")
    result: dict[str, float | None] = {"mean": float(data.mean())}
    for q, value in zip(qs, np.percentile(data, list(qs)), strict=True):
        result[f"p{q:g}"] = float(value)
    if include_max:
        result["max"] = float(data.max())
    return result

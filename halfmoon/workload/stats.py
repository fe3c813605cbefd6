"""Trace statistics and prefix-cache replay, both in one streaming pass.

Hit ratio (the paper's Table 1 definition): requests are replayed in arrival order; a
request's hit is the number of its leading blocks present in the cache, stopping at the
first miss; the hit ratio is total hit blocks / total blocks. After the lookup every block
of the request, in order, is touched (inserted if absent) and the cache evicts down to
its capacity (:meth:`halfmoon.core.eviction.PrefixCache.access`). Blocks are the
request's ``block_hashes`` including a partial last one, exactly as a trace's ``hash_ids``
list them. ``hit_ratio_infinite`` is the same replay without a capacity.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from halfmoon.core.eviction import POLICY_NAMES, PrefixCache
from halfmoon.core.request import Request

PERCENTILES = (50, 90, 99)


class _ArrivalOrder:
    """Checks that requests come in non-decreasing arrival order (replay needs it)."""

    def __init__(self) -> None:
        self.first_s: float | None = None
        self.last_s = -math.inf

    def check(self, request: Request) -> None:
        if request.arrival_time_s < self.last_s:
            raise ValueError(
                f"request {request.request_id} arrives at {request.arrival_time_s} s, before "
                f"the previous one ({self.last_s} s): replay needs arrival order"
            )
        if self.first_s is None:
            self.first_s = request.arrival_time_s
        self.last_s = request.arrival_time_s


def length_summary(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    """``mean``, ``p50``, ``p90``, ``p99`` and ``max`` of a non-empty list of lengths."""
    values = np.asarray(lengths, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no lengths to summarise")
    summary = {"mean": float(values.mean())}
    for q, value in zip(PERCENTILES, np.percentile(values, PERCENTILES), strict=True):
        summary[f"p{q}"] = float(value)
    summary["max"] = int(values.max())
    return summary


def _hit_ratio(num_hit_blocks: int, num_blocks: int) -> float:
    return num_hit_blocks / num_blocks if num_blocks else 0.0


def trace_stats(requests: Iterable[Request]) -> dict[str, Any]:
    """Summary of a request stream, iterated once.

    Keys: ``num_requests``, ``duration_s`` (last minus first arrival), ``rate_rps``
    (requests per second over that span; None when it is zero), ``input_tokens`` and
    ``output_tokens`` (each ``mean, p50, p90, p99, max``), ``unique_blocks`` and
    ``hit_ratio_infinite``. Memory: two lengths per request and the set of block ids seen.
    """
    order = _ArrivalOrder()
    input_lengths = array("q")
    output_lengths = array("q")
    seen: set[int] = set()
    num_blocks = num_hit_blocks = 0
    for request in requests:
        order.check(request)
        input_lengths.append(request.input_length)
        output_lengths.append(request.output_length)
        blocks = request.block_hashes
        # Infinite cache: everything seen stays resident, so the cache is just `seen`.
        num_hit = 0
        for block in blocks:
            if block not in seen:
                break
            num_hit += 1
        num_hit_blocks += num_hit
        num_blocks += len(blocks)
        seen.update(blocks)
    if not input_lengths:
        raise ValueError("no requests: the trace is empty")
    duration_s = order.last_s - (order.first_s or 0.0)
    return {
        "num_requests": len(input_lengths),
        "duration_s": duration_s,
        "rate_rps": len(input_lengths) / duration_s if duration_s > 0 else None,
        "input_tokens": length_summary(np.frombuffer(input_lengths, dtype=np.int64)),
        "output_tokens": length_summary(np.frombuffer(output_lengths, dtype=np.int64)),
        "unique_blocks": len(seen),
        "hit_ratio_infinite": _hit_ratio(num_hit_blocks, num_blocks),
    }


def _check_capacities(capacity_blocks_list: Sequence[int | None]) -> list[int | None]:
    if not capacity_blocks_list:
        raise ValueError("give at least one capacity (blocks)")
    for capacity in capacity_blocks_list:
        valid_int = isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 0
        if capacity is not None and not valid_int:
            raise ValueError(f"capacity must be an integer >= 0 blocks, got {capacity!r}")
    return list(capacity_blocks_list)


def replay_cache(
    requests: Iterable[Request], policy: str, capacity_blocks_list: Sequence[int | None]
) -> dict[str, Any]:
    """Replay a request stream through one global prefix cache per capacity, in one pass.

    ``None`` as a capacity means unbounded. Returns ``{"policy": policy, "results":
    [{"capacity_blocks": N, "hit_ratio": x}, ...]}`` in the order the capacities were given.
    """
    if policy not in POLICY_NAMES:
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose from {', '.join(POLICY_NAMES)}"
        )
    capacities = _check_capacities(capacity_blocks_list)
    caches = [PrefixCache(capacity, policy) for capacity in capacities]
    num_hit_blocks = [0] * len(caches)
    num_blocks = 0
    order = _ArrivalOrder()
    for request in requests:
        order.check(request)
        blocks = request.block_hashes
        num_blocks += len(blocks)
        for index, cache in enumerate(caches):
            num_hit_blocks[index] += cache.access(blocks)
    return {
        "policy": policy,
        "results": [
            {"capacity_blocks": capacity, "hit_ratio": _hit_ratio(num_hit, num_blocks)}
            for capacity, num_hit in zip(capacities, num_hit_blocks, strict=True)
        ],
    }

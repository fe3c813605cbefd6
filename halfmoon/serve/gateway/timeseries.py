"""The gateway's own recent history, in fixed time buckets, for the live cluster page.

Time is cut into ``bucket_s`` slices (5 s by default) and only the last ``window_s``
(10 min) are kept, so memory is bounded: at most ``window_s / bucket_s`` buckets, each
with at most ``max_samples`` latency samples per kind (a uniform reservoir sample once a
bucket has seen more; below that its percentiles are exact)::

    bucket index = floor(now_s / bucket_s)
    |  b-119  |  b-118  | ... |  b-1  |  b (now)  |    (older ones are dropped)

The clock is passed in (``time.monotonic`` in the gateway; a fake in tests), and so is
the random generator of the reservoirs.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The percentiles each bucket reports, per latency kind.
PERCENTILES = (50, 90, 99)


@dataclass
class _Samples:
    """A bounded uniform sample of one bucket's latencies (a reservoir)."""

    values: list[float] = field(default_factory=list)
    num_seen: int = 0

    def add(self, value_s: float, cap: int, rng: random.Random) -> None:
        self.num_seen += 1
        if len(self.values) < cap:
            self.values.append(value_s)
            return
        slot = rng.randrange(self.num_seen)
        if slot < cap:
            self.values[slot] = value_s


@dataclass
class Bucket:
    """What the gateway saw during one slice of time starting at ``index * bucket_s``."""

    index: int
    num_finished: int = 0
    num_rejected: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    kv_bytes: int = 0
    ttft: _Samples = field(default_factory=_Samples)
    itl: _Samples = field(default_factory=_Samples)


def percentiles(values: Sequence[float], qs: Sequence[int] = PERCENTILES) -> list[float | None]:
    """Linear-interpolation percentiles of ``values`` (None for each when empty)."""
    if not values:
        return [None] * len(qs)
    ordered = sorted(values)
    out: list[float | None] = []
    for q in qs:
        pos = (len(ordered) - 1) * q / 100
        low = math.floor(pos)
        high = min(low + 1, len(ordered) - 1)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))
    return out


class TimeSeries:
    """Recent gateway history: requests finished, rejected and failed, TTFT and
    inter-token latency samples, prefix-cache tokens queried and hit, KV bytes moved."""

    def __init__(
        self,
        bucket_s: float = 5.0,
        window_s: float = 600.0,
        max_samples: int = 256,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if bucket_s <= 0 or window_s < bucket_s or max_samples < 1:
            raise ValueError("need bucket_s > 0, window_s >= bucket_s and max_samples >= 1")
        self.bucket_s = bucket_s
        self.window_s = window_s
        self.max_samples = max_samples
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)
        self.num_buckets = int(window_s // bucket_s)
        self._buckets: deque[Bucket] = deque(maxlen=self.num_buckets)
        self._first_index = self._index(clock())

    def _index(self, now_s: float) -> int:
        return math.floor(now_s / self.bucket_s)

    def _current(self) -> Bucket:
        """The bucket of now (a new one when time has moved on; old ones fall off)."""
        index = self._index(self.clock())
        if not self._buckets or self._buckets[-1].index != index:
            self._buckets.append(Bucket(index))
        return self._buckets[-1]

    # -- recording -------------------------------------------------------------------------
    def finished(
        self,
        ttft_s: float | None,
        gaps_s: Sequence[float],
        prompt_tokens: int,
        cached_tokens: int,
        generated_tokens: int,
    ) -> None:
        """A request ended: its TTFT (None if no token came), inter-token gaps, prompt
        tokens (the prefix-cache query), how many of them were cached, tokens produced."""
        b = self._current()
        b.num_finished += 1
        b.prompt_tokens += prompt_tokens
        b.cached_tokens += cached_tokens
        b.generated_tokens += generated_tokens
        if ttft_s is not None:
            b.ttft.add(ttft_s, self.max_samples, self.rng)
        for gap_s in gaps_s:
            b.itl.add(gap_s, self.max_samples, self.rng)

    def rejected(self) -> None:
        """A request was refused (429: busy, or rejected by the Conductor)."""
        self._current().num_rejected += 1

    def failed(self) -> None:
        """A request failed (503)."""
        self._current().num_errors += 1

    def kv_moved(self, num_bytes: int) -> None:
        """KV bytes were transferred between workers for a request."""
        if num_bytes:
            self._current().kv_bytes += num_bytes

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The window as columns, oldest first, one entry per bucket since the series
        started (at most ``window_s``): ``t_s`` is each bucket's start relative to now
        (<= 0); rates are per second (the current bucket's over the part of it gone by,
        at least a second); percentiles and the hit ratio are None where the bucket has
        no sample."""
        now_s = self.clock()
        last = self._index(now_s)
        first = max(self._first_index, last - self.num_buckets + 1)
        by_index = {b.index: b for b in self._buckets}
        cols: dict[str, list[Any]] = {k: [] for k in _COLUMNS}
        for index in range(first, last + 1):
            start_s = index * self.bucket_s
            span_s = min(self.bucket_s, max(1.0, now_s - start_s))
            _append(cols, by_index.get(index) or Bucket(index), start_s - now_s, span_s)
        return {"bucket_s": self.bucket_s, "window_s": self.window_s, **cols}


_COLUMNS = (
    "t_s", "requests_per_s", "rejected_per_s", "errors_per_s", "tokens_per_s",
    "kv_bytes_per_s", "prefix_hit_ratio", "num_finished", "num_rejected",
    *(f"ttft_p{q}_s" for q in PERCENTILES), *(f"itl_p{q}_s" for q in PERCENTILES),
)  # fmt: skip


def _append(cols: dict[str, list[Any]], b: Bucket, t_s: float, bucket_s: float) -> None:
    """Add bucket ``b``'s row (it started ``t_s`` from now, rates over ``bucket_s``)."""
    cols["t_s"].append(round(t_s, 3))
    cols["requests_per_s"].append(b.num_finished / bucket_s)
    cols["rejected_per_s"].append(b.num_rejected / bucket_s)
    cols["errors_per_s"].append(b.num_errors / bucket_s)
    cols["tokens_per_s"].append(b.generated_tokens / bucket_s)
    cols["kv_bytes_per_s"].append(b.kv_bytes / bucket_s)
    cols["prefix_hit_ratio"].append(b.cached_tokens / b.prompt_tokens if b.prompt_tokens else None)
    cols["num_finished"].append(b.num_finished)
    cols["num_rejected"].append(b.num_rejected)
    for kind, samples in (("ttft", b.ttft), ("itl", b.itl)):
        for q, value in zip(PERCENTILES, percentiles(samples.values), strict=True):
            cols[f"{kind}_p{q}_s"].append(value)

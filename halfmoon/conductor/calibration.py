"""Prefill calibration: how much longer (or shorter) an instance's prefills really take
than its cost model says, learned online from the instance's own prefills.

The Conductor's TTFT estimates come from a cost model: a profile measured once on an
idle host, or a roofline. A live instance can run slower than that for as long as it
runs: processes sharing a few cores, a neighbour on the same GPU, thermal limits. Its
TTFT estimates are then too low, and early rejection admits requests that will miss
their SLO (docs/benchmarks.md, "Prefill calibration": simulated instances sharing a few
cores).

Each prefill instance keeps one :class:`PrefillCalibration`. The sample is *busy time*,
not a request's own start-to-finish time: a worker announces a prefill when the request
enters its engine's queue, so several can be "started" at once, and a per-request
duration would count their waits. Instead, the instance is busy while at least one of
its prefills has started and not finished; each finish closes the busy time since the
previous finish (or since the busy spell began) and pairs it with the cost model's
estimate for the finished request::

    busy  = decay * busy  + (now - mark)        mark: the busy spell's start, or the last finish
    est   = decay * est   + estimate(request)   (the cost model's own, before any scale,
                                                 for the cached prefix the instance found)
    scale = clamp(busy / est, low, high)        once `min_samples` prefills finished

The estimate is made again for the cached prefix the instance reports with
``PrefillFinished.cached_tokens``: a prompt queued behind one that shares its prefix finds
more cached than the Conductor planned with, and its shorter prefill says nothing about
the instance's speed (without this, an instance on the public trace looked twice as fast
as it was). Served one after another, a prefill's busy time is its duration; served side
by side, the sums still compare seconds of work with seconds estimated. Estimates are then
multiplied by ``scale`` (the candidates' prefill times, a load report's queue, the
bookings of new placements). A worker announces a prefill after fetching any remote
prefix, so busy time is compute; the CPP stages of a pipelined prefill close busy time
but add no sample (a stage's share is not a cost-model estimate).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillCalibration:
    """Measured over estimated prefill seconds of one instance (module docstring).

    ``decay``: weight of the history at each sample (0.9: about the last ten prefills);
    ``min_samples``: prefills before the scale moves from 1; ``low``/``high``: bounds of
    the scale (a stray sample cannot make an instance look free or dead).
    """

    decay: float = 0.9
    min_samples: int = 3
    low: float = 0.2
    high: float = 20.0
    busy_s: float = 0.0
    estimated_s: float = 0.0
    samples: int = 0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")
        if not 0 < self.low <= 1 <= self.high:
            raise ValueError(f"need 0 < low <= 1 <= high, got {self.low}, {self.high}")

    def observe(self, busy_s: float, estimated_s: float) -> float:
        """Add one finished prefill (its busy seconds, its unscaled estimate); the scale."""
        if busy_s < 0 or not estimated_s > 0:
            return self.scale
        self.busy_s = self.decay * self.busy_s + busy_s
        self.estimated_s = self.decay * self.estimated_s + estimated_s
        self.samples += 1
        if self.samples >= self.min_samples:
            ratio = self.busy_s / self.estimated_s
            self.scale = min(self.high, max(self.low, ratio))
        return self.scale

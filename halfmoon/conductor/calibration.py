"""Prefill calibration: how much longer (or shorter) an instance's prefills really take
than its cost model says, and how late first tokens reach clients against the TTFT
estimates, both learned online (:class:`PrefillCalibration`, :class:`LatenessCalibration`).

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

What happens after a prefill and before its first token reaches the client (the last
layers on the wire, the hand-over, the messages) no cost model prices: that is the
lateness :class:`LatenessCalibration` learns from ``FirstToken`` events: their decayed
mean, and with ``stddevs`` > 0 that many decayed standard deviations on top, so that the
TTFT held against the SLO covers late first tokens, not only the average one.

Both learners forget with time, not only with new samples: a Conductor that learned a
bad spell (a slow instance, a burst of late first tokens) rejects what would have
corrected it, and could stay stuck. So a learned value relaxes back to its neutral one
(scale 1, lateness 0) with a half-life (30 s) counted from its last sample; under steady
traffic samples come far more often and the relaxation is negligible::

    value(now) = neutral + (learned - neutral) * 0.5 ** ((now - last sample) / half_life)
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass, field

#: Seconds for a learned value with no new sample to come halfway back to neutral.
HALF_LIFE_S = 30.0
#: The largest margin, in standard deviations of lateness, a Conductor accepts.
MAX_STDDEVS = 5.0


def _check(decay: float, min_samples: int, half_life_s: float) -> None:
    """The settings both learners share, or a ValueError naming the bad one."""
    if not 0 < decay <= 1:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1, got {min_samples}")
    if not half_life_s > 0:
        raise ValueError(f"half_life_s must be > 0, got {half_life_s}")


def _relaxed(learned: float, neutral: float, since_s: float, half_life_s: float) -> float:
    """``learned`` moved back toward ``neutral`` for ``since_s`` seconds without samples."""
    if since_s <= 0:
        return learned
    return neutral + (learned - neutral) * 0.5 ** (since_s / half_life_s)


@dataclass
class PrefillCalibration:
    """Measured over estimated prefill seconds of one instance (module docstring).

    ``decay``: weight of the history at each sample (0.9: about the last ten prefills);
    ``min_samples``: prefills before the scale moves from 1; ``low``/``high``: bounds of
    the scale (a stray sample cannot make an instance look free or dead); ``half_life_s``:
    how fast, with no new sample, the scale returns to 1 (:meth:`relax`).
    """

    decay: float = 0.9
    min_samples: int = 3
    low: float = 0.2
    high: float = 20.0
    half_life_s: float = HALF_LIFE_S
    busy_s: float = 0.0
    estimated_s: float = 0.0
    samples: int = 0
    #: The ratio the samples give, and when the last one came.
    learned: float = 1.0
    last_sample_s: float = 0.0
    #: What estimates are multiplied by: ``learned``, relaxed to the last :meth:`relax`.
    scale: float = 1.0

    def __post_init__(self) -> None:
        _check(self.decay, self.min_samples, self.half_life_s)
        if not 0 < self.low <= 1 <= self.high:
            raise ValueError(f"need 0 < low <= 1 <= high, got {self.low}, {self.high}")

    def observe(self, busy_s: float, estimated_s: float, now_s: float = 0.0) -> float:
        """Add one finished prefill (its busy seconds, its unscaled estimate) at ``now_s``;
        the scale."""
        if busy_s < 0 or not estimated_s > 0:
            return self.scale
        self.busy_s = self.decay * self.busy_s + busy_s
        self.estimated_s = self.decay * self.estimated_s + estimated_s
        self.samples += 1
        self.last_sample_s = now_s
        if self.samples >= self.min_samples:
            ratio = self.busy_s / self.estimated_s
            self.learned = self.scale = min(self.high, max(self.low, ratio))
        return self.scale

    def relax(self, now_s: float) -> float:
        """The scale at ``now_s``: ``learned`` drifting back to 1 since the last sample."""
        self.scale = _relaxed(self.learned, 1.0, now_s - self.last_sample_s, self.half_life_s)
        return self.scale


@dataclass
class LatenessCalibration:
    """How much later than estimated placed requests' first tokens reach their clients:
    the hand-off after the prefill (the last layers on the wire, the hand-over) and the
    messages between, which no cost model prices. Each sample is a request's
    ``FirstToken`` time less its decision time and the TTFT the decision estimated
    (before any lateness). The Conductor adds the estimate to the TTFT it holds against
    the SLO and to the ready time it predicts; it moves every candidate alike, so it
    never changes which one is chosen.

    The learned value is the decayed mean of the samples once ``min_samples`` came, plus
    ``stddevs`` times their decayed standard deviation (0: the mean alone; 1.3 holds
    about the 90th percentile of normally spread lateness, so that admitted requests
    whose first token comes later than the average still meet the SLO), never below 0
    (an estimate that is early on average is left alone) nor above ``high_s``; :meth:`at`
    relaxes it toward 0 with ``half_life_s`` since the last sample.
    It also keeps each placement's (decision time, estimate) from :meth:`placed` until its
    :meth:`first_token` (or :meth:`forget`).
    """

    decay: float = 0.9
    min_samples: int = 3
    high_s: float = 60.0
    half_life_s: float = HALF_LIFE_S
    stddevs: float = 0.0
    total_s: float = 0.0
    total_sq_s: float = 0.0
    weight: float = 0.0
    samples: int = 0
    #: The decayed mean and standard deviation of the samples, and what they give.
    mean_s: float = 0.0
    std_s: float = 0.0
    learned_s: float = 0.0
    last_sample_s: float = 0.0
    #: Placed requests whose first token has not been seen: (decision time, estimate).
    pending: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _check(self.decay, self.min_samples, self.half_life_s)
        if not 0 <= self.stddevs <= MAX_STDDEVS:
            raise ValueError(f"stddevs must be in [0, {MAX_STDDEVS}], got {self.stddevs}")

    def placed(self, request_id: str, now_s: float, ttft_s: float) -> None:
        """A request was placed at ``now_s`` with this TTFT estimate (before lateness)."""
        self.pending[request_id] = (now_s, ttft_s)

    def first_token(self, request_id: str, now_s: float) -> None:
        """Its first token came: a sample (ignored for a request not placed here)."""
        placed = self.pending.pop(request_id, None)
        if placed is not None:
            decided_s, ttft_s = placed
            self.observe(now_s - decided_s - ttft_s, now_s)

    def forget(self, request_id: str) -> None:
        """The request ended (or was placed again) before its first token was seen."""
        self.pending.pop(request_id, None)

    def retain(self, request_ids: Container[str]) -> None:
        """Forget every pending request not in ``request_ids`` (instances left)."""
        self.pending = {r: p for r, p in self.pending.items() if r in request_ids}

    def observe(self, late_s: float, now_s: float = 0.0) -> float:
        """Add one request's lateness (seconds, signed) at ``now_s``; the learned value."""
        self.total_s = self.decay * self.total_s + late_s
        self.total_sq_s = self.decay * self.total_sq_s + late_s * late_s
        self.weight = self.decay * self.weight + 1.0
        self.samples += 1
        self.last_sample_s = now_s
        if self.samples >= self.min_samples:
            self.mean_s = self.total_s / self.weight
            self.std_s = math.sqrt(max(0.0, self.total_sq_s / self.weight - self.mean_s**2))
            held = self.mean_s + self.stddevs * self.std_s
            self.learned_s = min(self.high_s, max(0.0, held))
        return self.learned_s

    def at(self, now_s: float) -> float:
        """The lateness to add at ``now_s`` (relaxed since the last sample)."""
        return _relaxed(self.learned_s, 0.0, now_s - self.last_sample_s, self.half_life_s)

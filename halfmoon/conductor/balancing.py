"""The cache-balancing threshold: fixed, or tuned online from what the Conductor observes.

The kvcache-centric policy considers fetching a longer prefix from another instance only
when it is longer than the local one by more than ``threshold`` x the prompt
(``kvcache_balancing_threshold``; the paper leaves its choice open). The paper's
estimate of a fetch assumes an idle link and an exact queue; when links are contended,
or the estimates are off, fetches that look good on paper lose time, their own and that
of the KV streams they delay. A fixed threshold is right for one network and one
workload only. With adaptive balancing the Conductor also books its planned transfers
on the instances' links (:mod:`halfmoon.conductor.links`), so a fetch's estimate
includes its wait for them; what that view still misses is learned here.

:class:`Balancer` with ``adaptive`` learns it from outcomes, on two levels.

*Which fetches pay for themselves.* For every placement it keeps the estimate the
decision was made on; when the prefill ends (``PrefillFinished``) it measures the
*excess*, measured minus estimated time to prefill end. For a placement that fetched a
remote prefix of ``f`` x the prompt, the realized gain over the best local candidate is::

    gain = (best local estimate - fetch estimate) - (fetch excess - mean local excess)

(the local excess is the error every estimate shares: queues). A threshold ``t`` keeps
the fetches with ``f > t``; the fetch threshold is the one of :data:`THRESHOLD_GRID` that
maximizes the summed gain of the recent fetches it keeps (fetches it would not make
count zero), ties going to the value closest to the current one; it moves only when the
fetches between the two values gained (or lost) by more than :data:`SIGNIFICANCE`
standard errors (noise alone does not move it). Fetches below it
are no longer made, so nothing is learned about them; one decision in
``explore_every`` (four times fewer once ``window`` fetch outcomes are in) therefore
considers every fetch (threshold 0), and its outcomes are weighted by that period
(inverse propensity).

*Whether fetching pays at all.* A fetch also holds both instances' links, and the KV
streams of other requests wait behind it: a cost the fetcher's own gain does not show.
Decisions are grouped in epochs of ``epoch`` placements; one epoch in ``probe_every``
runs the other arm (no fetching when fetching is on, the fetch threshold when it is
off). The hand-off delay of every request (``PrefillFinished`` to ``DecodeStarted``:
its KV stream and the wait at the decode instance) is averaged per arm, and fetching
stays on while the fetches' mean own gain per request exceeds the extra hand-off delay
they bring (mean with fetching - mean without), switching only on :data:`SIGNIFICANCE`
standard errors of evidence. Probes cost time (in overload, every recomputed prefix
lengthens the queues), so they grow rarer with the evidence: one epoch in
``4 x probe_every`` beyond :data:`CONFIDENT` standard errors, one in ``16 x
probe_every`` while the fetches' own gain exceeds even the whole hand-off delay with
fetching on (no delay without it could change the verdict).

Until ``min_samples`` outcomes of each kind are in, the configured threshold is used
(the fallback). Deterministic: no randomness, only counters.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: Thresholds the adaptive balancer chooses from (1.0: never fetch a remote prefix).
THRESHOLD_GRID = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
NO_FETCH = 1.0
#: How many standard errors of evidence it takes to change a learned setting.
SIGNIFICANCE = 3.0
#: Beyond this many standard errors the other arm is probed CONFIDENT_SLOWDOWN x rarer.
CONFIDENT = 4.0
CONFIDENT_SLOWDOWN = 4


@dataclass
class _Placed:
    """What a placement's decision assumed (kept until its decode starts)."""

    placed_at_s: float
    est_ttft_s: float
    #: For a remote fetch: the fetched share of the prompt; None for a local placement.
    fraction: float | None
    est_gain_s: float
    weight: float
    fetch_arm: bool
    prefill_end_s: float | None = None


@dataclass(frozen=True)
class FetchOutcome:
    """A finished remote fetch: its share of the prompt, realized gain (s), weight."""

    fraction: float
    gain_s: float
    weight: float


def _mean(values: deque[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _sq_error(values: deque[float]) -> float:
    """The squared standard error of the mean of ``values`` (0 below two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = _mean(values)
    return sum((v - mean) ** 2 for v in values) / (n - 1) / n


class Balancer:
    """Hands the Conductor the threshold for each decision and learns from outcomes.

    ``fixed``: the configured threshold, always (no bookkeeping). ``adaptive``: see the
    module docstring; ``window`` recent outcomes of each kind are kept.
    """

    def __init__(
        self,
        fixed_threshold: float,
        adaptive: bool,
        *,
        window: int = 256,
        min_samples: int = 16,
        explore_every: int = 16,
        refit_every: int = 8,
        epoch: int = 16,
        probe_every: int = 16,
    ) -> None:
        if not 0 <= fixed_threshold <= 1:
            raise ValueError("the balancing threshold must be in [0, 1]")
        if min(window, min_samples, refit_every, epoch) < 1 or min(explore_every, probe_every) < 2:
            raise ValueError("window, min_samples, refit_every, epoch >= 1; explore/probe >= 2")
        self.fixed_threshold = fixed_threshold
        self.adaptive = adaptive
        #: The threshold fetches are filtered by when fetching is on (learned).
        self.fetch_threshold = min(fixed_threshold, THRESHOLD_GRID[-2])
        #: Whether the main arm fetches remote prefixes at all (learned).
        self.fetching = fixed_threshold < NO_FETCH
        self._min_samples = min_samples
        self._explore_every = explore_every
        self._refit_every = refit_every
        self._epoch = epoch
        self._probe_every = probe_every
        self._decisions = 0
        self._epochs = 0
        self._probing = False
        self._fetch_arm = self.fetching
        self._pending: dict[str, _Placed] = {}
        self._fetches: deque[FetchOutcome] = deque(maxlen=window)
        self._local_excess: deque[float] = deque(maxlen=window)
        #: Per arm (fetching on / off): hand-off delays, and own gain per request.
        self._handoff: dict[bool, deque[float]] = {a: deque(maxlen=window) for a in (True, False)}
        self._own_gain: deque[float] = deque(maxlen=window)
        self._since_refit = 0
        self._since_decide = 0
        self.num_explorations = 0

    @property
    def threshold(self) -> float:
        """The threshold of the main arm (what most decisions use)."""
        if not self.adaptive:
            return self.fixed_threshold
        return self.fetch_threshold if self.fetching else NO_FETCH

    # -- per decision ----------------------------------------------------------------------
    def decision_threshold(self) -> float:
        """The threshold for the next decision: the main arm's, the probe arm's in a probe
        epoch, or 0 when exploring which fetches pay."""
        if not self.adaptive:
            return self.fixed_threshold
        n = self._decisions
        self._decisions += 1
        if n % self._epoch == 0:  # a new epoch: probe the other arm, or not
            self._epochs += 1
            self._probing = self._epochs % self._probe_period() == 0
        probe = self._probing
        self._fetch_arm = self.fetching != probe
        if not self._fetch_arm:
            return NO_FETCH
        if self.fetch_threshold > 0 and n % self._explore_period() == 0:
            self.num_explorations += 1
            return 0.0
        return self.fetch_threshold

    def placed(
        self,
        request_id: str,
        now_s: float,
        est_ttft_s: float,
        fraction: float | None,
        best_local_ttft_s: float,
    ) -> None:
        """A request was placed: ``fraction`` of its prompt fetched from another instance
        (None: local prefix only), estimated TTFT ``est_ttft_s``, the best local
        candidate's ``best_local_ttft_s``."""
        if not self.adaptive:
            return
        weight = 1.0
        if fraction is not None and fraction <= self.fetch_threshold:
            weight = float(self._explore_period())  # only an exploring decision fetches it
        self._pending[request_id] = _Placed(
            now_s, est_ttft_s, fraction, best_local_ttft_s - est_ttft_s, weight, self._fetch_arm
        )

    def prefill_finished(self, request_id: str, now_s: float) -> None:
        """The request's prefill ended: score its estimate."""
        placed = self._pending.get(request_id)
        if placed is None or placed.prefill_end_s is not None:
            return
        placed.prefill_end_s = now_s
        excess = (now_s - placed.placed_at_s) - placed.est_ttft_s
        if placed.fraction is None:
            self._local_excess.append(excess)
            if placed.fetch_arm:
                self._own_gain.append(0.0)
            return
        gain = placed.est_gain_s - (excess - _mean(self._local_excess))
        self._fetches.append(FetchOutcome(placed.fraction, gain, placed.weight))
        self._own_gain.append(gain)
        self._since_refit += 1
        if self._since_refit >= self._refit_every:
            self._since_refit = 0
            self._refit()

    def decode_started(self, request_id: str, now_s: float) -> None:
        """The request joined a decode batch: its hand-off delay counts for its arm."""
        placed = self._pending.pop(request_id, None)
        if placed is None or placed.prefill_end_s is None:
            return
        self._handoff[placed.fetch_arm].append(now_s - placed.prefill_end_s)
        self._since_decide += 1
        if self._since_decide >= self._refit_every:  # O(window): not on every event
            self._since_decide = 0
            self._decide_fetching()

    def forget(self, request_id: str) -> None:
        """The request ended without (all) its outcomes (released, failed)."""
        self._pending.pop(request_id, None)

    # -- learning --------------------------------------------------------------------------
    def scores(self) -> dict[float, float]:
        """Weighted realized gain (s) of the recent fetches each grid threshold keeps."""
        return {
            t: sum(o.gain_s * o.weight for o in self._fetches if o.fraction > t)
            for t in THRESHOLD_GRID[:-1]
        }

    def fetching_benefit_s(self) -> tuple[float, float] | None:
        """Mean own gain per request with fetching on, less the hand-off delay fetching
        adds, and the standard error of that figure; None until each arm has
        ``min_samples`` outcomes."""
        on, off = self._handoff[True], self._handoff[False]
        if min(len(on), len(off), len(self._own_gain)) < self._min_samples:
            return None
        benefit = _mean(self._own_gain) - (_mean(on) - _mean(off))
        error = math.sqrt(_sq_error(self._own_gain) + _sq_error(on) + _sq_error(off))
        return benefit, error

    def _explore_period(self) -> int:
        """Decisions per exploring one: ``explore_every``, ``CONFIDENT_SLOWDOWN`` times
        that once the window of fetch outcomes is full (the fit has its data)."""
        full = len(self._fetches) == self._fetches.maxlen
        return self._explore_every * (CONFIDENT_SLOWDOWN if full else 1)

    def _probe_period(self) -> int:
        """Epochs per probe: ``probe_every``; ``CONFIDENT_SLOWDOWN`` times that while the
        evidence for the main arm is beyond ``CONFIDENT`` standard errors (probing the
        losing arm costs most when it loses clearly), its square while fetching pays
        even against a hand-off delay of zero without it."""
        if self.fetching and self._fetching_surely_pays():
            return self._probe_every * CONFIDENT_SLOWDOWN**2
        found = self.fetching_benefit_s()
        if found is not None:
            benefit, error = found
            if (benefit if self.fetching else -benefit) > CONFIDENT * error:
                return self._probe_every * CONFIDENT_SLOWDOWN
        return self._probe_every

    def _fetching_surely_pays(self) -> bool:
        """Whether the fetches' own gain exceeds the *whole* hand-off delay with fetching
        on (the delay without it cannot be below zero) by ``CONFIDENT`` standard errors:
        then no probe of the other arm can change the decision."""
        on = self._handoff[True]
        if min(len(on), len(self._own_gain)) < self._min_samples:
            return False
        bound = _mean(self._own_gain) - _mean(on)
        return bound > CONFIDENT * math.sqrt(_sq_error(self._own_gain) + _sq_error(on))

    def _decide_fetching(self) -> None:
        """Switch the main arm only on evidence: a benefit beyond ``SIGNIFICANCE`` standard
        errors of the other sign (hysteresis against noise)."""
        found = self.fetching_benefit_s()
        if found is None:
            return
        benefit, error = found
        if self.fetching and benefit < -SIGNIFICANCE * error:
            self.fetching = False
        elif not self.fetching and benefit > SIGNIFICANCE * error:
            self.fetching = True

    def _refit(self) -> None:
        """Move the fetch threshold to the best-scoring one when the fetches between the
        two thresholds gain (or lose) by more than ``SIGNIFICANCE`` standard errors."""
        if len(self._fetches) < self._min_samples or len(self._local_excess) < self._min_samples:
            return
        scores = self.scores()
        best = max(scores.values())
        target = min(
            (t for t, s in scores.items() if s >= best),
            key=lambda t: (abs(t - self.fetch_threshold), t),
        )
        low, high = sorted((target, self.fetch_threshold))
        between = [o.gain_s * o.weight for o in self._fetches if low < o.fraction <= high]
        error = math.sqrt(sum(g * g for g in between))
        if best - scores[self.fetch_threshold] > SIGNIFICANCE * error:
            self.fetch_threshold = target

    def state(self) -> dict[str, object]:
        """What an operator (or a report) wants to know."""
        found = self.fetching_benefit_s()
        return {
            "mode": "adaptive" if self.adaptive else "fixed",
            "threshold": self.threshold,
            "fixed_threshold": self.fixed_threshold,
            "fetch_threshold": self.fetch_threshold,
            "fetching": self.fetching if self.adaptive else self.fixed_threshold < NO_FETCH,
            "fetching_benefit_s": None if found is None else round(found[0], 6),
            "fetch_outcomes": len(self._fetches),
            "explorations": self.num_explorations,
            "local_outcomes": len(self._local_excess),
            "mean_local_excess_s": round(_mean(self._local_excess), 6),
        }

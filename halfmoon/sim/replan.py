"""Re-planning the P:D split while the cluster runs.

A :class:`Replanner` watches the requests as they arrive. Every ``interval_s`` it
replays the last ``window_s`` of them on copies of the cluster with other splits of the
same instances (the planner's nested simulation: :func:`halfmoon.sim.parallel.run_jobs`
with the cluster's own Conductor settings and cost model), and when a split beats the
current one by more than ``margin`` in goodput (requests meeting both SLOs per second),
it asks for a move of at most ``max_moves`` instances towards it. After a move it waits
``cooldown_s`` before it considers another (hysteresis: the moved instances drain first,
and the window must show the new split at work).

The simulator carries the moves out (:class:`~halfmoon.sim.simulator.Simulator` with
``replan``): it drains the instance that will change role (the Conductor places nothing
more on it), and once nothing placed uses it and its link is free, removes it and adds a
new instance of the other role in its place (a prefill instance's cache does not
survive the change).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from halfmoon.conductor.config import ConductorConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.sim.config import ClusterSpec, SimConfig

#: A nested simulation: (requests, cost model, [(sim config, conductor config)]) ->
#: reports, in order. :func:`halfmoon.sim.parallel.run_jobs` by default.
Evaluate = Callable[
    [list[Request], CostModel, list[tuple[SimConfig, ConductorConfig]]], list[dict[str, Any]]
]


@dataclass(frozen=True)
class ReplanConfig:
    """When and how far the split may move (see the module docstring)."""

    interval_s: float = 30.0
    window_s: float = 60.0
    margin: float = 0.05
    max_moves: int = 4
    cooldown_s: float = 30.0
    min_requests: int = 30
    #: Splits tried around the current prefill count (+- these, within 1..N-1).
    steps: tuple[int, ...] = (1, 2, 4)
    processes: int | None = 1

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.window_s > 0 and self.cooldown_s >= 0):
            raise HalfmoonError("re-planning needs interval_s, window_s > 0, cooldown_s >= 0")
        if self.margin < 0 or self.max_moves < 1 or self.min_requests < 1:
            raise HalfmoonError("re-planning needs margin >= 0, max_moves >= 1, min_requests >= 1")
        if not self.steps or min(self.steps) < 1:
            raise HalfmoonError("re-planning steps must be positive")


@dataclass
class ReplanDecision:
    """One re-planning round: what was simulated and what it chose."""

    time_s: float
    current: int
    goodput_rps: dict[int, float]
    target: int
    moves: int = 0


def _default_evaluate(processes: int | None) -> Evaluate:
    def evaluate(requests, cost_model, configs):  # type: ignore[no-untyped-def]
        from halfmoon.sim.parallel import SimJob, run_jobs

        jobs = [SimJob(sim, conductor) for sim, conductor in configs]
        return run_jobs(requests, cost_model, jobs, processes)

    return evaluate


@dataclass
class Replanner:
    """Decides, from the recent arrivals, whether the split should move (pure: the
    simulator, or a live controller, carries the moves out)."""

    config: ReplanConfig
    sim: SimConfig
    conductor: ConductorConfig
    cost_model: CostModel
    instances: int
    evaluate: Evaluate | None = None
    decisions: list[ReplanDecision] = field(default_factory=list)
    _recent: deque[tuple[float, Request]] = field(default_factory=deque)
    _next_s: float = 0.0
    _quiet_until_s: float = 0.0

    def __post_init__(self) -> None:
        if self.instances < 2:
            raise HalfmoonError("re-planning needs at least two instances")
        if self.evaluate is None:
            self.evaluate = _default_evaluate(self.config.processes)
        self._next_s = self.config.interval_s

    def observe(self, request: Request, now_s: float) -> None:
        """A request arrived at ``now_s`` (simulated or wall-clock seconds)."""
        self._recent.append((now_s, request))
        while self._recent and self._recent[0][0] < now_s - self.config.window_s:
            self._recent.popleft()

    def due(self, now_s: float) -> bool:
        """Whether a round is due (its interval passed and no cooldown holds)."""
        return now_s >= self._next_s and now_s >= self._quiet_until_s

    def target(self, now_s: float, prefill: int, window: list[Request] | None = None) -> int | None:
        """Run a round: the prefill count to move towards (at most ``max_moves`` from
        ``prefill``), or None to stay. ``window``: the recent requests with their arrival
        times from 0 (a live cluster's, from its Conductor); by default the ones
        :meth:`observe` saw in the last ``window_s``."""
        cfg = self.config
        self._next_s = now_s + cfg.interval_s
        if window is None:
            if len(self._recent) < cfg.min_requests:
                return None
            start = self._recent[0][0]
            window = [
                replace(r, arrival_time_s=max(0.0, t - start)) for t, r in self._recent
            ]  # arrival times as seen by the cluster (scaled), from 0
        elif len(window) < cfg.min_requests:
            return None
        n = self.instances
        splits = sorted(
            {prefill} | {p for d in cfg.steps for p in (prefill - d, prefill + d) if 0 < p < n}
        )
        sim = replace(self.sim, time_scale=1.0, max_requests=None)
        configs = [(replace(sim, cluster=ClusterSpec(p, n - p)), self.conductor) for p in splits]
        assert self.evaluate is not None
        reports = self.evaluate(window, self.cost_model, configs)
        goodput = {p: r["goodput_rps"] for p, r in zip(splits, reports, strict=True)}
        attainment = {p: r["slo_attainment"] for p, r in zip(splits, reports, strict=True)}
        best = max(splits, key=lambda p: (goodput[p], attainment[p], -abs(p - prefill)))
        decision = ReplanDecision(now_s, prefill, goodput, prefill)
        self.decisions.append(decision)
        if best == prefill or goodput[best] <= goodput[prefill] * (1 + cfg.margin):
            return None
        step = max(-cfg.max_moves, min(cfg.max_moves, best - prefill))
        decision.target = prefill + step
        decision.moves = abs(step)
        self._quiet_until_s = now_s + cfg.cooldown_s
        return decision.target

    def summary(self) -> list[dict[str, Any]]:
        """Every round (the report's ``replans``)."""
        return [
            {
                "time_s": round(d.time_s, 3),
                "prefill": d.current,
                "target": d.target,
                "goodput_rps": {str(p): round(g, 4) for p, g in d.goodput_rps.items()},
            }
            for d in self.decisions
        ]

"""The Conductor's Prometheus metrics: its own registry (no global one), rendered when a
gateway asks (``metrics_query``); the gateway adds ``role="conductor"`` and the other
labels when it merges every process's metrics (:mod:`halfmoon.serve.gateway.scrape`).

Decisions are counted as they are made (:meth:`ConductorMetrics.observe_decision`); the
instance figures (registered instances by role and state, index blocks per instance) and
the cache-balancing state are read from the service when the metrics are rendered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from halfmoon.conductor.messages import RejectCode

#: Seconds one placement takes inside the Conductor (tens of microseconds to a few ms).
DECISION_BUCKETS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
#: Every reject code (``RejectCode``'s constants), so each series exists from the start.
REJECT_CODES = tuple(
    value for name, value in vars(RejectCode).items() if name.isupper() and isinstance(value, str)
)
ROLES = ("prefill", "decode", "coupled")
STATES = ("placeable", "draining")


@dataclass(frozen=True)
class InstanceFigures:
    """What the service knows when the metrics are rendered: the role of every registered
    instance, the draining ones, the blocks its index holds per instance, and the
    cache-balancing state."""

    roles: dict[str, str] = field(default_factory=dict)
    draining: frozenset[str] = frozenset()
    index_blocks: dict[str, int] = field(default_factory=dict)
    #: ``Conductor.balancing``: the cache-balancing threshold in use and how it was learned.
    balancing: dict[str, Any] = field(default_factory=dict)
    #: Each prefill instance's learned prefill scale (``Conductor.prefill_calibration``).
    prefill_scale: dict[str, float] = field(default_factory=dict)
    #: Seconds the Conductor adds to every TTFT estimate (``Conductor.ttft_lateness_s``).
    ttft_lateness_s: float = 0.0


class InstanceCollector:
    """Registered instances by role and state; index blocks per instance."""

    def __init__(self, figures: Callable[[], InstanceFigures]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Two families, read from the service now."""
        f = self._figures()
        instances = GaugeMetricFamily(
            "halfmoon:conductor_instances",
            "Registered instances by role and state (placeable, or draining: out of placement).",
            labels=["instance_role", "state"],
        )
        for role in ROLES:
            ids = [i for i, r in f.roles.items() if r == role]
            num_draining = sum(1 for i in ids if i in f.draining)
            instances.add_metric([role, "placeable"], len(ids) - num_draining)
            instances.add_metric([role, "draining"], num_draining)
        blocks = GaugeMetricFamily(
            "halfmoon:conductor_index_blocks",
            "Blocks the Conductor's prefix index holds per instance (any tier).",
            labels=["instance_id"],
        )
        for iid, num_blocks in sorted(f.index_blocks.items()):
            blocks.add_metric([iid], num_blocks)
        scales = GaugeMetricFamily(
            "halfmoon:conductor_prefill_scale",
            "What each prefill instance's estimates are multiplied by: its measured prefill "
            "time over the cost model's, learned online (--prefill-calibration on).",
            labels=["instance_id"],
        )
        for iid, scale in sorted(f.prefill_scale.items()):
            scales.add_metric([iid], scale)
        lateness = GaugeMetricFamily(
            "halfmoon:conductor_ttft_lateness_seconds",
            "Seconds added to every TTFT estimate: how much later than estimated first "
            "tokens reached the gateway, learned online (--prefill-calibration on).",
        )
        lateness.add_metric([], f.ttft_lateness_s)
        yield from (instances, blocks, scales, lateness, *balancing_families(f.balancing))


def balancing_families(state: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """The cache-balancing threshold in use, whether fetching is on, and the adaptive
    learner's evidence (:meth:`halfmoon.conductor.balancing.Balancer.state`)."""
    if not state:
        return
    gauges = (
        ("threshold", "halfmoon:conductor_balancing_threshold",
         "The kvcache-balancing threshold in use (a fraction of the prompt; 1: never fetch)."),
        ("fetching", "halfmoon:conductor_balancing_fetching",
         "1 while the Conductor fetches longer prefixes from other instances, else 0."),
        ("fetch_outcomes", "halfmoon:conductor_balancing_fetch_outcomes",
         "Measured fetch outcomes the adaptive learner holds (0 with --balancing fixed)."),
        ("explorations", "halfmoon:conductor_balancing_explorations",
         "Placements the adaptive learner explored at threshold 0."),
        ("max_link_backlog_s", "halfmoon:conductor_balancing_link_backlog_seconds",
         "The longest transfer backlog the Conductor has booked on an instance's link, "
         "seconds from now (fetches priced by link backlog only; else 0)."),
    )  # fmt: skip
    for key, name, text in gauges:
        family = GaugeMetricFamily(name, text, labels=["mode"])
        family.add_metric([str(state.get("mode", ""))], float(state.get(key) or 0))
        yield family


class ConductorMetrics:
    """Decisions by outcome and reject code, the time each took, and the instances."""

    def __init__(self, figures: Callable[[], InstanceFigures]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "halfmoon:conductor_decisions",
            "Placement decisions by outcome (accepted, rejected) and reason (a reject "
            "code; empty when accepted).",
            ["outcome", "reason"],
            registry=r,
        )
        self.decision_time = Histogram(
            "halfmoon:conductor_decision_time_seconds",
            "Seconds the Conductor took to place (or reject) one request.",
            buckets=DECISION_BUCKETS_S,
            registry=r,
        )
        self.decisions.labels("accepted", "")
        for code in REJECT_CODES:
            self.decisions.labels("rejected", code)
        r.register(InstanceCollector(figures))

    def observe_decision(self, decision: Any, elapsed_s: float) -> None:
        """Count one ``Decision`` (its ``accepted`` and ``reject_code``) that took
        ``elapsed_s``."""
        if decision.accepted:
            self.decisions.labels("accepted", "").inc()
        else:
            self.decisions.labels("rejected", decision.reject_code or "other").inc()
        self.decision_time.observe(elapsed_s)

    def render(self) -> str:
        """The text exposition format."""
        return generate_latest(self.registry).decode()

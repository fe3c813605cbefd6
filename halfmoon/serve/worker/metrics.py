"""A worker's Prometheus metrics: its own registry (no global one), rendered when the
gateway asks (``metrics_query``), which adds the ``role`` / ``worker`` / ``model_name``
labels when it merges every process's metrics (:mod:`halfmoon.serve.gateway.scrape`).

Names follow vLLM's under the ``halfmoon:`` prefix. What the worker sees of a request::

    queued (add_request) --scheduled (left the waiting queue)--> first token --> ... --> last
       |<-- queue time -->|<--------- prefill time --------->|<---- decode time ---->|

A request's times are observed once, cluster-wide: a prefill worker observes its queue
and prefill times and its prompt tokens, the decode worker its decode time, generated
tokens and time per output token; a coupled worker all of them. "Scheduled" is inferred
from the engine's FCFS waiting queue after each step (the connector exposes lengths, not
per-request states): a request counts as scheduled at the start of the step after which
fewer requests wait than were queued before it. Gauges (load, KV pool) and the block
store's figures are read when the metrics are rendered, on the worker's loop thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from halfmoon.store import StoreStats

#: Request phases (seconds): from a few ms on a GPU to minutes for a long CPU prefill.
REQUEST_TIME_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 160.0,
)  # fmt: skip
#: One engine step or one token's gap.
STEP_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Token counts (vLLM's 1-2-5 series).
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TIERS = ("dram", "ssd")


class StoreCollector:
    """A block store's figures, read at collection: blocks, bytes and capacity per tier
    (gauges); hits and evictions per tier, misses and checksum failures (counters)."""

    def __init__(self, stats: Callable[[], StoreStats], block_bytes: int) -> None:
        self._stats = stats
        self._block_bytes = block_bytes

    def collect(self) -> Iterator[Any]:
        """One family per figure."""
        s = self._stats()
        tiers = {"dram": s.dram, "ssd": s.ssd}
        blocks = GaugeMetricFamily(
            "halfmoon:kv_store_blocks", "Blocks the block store holds, per tier.", labels=["tier"]
        )
        capacity = GaugeMetricFamily(
            "halfmoon:kv_store_capacity_blocks", "Blocks each tier can hold.", labels=["tier"]
        )
        size = GaugeMetricFamily(
            "halfmoon:kv_store_bytes", "Bytes of KV the block store holds, per tier.",
            labels=["tier"],
        )  # fmt: skip
        hits = CounterMetricFamily(
            "halfmoon:kv_store_hits", "Block-store reads served, per tier.", labels=["tier"]
        )
        evictions = CounterMetricFamily(
            "halfmoon:kv_store_evictions",
            "Blocks evicted from each tier (DRAM evictions may demote to SSD).", labels=["tier"],
        )  # fmt: skip
        for tier, t in tiers.items():
            blocks.add_metric([tier], t.num_blocks)
            capacity.add_metric([tier], t.capacity_blocks)
            size.add_metric([tier], t.num_blocks * self._block_bytes)
            hits.add_metric([tier], t.num_hits)
            evictions.add_metric([tier], t.num_evictions)
        misses = CounterMetricFamily(
            "halfmoon:kv_store_misses", "Block-store reads that found no intact block."
        )
        misses.add_metric([], s.num_misses)
        corrupt = CounterMetricFamily(
            "halfmoon:kv_store_corrupt_blocks",
            "SSD blocks that failed their checksum: dropped, their tokens recomputed.",
        )
        corrupt.add_metric([], s.num_corrupt)
        yield from (blocks, capacity, size, hits, evictions, misses, corrupt)


class GuardCollector:
    """The decode TBT guard's counters (``--decode-guard``), read at collection."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        """Refused, waited and expired hand-offs (counters); hand-offs waiting (gauge)."""
        s = self._stats()
        for key, what in (("refused", "refused at hand-off: the batch would break the TBT SLO"),
                          ("waited", "held at hand-off until the batch had room"),
                          ("wait_expired", "held past their deadline, then failed")):  # fmt: skip
            family = CounterMetricFamily(f"halfmoon:decode_guard_{key}", f"Requests {what}.")
            family.add_metric([], s.get(f"guard_{key}", 0))
            yield family
        waiting = GaugeMetricFamily(
            "halfmoon:decode_guard_waiting", "Hand-offs the decode guard holds now."
        )
        waiting.add_metric([], s.get("guard_waiting", 0))
        yield waiting


@dataclass
class _Timing:
    """What the worker saw of one request (monotonic seconds)."""

    arrived_s: float
    num_prompt_tokens: int
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None


class WorkerMetrics:
    """The worker's registry and the request clocks that feed it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        self._timings: dict[str, _Timing] = {}
        #: Requests queued in the engine and not yet scheduled, in arrival order (FCFS).
        self._pending: deque[str] = deque()
        #: Requests scheduled whose first token is not out yet (their prompt is computing):
        #: kept as a set, so a step does not walk every tracked request.
        self._prefilling: set[str] = set()
        self._num_preemptions = 0
        self._spec_seen = (0, 0, 0)
        self._spec_per_position: list[int] = []
        self._define_gauges()
        self._define_requests()
        self._define_kv()

    def _define_gauges(self) -> None:
        r = self.registry
        self.running = Gauge("halfmoon:num_requests_running", "Requests in the engine's batch.",
                             registry=r)  # fmt: skip
        self.waiting = Gauge(
            "halfmoon:num_requests_waiting", "Requests queued in the engine, not yet running.",
            registry=r,
        )  # fmt: skip
        self.kv_usage = Gauge(
            "halfmoon:kv_cache_usage_perc",
            "Fraction of the KV pool's blocks in use (0..1; 1 = full), as vLLM's.", registry=r,
        )  # fmt: skip
        self.kv_used_blocks = Gauge("halfmoon:kv_cache_used_blocks", "KV pool blocks in use.",
                                    registry=r)  # fmt: skip
        self.kv_capacity_blocks = Gauge(
            "halfmoon:kv_cache_capacity_blocks", "KV pool blocks in all.", registry=r
        )
        self.sleep_state = Gauge(
            "halfmoon:engine_sleep_state",
            "The engine's sleep state, as vLLM's: awake = 1 while awake; weights_offloaded = 1 "
            "at sleep level 1 (here the KV pool released, the weights in place); discard_all "
            "= 1 at level 2 (not served).", ["sleep_state"], registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "halfmoon:num_preemptions",
            "Requests the engine preempted (blocks freed, recomputed later). Stays 0 for an "
            "engine that never preempts or does not say (a vLLM server's).", registry=r,
        )  # fmt: skip
        self.spec_drafts = Counter(
            "halfmoon:spec_decode_num_drafts",
            "Decode steps of a request that checked draft tokens (--speculative-config; "
            "as vLLM's).", registry=r,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "halfmoon:spec_decode_num_draft_tokens", "Draft tokens checked.", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "halfmoon:spec_decode_num_accepted_tokens",
            "Draft tokens accepted (each one a decode step saved).", registry=r,
        )  # fmt: skip
        self.spec_accepted_per_position = Counter(
            "halfmoon:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0 first).",
            ["position"], registry=r,
        )  # fmt: skip
        self.request_failures = Counter(
            "halfmoon:engine_request_failures",
            "Requests the engine dropped: its step failed with them (computed alone, they "
            "failed again), a vLLM server lost or refused them; retryable: whether the "
            "gateway may place them again.", ["retryable"], registry=r,
        )  # fmt: skip

    def _define_requests(self) -> None:
        r = self.registry

        def histogram(name: str, doc: str, buckets: Sequence[float], labels=()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        b = REQUEST_TIME_BUCKETS_S
        self.queue_time = histogram("halfmoon:request_queue_time_seconds",
                                    "Queued in the engine until scheduled.", b)  # fmt: skip
        self.prefill_time = histogram("halfmoon:request_prefill_time_seconds",
                                      "Scheduled until the first token.", b)  # fmt: skip
        self.decode_time = histogram(
            "halfmoon:request_decode_time_seconds",
            "First token (joining the batch, on a decode worker) until the last.", b,
        )  # fmt: skip
        self.prompt_tokens = histogram("halfmoon:request_prompt_tokens",
                                       "Prompt tokens per prefilled request.",
                                       TOKEN_BUCKETS)  # fmt: skip
        self.generation_tokens = histogram("halfmoon:request_generation_tokens",
                                           "Generated tokens per finished request.",
                                           TOKEN_BUCKETS)  # fmt: skip
        self.tpot = histogram("halfmoon:time_per_output_token_seconds",
                              "Gap before each output token after the first.",
                              STEP_BUCKETS_S)  # fmt: skip
        self.step_time = histogram(
            "halfmoon:engine_step_seconds",
            "One engine step, by phase: prefill when any request in it computed prompt "
            "tokens, else decode.", STEP_BUCKETS_S, ["phase"],
        )  # fmt: skip
        self.batch_size = histogram("halfmoon:engine_batch_size", "Requests per engine step.",
                                    BATCH_BUCKETS)  # fmt: skip

    def _define_kv(self) -> None:
        r = self.registry
        self.kv_sent = Counter("halfmoon:kv_transfer_sent_bytes",
                               "KV bytes this worker streamed to other workers.",
                               registry=r)  # fmt: skip
        self.kv_received = Counter("halfmoon:kv_transfer_received_bytes",
                                   "KV bytes this worker received from other workers.",
                                   registry=r)  # fmt: skip
        self.kv_transfer_time = Histogram(
            "halfmoon:kv_transfer_seconds",
            "Seconds spent on the wire moving one request's KV (sender side).",
            buckets=STEP_BUCKETS_S, registry=r,
        )  # fmt: skip

    def add_store(self, stats: Callable[[], StoreStats], block_bytes: int) -> None:
        """Export a block store's figures (a prefill worker's)."""
        self.registry.register(StoreCollector(stats, block_bytes))

    def add_guard(self, stats: Callable[[], dict[str, int]]) -> None:
        """Export the decode TBT guard's counters (a decode worker's)."""
        self.registry.register(GuardCollector(stats))

    # -- requests -------------------------------------------------------------------------------
    def request_queued(self, rid: str, num_prompt_tokens: int) -> None:
        """``rid`` was added to the engine's waiting queue (prefill, coupled)."""
        self._timings[rid] = _Timing(self._clock(), num_prompt_tokens)
        self._pending.append(rid)

    def request_joined(self, rid: str) -> None:
        """``rid`` joined the running batch with its first token already out (a decode
        worker's KV import): its decode time starts now."""
        now = self._clock()
        self._timings[rid] = _Timing(now, 0, now, now, now)

    def request_finished(self, rid: str, num_generated_tokens: int) -> None:
        """``rid`` ended on this worker after ``num_generated_tokens`` in all."""
        t = self._timings.pop(rid, None)
        self._prefilling.discard(rid)
        if t is None:
            return
        if t.first_token_s is not None and t.last_token_s is not None:
            self.decode_time.observe(t.last_token_s - t.first_token_s)
        self.generation_tokens.observe(num_generated_tokens)

    def request_failed(self, retryable: bool) -> None:
        """The engine dropped a request (see ``halfmoon:engine_request_failures``)."""
        self.request_failures.labels(retryable=str(retryable).lower()).inc()

    def request_dropped(self, rid: str) -> None:
        """Forget ``rid`` (aborted, failed, or handed over to a decode worker)."""
        self._timings.pop(rid, None)
        self._prefilling.discard(rid)

    # -- steps ----------------------------------------------------------------------------------
    def observe_step(
        self, started_s: float, step_s: float, outputs: Sequence[Any], num_waiting: int
    ) -> None:
        """One engine step that started at ``started_s`` and took ``step_s``, its outputs
        (``request_id``, ``new_token_ids``) and the requests still waiting after it."""
        self._mark_scheduled(started_s, num_waiting)
        prefilling = bool(self._prefilling)  # a prompt was in this step (before outputs)
        in_batch = set(self._prefilling)
        now = started_s + step_s
        for out in outputs:
            in_batch.add(out.request_id)
            t = self._timings.get(out.request_id)
            if t is None or not out.new_token_ids:
                continue
            if t.first_token_s is None:
                self._prefilling.discard(out.request_id)
                self._first_token(t, now)
            else:
                self.tpot.observe((now - (t.last_token_s or now)) / len(out.new_token_ids))
            t.last_token_s = now
        self.step_time.labels("prefill" if prefilling else "decode").observe(step_s)
        self.batch_size.observe(max(1, len(in_batch)))

    def _mark_scheduled(self, started_s: float, num_waiting: int) -> None:
        while self._pending and self._pending[0] not in self._timings:
            self._pending.popleft()  # dropped meanwhile
        for _ in range(max(0, len(self._pending) - num_waiting)):
            rid = self._pending.popleft()
            t = self._timings.get(rid)
            if t is not None:
                t.scheduled_s = started_s
                self._prefilling.add(rid)

    def _first_token(self, t: _Timing, now_s: float) -> None:
        scheduled_s = t.arrived_s if t.scheduled_s is None else t.scheduled_s
        t.scheduled_s = scheduled_s
        t.first_token_s = now_s
        self.queue_time.observe(scheduled_s - t.arrived_s)
        self.prefill_time.observe(now_s - scheduled_s)
        self.prompt_tokens.observe(t.num_prompt_tokens)

    def observe_kv_sent(self, num_bytes: int, transfer_s: float) -> None:
        """A request's KV went out: ``num_bytes`` on the wire in ``transfer_s``."""
        self.kv_sent.inc(num_bytes)
        self.kv_transfer_time.observe(transfer_s)

    def observe_kv_received(self, num_bytes: int) -> None:
        """A request's KV arrived (``num_bytes`` on the wire)."""
        self.kv_received.inc(num_bytes)

    # -- rendering ------------------------------------------------------------------------------
    def refresh(self, stats: Any) -> None:
        """Set the load gauges from the engine's ``EngineStats``."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        used = stats.num_blocks - stats.num_free_blocks
        self.kv_used_blocks.set(used)
        self.kv_capacity_blocks.set(stats.num_blocks)
        self.kv_usage.set(used / stats.num_blocks if stats.num_blocks else 0.0)
        asleep = bool(getattr(stats, "sleeping", False))
        for state, value in (("awake", not asleep), ("weights_offloaded", asleep),
                             ("discard_all", False)):  # fmt: skip
            self.sleep_state.labels(state).set(float(value))
        if stats.num_preemptions > self._num_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._num_preemptions)
            self._num_preemptions = stats.num_preemptions
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            self._refresh_spec(spec)

    def _refresh_spec(self, spec: Any) -> None:
        """Advance the speculative-decoding counters to the engine's totals."""
        totals = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
        for counter, new, old in zip(
            (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens),
            totals, self._spec_seen, strict=True,
        ):  # fmt: skip
            if new > old:
                counter.inc(new - old)
        self._spec_seen = totals
        seen = self._spec_per_position
        seen += [0] * (len(spec.accepted_per_position) - len(seen))
        for position, total in enumerate(spec.accepted_per_position):
            if total > seen[position]:
                self.spec_accepted_per_position.labels(str(position)).inc(total - seen[position])
                seen[position] = total

    def render(self, stats: Any) -> str:
        """The text exposition format, the gauges refreshed from ``stats`` first."""
        self.refresh(stats)
        return generate_latest(self.registry).decode()

    @property
    def num_tracked(self) -> int:
        """Requests the clocks follow (tests check nothing leaks)."""
        return len(self._timings)

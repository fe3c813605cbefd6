"""The Conductor's books: which instances there are, what is placed where, and the
events that move requests along (:class:`Cluster`, the base of
:class:`~halfmoon.conductor.conductor.Conductor`).

Nothing here decides a placement: it keeps the prefix index, each instance's prefill
queue and decode batch (:mod:`halfmoon.conductor.state`), the placements and their CPP
groups and prefix sources, and applies the events an instance sends. The Conductor
hooks into the lifecycle (:meth:`Cluster._instances_changed`, ``_prefill_finished``,
``_decode_started``, ``_finished``, ``_touched``) to keep its own summaries and
learners in step.
"""

from __future__ import annotations

from halfmoon.conductor.calibration import PrefillCalibration
from halfmoon.conductor.index import PrefixIndex
from halfmoon.conductor.messages import (
    BlockEvicted,
    BlockStored,
    DecodeStarted,
    FirstToken,
    LoadReport,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.conductor.state import DecodeState, PrefillState, check_bookings
from halfmoon.core.clock import Clock
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates

Event = (
    BlockStored
    | BlockEvicted
    | PrefillStarted
    | PrefillFinished
    | DecodeStarted
    | FirstToken
    | RequestFinished
    | LoadReport
)


class Cluster:
    """Membership, bookings and events of the instances a Conductor places on."""

    def __init__(self, cost_model: CostModel, clock: Clock) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.index = PrefixIndex()
        self._prefill: dict[str, PrefillState] = {}
        self._decode: dict[str, DecodeState] = {}
        self._coupled: set[str] = set()
        self._draining: set[str] = set()
        self._sources: dict[str, str] = {}  # request -> instance it fetches a prefix from
        self._placements: dict[str, tuple[str, str]] = {}
        self._group_of: dict[str, tuple[str, ...]] = {}
        self._ids: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # prefill, decode
        #: Prefill instances registered from now on learn their prefill scale
        #: (:mod:`halfmoon.conductor.calibration`; ``ConductorConfig.prefill_calibration``).
        self.calibrate_prefill = False

    # -- hooks (the Conductor's) -----------------------------------------------------------
    def _instances_changed(self) -> None:
        """An instance joined, left or is draining."""
        self._ids = None

    def _prefill_finished(self, request_id: str, now_s: float) -> None:
        """A request's prefill ended."""

    def _decode_started(self, request_id: str, now_s: float) -> None:
        """A request joined a decode batch."""

    def _first_token(self, request_id: str, now_s: float) -> None:
        """A request's first token reached its client."""

    def _finished(self, request_id: str, decode_s: float | None) -> None:
        """A request left; ``decode_s``: how long it decoded, when that is a sample."""

    def _touched(self, instance_id: str) -> None:
        """An event or a booking concerned ``instance_id``."""

    # -- membership ----------------------------------------------------------------------
    def add_prefill_instance(self, instance_id: str, cost_model: CostModel | None = None) -> None:
        """Register a prefill instance (its own cost model, or the Conductor's)."""
        calibration = PrefillCalibration() if self.calibrate_prefill else None
        self._prefill[instance_id] = PrefillState(
            instance_id, cost_model or self.cost_model, calibration=calibration
        )
        self.index.add_instance(instance_id)
        self._instances_changed()

    def add_decode_instance(
        self,
        instance_id: str,
        cost_model: CostModel | None = None,
        kv_capacity_tokens: int | None = None,
        speculation: SpeculationRates = NO_SPECULATION,
    ) -> None:
        """Register a decode instance and its KV capacity in tokens (``speculation``: its
        speculative decoding until a load report says otherwise)."""
        cm = cost_model or self.cost_model
        capacity = cm.kv_capacity_tokens() if kv_capacity_tokens is None else kv_capacity_tokens
        self._decode[instance_id] = DecodeState(instance_id, cm, capacity, speculation=speculation)
        self._instances_changed()

    def add_coupled_instance(
        self,
        instance_id: str,
        cost_model: CostModel | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        """Register an instance that does both prefill and decode (vLLM-like)."""
        self.add_prefill_instance(instance_id, cost_model)
        self.add_decode_instance(instance_id, cost_model, kv_capacity_tokens)
        self._coupled.add(instance_id)
        self._instances_changed()

    def remove_instance(self, instance_id: str) -> None:
        """Stop placing on ``instance_id``, forget its blocks, and drop what its requests
        had booked on other instances (they will be placed again, or fail)."""
        for rid, (prefill_id, decode_id) in list(self._placements.items()):
            members = self._group_of.get(rid, (prefill_id,))  # a CPP group: every stage
            if instance_id in (*members, decode_id):
                del self._placements[rid]
                self._group_of.pop(rid, None)
                self._sources.pop(rid, None)
                for member in members:
                    if (state := self._prefill.get(member)) is not None:
                        state.finish(rid)
                if (dstate := self._decode.get(decode_id)) is not None:
                    dstate.finish(rid)  # no decode-time sample: it did not finish
        self._prefill.pop(instance_id, None)
        self._decode.pop(instance_id, None)
        self._coupled.discard(instance_id)
        self._draining.discard(instance_id)
        self.index.remove_instance(instance_id)
        self._instances_changed()

    def drain(self, instance_id: str) -> None:
        """Place nothing more on ``instance_id`` (nor fetch prefixes from it); what is
        booked there runs to its end. :meth:`busy` says when it has; then
        :meth:`remove_instance` (a role change adds it again in its new role)."""
        if instance_id not in self._prefill and instance_id not in self._decode:
            raise KeyError(f"unknown instance {instance_id!r}")
        self._draining.add(instance_id)
        self._instances_changed()

    @property
    def draining(self) -> frozenset[str]:
        """Instances drained and not yet removed."""
        return frozenset(self._draining)

    def busy(self, instance_id: str) -> bool:
        """Whether a placed request still uses ``instance_id`` (prefill, CPP stage,
        decode, or the source of a prefix it fetches)."""
        if instance_id in self._sources.values():
            return True
        return any(
            instance_id == decode_id or instance_id in self._group_of.get(rid, (prefill_id,))
            for rid, (prefill_id, decode_id) in self._placements.items()
        )

    @property
    def num_placements(self) -> int:
        """Requests placed and not yet finished or released."""
        return len(self._placements)

    @property
    def prefill_instances(self) -> tuple[str, ...]:
        """Instances that accept prefill work (disaggregated, not draining)."""
        return self._disaggregated()[0]

    @property
    def decode_instances(self) -> tuple[str, ...]:
        """Disaggregated decode instances (not draining)."""
        return self._disaggregated()[1]

    def _disaggregated(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if self._ids is None:
            out = self._coupled | self._draining
            self._ids = (
                tuple(i for i in self._prefill if i not in out),
                tuple(i for i in self._decode if i not in out),
            )
        return self._ids

    @property
    def coupled_instances(self) -> tuple[str, ...]:
        """Coupled instances."""
        return tuple(i for i in self._prefill if i in self._coupled)

    def queue_s(self, instance_id: str) -> float:
        """Estimated prefill queue time on an instance now."""
        return self._prefill[instance_id].queue_s(self.clock.now())

    # -- events ----------------------------------------------------------------------------
    def handle(self, event: Event) -> None:
        """Apply one event from an instance."""
        now = self.clock.now()
        if isinstance(event, BlockStored):
            if event.instance_id in self._prefill:
                self.index.stored(event.instance_id, event.block_hash, event.tier)
        elif isinstance(event, BlockEvicted):
            self.index.evicted(event.instance_id, event.block_hash, event.tier)
        elif isinstance(event, PrefillStarted):
            if (state := self._prefill.get(event.instance_id)) is not None:
                state.start(event.request_id, now)
        elif isinstance(event, PrefillFinished):
            if (state := self._prefill.get(event.instance_id)) is not None:
                state.finish(event.request_id, now, cached_tokens=event.cached_tokens)
            self._prefill_finished(event.request_id, now)
        elif isinstance(event, DecodeStarted):
            if (dstate := self._decode.get(event.instance_id)) is not None:
                dstate.start(event.request_id, now)
            self._decode_started(event.request_id, now)
        elif isinstance(event, RequestFinished):
            self._finish(event.request_id, now)
        elif isinstance(event, FirstToken):
            self._first_token(event.request_id, now)
            return  # books nothing on an instance
        elif isinstance(event, LoadReport):
            self._apply_report(event)
        else:
            raise TypeError(f"unknown event {event!r}")
        self._touched(event.instance_id)

    def release(self, request_id: str) -> bool:
        """Drop whatever ``request_id`` still has booked (its gateway saw it end without a
        worker's RequestFinished: a failure before dispatch, a refusal, a hang-up).
        Idempotent; True when something was booked. No decode-time sample is taken."""
        booked = request_id in self._placements
        self._finish(request_id, self.clock.now(), sample=False)
        return booked

    def check_integrity(self) -> None:
        """Assert that placements and per-instance bookings agree both ways, and that each
        instance's totals equal the sum of its parts (tests and the service's ping)."""
        check_bookings(self._placements, self._group_of, self._prefill, self._decode)
        assert self._sources.keys() <= self._placements.keys(), "fetch source of no placement"

    def _finish(self, request_id: str, now_s: float, sample: bool = True) -> None:
        prefill_id, decode_id = self._placements.pop(request_id, ("", ""))
        self._sources.pop(request_id, None)
        for member in self._group_of.pop(request_id, (prefill_id,)):
            if (state := self._prefill.get(member)) is not None:
                state.finish(request_id, now_s, sample=False)
        decode_s = None
        if (dstate := self._decode.get(decode_id)) is not None:
            self._touched(decode_id)
            started = dstate.finish(request_id)
            if sample and started is not None:
                decode_s = now_s - started
        self._finished(request_id, decode_s)

    def _apply_report(self, report: LoadReport) -> None:
        if (state := self._prefill.get(report.instance_id)) is not None:
            state.report(report.queued_prefill_tokens, self.clock.now())
        dstate = self._decode.get(report.instance_id)
        if dstate is None:
            return
        dstate.reported_running = report.num_running
        dstate.reported_context_tokens = report.context_tokens
        try:  # (the event's instance is marked touched after this)
            dstate.speculation = SpeculationRates(
                report.spec_rows_per_seq, report.spec_tokens_per_step
            )
        except ValueError:  # a report that cannot be rates: decoding without speculation
            dstate.speculation = NO_SPECULATION
        if report.kv_capacity_tokens:
            dstate.kv_capacity_tokens = report.kv_capacity_tokens

"""The Conductor's per-instance bookkeeping, kept from its own placements and events.

Nothing here talks to an instance: the Conductor records what it placed, and the
lifecycle events (PrefillStarted/Finished, DecodeStarted, RequestFinished) and load
reports move requests along or correct the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from halfmoon.conductor.calibration import PrefillCalibration
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates


@dataclass
class PrefillState:
    """Prefill work placed on one instance and not yet finished (FIFO).

    ``queue_s(now)`` is the paper's T_queue: the estimated prefill time of everything
    ahead of a new request, less what the started ones have already done. An instance
    works through its started prefills at one second of (estimated) work per second of
    busy time, however many it runs side by side and whenever it announced them (a
    live worker does on arrival in its engine's queue, so several are "started" at
    once): what they have done is the busy time since the last prefill ended (or the busy
    spell began), up to their estimates.
    ``on_change`` (if set) is called after every change of the bookings; the Conductor's
    :class:`~halfmoon.conductor.loads.PrefillLoads` keeps its queue arrays current with it.
    With a ``calibration`` (:mod:`halfmoon.conductor.calibration`) the instance's finished
    prefills teach it how far off the cost model is: :attr:`prefill_scale` multiplies the
    estimates made for it.

    Under vLLM's ``priority`` scheduling policy an engine serves its queue by the
    requests' ``priority`` (lower first, arrival among equals), so a request of priority
    ``p`` waits only for the bookings of a value up to ``p`` and for the one in service
    (the earliest started: engines step their running prefills oldest first and never
    preempt one for another's compute). ``queue_s(now, p)`` leaves the others out::

        booked (started first)   B(p 0, in service)  C(p 5)  D(p 0)  E(p -1)
        a request of priority 0  waits for B, D, E   (C comes after it)
        a request of priority -1 waits for B, E
    """

    instance_id: str
    cost_model: CostModel
    pending_s: dict[str, float] = field(default_factory=dict)
    pending_tokens: dict[str, int] = field(default_factory=dict)
    started_at_s: dict[str, float] = field(default_factory=dict)
    total_pending_s: float = 0.0
    reported_queue_s: float = 0.0
    reported_at_s: float = 0.0
    on_change: Callable[[PrefillState], None] | None = field(
        default=None, repr=False, compare=False
    )
    calibration: PrefillCalibration | None = None
    #: (unscaled cost-model estimate, prompt tokens) of the placements that are
    #: calibration samples.
    estimated_s: dict[str, tuple[float, int]] = field(default_factory=dict)
    #: Start of the busy time no finished prefill has yet accounted for (None: idle).
    busy_mark_s: float | None = None
    #: Booked seconds of the started prefills.
    started_pending_s: float = 0.0
    #: The priorities of the bookings whose priority is not 0 (none under ``fcfs``).
    priority_of: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_scale(self) -> float:
        """What this instance's prefill estimates are multiplied by (1 uncalibrated)."""
        return 1.0 if self.calibration is None else self.calibration.scale

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def add(
        self,
        request_id: str,
        prefill_s: float,
        new_tokens: int,
        estimated_s: float | None = None,
        prompt_tokens: int = 0,
        priority: int = 0,
    ) -> None:
        """Queue a placed request booked for ``prefill_s`` seconds; ``estimated_s``: the
        cost model's unscaled estimate, when the booking is a plain prefill whose busy
        time can calibrate the instance (of a ``prompt_tokens`` prompt: the estimate is
        made again if the instance reports another cached prefix); ``priority``: the
        request's (see the class docstring)."""
        self.pending_s[request_id] = prefill_s
        self.pending_tokens[request_id] = new_tokens
        self.total_pending_s += prefill_s
        if priority:
            self.priority_of[request_id] = priority
        if estimated_s is not None:
            self.estimated_s[request_id] = (estimated_s, prompt_tokens)
        self._changed()

    def start(self, request_id: str, now_s: float) -> None:
        """The instance began this request's prefill."""
        if request_id in self.pending_s:
            if request_id not in self.started_at_s:
                self.started_pending_s += self.pending_s[request_id]
            self.started_at_s[request_id] = now_s
            if self.busy_mark_s is None:
                self.busy_mark_s = now_s
            self._changed()

    def finish(
        self,
        request_id: str,
        now_s: float | None = None,
        sample: bool = True,
        cached_tokens: int | None = None,
    ) -> None:
        """The prefill is over (done, failed or aborted). With ``now_s``, the busy time
        since the last finish ends here; with ``sample`` too, it is the request's and
        calibrates the instance (a prefill that finished, not one that was dropped),
        against the estimate for the ``cached_tokens`` the instance found when it says
        (a prefix cached after the decision makes the prefill shorter, not the instance
        faster)."""
        est = self.pending_s.pop(request_id, None)
        if est is not None:
            self.total_pending_s -= est
        self.pending_tokens.pop(request_id, None)
        self.priority_of.pop(request_id, None)
        started = self.started_at_s.pop(request_id, None) is not None
        if started and est is not None:
            self.started_pending_s -= est
        estimated = self.estimated_s.pop(request_id, None)
        if started and now_s is not None and self.busy_mark_s is not None:
            if sample and estimated is not None and self.calibration is not None:
                estimate_s, prompt = estimated
                if cached_tokens is not None and 0 <= cached_tokens < prompt:
                    estimate_s = self.cost_model.prefill_time_s(
                        prompt - cached_tokens, cached_tokens
                    )
                self.calibration.observe(now_s - self.busy_mark_s, estimate_s, now_s)
            self.busy_mark_s = now_s
        if not self.started_at_s:
            self.busy_mark_s = None
            self.started_pending_s = 0.0  # no float drift once idle
        if not self.pending_s:
            self.total_pending_s = 0.0  # no float drift once empty
        self._changed()

    def relax(self, now_s: float) -> None:
        """Let the learned scale drift back toward 1 for the time without samples
        (:meth:`PrefillCalibration.relax`)."""
        if self.calibration is not None:
            before = self.calibration.scale
            if self.calibration.relax(now_s) != before:
                self._changed()

    def report(self, queued_prefill_tokens: int, now_s: float) -> None:
        """The instance says how many uncached tokens it has queued (work the Conductor
        may not know of, e.g. after a restart)."""
        raw_s = self.cost_model.prefill_time_s(queued_prefill_tokens, 0)
        self.reported_queue_s = raw_s * self.prefill_scale
        self.reported_at_s = now_s
        self._changed()

    @property
    def max_priority(self) -> float:
        """The highest priority value booked here (-inf with nothing booked)."""
        if not self.pending_s:
            return -math.inf
        top = max(self.priority_of.values(), default=0)
        return top if len(self.priority_of) == len(self.pending_s) else max(top, 0)

    def in_service(self) -> str | None:
        """The booking taken to be in service: the earliest started (None: none is)."""
        return min(self.started_at_s, key=self.started_at_s.__getitem__, default=None)

    def queue_s(self, now_s: float, priority: int | None = None) -> float:
        """Estimated seconds until a newly queued request could start.

        The larger of the Conductor's own bookkeeping and the instance's last report
        (drained at one second of work per second since it was made). With ``priority``
        (the request's, under the ``priority`` policy), bookings of a higher value that
        are not in service are left out of both (see the class docstring); the work done
        since the busy mark counts against the started bookings that remain.
        """
        done = 0.0
        if self.busy_mark_s is not None:
            done = min(self.started_pending_s, max(0.0, now_s - self.busy_mark_s))
        reported = self.reported_queue_s - (now_s - self.reported_at_s)
        behind_s = behind_started_s = 0.0
        if priority is not None and self.max_priority > priority:
            head = self.in_service()
            for rid, booked_s in self.pending_s.items():
                if rid != head and self.priority_of.get(rid, 0) > priority:
                    behind_s += booked_s
                    if rid in self.started_at_s:
                        behind_started_s += booked_s
        if not behind_s:
            return max(0.0, self.total_pending_s - done, reported)
        ahead_started_s = max(0.0, self.started_pending_s - behind_started_s)
        booked = (self.total_pending_s - behind_s) - min(done, ahead_started_s)
        return max(0.0, booked, reported - behind_s)

    @property
    def queued_tokens(self) -> int:
        """Uncached prompt tokens still to prefill."""
        return sum(self.pending_tokens.values())


@dataclass
class DecodeState:
    """Requests decoding on, or heading to, one decode instance.

    ``incoming`` maps a request to (expected prefill-done time, context tokens);
    ``running`` to (decode start time, context tokens); ``predicted_s`` those of either
    with a predicted decode duration (:mod:`halfmoon.conductor.lengths`) to it.
    ``speculation``: the instance's speculative decoding, from its load reports: a step
    costs the rows it checks and gives each sequence ``tokens_per_step`` tokens.
    """

    instance_id: str
    cost_model: CostModel
    kv_capacity_tokens: int
    running: dict[str, tuple[float, int]] = field(default_factory=dict)
    incoming: dict[str, tuple[float, int]] = field(default_factory=dict)
    predicted_s: dict[str, float] = field(default_factory=dict)
    reported_running: int | None = None
    reported_context_tokens: int | None = None
    speculation: SpeculationRates = NO_SPECULATION

    @property
    def num_running(self) -> int:
        """Requests in the decode batch (a load report wins over bookkeeping)."""
        return len(self.running) if self.reported_running is None else self.reported_running

    @property
    def context_tokens(self) -> int:
        """KV tokens the batch reads per step."""
        if self.reported_context_tokens is not None:
            return self.reported_context_tokens
        return sum(ctx for _, ctx in self.running.values())

    @property
    def committed_tokens(self) -> int:
        """KV tokens of running plus incoming requests."""
        return self.context_tokens + sum(ctx for _, ctx in self.incoming.values())

    def context_tokens_at(self, now_s: float) -> int:
        """``context_tokens`` with the tokens the running requests have generated since
        they joined (``speculation.tokens_per_step`` per step, at the batch's estimated
        step): the bookings hold prompts only, and a long decode adds thousands. A load
        report already counts them."""
        if self.reported_context_tokens is not None or not self.running:
            return self.context_tokens
        ctx = self.context_tokens
        token_s = self.token_time_s(len(self.running), ctx)
        age_s = sum(now_s - start for start, _ in self.running.values())
        return ctx + round(max(0.0, age_s) / token_s)

    def step_time_s(self, num_running: int, context_tokens: int) -> float:
        """Estimated decode step for a batch of that shape (its drafts' rows too)."""
        return self.speculation.step_s(
            self.cost_model.decode_step_time_s, max(1, num_running), context_tokens
        )

    def token_time_s(self, num_running: int, context_tokens: int) -> float:
        """Estimated seconds per generated token of each sequence in such a batch (the
        step, over the tokens a step gives a sequence)."""
        return self.speculation.per_token_s(self.step_time_s(num_running, context_tokens))

    def start(self, request_id: str, now_s: float) -> None:
        """The request joined the batch (ignored unless it was booked here: a request
        placed by an earlier Conductor, or by the gateway while this one was away, would
        otherwise be an orphan booking that nothing ever removes)."""
        if request_id not in self.incoming:
            return
        _, ctx = self.incoming.pop(request_id)
        self.running[request_id] = (now_s, ctx)
        self.reported_running = self.reported_context_tokens = None

    def finish(self, request_id: str) -> float | None:
        """The request left; returns its decode duration start->now if it was running."""
        self.incoming.pop(request_id, None)
        self.predicted_s.pop(request_id, None)
        entry = self.running.pop(request_id, None)
        self.reported_running = self.reported_context_tokens = None
        return None if entry is None else entry[0]


def check_bookings(
    placements: Mapping[str, tuple[str, str]],
    group_of: Mapping[str, tuple[str, ...]],
    prefill: Mapping[str, PrefillState],
    decode: Mapping[str, DecodeState],
) -> None:
    """Assert that every placement (request -> (prefill, decode) instance; a CPP group's
    members in ``group_of``) is booked where it says and that every booking belongs to a
    placement on that instance; each prefill state's total equals the sum of its parts."""
    for rid, (prefill_id, decode_id) in placements.items():
        assert prefill_id in prefill, f"{rid}: placed on unknown prefill {prefill_id}"
        if not decode_id:  # prefill only (an embedding): no decode instance booked
            continue
        dstate = decode.get(decode_id)
        assert dstate is not None, f"{rid}: placed on unknown decode {decode_id}"
        assert (rid in dstate.incoming) != (rid in dstate.running), (
            f"{rid}: neither (or both) incoming and running on {decode_id}"
        )
    for iid, state in prefill.items():
        assert state.pending_s.keys() == state.pending_tokens.keys(), iid
        assert state.started_at_s.keys() <= state.pending_s.keys(), iid
        assert state.estimated_s.keys() <= state.pending_s.keys(), iid
        assert state.priority_of.keys() <= state.pending_s.keys(), iid
        assert all(state.priority_of.values()), f"{iid}: a priority 0 kept as one"
        assert (state.busy_mark_s is None) == (not state.started_at_s), iid
        started = sum(state.pending_s[rid] for rid in state.started_at_s)
        assert abs(state.started_pending_s - started) <= 1e-6 * max(1.0, started), iid
        total = sum(state.pending_s.values())
        assert abs(state.total_pending_s - total) <= 1e-6 * max(1.0, total), (
            f"{iid}: booked {state.total_pending_s} s, parts sum to {total} s"
        )
        for rid in state.pending_s:
            members = group_of.get(rid, (placements.get(rid, ("",))[0],))
            assert rid in placements and iid in members, f"{rid}: orphan on {iid}"
    for iid, dstate in decode.items():
        for rid in (*dstate.incoming, *dstate.running):
            assert placements.get(rid, ("", ""))[1] == iid, f"{rid}: orphan on {iid}"
        assert dstate.predicted_s.keys() <= dstate.incoming.keys() | dstate.running.keys(), iid
    assert group_of.keys() <= placements.keys(), "group of an unplaced request"

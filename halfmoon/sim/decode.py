"""A simulated decode instance: continuous batching under a KV capacity limit.

A request reaches it when its KV has arrived from the prefill instance. Then:

- it is refused when it can never fit (prompt + output above the KV capacity), or, with
  the ``reject`` guard, when joining the batch (running plus already waiting requests)
  would make the estimated step exceed the TBT SLO (the paper's "decoding instance
  rejects"; its prefill is wasted). With the ``wait`` guard it instead waits until
  joining keeps the step within the SLO (or the batch is empty);
- otherwise it waits FCFS until its KV reservation (prompt + all output tokens) fits,
  and joins the batch at a step boundary. Joining emits its first token (the one the
  prefill computed) and sends ``DecodeStarted``;
- every step takes ``decode_step_time_s(batch, context)`` plus the serving path's
  ``decode_step_overhead_s + batch * decode_per_seq_overhead_s`` and, for the requests joining
  at that step, ``prompt tokens * kv_import_s_per_token`` (their KV is copied into the
  engine before the step runs), times a lognormal jitter factor (``step_jitter_sigma``,
  drawn from ``rng``; none when the sigma is 0), plus an exponential wait
  (``step_wait_mean_s``); it emits one token for each running
  request; a request with all its tokens leaves (``RequestFinished``).
- with ``speculation`` (:class:`~halfmoon.costmodel.speculation.SpeculationRates`), a
  step costs the rows its drafts add (the live guard's estimate) and emits, at its end,
  ``tokens_per_step`` tokens per request on average: each request carries the fraction
  over to its next step (``Job.spec_credit``), so 1.8 gives 1, 2, 2, 2, 2, 1, ... and no
  request gets more than its output.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from halfmoon.conductor.messages import DecodeStarted, FirstToken, RequestFinished
from halfmoon.core.clock import Clock
from halfmoon.costmodel.decode_guard import (
    ADMIT,
    REJECT,
    decode_guard_verdict,
    decode_step_estimate_s,
    guard_refusal,
)
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates
from halfmoon.sim.cache import Notify
from halfmoon.sim.config import InstanceSpec
from halfmoon.sim.events import NO_EVENTS, Event
from halfmoon.sim.host import Host, shared_step_s
from halfmoon.sim.job import Job
from halfmoon.sim.network import Nic


class DecodeInstance:
    """A decode-only instance of ``spec`` (its knobs: ``kv_capacity_tokens``,
    ``slo.tbt_s``, ``decode_tbt_guard`` = ``reject`` | ``wait`` | ``off``,
    ``max_batch_size``, ``serving``, ``first_token_at``); ``notify`` sends events to the
    Conductor; ``rng`` draws the step jitter (None: ``random.Random(0)``); ``host``: the
    CPUs it shares (None: its own hardware)."""

    def __init__(
        self,
        instance_id: str,
        spec: InstanceSpec,
        *,
        clock: Clock,
        notify: Notify,
        rng: random.Random | None = None,
        host: Host | None = None,
    ) -> None:
        config = spec.config
        self.instance_id = instance_id
        self.spec = spec
        self._first_token_on_arrival = config.first_token_at == "kv"
        self.cost_model = spec.cost_model
        self.kv_capacity_tokens = spec.kv_capacity_tokens
        self.clock = clock
        self.nic = Nic()
        self._notify = notify
        self._tbt_slo_s = config.slo.tbt_s
        self._guard = config.decode_tbt_guard
        self._max_batch_size = config.max_batch_size
        self._serving = config.serving
        self._speculation = config.speculation
        # what the guard estimates with (a speculation-blind scheduler: none)
        self._estimated = NO_SPECULATION if config.speculation_blind else config.speculation
        self._rng = rng or random.Random(0)
        self._host = host
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._context_tokens = 0
        self.kv_used_tokens = 0
        self._stepping = False
        self.num_refused = 0
        self.num_steps = 0
        self.max_batch_seen = 0

    @property
    def num_running(self) -> int:
        """Requests in the batch."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests whose KV arrived, waiting for KV space."""
        return len(self._waiting)

    def step_estimate_s(self, joining: Sequence[Job] = ()) -> float:
        """Estimated step time of the current batch with ``joining`` requests added."""
        num = len(self._running) + len(joining)
        ctx = self._context_tokens + sum(job.context_tokens + 1 for job in joining)
        return self._step_s(num, ctx, 0, self._estimated)

    def step_now_s(self) -> float:
        """The step the batch takes as it is now, speculating as the instance does (its
        guard's estimate, :meth:`step_estimate_s`, may be blind to that)."""
        return self._step_s(len(self._running), self._context_tokens, 0, self._speculation)

    def _step_s(
        self,
        batch_size: int,
        context_tokens: int,
        imported_tokens: int,
        speculation: SpeculationRates,
    ) -> float:
        """A step of the engine plus the serving path's per-step, per-sequence and import
        terms (the estimate the live decode worker's guard makes too), speculating at
        ``speculation`` (the instance's own, or what its guard assumes)."""
        return decode_step_estimate_s(
            self.cost_model.decode_step_time_s, self._serving, batch_size, context_tokens,
            imported_tokens, speculation,
        )  # fmt: skip

    def kv_arrived(self, job: Job) -> Sequence[Event]:
        """The request's KV is here: refuse it, or queue it for the batch."""
        reason = self._refusal(job)
        if reason:
            self._refuse(job, reason)
            return NO_EVENTS
        if self._first_token_on_arrival:  # sent by the prefill worker (SimConfig)
            job.record.token_times_s.append(self.clock.now())
            self._notify(FirstToken(self.instance_id, job.request_id))
        self._waiting.append(job)
        return NO_EVENTS if self._stepping else self._admit_and_step()

    def _refusal(self, job: Job) -> str:
        need = job.kv_reserved_tokens
        if need > self.kv_capacity_tokens:
            return (
                f"decode {self.instance_id} refused: needs {need} KV tokens, "
                f"capacity {self.kv_capacity_tokens}"
            )
        if self._guard == "reject" and (self._running or self._waiting):  # else: no estimate
            # the requests already waiting will join first, so they count
            step_s = self.step_estimate_s((*self._waiting, job))
            verdict = decode_guard_verdict("reject", busy=True, step_s=step_s,
                                           tbt_slo_s=self._tbt_slo_s)  # fmt: skip
            if verdict == REJECT:
                return guard_refusal(self.instance_id, step_s, self._tbt_slo_s)
        return ""

    def _refuse(self, job: Job, reason: str) -> None:
        job.record.rejected = True
        job.record.reject_reason = reason
        self.num_refused += 1
        self._notify(RequestFinished(self.instance_id, job.request_id))

    def _fits(self, job: Job) -> bool:
        if len(self._running) >= self._max_batch_size:
            return False
        if self.kv_used_tokens + job.kv_reserved_tokens > self.kv_capacity_tokens:
            return False
        if self._guard == "wait" and self._running:  # an idle batch admits anything
            step_s = self.step_estimate_s((job,))
            verdict = decode_guard_verdict("wait", busy=True, step_s=step_s,
                                           tbt_slo_s=self._tbt_slo_s)  # fmt: skip
            return verdict == ADMIT
        return True

    def _admit_and_step(self) -> Sequence[Event]:
        now = self.clock.now()
        imported_tokens = 0
        while self._waiting and self._fits(self._waiting[0]):
            job = self._waiting.popleft()
            imported_tokens += job.request.input_length
            self.kv_used_tokens += job.kv_reserved_tokens
            job.generated = 1
            if not self._first_token_on_arrival:
                job.record.token_times_s.append(now)
                self._notify(FirstToken(self.instance_id, job.request_id))
            self._notify(DecodeStarted(self.instance_id, job.request_id))
            if job.done:
                self._release(job, now)
            else:
                self._running.append(job)
                self._context_tokens += job.context_tokens
        if not self._running:
            self._stepping = False
            if self._host is not None:
                self._host.stop(self.instance_id)
            return NO_EVENTS
        self._stepping = True
        self.num_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(self._running))
        step_s = self._step_s(
            len(self._running), self._context_tokens, imported_tokens, self._speculation
        )
        step_s = shared_step_s(
            step_s, self._serving, self._rng, self._host, self.instance_id, len(self._running)
        )
        return (Event(now + step_s, self._step_done),)

    def _step_done(self) -> Sequence[Event]:
        now = self.clock.now()
        still = []
        extra_per_step = self._speculation.tokens_per_step - 1.0
        for job in self._running:
            before = job.context_tokens
            tokens = 1
            if extra_per_step:
                job.spec_credit += extra_per_step
                extra = int(job.spec_credit)
                job.spec_credit -= extra
                tokens = min(1 + extra, job.request.output_length - job.generated)
            job.record.token_times_s.extend([now] * tokens)
            job.generated += tokens
            if job.done:
                self._context_tokens -= before
                self._release(job, now)
            else:
                self._context_tokens += tokens
                still.append(job)
        self._running = still
        return self._admit_and_step()

    def check_integrity(self) -> None:
        """Raise AssertionError if the KV and context books disagree with the batch."""
        reserved = sum(job.kv_reserved_tokens for job in self._running)
        context = sum(job.context_tokens for job in self._running)
        assert self.kv_used_tokens == reserved, (self.kv_used_tokens, reserved)
        assert self._context_tokens == context, (self._context_tokens, context)
        assert 0 <= self.kv_used_tokens <= self.kv_capacity_tokens
        assert self._stepping or not self._running, "requests running but no step scheduled"

    def _release(self, job: Job, now_s: float) -> None:
        self.kv_used_tokens -= job.kv_reserved_tokens
        job.record.finish_s = now_s
        self._notify(RequestFinished(self.instance_id, job.request_id))

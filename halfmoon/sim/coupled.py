"""A simulated coupled (vLLM-like) instance: prefill and decode on the same GPUs.

Continuous batching, one step at a time, with a KV capacity limit (a request reserves
prompt + output tokens when admitted). Two schedulers:

- default, as vLLM's v0 scheduler: before every step, if waiting prompts fit (KV space,
  at most ``max_batched_tokens`` prompt tokens, always at least one prompt) the step is a
  prefill of those prompts and every running decode stalls for it; otherwise the step
  is a decode step of the running batch;
- ``chunked``, Sarathi-style: each step has a budget of ``token_budget`` tokens; running
  decodes take one each first, the rest goes to prompt chunks (prompts already started
  first, then new ones FCFS, or by priority: below). A mixed step costs the prefill chunks plus what the decode
  step adds beyond streaming the weights once::

      mixed_s = sum(prefill_time_s(chunk, done)) + max(0, decode_step(b, ctx) - decode_step(1, 0))

Every step with ``b > 0`` decodes also pays ``decode_step_overhead_s + b *
decode_per_seq_overhead_s``, the serving path's cost outside the forward, and
every step is multiplied by a lognormal jitter factor (``step_jitter_sigma``) and waits
an exponential time (``step_wait_mean_s``, see
:class:`~halfmoon.costmodel.serving.ServingTerms`).

Under the ``priority`` scheduling policy (``SimConfig.scheduling_policy``) waiting prompts
are admitted by their requests' ``priority`` (lower first), then arrival; admitted ones
are not preempted for them.

A prompt's first token is emitted when its prefill completes (``PrefillFinished`` and
``DecodeStarted`` at that moment). With prefix caching, the prompt's full blocks are
cached locally (reported to the Conductor, whose cache-aware router reads them).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from halfmoon.conductor.messages import (
    DecodeStarted,
    FirstToken,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.core.clock import Clock
from halfmoon.sim.cache import InstanceCache, Notify
from halfmoon.sim.config import InstanceSpec
from halfmoon.sim.events import NO_EVENTS, Event
from halfmoon.sim.host import Host, shared_step_s
from halfmoon.sim.job import Job, enqueue

Chunk = tuple[Job, int]


class CoupledInstance:
    """One vLLM-like instance of ``spec`` (its knobs: ``kv_capacity_tokens``,
    ``max_batch_size``, ``coupled_chunked_prefill``, ``coupled_token_budget``,
    ``coupled_max_batched_tokens``, ``serving``); ``cache`` is its prefix cache (None: no
    prefix caching); ``notify`` sends events to the Conductor; ``rng`` draws the step
    jitter (None: ``random.Random(0)``); ``host``: the CPUs it shares (None: its own
    hardware)."""

    def __init__(
        self,
        instance_id: str,
        spec: InstanceSpec,
        *,
        clock: Clock,
        notify: Notify,
        cache: InstanceCache | None = None,
        rng: random.Random | None = None,
        host: Host | None = None,
    ) -> None:
        config = spec.config
        self.instance_id = instance_id
        self.spec = spec
        self.cost_model = spec.cost_model
        self.kv_capacity_tokens = spec.kv_capacity_tokens
        self.clock = clock
        self.cache = cache
        self._notify = notify
        self._max_batch_size = config.max_batch_size
        self._chunked = config.coupled_chunked_prefill
        self._token_budget = config.coupled_token_budget
        self._max_batched_tokens = config.coupled_max_batched_tokens
        self._serving = config.serving
        self._rng = rng or random.Random(0)
        self._host = host
        self._waiting: deque[Job] = deque()
        self._by_priority = config.scheduling_policy == "priority"
        self._prefilling: list[Job] = []
        self._running: list[Job] = []
        self._context_tokens = 0
        self.kv_used_tokens = 0
        self._busy = False
        self.num_refused = 0
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.stalled_s = 0.0

    @property
    def num_running(self) -> int:
        """Requests decoding."""
        return len(self._running)

    def submit(self, job: Job) -> Sequence[Event]:
        """A routed request arrives; refused only if it can never fit in KV memory."""
        if job.kv_reserved_tokens > self.kv_capacity_tokens:
            job.record.rejected = True
            job.record.reject_reason = (
                f"coupled {self.instance_id} refused: needs {job.kv_reserved_tokens} KV "
                f"tokens, capacity {self.kv_capacity_tokens}"
            )
            self.num_refused += 1
            self._notify(RequestFinished(self.instance_id, job.request_id))
            return NO_EVENTS
        enqueue(self._waiting, job, self._by_priority)
        return NO_EVENTS if self._busy else self._next_step()

    # -- admission ------------------------------------------------------------------------
    def _can_admit(self, job: Job) -> bool:
        if len(self._running) + len(self._prefilling) >= self._max_batch_size:
            return False
        return self.kv_used_tokens + job.kv_reserved_tokens <= self.kv_capacity_tokens

    def _admit(self) -> Job:
        job = self._waiting.popleft()
        self.kv_used_tokens += job.kv_reserved_tokens
        cached = 0
        if self.cache is not None:
            blocks = self.cache.match(job.full_block_hashes)
            cached = min(blocks * job.request.block_size_tokens, job.request.input_length - 1)
        job.prefilled_tokens = cached
        job.record.cached_tokens = cached
        self._notify(PrefillStarted(self.instance_id, job.request_id))
        return job

    # -- step planning --------------------------------------------------------------------
    def _next_step(self) -> Sequence[Event]:
        plan = self._plan_chunked() if self._chunked else self._plan_prefill_first()
        if plan is None:
            self._busy = False
            if self._host is not None:
                self._host.stop(self.instance_id)
            return NO_EVENTS
        duration_s, decodes, chunks = plan
        duration_s += self._serving.decode_overhead_s(len(decodes))
        duration_s = shared_step_s(
            duration_s, self._serving, self._rng, self._host, self.instance_id, len(decodes)
        )
        self._busy = True
        if chunks:
            self.num_prefill_steps += 1
            if not decodes and self._running:
                self.stalled_s += duration_s
        else:
            self.num_decode_steps += 1
        end_s = self.clock.now() + duration_s
        return (Event(end_s, lambda: self._step_done(decodes, chunks)),)

    def _plan_prefill_first(self) -> tuple[float, list[Job], list[Chunk]] | None:
        """vLLM v0: a prefill step whenever waiting prompts fit, else a decode step."""
        chunks: list[Chunk] = []
        new_tokens = 0
        while self._waiting and self._can_admit(self._waiting[0]):
            head = self._waiting[0]
            if chunks and new_tokens + head.request.input_length > self._max_batched_tokens:
                break
            job = self._admit()
            self._prefilling.append(job)  # counted by the next _can_admit
            take = job.request.input_length - job.prefilled_tokens
            chunks.append((job, take))
            new_tokens += take
        if chunks:
            return self._prefill_s(chunks), [], chunks
        if self._running:
            step_s = self.cost_model.decode_step_time_s(len(self._running), self._context_tokens)
            return step_s, list(self._running), []
        return None

    def _plan_chunked(self) -> tuple[float, list[Job], list[Chunk]] | None:
        """Sarathi: decodes first, then prompt chunks within the token budget."""
        budget = self._token_budget
        decodes = self._running[:budget]
        budget -= len(decodes)
        chunks: list[Chunk] = []
        for job in self._prefilling:
            if budget <= 0:
                break
            take = min(job.request.input_length - job.prefilled_tokens, budget)
            chunks.append((job, take))
            budget -= take
        while budget > 0 and self._waiting and self._can_admit(self._waiting[0]):
            job = self._admit()
            self._prefilling.append(job)
            take = min(job.request.input_length - job.prefilled_tokens, budget)
            chunks.append((job, take))
            budget -= take
        if not decodes and not chunks:
            return None
        if len(decodes) == len(self._running):
            context = self._context_tokens
        else:
            context = sum(job.context_tokens for job in decodes)
        decode_s = self.cost_model.decode_step_time_s(len(decodes), context)
        if not chunks:
            return decode_s, decodes, chunks
        if decodes:
            weights_s = self.cost_model.decode_step_time_s(1, 0)
            return self._prefill_s(chunks) + max(0.0, decode_s - weights_s), decodes, chunks
        return self._prefill_s(chunks), decodes, chunks

    def _prefill_s(self, chunks: list[Chunk]) -> float:
        cost = self.cost_model
        return sum(cost.prefill_time_s(take, job.prefilled_tokens) for job, take in chunks)

    # -- step completion ------------------------------------------------------------------
    def _step_done(self, decodes: list[Job], chunks: list[Chunk]) -> Sequence[Event]:
        now = self.clock.now()
        if decodes:
            self._emit_tokens(decodes, now)
        for job, take in chunks:
            job.prefilled_tokens += take
            if job.prefilled_tokens >= job.request.input_length:
                self._prefill_complete(job, now)
        return self._next_step()

    def _emit_tokens(self, decodes: list[Job], now_s: float) -> None:
        finished = []
        for job in decodes:
            job.record.token_times_s.append(now_s)
            job.generated += 1
            self._context_tokens += 1
            if job.done:
                finished.append(job)
        if finished:
            gone = set(map(id, finished))
            self._running = [job for job in self._running if id(job) not in gone]
            for job in finished:
                self._context_tokens -= job.context_tokens
                self._release(job, now_s)

    def _prefill_complete(self, job: Job, now_s: float) -> None:
        self._prefilling.remove(job)
        job.record.prefill_done_s = now_s
        if self.cache is not None:
            self.cache.touch(job.full_block_hashes)
        cached = job.record.cached_tokens
        self._notify(PrefillFinished(self.instance_id, job.request_id, cached))
        job.generated = 1
        job.record.token_times_s.append(now_s)
        self._notify(FirstToken(self.instance_id, job.request_id))
        self._notify(DecodeStarted(self.instance_id, job.request_id))
        if job.done:
            self._release(job, now_s)
        else:
            self._running.append(job)
            self._context_tokens += job.context_tokens

    def check_integrity(self) -> None:
        """Raise AssertionError if the KV and context books disagree with the batches."""
        admitted = self._running + self._prefilling
        reserved = sum(job.kv_reserved_tokens for job in admitted)
        context = sum(job.context_tokens for job in self._running)
        assert self.kv_used_tokens == reserved, (self.kv_used_tokens, reserved)
        assert self._context_tokens == context, (self._context_tokens, context)
        assert 0 <= self.kv_used_tokens <= self.kv_capacity_tokens
        assert self._busy or not (admitted or self._waiting), "work left but no step scheduled"

    def _release(self, job: Job, now_s: float) -> None:
        self.kv_used_tokens -= job.kv_reserved_tokens
        job.record.finish_s = now_s
        self._notify(RequestFinished(self.instance_id, job.request_id))

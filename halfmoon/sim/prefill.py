"""A simulated prefill instance: FCFS (or priority) queue, optional chunking, local DRAM prefix cache,
remote prefix fetches, and layer-wise KV streaming to the decode instance.

One request at a time, in arrival order, or under the ``priority`` scheduling policy by
each request's ``priority`` (lower first) and then arrival (a request run by a CPP group
holds every member instance, see :mod:`halfmoon.sim.cpp`)::

    start:    match the local cache; if the decision fetches a longer prefix from
              another instance, move the missing blocks first (NIC reservation); with
              ``overlap``, the fetch ran instead from the request's arrival, while the
              queue ran, and the request joined the queue when it was done (halfmoon's
              live prefill workers)
    compute:  PrefillStarted; prefill the uncached tokens (in chunks if configured),
              then ``handoff_s_per_token`` x prompt tokens of serving-path work (store
              save, KV streaming, export and hand-over)
    finish:   PrefillFinished; cache the prompt's full blocks (BlockStored/Evicted);
              the KV tail reaches the decode instance after kv_stream_tail_s (a
              prefill-only request, an embedding, ends here instead: its answer is due
              now, RequestFinished, nothing streamed)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from halfmoon.conductor.messages import PrefillFinished, PrefillStarted, RequestFinished
from halfmoon.core.clock import Clock
from halfmoon.sim.cache import InstanceCache, Notify
from halfmoon.sim.config import InstanceSpec
from halfmoon.sim.events import NO_EVENTS, Event
from halfmoon.sim.host import Host
from halfmoon.sim.job import Job, enqueue
from halfmoon.sim.network import Nic, kv_stream_tail_s, reserve_transfer


def chunk_sizes(num_tokens: int, chunk_tokens: int | None) -> list[int]:
    """Split ``num_tokens`` into chunks of at most ``chunk_tokens`` (None: one chunk)."""
    if chunk_tokens is None or num_tokens <= chunk_tokens:
        return [num_tokens]
    full, rest = divmod(num_tokens, chunk_tokens)
    return [chunk_tokens] * full + ([rest] if rest else [])


class PrefillInstance:
    """A prefill-only instance of ``spec`` (its knobs: ``num_layers``,
    ``prefill_chunk_tokens``, ``serving.prefill_handoff_s_per_token``) with its local
    prefix ``cache``; ``notify`` sends events to the Conductor; ``host``: the CPUs it
    shares (None: its own hardware); ``overlap``: a request's prefix fetch starts when it
    arrives, not when its turn comes."""

    def __init__(
        self,
        instance_id: str,
        spec: InstanceSpec,
        *,
        cache: InstanceCache,
        clock: Clock,
        notify: Notify,
        host: Host | None = None,
        overlap: bool = False,
    ) -> None:
        config = spec.config
        self.instance_id = instance_id
        self.spec = spec
        self.cost_model = spec.cost_model
        self.cache = cache
        self.clock = clock
        self.nic = Nic()
        self._notify = notify
        self._num_layers = config.num_layers
        self._chunk_tokens = config.prefill_chunk_tokens
        self._handoff_s_per_token = config.serving.prefill_handoff_s_per_token
        self._host = host
        self._overlap = overlap
        self._queue: deque[Job] = deque()
        self._by_priority = config.scheduling_policy == "priority"
        self._num_fetching = 0
        self._busy = False
        self.num_prefilled = 0
        self.num_fetches = 0
        self.busy_s = 0.0

    @property
    def busy(self) -> bool:
        """Whether a request is in progress (or a CPP stage holds the instance)."""
        return self._busy

    @property
    def queue_length(self) -> int:
        """Requests waiting, those still fetching their prefix included (not counting the
        one in progress)."""
        return len(self._queue) + self._num_fetching

    def submit(self, job: Job) -> Sequence[Event]:
        """Queue a placed request; starts it at once if the instance is idle. With
        ``overlap``, a request that fetches a prefix joins the queue once it is here."""
        if self._overlap and job.cpp is None:
            fetch = self._fetch(job)[1]
            if fetch is not None:
                self._num_fetching += 1
                return fetch
        return self._enqueue(job)

    def _enqueue(self, job: Job) -> Sequence[Event]:
        enqueue(self._queue, job, self._by_priority)
        return NO_EVENTS if self._busy else self._start_next()

    def notify(self, event: object) -> None:
        """Send an event to the Conductor (used by a CPP group run)."""
        self._notify(event)

    def release(self) -> Sequence[Event]:
        """A CPP group run is done with this instance: start the next request."""
        return self._start_next()

    def _start_next(self) -> Sequence[Event]:
        if self._host is not None:
            self._host.stop(self.instance_id)
        if not self._queue:
            self._busy = False
            return NO_EVENTS
        self._busy = True
        job = self._queue.popleft()
        if job.cpp is not None:  # a pipeline stage: hold until every member is ready
            return job.cpp.member_ready(self)
        if self._overlap:  # any fetch ran before the request joined the queue
            return self._compute(job, max(self.cache.match(job.full_block_hashes),
                                          job.fetched_blocks))  # fmt: skip
        local, fetch = self._fetch(job)
        return self._compute(job, local) if fetch is None else fetch

    def _fetch(self, job: Job) -> tuple[int, Sequence[Event] | None]:
        """The prefix blocks held here, and the start of moving those the decision
        fetches from another instance: the events that end it (None: nothing to fetch)."""
        hashes = job.full_block_hashes
        local = self.cache.match(hashes)
        source = job.cache_source
        if source is None or source is self or job.planned_cached_blocks <= local:
            return local, None
        # The source may have evicted part of the prefix since the decision: take what
        # it still holds, up to what was planned.
        held = source.cache.match(hashes[: job.planned_cached_blocks])
        if held <= local:
            return local, None
        num_bytes = (
            (held - local) * job.request.block_size_tokens * self.cost_model.kv_bytes_per_token
        )
        end_s = reserve_transfer(
            self.clock.now(), self.cost_model.transfer_time_s(num_bytes), source.nic, self.nic
        )
        self.num_fetches += 1
        return local, (Event(end_s, lambda: self._fetched(job, local, held)),)

    def _fetched(self, job: Job, local: int, held: int) -> Sequence[Event]:
        if job.keep_fetched:
            hashes = job.full_block_hashes
            self.cache.insert([(p, hashes[p]) for p in range(local, held)])
        if self._overlap:
            job.fetched_blocks = held
            self._num_fetching -= 1
            return self._enqueue(job)
        return self._compute(job, held)

    def _compute(self, job: Job, num_cached_blocks: int) -> Sequence[Event]:
        request = job.request
        cached = min(num_cached_blocks * request.block_size_tokens, request.input_length - 1)
        job.record.cached_tokens = cached
        self._notify(PrefillStarted(self.instance_id, job.request_id))
        start_s = self.clock.now()
        done = cached
        compute_s = last_s = 0.0
        chunks = chunk_sizes(request.input_length - cached, self._chunk_tokens)
        for size in chunks:
            last_s = self.cost_model.prefill_time_s(size, done)
            compute_s += last_s
            done += size
        # The hand-over (store save, last layers on the wire, export) keeps the instance
        # busy after the forward, and the decode side starts only once it is done.
        busy_s = compute_s + self._handoff_s_per_token * request.input_length
        if self._host is not None:  # the whole run at the CPU share it starts with
            factor = self._host.start(self.instance_id)
            compute_s, last_s, busy_s = compute_s * factor, last_s * factor, busy_s * factor
        stream_end_s = self._stream_end_s(request.input_length, chunks[-1], compute_s, last_s)
        stream_end_s = max(stream_end_s, busy_s)
        end_s = start_s + busy_s
        self.busy_s += busy_s
        return (Event(end_s, lambda: self._finish(job, start_s + stream_end_s)),)

    def _stream_end_s(
        self, input_tokens: int, last_chunk_tokens: int, compute_s: float, last_s: float
    ) -> float:
        """Seconds after the compute start when the decode instance holds all the KV.

        KV of the prompt before the last chunk (cached prefix, earlier chunks) is counted
        as ready when the last chunk starts; the last chunk streams layer by layer
        (:func:`kv_stream_tail_s`); nothing ends before the whole prompt's KV has crossed
        the link at full speed from the compute start.
        """
        xfer = self.cost_model.transfer_time_s
        per_token = self.cost_model.kv_bytes_per_token
        before_tokens = input_tokens - last_chunk_tokens
        tail_s = kv_stream_tail_s(
            last_s,
            xfer(before_tokens * per_token),
            xfer(last_chunk_tokens * per_token),
            self._num_layers,
        )
        return max(xfer(input_tokens * per_token), compute_s + tail_s)

    def _finish(self, job: Job, stream_end_s: float) -> Sequence[Event]:
        now = self.clock.now()
        job.record.prefill_done_s = now
        self.num_prefilled += 1
        self.cache.touch(job.full_block_hashes)
        cached = job.record.cached_tokens
        self._notify(PrefillFinished(self.instance_id, job.request_id, cached))
        if job.request.prefill_only:  # an embedding: answered here, no KV goes anywhere
            job.record.token_times_s.append(now)  # (its answer: what its TTFT measures)
            job.record.finish_s = now
            self._notify(RequestFinished(self.instance_id, job.request_id))
            return self._start_next()
        decode = job.decode
        if decode is None:
            raise RuntimeError(f"request {job.request_id} has no decode instance")
        arrive_s = reserve_transfer(now, stream_end_s - now, self.nic, decode.nic)
        handoff = Event(arrive_s, lambda: decode.kv_arrived(job))
        return (handoff, *self._start_next())

    def check_integrity(self) -> None:
        """Raise AssertionError if queued work is stranded or the cache books disagree."""
        assert self._busy or not self._queue, "requests queued but nothing running"
        assert self._num_fetching >= 0, "more fetches ended than began"
        self.cache.check_integrity()

    def replicate_to(
        self,
        target: PrefillInstance,
        block_hashes: Sequence[int],
        block_size_tokens: int,
        on_done: Callable[[int], None],
    ) -> Sequence[Event]:
        """Copy the blocks of ``block_hashes`` this instance holds and ``target`` lacks to
        ``target``'s cache (position = index in ``block_hashes``); ``on_done`` gets the
        number of blocks copied when they arrive."""
        blocks = [
            (p, h) for p, h in enumerate(block_hashes) if h in self.cache and h not in target.cache
        ]
        if not blocks:
            return NO_EVENTS
        num_bytes = len(blocks) * block_size_tokens * self.cost_model.kv_bytes_per_token
        end_s = reserve_transfer(
            self.clock.now(), self.cost_model.transfer_time_s(num_bytes), self.nic, target.nic
        )

        def arrive() -> Sequence[Event]:
            target.cache.insert(blocks)
            on_done(len(blocks))
            return NO_EVENTS

        return (Event(end_s, arrive),)

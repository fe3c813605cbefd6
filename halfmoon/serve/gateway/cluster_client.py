"""The gateway's :class:`~halfmoon.serve.gateway.backend.Backend` over a live cluster.

It asks the Conductor service for a placement, then talks to the workers directly:

- coupled: ``generate`` to the chosen worker, which streams ``tokens`` back;
- disaggregated: ``expect`` to the decode worker (it will stream the tokens), then
  ``prefill`` to the prefill worker with the decode worker's transfer endpoint; the
  prefill worker streams the KV layer by layer to the decode worker and sends the first
  token back itself;
- an embedding (``params.embed``): ``prefill`` alone to the chosen prefill (or ``generate``
  to the coupled) worker, which computes the prompt and answers with its vector.

Its connections are :mod:`~halfmoon.serve.gateway.cluster_link`'s (one DEALER socket per
peer, replies routed to each request's queue); its cluster-wide operations (metrics,
status, adapters, resets, drains) :mod:`~halfmoon.serve.gateway.cluster_ops`'s. A request that sees no progress for ``token_timeout_s`` fails with
:class:`BackendError` instead of hanging. A request's ``cache_salt`` roots the block
hashes sent to the Conductor and goes with every command to the workers, which hash
under it too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from halfmoon.conductor.messages import RejectCode
from halfmoon.core.hashing import chain_root, hash_blocks
from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.messages import (
    NO_ENDPOINTS,
    CppPrefill,
    Endpoints,
    Error,
    Expect,
    FirstTokenSeen,
    Generate,
    InstanceFailed,
    Lost,
    Member,
    PlacementDecision,
    Prefill,
    Release,
    Replicate,
    Schedule,
    Tokens,
    WireParams,
)
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.gateway.backend import (
    BackendError,
    BackendRefused,
    GenerationChunk,
    Rejected,
)
from halfmoon.serve.gateway.cluster_link import WorkerLost
from halfmoon.serve.gateway.cluster_ops import ClusterOperations

__all__ = ["ClusterBackend", "WorkerLost"]

log = logging.getLogger(__name__)

#: Put in a request's queue by :meth:`ClusterBackend.abort`: its stream ends there.
_ABORTED = object()


class _Aborted(Exception):
    """A request's stream reached :data:`_ABORTED`."""


def _incarnation(endpoints: Endpoints) -> tuple[str, str]:
    """(instance id, incarnation) of a worker named in a decision."""
    return endpoints.instance_id, endpoints.incarnation


class ClusterBackend(ClusterOperations):
    """Generates through the Conductor and the workers of one cluster."""

    def __init__(
        self,
        conductor_endpoint: str,
        secret: bytes,
        block_size: int,
        mode: str = "disaggregated",
        expected_instances: int = 0,
        token_timeout_s: float = 120.0,
    ) -> None:
        if mode not in ("disaggregated", "coupled"):
            raise ValueError(f"unknown mode {mode!r}")
        super().__init__(conductor_endpoint, secret)
        self.block_size = block_size
        self.mode = mode
        self.expected_instances = expected_instances
        self.token_timeout_s = token_timeout_s
        self._routes: dict[str, tuple[str, ...]] = {}
        self._route_ids: dict[str, tuple[tuple[str, str], ...]] = {}
        self._attempts: dict[str, str] = {}
        #: Running requests told to abort (:meth:`abort`): one still being placed ends as
        #: soon as its queue exists.
        self._aborting: set[str] = set()
        self._incarnations: dict[str, str] = {}
        #: A request is placed again after each worker loss, but it fails (503) once it
        #: lost its workers this many times with no new token in between (a
        #: request that crashes every worker it reaches takes down only so many), or after
        #: ``max_attempts`` placements in all. Losses with tokens between do not add up: five
        #: quick kills of two decode workers once cost a streaming request three losses.
        self.max_losses_without_progress = 3
        self.max_attempts = 8
        self.conductor_wait_s = 20.0
        #: How long a request placed again after its worker died (its client already
        #: streaming) waits for a worker while none is registered: restarts of killed
        #: workers took over 20 s on a loaded 2-core host (a Python start alone 17 s).
        self.failover_wait_s = 60.0
        #: After the Conductor has not answered for this long (frozen, or restarting), the
        #: gateway places requests itself: least loaded by its own count, no prefix reuse.
        self.conductor_fallback_s = 3.0
        #: Placeable instances (id -> endpoints and role) as the Conductor last listed them.
        self._members: dict[str, Member] = {}
        self.num_fallback_placements = 0
        self.watch_interval_s = 0.5

    # -- Backend -------------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        """The Conductor's view; fails until every expected worker has registered."""
        instances = (await self._ping(5.0)).instances
        if len(instances) < self.expected_instances:
            raise BackendError(f"{len(instances)} of {self.expected_instances} workers registered")
        return {"mode": self.mode, "instances": instances}

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Place the request, start it, and stream its tokens (its prefix-cache hits
        come only from requests with the same ``cache_salt``).

        When a worker it runs on is declared dead, the request is placed again from its
        prompt plus the tokens it already produced and continues; the client sees one
        uninterrupted stream. It fails after ``max_losses_without_progress`` losses with no
        new token in between, or after ``max_attempts`` placements.
        """
        chain_root(cache_salt)  # a bad salt fails before anything is placed
        produced: list[int] = []
        losses_in_a_row = 0
        try:
            for attempt in range(self.max_attempts):
                produced_before = len(produced)
                attempt_id = request_id if attempt == 0 else f"{request_id}~{attempt}"
                self._attempts[request_id] = attempt_id
                completed = False
                ids = [*prompt_token_ids, *produced]
                left = dataclasses.replace(
                    params,
                    max_tokens=params.max_tokens - len(produced),
                    min_tokens=max(0, params.min_tokens - len(produced)),
                )
                try:
                    decision, rtt_s = await self._place(
                        attempt_id, ids, left, cache_salt, admitted=attempt > 0
                    )
                    queue: asyncio.Queue = asyncio.Queue()
                    self._queues[attempt_id] = queue
                    if request_id in self._aborting:  # (aborted while it was being placed)
                        queue.put_nowait(_ABORTED)
                    await self._start(attempt_id, ids, left, decision, cache_salt)
                    async for chunk in self._in_order(attempt_id, queue, decision, rtt_s):
                        produced.extend(chunk.token_ids)
                        if attempt and chunk.cached_tokens is not None:
                            chunk = dataclasses.replace(chunk, cached_tokens=None, est_ttft_s=None)
                        yield chunk
                    completed = True
                    return
                except _Aborted:  # (not completed: the booking is released below)
                    await self._abort_attempt(attempt_id)  # (it may have started meanwhile)
                    yield GenerationChunk((), "abort")
                    return
                except WorkerLost as exc:
                    await self._abort_attempt(attempt_id)
                    if exc.suspect:
                        await self._report_failed(exc.suspect)
                    losses_in_a_row = 1 if len(produced) > produced_before else losses_in_a_row + 1
                    if losses_in_a_row >= self.max_losses_without_progress:
                        raise BackendError(
                            f"request {request_id} lost its workers {losses_in_a_row} times with no "
                            f"new token in between (last: {exc})"
                        ) from None
                    log.warning("request %s: %s; placing it again", request_id, exc)
                finally:
                    self._queues.pop(attempt_id, None)
                    self._attempts.pop(request_id, None)
                    if not completed:
                        # Failed before dispatch, refused, lost, timed out or hung up on: a
                        # worker may never say RequestFinished, so the booking goes here.
                        await self._tell_conductor(Release(request_id=attempt_id))
            raise BackendError(
                f"request {request_id} lost its workers {self.max_attempts} times "
                f"({len(produced)} tokens out)"
            )
        finally:
            self._aborting.discard(request_id)

    async def instance_exited(self, instance_id: str) -> None:
        """The process of worker ``instance_id`` is known dead (its launcher saw it exit):
        the requests routed to it are placed again now, and the Conductor drops it from
        placement, without waiting for either to notice its silence."""
        for attempt_id, instances in list(self._route_ids.items()):
            queue = self._queues.get(attempt_id)
            if queue is not None and any(i == instance_id for i, _ in instances):
                queue.put_nowait(Lost(instance_id=instance_id))
        await self._report_failed(instance_id)

    async def _report_failed(self, instance_id: str) -> None:
        """Tell the Conductor a worker failed us (it re-checks through heartbeats)."""
        incarnation = self._incarnations.get(instance_id, "")
        self._members.pop(instance_id, None)  # not for fallback placements either
        await self._tell_conductor(InstanceFailed(instance_id=instance_id, incarnation=incarnation))

    async def _watch(self) -> None:
        """Follow the Conductor's live instances; a request on a vanished one is told."""
        while True:
            await asyncio.sleep(self.watch_interval_s)
            try:
                pong = await self._ping(2.0)
            except BackendError:
                continue  # the Conductor is restarting: keep the last view
            alive = pong.incarnations
            for attempt_id, instances in list(self._route_ids.items()):
                gone = [i for i, inc in instances if alive.get(i) != inc]
                queue = self._queues.get(attempt_id)
                if gone and queue is not None:
                    queue.put_nowait(Lost(instance_id=gone[0]))
            self._incarnations = alive
            self._members = pong.members
            self.adapters = {r.name: r.adapter() for r in pong.adapters}

    async def _in_order(
        self,
        request_id: str,
        queue: asyncio.Queue,
        decision: PlacementDecision,
        rtt_s: float | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Token messages in output order: the first token comes from the prefill
        worker, the rest from the decode worker, over different sockets."""
        held: dict[int, Tokens] = {}
        next_index = 0
        # A long prompt's prefill may take minutes: the first token gets its estimate too.
        first_timeout_s = self.token_timeout_s + 4.0 * decision.est_ttft_s
        while True:
            timeout_s = first_timeout_s if next_index == 0 else self.token_timeout_s
            try:
                msg = await asyncio.wait_for(queue.get(), timeout_s)
            except TimeoutError:
                raise BackendError(
                    f"no progress for {timeout_s:g}s on request {request_id}"
                ) from None
            if isinstance(msg, Error):
                if msg.retryable:
                    raise WorkerLost(msg.error, msg.suspect)
                raise (BackendRefused if msg.unsupported else BackendError)(msg.error)
            if isinstance(msg, Lost):
                raise WorkerLost(f"worker {msg.instance_id} is gone")
            if msg is _ABORTED:
                raise _Aborted
            if not isinstance(msg, Tokens):
                log.warning("request %s: unexpected %s message ignored", request_id, msg.wire_name)
                continue
            held[msg.index] = msg
            while next_index in held:
                msg = held.pop(next_index)
                first = next_index == 0
                next_index += len(msg.token_ids)
                # A worker's own count wins; some engines send it with the last tokens.
                cached = msg.cached_tokens
                if cached is None and first:
                    cached = decision.cached_tokens
                yield GenerationChunk(
                    tuple(msg.token_ids),
                    msg.finish_reason,
                    cached,
                    decision.est_ttft_s if first else None,
                    msg.kv_bytes,
                    decision.decision_s if first else None,
                    rtt_s if first else None,
                    msg.token_logprobs,
                    msg.prompt_token_logprobs,
                    msg.embedding_values,
                )
                if first:  # once the client has it: the Conductor learns how late it came
                    await self._tell_conductor(FirstTokenSeen(request_id=request_id))
                finish = msg.finish_reason
                if finish is not None:
                    await self._release(request_id)
                    return

    async def _release(self, request_id: str) -> None:
        """The request ended: tell the workers that may still hold it (decode after a
        first-token finish) and forget its route."""
        self._route_ids.pop(request_id, None)
        routes = self._routes.pop(request_id, ())
        for endpoint in routes[1:]:
            await self._send_abort(endpoint, request_id)

    async def _abort_attempt(self, attempt_id: str) -> None:
        self._route_ids.pop(attempt_id, None)
        for endpoint in self._routes.pop(attempt_id, ()):
            await self._send_abort(endpoint, attempt_id)

    async def _place(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        admitted: bool = False,
    ) -> tuple[PlacementDecision, float | None]:
        """Ask the Conductor (the decision, and the round trip it took; None for a
        decision made here); while it is away or has no worker (a restart in progress),
        ask again for up to ``conductor_wait_s``. An ``admitted`` request (placed again
        after its worker died) is not rejected early, and waits for a worker for up to
        ``failover_wait_s``."""
        root = chain_root(cache_salt)
        hashes = hash_blocks(prompt_token_ids, self.block_size, root).hashes  # partial last too
        if params.prompt_logprobs is not None:  # computes its whole prompt: no cache counts
            hashes = []
        msg = Schedule(
            request_id=request_id, input_length=len(prompt_token_ids),
            output_length=params.max_tokens, block_size=self.block_size,
            hashes=hashes_to_wire(hashes), coupled=self.mode == "coupled", admitted=admitted,
            priority=params.priority, prefill_only=params.embed,
        )  # fmt: skip
        wait_s = max(self.conductor_wait_s, self.failover_wait_s if admitted else 0.0)
        deadline = time.monotonic() + wait_s
        while True:
            if (fallback := self._fallback_placement()) is not None:
                return fallback, None
            try:
                sent_s = time.perf_counter()
                decision = await self._call(self._conductor_endpoint, msg, 2.0)
                rtt_s = time.perf_counter() - sent_s
            except BackendError:
                if (fallback := self._fallback_placement()) is not None:
                    return fallback, None
                if time.monotonic() > deadline:
                    raise BackendError(f"the Conductor did not answer within {wait_s:g}s") from None
                continue
            if not isinstance(decision, PlacementDecision):
                error = decision.error if isinstance(decision, Error) else decision.wire_name
                raise BackendError(f"conductor error: {error}")
            if decision.accepted:
                return decision, rtt_s
            waiting = decision.reject_code == RejectCode.NO_INSTANCE
            if not waiting or time.monotonic() > deadline:
                raise Rejected(decision.reject_reason)
            await asyncio.sleep(0.5)  # no worker registered (yet): they are restarting

    async def _start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        decision: PlacementDecision,
        cache_salt: str | None = None,
    ) -> None:
        wire_params = WireParams.of(params)
        chosen, decode_ep = decision.prefill, decision.decode
        assert chosen is not None, "an accepted decision names its prefill (or coupled) instance"
        if self.mode == "coupled":
            self._route_ids[request_id] = (_incarnation(chosen),)
            self._routes[request_id] = (chosen.command,)
            await self._send(chosen.command, Generate(
                request_id=request_id, token_ids=list(prompt_token_ids), params=wire_params,
                cache_salt=cache_salt,
            ))  # fmt: skip
            return
        if params.embed:  # computed where it was placed, and answered from there
            self._route_ids[request_id] = (_incarnation(chosen),)
            self._routes[request_id] = (chosen.command,)
            await self._send(chosen.command, Prefill(
                request_id=request_id, token_ids=list(prompt_token_ids), params=wire_params,
                cache_source=decision.cache_source,
                cached_tokens=decision.cached_tokens, cache_salt=cache_salt,
            ))  # fmt: skip
            return
        assert decode_ep is not None, "a generation's decision names its decode instance"
        group = decision.group or []
        self._route_ids[request_id] = (
            *(_incarnation(m) for m in group or [chosen]),
            _incarnation(decode_ep),
        )
        # The first token comes from the last stage; the rest hear of an abort after it.
        stages = [m.command for m in group]
        self._routes[request_id] = (
            (stages[-1], *stages[:-1], decode_ep.command) if group
            else (chosen.command, decode_ep.command)
        )  # fmt: skip
        await self._send(decode_ep.command, Expect(
            request_id=request_id, params=wire_params, num_prompt_tokens=len(prompt_token_ids),
            num_stages=max(1, len(group)), est_ttft_s=decision.est_ttft_s,
            prefill_instance=(group[-1] if group else chosen).instance_id, cache_salt=cache_salt,
        ))  # fmt: skip
        if group:
            await self._start_group(request_id, prompt_token_ids, wire_params, decision,
                                    cache_salt)  # fmt: skip
            return
        for plan in decision.replications:
            target = plan.target
            if target.instance_id != chosen.instance_id and target.command:
                await self._send(target.command,
                                 Replicate(hashes=plan.hashes, source=plan.source.transfer))  # fmt: skip
        await self._send(chosen.command, Prefill(
            request_id=request_id, token_ids=list(prompt_token_ids), params=wire_params,
            decode=decode_ep, cache_source=decision.cache_source,
            cached_tokens=decision.cached_tokens, replications=decision.replications,
            cache_salt=cache_salt,
        ))  # fmt: skip

    async def _start_group(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        wire_params: WireParams,
        decision: PlacementDecision,
        cache_salt: str | None = None,
    ) -> None:
        """A chunked-pipeline prefill: every stage gets the prompt, its place in the
        pipeline and its successor's transfer endpoint (see halfmoon.serve.worker.pipeline)."""
        group = decision.group or []
        assert decision.decode is not None
        for stage, member in enumerate(group):
            await self._send(member.command, CppPrefill(
                request_id=request_id, token_ids=list(prompt_token_ids), params=wire_params,
                stage=stage, num_stages=len(group), chunk_tokens=decision.cpp_chunk_tokens,
                next_transfer=group[stage + 1].transfer if stage + 1 < len(group) else "",
                group=[m.instance_id for m in group], commands=[m.command for m in group],
                decode=decision.decode, cached_tokens=decision.cached_tokens,
                cache_source=decision.cache_source, cache_salt=cache_salt,
            ))  # fmt: skip

    def _fallback_placement(self) -> PlacementDecision | None:
        """A decision made here while the Conductor has been silent for longer than
        ``conductor_fallback_s`` (None before that, or with no known worker): the prefill
        (or coupled) and decode instances with the fewest requests this gateway has on
        them. No prefix reuse, no early rejection; the workers' events still go to the
        Conductor, which ignores requests it did not place."""
        if time.monotonic() - self._conductor_seen_s <= self.conductor_fallback_s:
            return None
        load: dict[str, int] = {}
        for instances in self._route_ids.values():
            for iid, _ in instances:
                load[iid] = load.get(iid, 0) + 1

        def least(role: str) -> Member | None:
            live = [m for m in self._members.values() if m.role == role]
            return min(live, key=lambda m: (load.get(m.instance_id, 0), m.instance_id),
                       default=None)  # fmt: skip

        if self.mode == "coupled":
            prefill = decode = least("coupled")
        else:
            prefill, decode = least("prefill"), least("decode")
        if prefill is None or decode is None:
            return None
        self.num_fallback_placements += 1
        return PlacementDecision(accepted=True, prefill=prefill.endpoints(),
                                 decode=decode.endpoints(), cache_source=NO_ENDPOINTS,
                                 fallback=True)  # fmt: skip

    async def abort(self, request_id: str) -> None:
        """Tell every worker the request touched to drop it; a stream of it still being
        read ends (with a chunk finished ``abort``)."""
        attempt_id = self._attempts.get(request_id, request_id)
        await self._abort_attempt(attempt_id)
        if request_id in self._attempts:  # running (perhaps still being placed)
            self._aborting.add(request_id)
        queue = self._queues.get(attempt_id)
        if queue is not None:
            queue.put_nowait(_ABORTED)

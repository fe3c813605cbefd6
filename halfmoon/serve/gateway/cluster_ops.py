"""The gateway's operations on a whole cluster, beside serving requests: every process's
metrics, the Conductor's status and workload window, LoRA adapters loaded and unloaded
while serving, prefix caches reset, weights updated, sleep mode, the profiler, workers
drained. :class:`ClusterOperations` is a base of
:class:`~halfmoon.serve.gateway.cluster_client.ClusterBackend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.profiling import STOP_TIMEOUT_S, ProfilerConfig, ProfileSession
from halfmoon.serve.control.messages import (
    AdapterRecord,
    AdaptersOk,
    AdapterUpdate,
    CacheReset,
    ClusterStatus,
    ConductorPong,
    Drain,
    Draining,
    Error,
    Message,
    MetricsQuery,
    MetricsText,
    Profile,
    ProfileState,
    ResetPrefixCache,
    Sleep,
    SleepState,
    StatusQuery,
    UpdateWeights,
    WeightsOk,
    WeightsRecord,
    WorkloadQuery,
    WorkloadWindow,
)
from halfmoon.serve.gateway.backend import BackendError, BackendRefused
from halfmoon.serve.gateway.cluster_link import ClusterLink, reason_of

log = logging.getLogger("halfmoon.serve.gateway.cluster_client")

#: How long a weight update's commit waits for a worker's last requests to end.
COMMIT_SETTLE_S = 10.0
#: How long a draining worker (which may have exited) is waited for where its answer is
#: only welcome.
DRAINING_ANSWER_S = 5.0


def _or_unset(value: int | None) -> int:
    """An optional count on the wire (-1: not given)."""
    return -1 if value is None else value


def serving(pong: ConductorPong) -> dict[str, str]:
    """The command endpoints of the instances ``pong`` lists that are not draining: a
    draining worker takes no new request and exits once idle (it may be gone already, its
    silence not yet noticed), so what changes the cluster from now on skips it."""
    return {i: e for i, e in pong.endpoints.items() if i not in pong.draining}


class WorkerBusy(BackendError):
    """A worker refused a step for now (its requests are still ending): ask again."""


class ClusterOperations(ClusterLink):
    """Cluster-wide operations over a :class:`ClusterLink` (see the module docstring)."""

    def __init__(self, conductor_endpoint: str, secret: bytes) -> None:
        super().__init__(conductor_endpoint, secret)
        #: LoRA adapters loaded while the cluster serves (the Conductor's list, as its last
        #: answer gave it): what a request's ``model`` may name besides ``--lora-modules``.
        self.adapters: dict[str, RuntimeAdapter] = {}

    async def metrics_texts(self, timeout_s: float = 0.5) -> tuple[list[MetricsText], list[str]]:
        """Every process's Prometheus metrics: the Conductor's and those of each instance
        its pong lists, asked at once, each answer awaited at most ``timeout_s``. Returns
        the answers and the ids of the processes that gave none (``conductor`` for it)."""

        async def ask(endpoint: str) -> MetricsText:
            reply = await self._call(endpoint, MetricsQuery(), timeout_s)
            if not isinstance(reply, MetricsText):
                raise BackendError(f"{endpoint} answered a metrics query with {reply.wire_name}")
            return reply

        pong, conductor = await asyncio.gather(
            self._ping(timeout_s), ask(self._conductor_endpoint), return_exceptions=True
        )
        ids = ["conductor"]
        asks = [conductor]
        if isinstance(pong, ConductorPong):
            ids += list(pong.endpoints)
            asks += await asyncio.gather(
                *(ask(endpoint) for endpoint in pong.endpoints.values()), return_exceptions=True
            )
        texts = [a for a in asks if isinstance(a, MetricsText)]
        failed = [i for i, a in zip(ids, asks, strict=True) if not isinstance(a, MetricsText)]
        for answer in asks:
            if isinstance(answer, BaseException) and not isinstance(answer, BackendError):
                raise answer
        return texts, failed

    async def cluster_status(
        self, num_decisions: int = 20, timeout_s: float = 2.0
    ) -> ClusterStatus:
        """The Conductor's view of the cluster and its latest ``num_decisions`` decisions
        (for the live cluster page); BackendError when it does not answer in ``timeout_s``."""
        msg = StatusQuery(num_decisions=num_decisions)
        status = await self._call(self._conductor_endpoint, msg, timeout_s)
        if not isinstance(status, ClusterStatus):
            error = reason_of(status)
            raise BackendError(f"the Conductor answered a status query with {error}")
        return status

    async def workload_window(self, window_s: float, timeout_s: float = 5.0) -> WorkloadWindow:
        """The requests the Conductor placed in the last ``window_s`` seconds and what a
        simulation of the cluster needs (live re-planning); BackendError when it does not
        answer in ``timeout_s``."""
        reply = await self._call(self._conductor_endpoint, WorkloadQuery(window_s=window_s),
                                 timeout_s)  # fmt: skip
        if not isinstance(reply, WorkloadWindow):
            error = reason_of(reply)
            raise BackendError(f"the Conductor answered a workload query with {error}")
        return reply

    async def load_adapter(self, adapter: RuntimeAdapter, timeout_s: float = 60.0) -> None:
        """Load LoRA adapter ``adapter`` on every worker (vLLM's ``/v1/load_lora_adapter``
        for a cluster): the Conductor first, so that a worker registering meanwhile is
        given it, then each worker it lists, at once. When any cannot (its reason in the
        BackendError), it is unloaded again where it loaded: all or none."""
        record = AdapterRecord.of(adapter)
        await self._tell_adapters("load", record, timeout_s)
        loaded: dict[str, str] = {}
        try:
            endpoints = serving(await self._ping(timeout_s))
            results = await self._on_workers(
                endpoints, AdapterUpdate(op="load", adapter=record), timeout_s
            )
            loaded = {i: endpoints[i] for i, r in results.items() if r is None}
            failed = [r for r in results.values() if isinstance(r, BaseException)]
            if failed:
                raise BackendError(str(failed[0]))
        except BackendError:
            unload = AdapterUpdate(op="unload", adapter=AdapterRecord(name=adapter.name,
                                                                      path="", tag=""))  # fmt: skip
            await self._on_workers(loaded, unload, timeout_s)
            with contextlib.suppress(BackendError):
                await self._tell_adapters("unload", unload.adapter, timeout_s)
            raise

    async def unload_adapter(self, name: str, timeout_s: float = 60.0) -> None:
        """Unload LoRA adapter ``name`` everywhere (``/v1/unload_lora_adapter``): out of
        the Conductor's list (and this gateway's) first, so that no new request names it,
        then off every worker, each once the requests using it there have finished."""
        record = AdapterRecord(name=name, path="", tag="")
        await self._tell_adapters("unload", record, timeout_s)
        endpoints = serving(await self._ping(timeout_s))
        results = await self._on_workers(endpoints, AdapterUpdate(op="unload", adapter=record),
                                         timeout_s)  # fmt: skip
        for instance_id, result in results.items():
            if isinstance(result, BaseException):  # (one that never had it, or gone)
                log.warning("unloading LoRA adapter %r on %s: %s", name, instance_id, result)

    async def reset_prefix_cache(self, external: bool, timeout_s: float = 60.0) -> dict[str, str]:
        """Have every worker forget its engine's cached prefixes, and with ``external``
        its block store's (vLLM's ``/reset_prefix_cache``), at once: per instance, ""
        when all of it went, else why not (running requests hold blocks, its engine
        cannot). Their cache events tell the Conductor."""

        async def one(endpoint: str) -> str:
            try:
                reply = await self._call(endpoint, ResetPrefixCache(external=external), timeout_s)
            except BackendError as exc:
                return str(exc)
            if isinstance(reply, CacheReset):
                return "" if reply.success else reply.reason or "not reset"
            return reason_of(reply)

        endpoints = serving(await self._ping(timeout_s))
        reasons = await asyncio.gather(*(one(e) for e in endpoints.values()))
        return dict(zip(endpoints, reasons, strict=True))

    async def update_weights(self, path: str, version: str, timeout_s: float = 600.0) -> None:
        """Install the checkpoint at ``path`` on every worker, all or none (SGLang's
        ``/update_weights_from_disk`` for a cluster): each reads it beside its served
        weights (``stage``); if any cannot, the others drop theirs and the BackendError
        says why; else each installs its (``commit``) and forgets the KV of the old
        weights, and the Conductor keeps them as the cluster's (a worker registering from
        then on installs them first). Requests must have ended (the gateway pauses)."""
        record = WeightsRecord(path=path, version=version)
        first = await self._ping(timeout_s)
        endpoints = serving(first)
        if not endpoints:
            raise BackendError("no worker is registered")
        staged = await self._weights_on(endpoints, UpdateWeights(op="stage", weights=record),
                                        timeout_s)  # fmt: skip
        failed = [str(r) for r in staged.values() if r is not None]
        if failed:
            await self._weights_on(endpoints, UpdateWeights(op="drop"), timeout_s)
            raise BackendError(f"new weights not installed: {failed[0]}")
        committed = await self._commit_when_idle(endpoints, record, timeout_s)
        failed = [f"{i}: {r}" for i, r in committed.items() if r is not None]
        # (those that installed them serve them: the record says so, and a worker that
        # failed to is told again when it registers)
        if len(failed) < len(endpoints):
            await self._record_weights(UpdateWeights(op="record", weights=record), timeout_s)
            # A worker that registered (or restarted) meanwhile was given the old record:
            # it installs them now (one registering from now on is given the new one).
            later = await self._ping(timeout_s)
            joined = {i: e for i, e in serving(later).items()
                      if later.incarnations.get(i) != first.incarnations.get(i)}  # fmt: skip
            for op in ("stage", "commit"):
                late = await self._weights_on(joined, UpdateWeights(op=op, weights=record),
                                              timeout_s)  # fmt: skip
                failed += [f"{i}: {r}" for i, r in late.items() if r is not None]
                joined = {i: e for i, e in joined.items() if late[i] is None}
        if failed:
            await self._weights_on(endpoints, UpdateWeights(op="drop"), timeout_s)
            raise BackendError(f"new weights not installed everywhere: {'; '.join(failed)}")

    async def _commit_when_idle(
        self, endpoints: dict[str, str], record: WeightsRecord, timeout_s: float
    ) -> dict[str, BackendError | None]:
        """``commit`` on every worker, each asked again while its requests are still
        ending (:meth:`_when_idle`)."""
        msg = UpdateWeights(op="commit", weights=record)
        results = await self._when_idle(endpoints, msg, WeightsOk, timeout_s)
        return {i: r if isinstance(r, BackendError) else None for i, r in results.items()}

    async def _when_idle(
        self, endpoints: dict[str, str], msg: Message, answer: type[Message], timeout_s: float
    ) -> dict[str, Message | BackendError]:
        """:meth:`_each`, a worker whose requests are still ending (the gateway saw them
        end, but an aborted one may still be finishing its KV stream there) asked again
        every 0.1 s for up to :data:`COMMIT_SETTLE_S`."""
        results = await self._each(endpoints, msg, answer, timeout_s)
        deadline = time.monotonic() + COMMIT_SETTLE_S
        while time.monotonic() < deadline:
            busy = {i: endpoints[i] for i, r in results.items() if isinstance(r, WorkerBusy)}
            if not busy:
                break
            await asyncio.sleep(0.1)
            results.update(await self._each(busy, msg, answer, timeout_s))
        return results

    async def sleep_workers(self, timeout_s: float = 60.0) -> int:
        """vLLM's sleep, level 1, on every worker (but a draining one): each forgets its
        cached prefixes and releases its KV pool, once its last requests have ended
        (:meth:`_when_idle`); the bytes released in all. All or none: when any cannot,
        those that slept wake up again and the BackendError says why
        (:class:`BackendRefused` where an engine has no sleep mode)."""
        endpoints = serving(await self._ping(timeout_s))
        results = await self._when_idle(endpoints, Sleep(op="sleep"), SleepState, timeout_s)
        failed = [r for r in results.values() if isinstance(r, BackendError)]
        if failed:
            asleep = {i: endpoints[i] for i, r in results.items() if isinstance(r, SleepState)}
            await self._each(asleep, Sleep(op="wake"), SleepState, timeout_s)
            raise failed[0]
        return sum(r.released_bytes for r in results.values() if isinstance(r, SleepState))

    async def wake_workers(self, timeout_s: float = 60.0) -> None:
        """Every worker's KV pool allocated again after :meth:`sleep_workers` (one that
        restarted meanwhile is awake already); BackendError naming one that could not."""
        endpoints = serving(await self._ping(timeout_s))
        results = await self._each(endpoints, Sleep(op="wake"), SleepState, timeout_s)
        failed = [r for r in results.values() if isinstance(r, BackendError)]
        if failed:
            raise failed[0]

    async def start_profile(
        self, config: ProfilerConfig, session: ProfileSession, timeout_s: float = 60.0
    ) -> list[str]:
        """vLLM's ``/start_profile`` on every worker (but a draining one): each records its
        engine's coming steps with torch's profiler; the instances profiling. All or none:
        when any cannot, those that started stop again (their traces, if any, stay) and
        the BackendError says why (:class:`BackendRefused` where an engine has none)."""
        endpoints = serving(await self._ping(timeout_s))
        if not endpoints:
            raise BackendError("no worker is registered")
        msg = Profile(op="start", config=config.to_json(), prefix=session.profile_prefix or "",
                      delay_iterations=_or_unset(session.delay_iterations),
                      max_iterations=_or_unset(session.max_iterations))  # fmt: skip
        results = await self._each(endpoints, msg, ProfileState, timeout_s)
        failed = [r for r in results.values() if isinstance(r, BackendError)]
        if failed:
            started = {i: endpoints[i] for i, r in results.items() if isinstance(r, ProfileState)}
            await self._each(started, Profile(op="stop"), ProfileState, STOP_TIMEOUT_S)
            raise failed[0]
        return sorted(endpoints)

    async def stop_profile(
        self, timeout_s: float = STOP_TIMEOUT_S
    ) -> tuple[dict[str, list[str]], dict[str, str]]:
        """vLLM's ``/stop_profile`` on every worker: each ends its session and writes its
        trace (a worker that was not profiling writes none). A draining one is asked too
        (it may have recorded), for a few seconds only: it may have exited. Returns the
        traces written, by instance, and the errors of serving workers that failed to
        stop, by instance."""
        pong = await self._ping(5.0)
        endpoints = serving(pong)
        draining = {i: e for i, e in pong.endpoints.items() if i not in endpoints}
        results, leaving = await asyncio.gather(
            self._each(endpoints, Profile(op="stop"), ProfileState, timeout_s),
            self._each(draining, Profile(op="stop"), ProfileState, DRAINING_ANSWER_S),
        )  # fmt: skip
        answers = {**leaving, **results}
        traces = {i: r.traces for i, r in answers.items() if isinstance(r, ProfileState)}
        errors = {i: str(r) for i, r in results.items() if isinstance(r, BackendError)}
        return traces, errors

    async def weights(self, timeout_s: float = 5.0) -> WeightsRecord | None:
        """The weights installed while the cluster serves (None: those it started with)."""
        return await self._record_weights(UpdateWeights(op="query"), timeout_s)

    async def record_weights_version(self, version: str, timeout_s: float = 5.0) -> None:
        """Give the cluster's weights a new version label (the weights stay)."""
        current = await self.weights(timeout_s)
        path = "" if current is None else current.path
        await self._record_weights(
            UpdateWeights(op="record", weights=WeightsRecord(path=path, version=version)),
            timeout_s,
        )

    async def _record_weights(self, msg: UpdateWeights, timeout_s: float) -> WeightsRecord | None:
        reply = await self._call(self._conductor_endpoint, msg, timeout_s)
        if not isinstance(reply, WeightsOk):
            raise BackendError(f"the Conductor answered a weights {msg.op} with "
                               f"{reason_of(reply)}")  # fmt: skip
        return reply.weights

    async def _weights_on(
        self, endpoints: dict[str, str], msg: UpdateWeights, timeout_s: float
    ) -> dict[str, BackendError | None]:
        """``msg`` to every worker at once: per instance, None when it carried it out,
        else the error (a BackendError naming why)."""
        results = await self._each(endpoints, msg, WeightsOk, timeout_s)
        return {i: r if isinstance(r, BackendError) else None for i, r in results.items()}

    async def _each(
        self, endpoints: dict[str, str], msg: Message, answer: type[Message], timeout_s: float
    ) -> dict[str, Message | BackendError]:
        """``msg`` to every worker at once: per instance, its reply when an ``answer``,
        else the error naming why (:class:`WorkerBusy` for a retryable refusal,
        :class:`BackendRefused` for what its engine cannot do)."""

        async def one(endpoint: str) -> Message | BackendError:
            try:
                reply = await self._call(endpoint, msg, timeout_s)
            except BackendError as exc:
                return exc
            if isinstance(reply, answer):
                return reply
            kind = BackendError
            if isinstance(reply, Error) and reply.retryable:
                kind = WorkerBusy
            elif isinstance(reply, Error) and reply.unsupported:
                kind = BackendRefused
            return kind(reason_of(reply))

        results = await asyncio.gather(*(one(e) for e in endpoints.values()))
        return dict(zip(endpoints, results, strict=True))

    async def _tell_adapters(self, op: str, record: AdapterRecord, timeout_s: float) -> None:
        """The Conductor's list of adapters loaded while serving, updated (and this
        gateway's view of it with it)."""
        reply = await self._call(self._conductor_endpoint,
                                 AdapterUpdate(op=op, adapter=record), timeout_s)  # fmt: skip
        if not isinstance(reply, AdaptersOk):
            error = reason_of(reply)
            raise BackendError(f"the Conductor did not take the adapter: {error}")
        self.adapters = {r.name: r.adapter() for r in reply.adapters}

    async def _on_workers(
        self, endpoints: dict[str, str], msg: AdapterUpdate, timeout_s: float
    ) -> dict[str, BaseException | None]:
        """Send ``msg`` to every worker of ``endpoints`` at once: per instance, None when
        it carried it out, else the error."""

        async def one(endpoint: str) -> None:
            reply = await self._call(endpoint, msg, timeout_s)
            if not isinstance(reply, AdaptersOk):
                error = reason_of(reply)
                raise BackendError(error)

        results = await asyncio.gather(*(one(e) for e in endpoints.values()),
                                       return_exceptions=True)  # fmt: skip
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # (a cancellation)
        return dict(zip(endpoints, results, strict=True))

    async def drain(self, instance_id: str, timeout_s: float = 5.0) -> None:
        """Take ``instance_id`` out of placement; it exits once its requests finish
        (BackendError when the Conductor refuses, e.g. it does not know the instance)."""
        reply = await self._call(self._conductor_endpoint, Drain(instance_id=instance_id),
                                 timeout_s)  # fmt: skip
        if not isinstance(reply, Draining):
            error = reason_of(reply)
            raise BackendError(f"the Conductor did not drain {instance_id}: {error}")

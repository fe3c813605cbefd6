"""The cluster backend's ``abort`` ends the request's stream wherever it is: while its
tokens stream (a last chunk finished ``abort``) and while it is still being placed (it
ends as soon as it is placed, and its workers are told); either way the Conductor's
booking is released. The sockets are replaced by recorders."""

from __future__ import annotations

import asyncio

from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.messages import Endpoints, PlacementDecision, Release, Tokens
from halfmoon.serve.gateway.cluster_client import ClusterBackend

WORKER = Endpoints(instance_id="w", command="tcp://127.0.0.1:1", transfer="tcp://127.0.0.1:2")
PLACED = PlacementDecision(accepted=True, prefill=WORKER, decode=WORKER)


def recording_backend(place_delay_s: float) -> tuple[ClusterBackend, list, list]:
    """A backend whose Conductor places every request after ``place_delay_s`` and whose
    workers are never reached: (backend, what the Conductor was told, requests started)."""
    backend = ClusterBackend("tcp://127.0.0.1:1", b"secret", 16)
    told: list = []
    started: list[str] = []

    async def call(endpoint, msg, timeout_s):
        await asyncio.sleep(place_delay_s)
        return PLACED

    async def start(attempt_id, ids, params, decision, cache_salt):
        started.append(attempt_id)

    async def tell(msg):
        told.append(msg)

    backend._call, backend._start, backend._tell_conductor = call, start, tell
    return backend, told, started


async def _read(backend: ClusterBackend, request_id: str) -> list:
    return [c async for c in backend.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=50))]


def test_an_abort_ends_a_streaming_request() -> None:
    backend, told, started = recording_backend(0.0)

    async def scenario() -> list:
        reading = asyncio.ensure_future(_read(backend, "r"))
        while "r" not in backend._queues:
            await asyncio.sleep(0.01)
        backend._queues["r"].put_nowait(Tokens(request_id="r", index=0, token_ids=[7, 8]))
        await asyncio.sleep(0.05)
        await backend.abort("r")
        return await asyncio.wait_for(reading, 5)

    chunks = asyncio.run(scenario())
    assert [c.token_ids for c in chunks] == [(7, 8), ()]
    assert chunks[-1].finish_reason == "abort"
    assert started == ["r"] and any(isinstance(m, Release) for m in told)
    assert not backend._aborting and not backend._queues and not backend._attempts


def test_an_abort_while_placing_ends_the_request_once_placed() -> None:
    backend, told, started = recording_backend(0.3)

    async def scenario() -> list:
        reading = asyncio.ensure_future(_read(backend, "p"))
        await asyncio.sleep(0.1)  # (the Conductor has not answered yet)
        await backend.abort("p")
        return await asyncio.wait_for(reading, 5)

    chunks = asyncio.run(scenario())
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [((), "abort")]
    assert [m.request_id for m in told if isinstance(m, Release)] == ["p"]
    assert not backend._aborting


def test_aborting_a_finished_request_leaves_nothing_behind() -> None:
    backend, _, _ = recording_backend(0.0)
    asyncio.run(backend.abort("gone"))
    assert not backend._aborting

"""Shared pieces of the serve tests: a Conductor service on a thread, a worker role with
nothing to do, a Conductor link that records what it is told, and a gateway backend that
records what it is asked."""

from __future__ import annotations

import random
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.core.clock import WallClock
from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.conductor_main import load_cost_model
from halfmoon.serve.control.conductor_service import ConductorService
from halfmoon.serve.gateway.backend import GenerationChunk


@contextmanager
def conductor_thread(secret: bytes) -> Iterator[ConductorService]:
    """A Conductor service answering on its own thread until the block ends."""
    core = Conductor(ConductorConfig(), load_cost_model(None, 16384), WallClock(),
                     random.Random(0))  # fmt: skip
    service = ConductorService(core, secret, "tcp://127.0.0.1:*")
    stop = threading.Event()
    thread = threading.Thread(target=service.serve_forever, args=(20, stop.is_set), daemon=True)
    thread.start()
    try:
        yield service
    finally:
        stop.set()
        thread.join(5)
        service.close()


class RecordingLink:
    """The Conductor link of a worker under test: records each lifecycle event as
    ``(kind, request_id)``; cache events, flushes and closing do nothing."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def event(self, kind: str, **fields: object) -> None:
        assert kind
        self.events.append((kind, str(fields.get("request_id"))))

    def cache_event(self, event: object) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class IdleRole:
    """A worker role with nothing to do: the worker answers its own commands only
    (ping, metrics_query)."""

    def handlers(self) -> dict:
        return {}

    def on_outputs(self, outputs: list) -> None:
        return None

    def on_abort(self, request_id: str) -> None:
        return None

    def on_failure(self, failure: object) -> None:
        return None

    def tick(self) -> None:
        return None

    def has_work(self) -> bool:
        return False

    def num_pending(self) -> int:
        return 0

    def stats(self) -> dict:
        return {}

    def snapshot(self) -> list:
        return []

    def close(self) -> None:
        return None


class RecordingBackend:
    """A gateway backend that answers token 65 ``max_tokens`` times and records the
    request ids it is given and the ones it is told to abort."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.aborted: list[str] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.request_ids.append(request_id)
        for i in range(params.max_tokens):
            last = i == params.max_tokens - 1
            yield GenerationChunk((65,), "length" if last else None, 0 if i == 0 else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "recording"}

"""Shared pieces of the worker and metrics tests: a Conductor service on a thread, a
worker role with nothing to do, and a Conductor link that records what it is told."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.core.clock import WallClock
from halfmoon.serve.control.conductor_main import load_cost_model
from halfmoon.serve.control.conductor_service import ConductorService


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

"""A worker's load report carries its engine's queued prefill tokens, and the Conductor's
queueing estimate for that instance follows them (work it did not place itself, e.g.
after a Conductor restart, still counts)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from halfmoon.engine.engine import EngineStats
from halfmoon.serve.worker import process
from halfmoon.serve.worker.conductor_link import ConductorLink, WorkerIdentity
from halfmoon.serve.worker.process import Worker
from tests.serve.fakes import IdleRole, conductor_thread

SECRET = b"load-reports-secret-0123456789"


@contextmanager
def reporting_worker(
    instance_id: str, queued: dict[str, int]
) -> Iterator[tuple[object, Callable[[], int]]]:
    """A prefill worker whose engine reports ``queued["tokens"]`` queued prefill tokens,
    running against a Conductor service: (the service, the last reported count or -1)."""
    engine = SimpleNamespace(
        stats=lambda: EngineStats(1, 0, 8, 8, 0, 0, num_prefill_tokens=queued["tokens"]),
        config=SimpleNamespace(block_size=16),
        has_unfinished_requests=lambda: False,
        close=lambda: None,
        take_failures=lambda: [],
    )
    with conductor_thread(SECRET) as service:
        me = WorkerIdentity("prefill", instance_id, "")
        link = ConductorLink(service.endpoint, SECRET, me)
        worker = Worker(me, engine, SECRET, link, "tcp://127.0.0.1:*")
        me.command_endpoint = worker.endpoint
        link.register(kv_capacity_tokens=128, timeout_s=10)
        worker.set_role(IdleRole())
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop.is_set,), daemon=True)
        thread.start()

        def reported() -> int:
            load = service.last_load.get(instance_id)
            return load.queued_prefill_tokens if load is not None else -1

        try:
            yield service, reported
        finally:
            stop.set()
            thread.join(5)
            worker.close()


def _wait_for(reported: Callable[[], int], value: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while reported() != value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reported() == value


def test_queued_prefill_tokens_reach_the_conductors_queue_estimate():
    queued = {"tokens": 0}
    with reporting_worker("p0", queued) as (service, reported):
        queued["tokens"] = 6000
        _wait_for(reported, 6000, 10)
        assert service.conductor.queue_s("p0") > 0  # nothing was placed there
        queued["tokens"] = 0
        _wait_for(reported, 0, 10)


def test_a_report_follows_at_once_when_the_named_prefill_queue_empties(monkeypatch):
    """Between two periodic reports, the worker still reports as soon as the prefill
    queue its last report named is empty (a stale queue would keep work away from it)."""
    queued = {"tokens": 4000}
    with reporting_worker("p1", queued) as (service, reported):
        _wait_for(reported, 4000, 10)  # the first report, at start
        monkeypatch.setattr(process, "LOAD_REPORT_INTERVAL_S", 3600.0)  # no more periodic
        queued["tokens"] = 2500  # still queued: no report until the interval
        time.sleep(0.5)
        assert reported() == 4000
        queued["tokens"] = 0
        _wait_for(reported, 0, 5)
        assert service.conductor.queue_s("p1") == 0.0

"""A worker's load report carries its engine's queued prefill tokens, and the Conductor's
queueing estimate for that instance follows them (work it did not place itself, e.g.
after a Conductor restart, still counts)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from halfmoon.engine.engine import EngineStats
from halfmoon.serve.worker import process
from halfmoon.serve.worker.process import ConductorLink, Worker, WorkerIdentity
from tests.serve.fakes import IdleRole, conductor_thread

SECRET = b"load-reports-secret-0123456789"


def test_queued_prefill_tokens_reach_the_conductors_queue_estimate():
    queued = {"tokens": 0}
    engine = SimpleNamespace(
        stats=lambda: EngineStats(1, 0, 8, 8, 0, 0, num_prefill_tokens=queued["tokens"]),
        config=SimpleNamespace(block_size=16),
        has_unfinished_requests=lambda: False,
        close=lambda: None,
    )
    with conductor_thread(SECRET) as service:
        me = WorkerIdentity("prefill", "p0", "")
        link = ConductorLink(service.endpoint, SECRET, me)
        worker = Worker(me, engine, SECRET, link, "tcp://127.0.0.1:*")
        me.command_endpoint = worker.endpoint
        link.register(kv_capacity_tokens=128, timeout_s=10)
        worker.set_role(IdleRole())
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop.is_set,), daemon=True)
        thread.start()
        try:
            queued["tokens"] = 6000

            def reported() -> int:
                load = service.last_load.get("p0")
                return load.queued_prefill_tokens if load is not None else -1

            deadline = time.monotonic() + 10
            while reported() != 6000 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reported() == 6000
            assert service.conductor.queue_s("p0") > 0  # nothing was placed there
            queued["tokens"] = 0
            deadline = time.monotonic() + 10
            while reported() != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reported() == 0
        finally:
            stop.set()
            thread.join(5)
            worker.close()


def test_a_report_follows_at_once_when_the_named_prefill_queue_empties(monkeypatch):
    """Between two periodic reports, the worker still reports as soon as the prefill
    queue its last report named is empty (a stale queue would keep work away from it)."""
    queued = {"tokens": 4000}
    engine = SimpleNamespace(
        stats=lambda: EngineStats(1, 0, 8, 8, 0, 0, num_prefill_tokens=queued["tokens"]),
        config=SimpleNamespace(block_size=16),
        has_unfinished_requests=lambda: False,
        close=lambda: None,
    )
    with conductor_thread(SECRET) as service:
        me = WorkerIdentity("prefill", "p1", "")
        link = ConductorLink(service.endpoint, SECRET, me)
        worker = Worker(me, engine, SECRET, link, "tcp://127.0.0.1:*")
        me.command_endpoint = worker.endpoint
        link.register(kv_capacity_tokens=128, timeout_s=10)
        worker.set_role(IdleRole())
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop.is_set,), daemon=True)
        thread.start()
        try:

            def reported() -> int:
                load = service.last_load.get("p1")
                return load.queued_prefill_tokens if load is not None else -1

            deadline = time.monotonic() + 10
            while reported() != 4000 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert reported() == 4000  # the first report, at start
            monkeypatch.setattr(process, "LOAD_REPORT_INTERVAL_S", 3600.0)  # no more periodic
            queued["tokens"] = 2500  # still queued: no report until the interval
            time.sleep(0.5)
            assert reported() == 4000
            queued["tokens"] = 0
            deadline = time.monotonic() + 5
            while reported() != 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert reported() == 0
            assert service.conductor.queue_s("p1") == 0.0
        finally:
            stop.set()
            thread.join(5)
            worker.close()

"""A prefill worker's block-store counters reach the gateway's ``/metrics``: the worker's
load reports carry them to the Conductor, whose pong carries them to the gateway.

In-process: a real Conductor service on a thread, a real Worker and store (over a fake
engine), a real ClusterBackend under the gateway app; the live cluster is in tests/e2e."""

from __future__ import annotations

import random
import re
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.core.clock import WallClock
from halfmoon.engine.engine import EngineStats
from halfmoon.serve.control.conductor_main import load_cost_model
from halfmoon.serve.control.conductor_service import ConductorService
from halfmoon.serve.gateway.cluster_client import ClusterBackend
from halfmoon.serve.runtime import free_port
from halfmoon.serve.worker.process import ConductorLink, Worker, WorkerIdentity
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.store.ssd import DATA_FILE

SECRET = b"store-metrics-secret"
BLOCK_BYTES = 4096


@pytest.fixture
def conductor():
    """A Conductor service answering on its own thread."""
    rng = random.Random(0)
    core = Conductor(ConductorConfig(), load_cost_model(None, 16384), WallClock(), rng)
    service = ConductorService(core, SECRET, "tcp://127.0.0.1:*")
    stop = threading.Event()
    thread = threading.Thread(target=service.serve_forever, args=(20, stop.is_set), daemon=True)
    thread.start()
    yield service
    stop.set()
    thread.join(5)
    service.close()


def _store_with_a_corrupt_block(directory: str) -> TieredStore:
    """An SSD-only store after one good read and one corrupt read."""
    store = TieredStore(
        StoreConfig(BLOCK_BYTES, 0, ssd_dir=directory, ssd_capacity_bytes=4 * BLOCK_BYTES)
    )
    for h in (1, 2):
        store.put(h, bytes([h]) * BLOCK_BYTES, BlockMeta(16, h - 1))
    with open(f"{directory}/{DATA_FILE}", "r+b") as f:
        f.seek(store.ssd_file_offset(2) + 10)
        f.write(b"\xee" * 8)
    buf = bytearray(BLOCK_BYTES)
    assert store.get_into(1, buf) is not None
    assert store.get_into(2, buf) is None  # corrupt: a miss
    return store


def _report(service: ConductorService, store: TieredStore, incarnation: str = "") -> Worker:
    """A registered prefill worker ``p0`` that has sent one load report for ``store``."""
    me = WorkerIdentity("prefill", "p0", "tcp://127.0.0.1:1")
    link = ConductorLink(service.endpoint, SECRET, me)
    link.incarnation = incarnation or link.incarnation
    link.register(kv_capacity_tokens=128, timeout_s=10)
    engine = SimpleNamespace(
        stats=lambda: EngineStats(0, 0, 8, 8, 0, 0),
        config=SimpleNamespace(block_size=16),
        close=lambda: None,
    )
    worker = Worker(me, engine, SECRET, link, "tcp://127.0.0.1:*")
    worker.store = store
    worker._maybe_report()  # noqa: SLF001 - one report now, not on the loop's schedule
    link.flush()
    return worker


def _scrape_until(client: TestClient, pattern: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = client.get("/metrics").text
        if re.search(pattern, text, re.M) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_corrupt_blocks_reach_the_gateway_metrics(conductor, gateways, tmp_path):
    stores = [_store_with_a_corrupt_block(str(tmp_path))]
    assert stores[0].stats().num_corrupt == 1
    workers = [_report(conductor, stores[0])]
    backend = ClusterBackend(conductor.endpoint, SECRET, 16)
    try:
        with TestClient(gateways.app(backend)) as client:
            corrupt = r'^halfmoon:kv_store_corrupt_blocks_total\{instance="p0"\} 1\.0$'
            text = _scrape_until(client, corrupt)
            assert re.search(corrupt, text, re.M), text
            assert 'halfmoon:kv_store_hits_total{instance="p0",tier="ssd"} 1.0' in text
            assert 'halfmoon:kv_store_hits_total{instance="p0",tier="dram"} 0.0' in text
            assert 'halfmoon:kv_store_misses_total{instance="p0"} 1.0' in text
            # A restarted worker's counters start again: the old ones are forgotten.
            stores.append(TieredStore(StoreConfig(BLOCK_BYTES, BLOCK_BYTES)))
            workers.append(_report(conductor, stores[-1], incarnation="restarted"))
            fresh = r'^halfmoon:kv_store_corrupt_blocks_total\{instance="p0"\} 0\.0$'
            assert re.search(fresh, _scrape_until(client, fresh), re.M)
            client.portal.call(backend.close)
    finally:
        for worker in workers:
            worker.close()
        for store in stores:
            store.close()


def test_metrics_answer_at_once_without_a_conductor(gateways):
    backend = ClusterBackend(f"tcp://127.0.0.1:{free_port()}", SECRET, 16)
    with TestClient(gateways.app(backend)) as client:
        start = time.monotonic()
        response = client.get("/metrics")
        assert time.monotonic() - start < 5.0  # one bounded ask, no hang
        assert response.status_code == 200
        assert "# HELP halfmoon:kv_store_corrupt_blocks" in response.text  # no worker yet
        assert "halfmoon:kv_store_corrupt_blocks_total{" not in response.text
        client.portal.call(backend.close)

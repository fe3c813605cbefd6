"""A prefill worker's block-store figures reach the gateway's ``/metrics``: the gateway
asks the worker itself (``metrics_query``) and labels its series ``role`` / ``worker``.

In-process: a real Conductor service on a thread, a real Worker and store (over a fake
engine) serving its loop on a thread, a real ClusterBackend under the gateway app; the
live cluster is in tests/e2e."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from halfmoon.engine.engine import EngineStats
from halfmoon.serve.gateway.cluster_client import ClusterBackend
from halfmoon.serve.runtime import free_port
from halfmoon.serve.worker.conductor_link import ConductorLink, WorkerIdentity
from halfmoon.serve.worker.process import Worker
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.store.ssd import DATA_FILE
from tests.serve.fakes import IdleRole, conductor_thread

SECRET = b"store-metrics-secret"
BLOCK_BYTES = 4096


@pytest.fixture
def conductor():
    """A Conductor service answering on its own thread."""
    with conductor_thread(SECRET) as service:
        yield service


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


@pytest.fixture
def prefill_worker(conductor):
    """Starts registered prefill worker ``p0`` exporting a store's figures, its loop on a
    thread; stops it at the end."""
    started = []

    def start(store: TieredStore) -> Worker:
        engine = SimpleNamespace(
            stats=lambda: EngineStats(0, 0, 8, 8, 0, 0), config=SimpleNamespace(block_size=16),
            has_unfinished_requests=lambda: False, close=lambda: None, take_failures=lambda: [],
        )  # fmt: skip
        me = WorkerIdentity("prefill", "p0", "")
        link = ConductorLink(conductor.endpoint, SECRET, me)
        worker = Worker(me, engine, SECRET, link, "tcp://127.0.0.1:*")
        me.command_endpoint = worker.endpoint
        link.register(kv_capacity_tokens=128, timeout_s=10)
        worker.store = store
        worker.metrics.add_store(store.stats, BLOCK_BYTES)
        worker.set_role(IdleRole())
        stop = threading.Event()
        thread = threading.Thread(target=worker.run, args=(stop.is_set,), daemon=True)
        thread.start()
        started.append((worker, stop, thread))
        return worker

    yield start
    for worker, stop, thread in started:
        stop.set()
        thread.join(5)
        worker.close()


def test_corrupt_blocks_reach_the_gateway_metrics(prefill_worker, conductor, gateways, tmp_path):
    store = _store_with_a_corrupt_block(str(tmp_path))
    assert store.stats().num_corrupt == 1
    prefill_worker(store)
    backend = ClusterBackend(conductor.endpoint, SECRET, 16)
    labels = 'model_name="tiny",role="prefill",worker="p0"'
    try:
        with TestClient(gateways.app(backend, model="tiny")) as client:
            text = client.get("/metrics").text
            corrupt = rf"^halfmoon:kv_store_corrupt_blocks_total\{{{labels}\}} 1\.0$"
            assert re.search(corrupt, text, re.M), text
            assert f"halfmoon:kv_store_misses_total{{{labels}}} 1.0" in text

            def tier(name: str, tier: str, value: float) -> str:  # labels sort by name
                return (f'{name}{{model_name="tiny",role="prefill",tier="{tier}",worker="p0"}} '
                        f"{float(value)}")  # fmt: skip

            assert tier("halfmoon:kv_store_hits_total", "ssd", 1) in text
            assert tier("halfmoon:kv_store_hits_total", "dram", 0) in text
            assert tier("halfmoon:kv_store_blocks", "ssd", 1) in text
            assert tier("halfmoon:kv_store_bytes", "ssd", BLOCK_BYTES) in text
            assert "halfmoon:scrape_errors_total{" not in text
            client.portal.call(backend.close)
    finally:
        store.close()


def test_metrics_answer_at_once_without_a_conductor(gateways):
    backend = ClusterBackend(f"tcp://127.0.0.1:{free_port()}", SECRET, 16)
    with TestClient(gateways.app(backend)) as client:
        start = time.monotonic()
        response = client.get("/metrics")
        assert time.monotonic() - start < 2.0  # one bounded ask, no hang
        assert response.status_code == 200
        assert "halfmoon:kv_store_corrupt_blocks" not in response.text  # no worker answered
        assert (
            'halfmoon:scrape_errors_total{model_name="echo",role="gateway",'
            'worker="conductor"} 1.0' in response.text
        )
        client.portal.call(backend.close)

"""A prefill worker's request whose prefix comes from a peer waits outside the engine
while a pull thread fetches it: the role goes on meanwhile, the request joins the engine
once the pull ended, and an abort while it waits leaves nothing behind."""

from __future__ import annotations

import socket
import time

import pytest

from halfmoon.core.hashing import NONE_HASH, hash_blocks
from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.messages import Endpoints, Prefill, WireParams
from halfmoon.store import BlockMeta
from tests.serve.fakes import RecordingLink

SECRET = b"prefill-pull-secret-0123456789ab"
PROMPT = [(i * 31) % 4000 + 23 for i in range(100)]  # 6 full 16-token blocks
#: No decode worker listens here: the requests below never reach their KV stream.
NOWHERE = Endpoints(instance_id="d0", command="tcp://127.0.0.1:1", transfer="127.0.0.1:1")


@pytest.fixture
def prefill(monkeypatch):
    from halfmoon.engine import EngineConfig, LLMEngine
    from halfmoon.engine.connector import LocalConnector
    from halfmoon.serve.worker import prefix_cache
    from halfmoon.serve.worker.conductor_link import WorkerIdentity
    from halfmoon.serve.worker.prefill import PrefillRole
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings
    from halfmoon.serve.worker.process import Worker
    from halfmoon.transfer import TransferEngine

    monkeypatch.setattr(prefix_cache, "PEER_TIMEOUT_S", 0.5)
    engine = LocalConnector(LLMEngine(EngineConfig(model="tiny", kv_cache_mb=16, num_threads=1)))
    link = RecordingLink()
    worker = Worker(WorkerIdentity("prefill", "p0", ""), engine, SECRET, link,
                    "tcp://127.0.0.1:*")  # fmt: skip
    holdings = Holdings(link)
    cache = ClusterPrefixCache(
        engine, ClusterPrefixCache.make_store(engine, 8, None, 0, holdings), holdings
    )
    role = PrefillRole(worker, TransferEngine(SECRET, transport="tcp"), cache, holdings)
    worker.set_role(role)
    try:
        yield role, link
    finally:
        role.close()
        worker.close()


def _prefill(rid: str, source: str) -> Prefill:
    return Prefill(
        request_id=rid, token_ids=PROMPT, params=WireParams.of(SamplingParams(max_tokens=4)),
        decode=NOWHERE, cache_source=Endpoints(instance_id="p1", command="", transfer=source),
        cached_tokens=96,
    )  # fmt: skip


def _tick_until(role, done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the pull did not end"
        role.tick()  # waits up to IDLE_WAIT_S on the pull while the engine is idle


def test_an_abort_while_the_prefix_is_pulled_leaves_nothing_behind(prefill):
    role, link = prefill
    blocks = role.worker.engine.engine.block_manager
    with socket.create_server(("127.0.0.1", 0)) as silent:  # a frozen peer
        role._on_prefill(b"client", _prefill("r1", f"127.0.0.1:{silent.getsockname()[1]}"))
        # Not in the engine, not announced: it waits for its pull.
        assert list(role.loading) == ["r1"] and role.has_work() and role.num_pending() == 1
        assert not role.worker.engine.has_unfinished_requests()
        assert ("prefill_started", "r1") not in link.events
        # The pool blocks its prefix needs are held for the pull from the start.
        assert blocks.num_free_blocks == blocks.num_blocks - 6
        role.on_abort("r1")
        assert not role.loading and role.num_pending() == 0
        assert ("request_finished", "r1") in link.events  # the Conductor's booking goes
        assert len(role.side_fetches) == 1  # the pull runs out on its own deadline
        # ... and so are its blocks, which the pull may still write into
        assert blocks.num_free_blocks == blocks.num_blocks - 6
        _tick_until(role, lambda: not role.side_fetches)
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.num_cached_blocks == 0
    blocks.check_integrity()
    assert not role.has_work() and not role.worker.engine.has_unfinished_requests()
    assert ("prefill_started", "r1") not in link.events and role.cache.num_blocks_pulled == 0


def test_a_request_joins_the_engine_once_its_pull_ended(prefill):
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings
    from halfmoon.transfer import TransferEngine

    role, link = prefill
    engine = role.worker.engine
    source_store = ClusterPrefixCache.make_store(engine, 8, None, 0, Holdings(RecordingLink()))
    parent = NONE_HASH
    for i, h in enumerate(hash_blocks(PROMPT, 16).full):
        payload = bytes([i + 1]) * engine.kv_bytes_per_block
        source_store.put(h, payload, BlockMeta(16, parent), position=i)
        parent = h
    with TransferEngine(SECRET, store=source_store, transport="tcp") as source:
        role._on_prefill(b"client", _prefill("r2", source.endpoint))
        assert list(role.loading) == ["r2"]
        _tick_until(role, lambda: not role.loading)
    assert engine.has_unfinished_requests()  # it joined the engine
    assert ("prefill_started", "r2") in link.events
    assert role.cache.num_blocks_pulled == 6 and role.cache.num_blocks_loaded == 6
    assert engine.cached_prefix_blocks(PROMPT, None) == 6  # seeded into the pool
    role.on_abort("r2")
    assert not engine.has_unfinished_requests()
    source_store.close()

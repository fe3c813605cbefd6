"""A prefill worker's cluster cache: blocks saved to the store and loaded into another
engine give the same output as computing them; corrupt SSD blocks are recomputed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from halfmoon.core.request import SamplingParams
from halfmoon.engine.connector import LocalConnector


class _Events:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def event(self, kind: str, **fields) -> None:
        self.kinds.append(kind)

    def cache_event(self, event) -> None:
        from halfmoon.core.events import BlockStored

        self.kinds.append("stored" if isinstance(event, BlockStored) else "evicted")


@pytest.fixture(scope="module")
def engines():
    from halfmoon.engine import EngineConfig, LLMEngine

    config = EngineConfig(model="tiny", kv_cache_mb=16, num_threads=1)
    return LLMEngine(config), LLMEngine(config)


def _run(engine, rid, prompt, n=6, cache_salt=None):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    engine.add_request(rid, prompt, params, keep_kv=True, cache_salt=cache_salt)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out = o
    return out


def _cache(engine, tmp_path: Path | None, events):
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings

    holdings = Holdings(events)
    ssd = str(tmp_path) if tmp_path else None
    store = ClusterPrefixCache.make_store(
        LocalConnector(engine), 0 if ssd else 8, ssd, 8 if ssd else 0, holdings
    )
    return ClusterPrefixCache(LocalConnector(engine), store, events), holdings


def test_blocks_saved_by_one_engine_serve_another(engines):
    a, b = engines
    events = _Events()
    cache_a, holdings = _cache(a, None, events)
    prompt = [(i * 37) % 4000 + 10 for i in range(200)]
    ref = _run(a, "a1", prompt)
    assert cache_a.save("a1", prompt) == 12  # 200 tokens: 12 full 16-token blocks
    a.export_kv("a1", release=True)
    assert events.kinds.count("stored") == 12 and len(holdings.snapshot()[0].block_hashes) == 12
    # engine B shares the store (as a peer pulling from it would): load, then prefill
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache

    cache_b = ClusterPrefixCache(LocalConnector(b), cache_a.store, events)
    assert cache_b.load(prompt) == 12
    out = _run(b, "b1", prompt)
    assert out.num_cached_tokens == 192
    assert out.token_ids == ref.token_ids  # the loaded KV is exactly the computed KV
    b.export_kv("b1", release=True)
    a.check_integrity()
    b.check_integrity()
    cache_a.store.check_integrity()


def test_salted_blocks_are_stored_and_found_only_under_their_salt(engines):
    from halfmoon.core.hashing import chain_root, hash_blocks
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache

    a, b = engines
    events = _Events()
    cache_a, holdings = _cache(a, None, events)
    prompt = [(i * 29) % 4000 + 11 for i in range(100)]
    ref = _run(a, "sa1", prompt, cache_salt="tenant-a")
    assert cache_a.save("sa1", prompt, "tenant-a") == 6
    a.export_kv("sa1", release=True)
    salted = hash_blocks(prompt, 16, chain_root("tenant-a")).full
    assert all(cache_a.store.contains(h) for h in salted)
    assert not any(cache_a.store.contains(h) for h in hash_blocks(prompt, 16).full)
    cache_b = ClusterPrefixCache(LocalConnector(b), cache_a.store, events)
    assert cache_b.load(prompt, cache_salt="tenant-b") == 0  # another tenant: nothing
    assert cache_b.load(prompt) == 0  # no salt: nothing
    assert cache_b.load(prompt, cache_salt="tenant-a") == 6
    assert _run(b, "sb0", prompt).num_cached_tokens == 0  # loaded, but under tenant-a only
    b.export_kv("sb0", release=True)
    out = _run(b, "sb1", prompt, cache_salt="tenant-a")
    assert out.num_cached_tokens == 96 and out.token_ids == ref.token_ids
    b.export_kv("sb1", release=True)
    a.check_integrity()
    b.check_integrity()


def test_corrupt_ssd_block_is_recomputed_not_served(engines, tmp_path):
    a, b = engines
    events = _Events()
    prompt = [(i * 53) % 4000 + 7 for i in range(100)]
    cache_a, ref = _saved_prompt(a, "a2", prompt, events, tmp_path)
    data_files = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and p.stat().st_size >= 6 * a.kv_bytes_per_block
    ]
    assert data_files
    with open(data_files[0], "r+b") as f:  # flip bytes in the middle of the 4th block
        f.seek(cache_a.store.ssd_file_offset(_hash(prompt, 3)) + 100)
        f.write(b"\xff" * 64)
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache

    cache_b = ClusterPrefixCache(LocalConnector(b), cache_a.store, events)
    loaded = cache_b.load(prompt)
    assert loaded == 3  # stops at the corrupt block
    out = _run(b, "b2", prompt)
    assert out.token_ids == ref.token_ids
    assert cache_a.store.stats().num_corrupt == 1
    b.export_kv("b2", release=True)
    b.check_integrity()


def test_blocks_cross_between_a_gpu_engine_and_the_store():
    """Saving copies blocks off the device into the store's host memory, loading copies
    them back: exactly (skipped without CUDA; ``HALFMOON_TEST_DEVICE=cpu`` dry-runs it)."""
    import torch

    device = os.environ.get("HALFMOON_TEST_DEVICE", "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from halfmoon.engine import EngineConfig, LLMEngine
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache

    config = EngineConfig(model="tiny", kv_cache_mb=16, num_threads=1, device=device)
    a, b = LLMEngine(config), LLMEngine(config)
    events = _Events()
    cache_a, _ = _cache(a, None, events)
    prompt = [(i * 41) % 4000 + 9 for i in range(100)]
    ref = _run(a, "g1", prompt)
    assert cache_a.save("g1", prompt) == 6
    computed = a.export_kv("g1", release=True).data  # [L, 2, 7, B, H, D] in host memory
    cache_b = ClusterPrefixCache(LocalConnector(b), cache_a.store, events)
    assert cache_b.load(prompt) == 6
    loaded = b.kv_cache.export_blocks(b.block_manager.match_prefix(prompt))
    assert torch.equal(loaded, computed[:, :, :6])
    out = _run(b, "g2", prompt)
    assert out.num_cached_tokens == 96 and out.token_ids == ref.token_ids
    b.export_kv("g2", release=True)
    a.check_integrity()
    b.check_integrity()


def _hash(prompt, index):
    from halfmoon.core.hashing import hash_blocks

    return hash_blocks(prompt, 16).full[index]


def _saved_prompt(engine, rid: str, prompt: list[int], events, ssd: Path | None = None):
    """``engine`` computes ``prompt`` and saves its full blocks in a store of its own (on
    ``ssd`` only, if given); (that cache, the reference output)."""
    cache, _ = _cache(engine, ssd, events)
    ref = _run(engine, rid, prompt)
    assert cache.save(rid, prompt) == len(prompt) // 16
    engine.export_kv(rid, release=True)
    return cache, ref


@contextlib.contextmanager
def _served_prompt(engine, rid: str, prompt: list[int], events):
    """``engine`` computes ``prompt`` and saves its full blocks in a store that a tcp
    transfer engine serves; yields (that cache, the reference output, a puller engine)."""
    from halfmoon.transfer import TransferEngine

    cache, ref = _saved_prompt(engine, rid, prompt, events)
    secret = rid.encode().ljust(32, b"s")
    with (
        TransferEngine(secret, store=cache.store, transport="tcp") as source,
        TransferEngine(secret, transport="tcp") as puller,
    ):
        yield SimpleNamespace(cache=cache, ref=ref, puller=puller, endpoint=source.endpoint)


def test_demote_stores_blocks_only_when_the_pool_evicts_them(engines):
    """--prefix-store demote: nothing is copied after a prefill; the pool's blocks are
    announced from the pool, read from it for a peer, and reach the store (still
    announced, without a gap) when the pool evicts them; another engine then loads them
    and computes exactly what computing them gives."""
    from halfmoon.core.hashing import hash_blocks
    from halfmoon.engine import EngineConfig, LLMEngine
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings

    _, b = engines
    a = LLMEngine(EngineConfig(model="tiny", kv_cache_mb=2, num_threads=1))
    events = _Events()
    holdings = Holdings(events)
    store = ClusterPrefixCache.make_store(LocalConnector(a), 16, None, 0, holdings)
    cache = ClusterPrefixCache(LocalConnector(a), store, holdings, "demote")
    prompt = [(i * 31) % 4000 + 5 for i in range(100)]
    chain = hash_blocks(prompt, 16).full  # 6 full blocks
    ref = _run(a, "d1", prompt)
    computed = [bytes(LocalConnector(a).block_bytes("d1", i)) for i in range(6)]
    assert cache.save("d1", prompt) == 0 and store.stats().dram.num_blocks == 0
    a.export_kv("d1", release=True)
    assert events.kinds.count("stored") == 6  # the pool's own events
    dest = memoryview(bytearray(a.kv_bytes_per_block))
    meta = cache.read_for_peer(chain[3], dest)
    assert meta is not None and meta.parent_hash == chain[2] and bytes(dest) == computed[3]
    # Other prompts fill the pool until it has evicted every block of the first.
    for k in range(100):
        if cache.num_blocks_demoted >= 6 and not a.block_manager.match_prefix(prompt):
            break
        other = [(i * 17 + k * 101) % 4000 + 3 for i in range(120)]
        _run(a, f"fill{k}", other, n=1)
        a.export_kv(f"fill{k}", release=True)
    assert all(store.contains(h) for h in chain)
    assert cache.read_for_peer(chain[3], dest) is None  # not in the pool any more
    assert all(holdings.tiers[h] == {"dram": {"store"}} for h in chain)  # never announced gone
    cache_b = ClusterPrefixCache(LocalConnector(b), store, events)
    assert cache_b.load(prompt) == 6
    out = _run(b, "d2", prompt)
    assert out.num_cached_tokens == 96 and out.token_ids == ref.token_ids
    b.export_kv("d2", release=True)
    a.check_integrity()
    b.check_integrity()
    store.check_integrity()


def test_with_demote_pulled_blocks_go_into_the_pool_only(engines):
    """--prefix-store demote: blocks pulled from a peer for a prefill are seeded into the
    pool and not put in the store (they reach it when the pool evicts them), where copy
    keeps them in both; either way the prefill computes what computing them gives."""
    from halfmoon.engine import EngineConfig, LLMEngine
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings

    a, _ = engines
    events = _Events()
    prompt = [(i * 43) % 4000 + 19 for i in range(100)]
    with _served_prompt(a, "p1", prompt, events) as source:
        for policy in ("demote", "copy"):
            b = LLMEngine(EngineConfig(model="tiny", kv_cache_mb=2, num_threads=1))
            holdings = Holdings(events)
            store = ClusterPrefixCache.make_store(LocalConnector(b), 16, None, 0, holdings)
            cache_b = ClusterPrefixCache(LocalConnector(b), store, holdings, policy)
            try:
                assert cache_b.load(prompt, source.puller, source.endpoint) == 6
                assert cache_b.num_blocks_pulled == 6
                stored = [store.contains(_hash(prompt, i)) for i in range(6)]
                assert stored == [policy == "copy"] * 6
                out = _run(b, f"p-{policy}", prompt)
                assert out.num_cached_tokens == 96 and out.token_ids == source.ref.token_ids
                b.export_kv(f"p-{policy}", release=True)
                b.check_integrity()
            finally:
                cache_b.close()
                store.close()


@pytest.mark.parametrize("held", [True, False])
def test_pulled_blocks_are_in_the_pool_before_the_load_ends(engines, held):
    """begin_load holds the pool blocks the prefix needs; every pulled block is copied
    into them as it arrives (on the transfer's threads), so end_load on the loop only
    registers them; the engine then computes exactly what computing the prefix gives.
    An engine that cannot hold blocks (None) gets them seeded at the end as before."""
    a, b = engines
    events = _Events()
    prompt = [(i * (67 if held else 71)) % 4000 + 31 for i in range(100)]
    with _served_prompt(a, f"h1-{held}", prompt, events) as source:
        cache_b, _ = _cache(b, None, events)
        if not held:
            cache_b.engine.reserve_prefix = lambda *args: None
        free = b.block_manager.num_free_blocks
        load = cache_b.begin_load(prompt, source.puller, source.endpoint)
        assert (load.reservation is not None) == held
        assert b.block_manager.num_free_blocks == free - 6 * held  # held from the start
        assert load.fetch.wait(10)
        if held:
            assert load.reservation.num_written() == 6  # before end_load
            pulled = [source.cache.store.get(_hash(prompt, i))[1] for i in range(6)]
            ids = load.reservation.block_ids
            assert [bytes(b.kv_cache.export_bytes([k])) for k in ids] == pulled
        assert b.block_manager.match_prefix(prompt) == []  # registered by end_load only
        assert cache_b.end_load(load) == 6 and cache_b.num_blocks_loaded == 6
        assert b.block_manager.num_free_blocks == free
        out = _run(b, f"h2-{held}", prompt)
        assert out.num_cached_tokens == 96 and out.token_ids == source.ref.token_ids
        b.export_kv(f"h2-{held}", release=True)
        b.check_integrity()
        cache_b.close()


def test_int8_pulled_blocks_are_decoded_straight_into_the_pool(engines):
    """With --kv-compression int8 and demote (pulled blocks go to the pool only), each
    encoded block is decoded straight into its held pool block, not into a buffer first:
    the pool then holds exactly the codec's decode of the source's blocks."""
    from halfmoon.engine.connector import wire_codec
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings
    from halfmoon.transfer import TransferEngine

    a, b = engines
    events = _Events()
    prompt = [(i * 73) % 4000 + 37 for i in range(100)]
    cache_a, _ = _saved_prompt(a, "i1", prompt, events)
    codec = wire_codec("int8", a.kv_layout, ["encode", "decode"])
    into_pool: list[tuple[int, ...]] = []
    decode_into = codec.decode_into

    def spy(payload, out):
        into_pool.append(tuple(out.shape))
        decode_into(payload, out)

    codec.decode_into = spy
    holdings = Holdings(events)
    store = ClusterPrefixCache.make_store(LocalConnector(b), 8, None, 0, holdings)
    cache_b = ClusterPrefixCache(LocalConnector(b), store, holdings, "demote")
    cache_b.pull_codec = codec
    secret = b"i" * 32
    with (
        TransferEngine(secret, store=cache_a.store, transport="tcp") as source,
        TransferEngine(secret, transport="tcp") as puller,
    ):
        source.set_pull_encoder(codec.encode)
        try:
            load = cache_b.begin_load(prompt, puller, source.endpoint)
            assert load.fetch.wait(10) and load.reservation.num_written() == 6
            # one decode per block, each into a pool block [L, 2, B, H_kv, D]
            assert into_pool == [b.kv_cache.pool[:, :, 0].shape] * 6
            expected = []
            for i in range(6):
                raw = cache_a.store.get(_hash(prompt, i))[1]
                out = bytearray(len(raw))
                codec.decode(codec.encode(memoryview(raw)), memoryview(out))
                expected.append(bytes(out))
            ids = load.reservation.block_ids
            assert [bytes(b.kv_cache.export_bytes([k])) for k in ids] == expected
            assert cache_b.end_load(load) == 6 and cache_b.num_blocks_pulled == 6
            assert not any(store.contains(_hash(prompt, i)) for i in range(6))  # demote
            b.check_integrity()
        finally:
            cache_b.close()
            store.close()


def test_a_block_the_pool_refuses_ends_the_seeded_prefix_there(engines, monkeypatch):
    """A block whose copy into the pool fails (a HalfmoonError) is logged and skipped:
    the load keeps the blocks before it, gives the rest back, and raises nothing."""
    from halfmoon.core.errors import HalfmoonError
    from halfmoon.engine.seeding import PrefixReservation
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache

    a, b = engines
    events = _Events()
    prompt = [(i * 79) % 4000 + 41 for i in range(100)]
    cache_a, ref = _saved_prompt(a, "r1", prompt, events)
    write = PrefixReservation.write

    def refuse_block_3(self, index, payload):
        if index == 3:
            raise HalfmoonError("a KV payload holds 1 bytes")
        write(self, index, payload)

    monkeypatch.setattr(PrefixReservation, "write", refuse_block_3)
    cache_b = ClusterPrefixCache(LocalConnector(b), cache_a.store, events)
    free = b.block_manager.num_free_blocks
    assert cache_b.load(prompt) == 3 and b.block_manager.num_free_blocks == free
    out = _run(b, "r2", prompt)
    assert out.num_cached_tokens == 48 and out.token_ids == ref.token_ids
    b.export_kv("r2", release=True)
    b.check_integrity()


def test_holdings_announce_a_block_while_either_source_holds_it():
    from halfmoon.core.events import BlockEvicted, BlockStored
    from halfmoon.serve.worker.prefix_cache import Holdings

    events = _Events()
    holdings = Holdings(events)
    holdings.from_pool(BlockStored(7))
    holdings(BlockStored(7))  # demoted into the store while the pool still has it
    holdings(BlockStored(7))  # a source repeating itself changes nothing
    holdings.from_pool(BlockEvicted(7))  # the pool reuses its block
    assert events.kinds == ["stored"] and holdings.tiers == {7: {"dram": {"store"}}}
    holdings(BlockStored(7, "ssd"))
    holdings(BlockEvicted(7))
    assert events.kinds == ["stored", "stored", "evicted"]
    assert holdings.tiers == {7: {"ssd": {"store"}}}
    assert [s.tier for s in holdings.snapshot()] == ["ssd"]
    holdings(BlockEvicted(7, "ssd"))
    assert holdings.tiers == {} and events.kinds[-1] == "evicted"


def test_int8_prefix_pull_between_workers_sends_compressed_blocks(engines):
    """--kv-compression int8 covers prefix pulls too: the source's store service encodes,
    the puller decodes; the blocks land within int8's error, and the Conductor is told
    the compressed size per token (its transfer estimates)."""
    import numpy as np

    from halfmoon.engine.connector import wire_codec
    from halfmoon.serve.worker.main import wire_bytes_per_block
    from halfmoon.transfer import TransferEngine

    a, b = engines
    events = _Events()
    cache_a, _ = _cache(a, None, events)
    cache_b, _ = _cache(b, None, events)
    codec = wire_codec("int8", a.kv_layout, ["encode", "decode"])
    sizes: list[int] = []

    def encode(view):
        payload = codec.encode(view)
        sizes.append(payload.nbytes)
        return payload

    cache_b.pull_codec = codec
    secret = b"s" * 32
    tcp = {"transport": "tcp"}  # between hosts (co-located workers pull through shm, raw)
    with (
        TransferEngine(secret, store=cache_a.store, **tcp) as source,
        TransferEngine(secret, **tcp) as puller,
    ):
        source.set_pull_encoder(encode, keep_bytes=4 << 20)  # as a worker keeps them
        prompt = [(i * 43) % 4000 + 13 for i in range(100)]
        _run(a, "p1", prompt)
        assert cache_a.save("p1", prompt) == 6
        raw = [bytes(LocalConnector(a).block_bytes("p1", i)) for i in range(6)]
        a.export_kv("p1", release=True)
        hashes = [_hash(prompt, i) for i in range(6)]
        got = cache_b.fetch(hashes, puller, source.endpoint)
        # a second puller of the same prefix gets the same payloads, encoded only once
        for h in hashes:
            cache_b.store.delete(h)
        again = cache_b.fetch(hashes, puller, source.endpoint)
    assert [bytes(x) for x in again] == [bytes(x) for x in got]
    assert len(got) == 6 and cache_b.num_blocks_pulled == 12
    per_block = wire_bytes_per_block(a.kv_bytes_per_block, codec)
    assert sizes == [per_block] * 6 and per_block < a.kv_bytes_per_block / 3.5
    for pulled, exact in zip(got, raw, strict=True):
        x = np.frombuffer(exact, np.float32)
        err = np.abs(np.frombuffer(pulled, np.float32) - x).max()
        assert 0 < err <= np.abs(x).max() / 127  # int8: at most half a step per group
    assert wire_bytes_per_block(a.kv_bytes_per_block, None) == a.kv_bytes_per_block


def test_a_load_whose_pool_gained_the_prefix_meanwhile_seeds_nothing_twice(engines):
    """begin_load pulls on a pull thread while the caller goes on, and that thread puts
    the pulled blocks in the store; if the engine computed the prompt itself meanwhile,
    end_load seeds nothing and reports the pool's own cached prefix."""
    a, b = engines
    events = _Events()
    cache_b, _ = _cache(b, None, events)
    prompt = [(i * 41) % 4000 + 17 for i in range(100)]
    with _served_prompt(a, "g1", prompt, events) as source:
        load = cache_b.begin_load(prompt, source.puller, source.endpoint)
        assert load.in_engine == 0 and load.fetch.future is not None
        out = _run(b, "g2", prompt)  # the caller's loop goes on: b computes the prompt
        b.export_kv("g2", release=True)
        assert load.fetch.wait(10)
        # The pull thread put the pulled blocks in the store: the loop only seeds them.
        assert all(cache_b.store.contains(_hash(prompt, i)) for i in range(6))
        assert cache_b.end_load(load) == 6
    assert out.token_ids == source.ref.token_ids and out.num_cached_tokens == 0
    assert cache_b.num_blocks_loaded == 0 and cache_b.num_blocks_pulled == 6
    assert all(cache_b.store.contains(_hash(prompt, i)) for i in range(6))
    cache_b.close()
    b.check_integrity()


def test_a_pull_from_a_silent_peer_does_not_hold_the_caller(engines, monkeypatch):
    """A peer that accepts connections but never answers (frozen): begin_load returns at
    once, the pull ends on its deadline with nothing, and the peer is skipped afterwards
    (the next load does not pull)."""
    import socket
    import time

    from halfmoon.serve.worker import prefix_cache
    from halfmoon.transfer import TransferEngine

    monkeypatch.setattr(prefix_cache, "PEER_TIMEOUT_S", 0.5)
    _, b = engines
    cache_b, _ = _cache(b, None, _Events())
    prompt = [(i * 47) % 4000 + 19 for i in range(100)]
    with (
        socket.create_server(("127.0.0.1", 0)) as silent,
        TransferEngine(b"s" * 32, transport="tcp") as puller,
    ):
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        load = cache_b.begin_load(prompt, puller, endpoint)
        assert time.monotonic() - started < 0.3 and not load.fetch.done()
        assert load.fetch.wait(20)
        waited = time.monotonic() - started
        assert cache_b.end_load(load) == 0 and cache_b.num_blocks_pulled == 0
        assert waited >= 0.5, f"the pull gave up after {waited:.2f}s, before its deadline"
        again = cache_b.begin_load(prompt, puller, endpoint)
        assert again.fetch.future is None and again.fetch.done()  # skipped: no new pull
    cache_b.close()


@pytest.mark.parametrize("where", ["ssd", "dram"])
def test_a_prefix_is_read_on_a_pull_thread(engines, tmp_path, monkeypatch, where):
    """A prefix whose blocks are on SSD only is read on a pull thread (milliseconds a
    block; the worker's loop goes on); one in this worker's DRAM is read on the caller's
    thread (the loop) only for its first INLINE_READ_BYTES, the rest on a pull thread.
    Either way it is seeded like any other and gives the computed output."""
    from halfmoon.serve.worker import prefix_cache
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache

    a, b = engines
    events = _Events()
    seed = 59 if where == "ssd" else 61
    prompt = [(i * seed) % 4000 + 29 for i in range(100)]
    cache_a, ref = _saved_prompt(a, f"{where}1", prompt, events,
                                 tmp_path if where == "ssd" else None)  # fmt: skip
    if where == "ssd":  # no DRAM: every block went to SSD
        assert all(cache_a.store.tiers(_hash(prompt, i)) == ("ssd",) for i in range(6))
        inline = 0
    else:
        monkeypatch.setattr(prefix_cache, "INLINE_READ_BYTES", 2 * a.kv_bytes_per_block)
        inline = 2
    cache_b = ClusterPrefixCache(LocalConnector(b), cache_a.store, events)
    load = cache_b.begin_load(prompt)
    assert len(load.fetch.local) == inline and load.fetch.future is not None
    assert load.fetch.wait(10)
    assert cache_b.end_load(load) == 6 and cache_b.num_blocks_pulled == 0
    out = _run(b, f"{where}2", prompt)
    assert out.num_cached_tokens == 96 and out.token_ids == ref.token_ids
    b.export_kv(f"{where}2", release=True)
    cache_b.close()
    b.check_integrity()

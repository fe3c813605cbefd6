import socket
import struct
import threading
import time
from typing import NamedTuple

import numpy as np
import pytest
import xxhash
from transfer_testing import SECRET, eventually

from halfmoon.core.errors import HalfmoonError
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.transfer import (
    AuthenticationError,
    PeerClient,
    ProtocolError,
    PutBlock,
    RemoteError,
    TransferCancelled,
    TransferCompleted,
    TransferError,
    TransferTimeout,
)
from halfmoon.transfer import link as link_module
from halfmoon.transfer.auth import client_handshake
from halfmoon.transfer.link import Link
from halfmoon.transfer.messages import meta_to_wire
from halfmoon.transfer.protocol import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    Kind,
    decode_prefix,
    hash_to_wire,
)
from halfmoon.transfer.regions import RegionTable
from halfmoon.transfer.server import TransferServer
from halfmoon.transfer.streams import StreamLayout, StreamTable

TRANSPORTS = ("tcp", "shm", "inproc")
BLOCK = 64 << 10


def block(i: int, size: int = BLOCK) -> np.ndarray:
    return np.full(size, i % 251, dtype=np.uint8)


@pytest.fixture
def pair(make_engine, hub):
    """(sender engine, receiver engine, receiver notifications) for one transport."""

    def make(transport, num_connections=3, **receiver_kwargs):
        done: list[TransferCompleted] = []
        receiver_kwargs.setdefault("on_complete", done.append)
        receiver = make_engine(hub=hub, **receiver_kwargs)
        sender = make_engine(hub=hub, transport=transport, num_connections=num_connections)
        return sender, receiver, done

    return make


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_batched_push_lands_in_the_receiver_region(pair, transport):
    sender, receiver, done = pair(transport)
    region = receiver.register_region("kv", 16 * BLOCK, shared=transport == "shm")
    blocks = [((15 - i) * BLOCK, block(i)) for i in range(10)]
    result = sender.connect(receiver.endpoint).push("kv", blocks)
    assert (result.num_blocks, result.num_bytes) == (10, 10 * BLOCK)
    for i in range(10):
        start = (15 - i) * BLOCK
        assert bytes(region.view[start : start + BLOCK]) == bytes(block(i))
    assert eventually(lambda: done)
    assert [(d.kind, d.num_blocks, d.num_bytes) for d in done] == [("push", 10, 10 * BLOCK)]
    assert done[0].transfer_id == result.transfer_id


def test_a_tcp_push_of_adjacent_blocks_names_their_runs_not_each_block(pair, monkeypatch):
    """Blocks that land back to back travel as one ``[offset, length]`` segment per run
    (the receiver counts blocks from the frame's ``blocks``), and their bytes land right."""
    sent: list[dict] = []
    real_send = Link.send

    def spy(self, kind, meta, *args, **kwargs):
        if kind == Kind.PUSH:
            sent.append(dict(meta))
        return real_send(self, kind, meta, *args, **kwargs)

    monkeypatch.setattr(Link, "send", spy)
    sender, receiver, done = pair("tcp", num_connections=1)
    region = receiver.register_region("kv", 16 * BLOCK)
    rows = np.stack([block(i) for i in range(8)])
    # rows 0-4 back to back from offset 0, then rows 5-7 back to back after a gap
    blocks = [(i * BLOCK, rows[i]) for i in range(5)] + [
        ((i + 3) * BLOCK, rows[i]) for i in (5, 6, 7)
    ]
    result = sender.connect(receiver.endpoint).push("kv", blocks)
    assert (result.num_blocks, result.num_bytes) == (8, 8 * BLOCK)
    assert [m["segs"] for m in sent] == [[[0, 5 * BLOCK], [8 * BLOCK, 3 * BLOCK]]]
    assert [m["blocks"] for m in sent] == [8]
    for offset, row in blocks:
        assert bytes(region.view[offset : offset + BLOCK]) == bytes(row)
    assert eventually(lambda: done)
    assert [(d.num_blocks, d.num_bytes) for d in done] == [(8, 8 * BLOCK)]


def test_a_push_with_a_malformed_block_count_is_refused(pair):
    _, receiver, done = pair("tcp")
    receiver.register_region("kv", 2 * BLOCK)
    host, port = receiver.endpoint.rsplit(":", 1)
    link = Link(socket.create_connection((host, int(port))), receiver.endpoint)
    client_handshake(link, SECRET, "raw-client", time.monotonic() + 5)
    try:
        for count in ("many", -1):
            meta = {"xfer": "x", "region": "kv", "parts": 1, "segs": [[0, BLOCK]], "blocks": count}
            link.send(Kind.PUSH, meta, [memoryview(block(1))], time.monotonic() + 5)
            reply = link.recv(time.monotonic() + 5)
            assert reply.kind == Kind.ERROR and "malformed block count" in reply.meta["message"]
        meta = {"xfer": "y", "region": "kv", "parts": 1, "segs": [[0, BLOCK]], "blocks": 1}
        link.send(Kind.PUSH, meta, [memoryview(block(2))], time.monotonic() + 5)
        assert link.recv(time.monotonic() + 5).kind == Kind.PUSH_ACK  # still aligned on frames
    finally:
        link.close()
    assert eventually(lambda: done)
    assert [d.num_blocks for d in done] == [1]


def test_push_async_reports_through_its_handle(pair):
    sender, receiver, _ = pair("tcp")
    receiver.register_region("kv", 4 * BLOCK)
    called = threading.Event()
    handle = sender.connect(receiver.endpoint).push_async("kv", [(0, block(1)), (BLOCK, block(2))])
    handle.add_done_callback(lambda h: called.set())
    assert handle.wait(5).num_blocks == 2
    assert handle.done() and called.wait(5)


def test_bad_region_and_out_of_range_push_are_remote_errors(pair):
    sender, receiver, done = pair("tcp")
    receiver.register_region("kv", 2 * BLOCK)
    client = sender.connect(receiver.endpoint)
    with pytest.raises(RemoteError, match="no region named 'nope'"):
        client.push("nope", [(0, block(1))])
    with pytest.raises(RemoteError, match="outside region 'kv'"):
        client.push("kv", [(BLOCK + 1, block(1))])
    client.push("kv", [(0, block(3))])  # the connection pool recovered
    assert eventually(lambda: done)
    assert [d.num_blocks for d in done] == [1]


def test_shm_push_checks_bounds_before_copying(pair):
    """A frame with a block out of range copies none of its blocks (a push cut into
    several frames fails the same way, though other frames may have landed, as over tcp)."""
    sender, receiver, _ = pair("shm", num_connections=1)
    region = receiver.register_region("kv", 2 * BLOCK, shared=True)
    client = sender.connect(receiver.endpoint)
    with pytest.raises(RemoteError, match="outside region"):
        client.push("kv", [(BLOCK + 1, block(7))])
    with pytest.raises(RemoteError, match=rf"range \[{2 * BLOCK}, {3 * BLOCK}\) is outside"):
        client.push("kv", [(0, block(1)), (BLOCK, block(2)), (2 * BLOCK, block(3))])
    assert bytes(region.view) == bytes(2 * BLOCK)
    client.push("kv", [(BLOCK, block(4))])  # the connection pool recovered
    assert bytes(region.view[BLOCK:]) == bytes(block(4))


def test_wrong_secret_is_refused_with_a_clear_error(make_engine):
    receiver = make_engine()
    receiver.register_region("kv", BLOCK)
    intruder = make_engine(secret=b"not-the-right-secret-at-all")
    with pytest.raises(AuthenticationError, match="refused the connection: wrong shared secret"):
        intruder.connect(receiver.endpoint).push("kv", [(0, block(1))])


def test_short_secret_and_unknown_transport_are_rejected(make_engine):
    with pytest.raises(ValueError, match="at least 16 bytes"):
        make_engine(secret=b"short")
    with pytest.raises(ValueError, match="unknown transport"):
        make_engine(transport="carrier-pigeon")


def test_connecting_to_nobody_fails_fast(make_engine):
    sender = make_engine()
    with pytest.raises(TransferError, match="cannot connect"):
        sender.connect("127.0.0.1:1").push("kv", [(0, block(1))], timeout_s=2)


def _stalled_receiver(pair, transport):
    """A receiver whose connection thread blocks after the first push (it stops acking)."""
    release = threading.Event()
    sender, receiver, _ = pair(
        transport, num_connections=1, on_complete=lambda _e: release.wait(10)
    )
    receiver.register_region("kv", 4 * BLOCK, shared=transport == "shm")
    client = sender.connect(receiver.endpoint)
    client.push("kv", [(0, block(1))])
    return client, release


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_silent_receiver_gives_a_timeout_not_a_hang(pair, transport):
    client, release = _stalled_receiver(pair, transport)
    started = time.monotonic()
    try:
        with pytest.raises(TransferTimeout):
            client.push("kv", [(BLOCK, block(2))], timeout_s=0.5)
        assert time.monotonic() - started < 3
    finally:
        release.set()


def test_cancel_stops_a_push_waiting_on_a_slow_receiver(pair):
    client, release = _stalled_receiver(pair, "tcp")
    try:
        handle = client.push_async("kv", [(BLOCK, block(2))], timeout_s=30)
        time.sleep(0.1)
        started = time.monotonic()
        handle.cancel()
        with pytest.raises(TransferCancelled):
            handle.wait(5)
        assert time.monotonic() - started < 2
    finally:
        release.set()


class StorePeer(NamedTuple):
    client: PeerClient
    store: TieredStore
    done: list
    endpoint: str


@pytest.fixture
def store_peer(pair, tmp_path):
    """A receiver engine serving a store (4 DRAM + 8 SSD slots) and a client to it."""

    def make(transport, shared_dram=None):
        store = TieredStore(
            StoreConfig(
                block_bytes=BLOCK,
                dram_capacity_bytes=4 * BLOCK,
                ssd_dir=str(tmp_path),
                ssd_capacity_bytes=8 * BLOCK,
                shared_dram=transport != "tcp" if shared_dram is None else shared_dram,
            )
        )
        stores.append(store)
        sender, receiver, done = pair(transport, store=store)
        return StorePeer(sender.connect(receiver.endpoint), store, done, receiver.endpoint)

    stores: list[TieredStore] = []
    yield make
    for store in stores:
        store.check_integrity()
        store.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_put_then_pull_round_trip_through_a_remote_store(store_peer, transport):
    client, store, done, _ = store_peer(transport)
    blocks = [
        PutBlock(2**127 + i, block(i), BlockMeta(16, 2**127 + i - 1), position=i) for i in range(6)
    ]
    assert client.put_blocks(blocks) == 6
    assert client.put_blocks(blocks[:2]) == 0  # already there
    # 4 DRAM slots: two blocks were demoted (which two depends on the frames' arrival order).
    assert sorted(store.tiers(2**127 + i) for i in range(6)).count(("ssd",)) == 2
    hashes = [2**127 + i for i in (5, 0, 3)] + [12345]
    dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
    metas = client.pull(hashes, dests)
    assert metas[:3] == [BlockMeta(16, 2**127 + i - 1) for i in (5, 0, 3)] and metas[3] is None
    assert [int(d[0]) for d in dests] == [5, 0, 3, 0]
    assert all((d == d[0]).all() for d in dests)
    assert eventually(lambda: store.stats().num_pinned == 0)  # RELEASE is asynchronous
    assert [d.kind for d in done].count("put") >= 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_single_small_pull_comes_inline_without_a_lease(store_peer, transport):
    client, store, _, _ = store_peer(transport)
    store.put(41, block(41), BlockMeta(16, 40))
    dest = np.zeros(BLOCK, np.uint8)
    assert client.pull([41], [dest]) == [BlockMeta(16, 40)]
    assert (dest == 41).all()
    stats = store.stats()
    assert stats.num_pinned == 0 and stats.dram.num_hits == 1  # no lease, nothing to release
    untouched = np.full(BLOCK, 7, np.uint8)
    assert client.pull([42], [untouched]) == [None] and (untouched == 7).all()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("num_pulled", [2, 6])  # inline copies / the pinned path
def test_a_pull_falls_back_to_the_engines_reader_for_blocks_the_store_lacks(
    pair, transport, num_pulled
):
    """A prefill worker with --prefix-store demote serves blocks that live only in its
    engine's pool through the fallback reader; the store's own blocks and misses as ever."""
    store = TieredStore(
        StoreConfig(block_bytes=BLOCK, dram_capacity_bytes=8 * BLOCK, shared_dram=True)
    )
    try:
        sender, receiver, _ = pair(transport, store=store)
        store.put(50, block(50), BlockMeta(16, 49))
        asked: list[int] = []

        def reader(block_hash: int, dest: memoryview) -> BlockMeta | None:
            asked.append(block_hash)
            if block_hash >= 1000:
                return None
            dest[:] = block(block_hash).data
            return BlockMeta(16, block_hash - 1)

        receiver.set_store_fallback(reader)
        hashes = [50, 60, 70, 80, 2000, 90][:num_pulled]
        dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
        metas = sender.connect(receiver.endpoint).pull(hashes, dests)
        expected = [h < 1000 for h in hashes]
        assert [m is not None for m in metas] == expected
        assert [m.parent_hash for m in metas if m] == [h - 1 for h in hashes if h < 1000]
        for h, dest, found in zip(hashes, dests, expected, strict=True):
            assert (dest == (h % 251 if found else 0)).all()
        assert sorted(asked) == sorted(hashes[1:])  # only the store's misses (in any order)
        assert eventually(lambda: store.stats().num_pinned == 0)
        receiver.set_store_fallback(None)
        assert sender.connect(receiver.endpoint).pull([60], [np.zeros(BLOCK, np.uint8)]) == [None]
    finally:
        store.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("num_pulled", [1, 6])
def test_pulled_blocks_go_encoded_over_tcp_to_a_client_that_decodes(pair, transport, num_pulled):
    """Compressed KV on prefix pulls: over tcp the peer encodes each hit (its pull
    encoder) and sends its size; the client decodes into the destinations. Through shared
    memory nothing is encoded; a client that cannot decode gets raw blocks."""
    import zlib

    store = TieredStore(
        StoreConfig(block_bytes=BLOCK, dram_capacity_bytes=8 * BLOCK, shared_dram=True)
    )
    try:
        sender, receiver, _ = pair(transport, store=store)
        hashes = [70 + i for i in range(num_pulled)]
        for h in hashes[:-1] if num_pulled > 1 else hashes:  # the last one a miss (if 6)
            store.put(h, block(h), BlockMeta(16, h - 1))
        sent: list[int] = []

        def encode(view: memoryview) -> memoryview:
            payload = zlib.compress(bytes(view))
            sent.append(len(payload))
            return memoryview(payload)

        def decode(payload: memoryview, dest: memoryview) -> None:
            dest[:] = zlib.decompress(payload)

        receiver.set_pull_encoder(encode)
        client = sender.connect(receiver.endpoint)
        for decoder in (decode, None):
            sent.clear()
            dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
            metas = client.pull(hashes, dests, decode=decoder)
            found = [h in hashes[:-1] or num_pulled == 1 for h in hashes]
            assert [m is not None for m in metas] == found
            for h, dest, hit in zip(hashes, dests, found, strict=True):
                assert (dest == (h % 251 if hit else 0)).all()
            encoded = decoder is not None and transport == "tcp"
            assert len(sent) == (sum(found) if encoded else 0)
            assert all(n < BLOCK // 100 for n in sent)  # a repeated byte compresses well
        if transport == "tcp":  # a payload that does not decode is a clear error

            def refuse(payload: memoryview, dest: memoryview) -> None:
                raise HalfmoonError("not a payload of this codec")

            with pytest.raises(ProtocolError, match="does not decode: not a payload"):
                client.pull(hashes, [np.zeros(BLOCK, np.uint8) for _ in hashes], decode=refuse)
            assert client.pull(hashes[:1], [np.zeros(BLOCK, np.uint8)], decode=decode)[0]
        assert eventually(lambda: store.stats().num_pinned == 0)
    finally:
        store.close()


def test_kept_encodings_serve_later_pulls_without_encoding_again(pair):
    """With ``keep_bytes`` a peer encodes a block once: later pulls of it (by any client,
    also after the store dropped it) get the kept payload; the least recently used
    leave when the budget is full; a fallback's blocks are kept too."""
    import zlib

    store = TieredStore(StoreConfig(block_bytes=BLOCK, dram_capacity_bytes=8 * BLOCK))
    try:
        sender, receiver, _ = pair("tcp", store=store)
        encoded: list[int] = []

        def encode(view: memoryview) -> memoryview:  # (a pull's two connections: any order)
            encoded.append(int(view[0]))
            return memoryview(zlib.compress(bytes(view)))

        def decode(payload: memoryview, dest: memoryview) -> None:
            dest[:] = zlib.decompress(payload)

        size = len(zlib.compress(bytes(block(1))))  # every block compresses to this
        receiver.set_pull_encoder(encode, keep_bytes=3 * size)

        def from_pool(block_hash: int, dest: memoryview) -> BlockMeta | None:
            if block_hash != 120:
                return None
            dest[:] = block(block_hash).tobytes()
            return BlockMeta(16, 119)

        receiver.set_store_fallback(from_pool)
        for h in (110, 111, 112, 113):
            store.put(h, block(h), BlockMeta(16, h - 1))
        client = sender.connect(receiver.endpoint)

        def pull(hashes):
            dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
            metas = client.pull(hashes, dests, decode=decode)
            for h, dest, meta in zip(hashes, dests, metas, strict=True):
                assert meta is not None and (dest == h % 251).all(), h
            return metas

        pull([110, 111])
        assert sorted(encoded) == [110, 111]
        metas = pull([110, 111, 112])  # two kept, one new
        assert sorted(encoded) == [110, 111, 112] and [m.parent_hash for m in metas] == [
            109,
            110,
            111,
        ]
        kept = receiver.encoded_blocks
        assert kept is not None and len(kept) == 3 and kept.bytes == 3 * size
        store.delete(110)  # the kept payload still names the same content
        pull([110])
        assert sorted(encoded) == [110, 111, 112]
        for h in (112, 111, 110):  # one at a time: 112 is now the least recently used
            pull([h])
        pull([113])  # the budget is full: 112 leaves
        assert sorted(kept._items) == [110, 111, 113]
        # One block a pull: a pull's blocks go over parallel connections, and the new
        # block's insertion could evict 111 before the other connection touched it.
        pull([111])  # 110 is now the least recently used
        pull([120])  # the fallback's block is encoded once (110 leaves), then kept
        pull([120])
        assert sorted(encoded) == [110, 111, 112, 113, 120]
        assert kept.hits >= 4 and eventually(lambda: store.stats().num_pinned == 0)
        receiver.set_pull_encoder(None, keep_bytes=3 * size)  # no encoder: nothing kept
        assert receiver.encoded_blocks is None
    finally:
        store.close()


def test_an_encoded_pull_is_pipelined_in_requests_of_a_few_blocks(pair, monkeypatch):
    """An encoded pull is cut into requests of ``ENCODED_GROUP_BYTES`` (here two blocks)
    that follow each other on each connection, so that the peer encodes the next while
    this one is on the wire; the blocks arrive decoded, a miss among them as a miss."""
    import zlib

    from halfmoon.transfer import store_client

    monkeypatch.setattr(store_client, "ENCODED_GROUP_BYTES", 2 * BLOCK)
    requests: list[int] = []
    send_pull = store_client.StoreClient._send_pull

    def counted(self, link, block_hashes, *args):
        requests.append(len(block_hashes))
        return send_pull(self, link, block_hashes, *args)

    monkeypatch.setattr(store_client.StoreClient, "_send_pull", counted)
    store = TieredStore(StoreConfig(block_bytes=BLOCK, dram_capacity_bytes=8 * BLOCK))
    try:
        sender, receiver, _ = pair("tcp", store=store)
        hashes = [90 + i for i in range(8)]
        for h in hashes:
            if h != 95:  # a miss in the middle of the second half
                store.put(h, block(h), BlockMeta(16, h - 1))
        encoded: list[int] = []

        def encode(view: memoryview) -> memoryview:
            encoded.append(1)
            return memoryview(zlib.compress(bytes(view)))

        receiver.set_pull_encoder(encode)

        def decode(payload: memoryview, dest: memoryview) -> None:
            dest[:] = zlib.decompress(payload)

        dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
        metas = sender.connect(receiver.endpoint).pull(hashes, dests, decode=decode)
        assert [m is not None for m in metas] == [h != 95 for h in hashes]
        for h, dest in zip(hashes, dests, strict=True):
            assert (dest == (0 if h == 95 else h % 251)).all()
        assert requests == [2, 2, 2, 2] and len(encoded) == 7
        # Hits are encoded from the store's memory under a lease, released after the
        # reply; a miss the engine's fallback serves (its pool, with demote) goes too.
        assert eventually(lambda: store.stats().num_pinned == 0)

        def from_pool(block_hash: int, dest: memoryview) -> BlockMeta | None:
            if block_hash != 95:
                return None
            dest[:] = block(95).data
            return BlockMeta(16, 94)

        receiver.set_store_fallback(from_pool)
        dests = [np.zeros(BLOCK, np.uint8) for _ in hashes]
        metas = sender.connect(receiver.endpoint).pull(hashes, dests, decode=decode)
        assert all(m is not None for m in metas) and metas[5] == BlockMeta(16, 94)
        assert all((dest == h % 251).all() for h, dest in zip(hashes, dests, strict=True))
        assert eventually(lambda: store.stats().num_pinned == 0)
    finally:
        store.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("encoded", [False, True])
@pytest.mark.parametrize("num_blocks", [1, 3, 40])  # one / one group / split and pipelined
def test_on_block_hears_each_block_once_it_is_whole(pair, monkeypatch, transport, encoded,
                                                     num_blocks):  # fmt: skip
    """``pull(on_block=...)`` names each block the peer had as soon as its destination
    holds all of it (whatever path it came by: inline, from a shared arena, decoded, in
    parallel groups or pipelined ones), once, before ``pull`` returns; never a miss."""
    import zlib

    from halfmoon.transfer import store_client

    size = 4 << 10  # small blocks: several groups of a pipelined co-located pull
    monkeypatch.setattr(store_client, "ENCODED_GROUP_BYTES", 4 * size)
    monkeypatch.setattr(store_client, "PIPELINE_GROUP_BLOCKS", 8)
    store = TieredStore(
        StoreConfig(block_bytes=size, dram_capacity_bytes=64 * size, shared_dram=True)
    )
    try:
        sender, receiver, _ = pair(transport, store=store)
        hashes = [500 + i for i in range(num_blocks)]
        missing = hashes[num_blocks // 2] if num_blocks > 1 else None
        for h in hashes:
            if h != missing:
                store.put(h, block(h, size), BlockMeta(16, h - 1))
        receiver.set_pull_encoder(lambda view: memoryview(zlib.compress(bytes(view))))

        def decode(payload: memoryview, dest: memoryview) -> None:
            dest[:] = zlib.decompress(payload)

        dests = [np.zeros(size, np.uint8) for _ in hashes]
        heard: list[int] = []
        lock = threading.Lock()

        def on_block(i: int) -> None:
            assert (dests[i] == hashes[i] % 251).all(), f"block {i} not whole yet"
            with lock:
                heard.append(i)

        client = sender.connect(receiver.endpoint)
        metas = client.pull(hashes, dests, decode=decode if encoded else None,
                            on_block=on_block)  # fmt: skip
        found = [i for i, m in enumerate(metas) if m is not None]
        assert len(found) == num_blocks - (missing is not None)
        assert sorted(heard) == found  # each found block once, no miss
        assert eventually(lambda: store.stats().num_pinned == 0)
    finally:
        store.close()


@pytest.mark.parametrize("num_blocks", [1, 40])
def test_take_encoded_may_decode_a_block_where_the_caller_keeps_it(pair, monkeypatch,
                                                                   num_blocks):  # fmt: skip
    """``pull(take_encoded=...)`` sees each encoded block before ``decode``: a block it
    takes (returns True) is its own to decode (its destination stays as it was), the
    others are decoded into theirs; ``on_block`` hears every block either way."""
    import zlib

    from halfmoon.transfer import store_client

    size = 4 << 10
    monkeypatch.setattr(store_client, "ENCODED_GROUP_BYTES", 4 * size)
    store = TieredStore(StoreConfig(block_bytes=size, dram_capacity_bytes=64 * size))
    try:
        sender, receiver, _ = pair("tcp", store=store)
        hashes = [700 + i for i in range(num_blocks)]
        for h in hashes:
            store.put(h, block(h, size), BlockMeta(16, h - 1))
        receiver.set_pull_encoder(lambda view: memoryview(zlib.compress(bytes(view))))
        kept: dict[int, bytes] = {}
        heard: list[int] = []
        lock = threading.Lock()

        def take(i: int, payload: memoryview) -> bool:
            if i % 2:
                return False
            with lock:
                kept[i] = zlib.decompress(payload)
            return True

        def on_block(i: int) -> None:
            with lock:
                heard.append(i)

        def decode(payload: memoryview, dest: memoryview) -> None:
            dest[:] = zlib.decompress(payload)

        dests = [np.zeros(size, np.uint8) for _ in hashes]
        metas = sender.connect(receiver.endpoint).pull(
            hashes, dests, decode=decode, on_block=on_block, take_encoded=take
        )
        assert all(m is not None for m in metas) and sorted(heard) == list(range(num_blocks))
        assert sorted(kept) == list(range(0, num_blocks, 2))
        for i, (h, dest) in enumerate(zip(hashes, dests, strict=True)):
            if i % 2:
                assert (dest == h % 251).all()
            else:
                assert not dest.any() and kept[i] == block(h, size).tobytes()
    finally:
        store.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_store_errors_reach_the_client(store_peer, pair, transport):
    client, store, _, _ = store_peer(transport)
    with pytest.raises(RemoteError, match="blocks have 65536 bytes"):
        client.put_blocks([PutBlock(1, bytes(100), BlockMeta(1, 0))])
    with pytest.raises(RemoteError, match="blocks have 65536 bytes"):  # never into a slot
        client.put_blocks([PutBlock(1, bytes(2 * BLOCK), BlockMeta(1, 0))] * 2)
    with pytest.raises(ValueError, match="the store's block size"):
        client.put_blocks([PutBlock(1, block(1), BlockMeta(1, 0)), PutBlock(2, bytes(9), None)])
    assert store.stats().dram.num_blocks == 0
    with pytest.raises(RemoteError, match="blocks have 65536 bytes"):
        client.pull([1], [bytearray(100)])
    with pytest.raises(ValueError, match="2 hashes but 1"):
        client.pull([1, 2], [bytearray(BLOCK)])
    sender, receiver, _ = pair("tcp")
    with pytest.raises(RemoteError, match="no block store"):
        sender.connect(receiver.endpoint).pull([1], [bytearray(BLOCK)])


@pytest.mark.parametrize("transport", ["shm", "inproc"])
def test_co_located_put_falls_back_inline_without_a_shared_arena(store_peer, transport):
    client, store, _, _ = store_peer(transport, shared_dram=False)
    blocks = [PutBlock(77 + i, block(i), BlockMeta(16, 0)) for i in range(3)]
    assert client.put_blocks(blocks) == 3
    dests = [np.zeros(BLOCK, np.uint8) for _ in range(3)]
    assert client.pull([77, 78, 79], dests) == [BlockMeta(16, 0)] * 3
    assert [int(d[0]) for d in dests] == [0, 1, 2]


def test_placed_put_sends_inline_what_must_go_to_ssd(store_peer):
    client, store, _, _ = store_peer("shm")
    for h in range(4):
        store.put(1000 + h, block(h), BlockMeta(16, 0))
        store.pin(1000 + h)  # DRAM full of pins: new blocks are staged for SSD, not placed
    assert client.put_blocks([PutBlock(5, block(5), BlockMeta(16, 0))]) == 1
    assert store.tiers(5) == ("ssd",)
    assert store.get(5)[1] == bytes(block(5))
    for h in range(4):
        store.unpin(1000 + h)


def test_a_client_that_vanishes_after_reserving_leaks_no_slot(store_peer):
    _, store, _, endpoint = store_peer("shm")
    host, port = endpoint.rsplit(":", 1)
    link = Link(socket.create_connection((host, int(port))), endpoint)  # a hand-driven client
    client_handshake(link, SECRET, "raw-client", time.monotonic() + 5)
    wire = [[hash_to_wire(9), meta_to_wire(BlockMeta(16, 0)), 0]]
    request = {"xfer": "x", "blocks": wire, "block_bytes": BLOCK}
    link.send(Kind.PUT_RESERVE, request, deadline=time.monotonic() + 5)
    assert link.recv(time.monotonic() + 5).kind == Kind.PUT_SLOTS
    assert store.stats().num_reserved == 1
    link.close()  # gone without PUT_COMMIT
    assert eventually(lambda: store.stats().num_reserved == 0)
    assert not store.contains(9)


def _stranger(endpoint: str) -> socket.socket:
    """A raw TCP connection to a transfer server, its CHALLENGE frame read."""
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    got = b""
    while len(got) < HEADER_BYTES:
        got += sock.recv(HEADER_BYTES - len(got))
    _kind, meta_len, _payload, _check, _flags = decode_prefix(got)
    while meta_len:
        meta_len -= len(sock.recv(meta_len))
    return sock


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server hangs up (EOF or reset) within ``timeout_s``, reading what it
    sends before (an ERROR frame)."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_stranger_declaring_a_big_frame_is_cut_before_it_is_read():
    """An unauthenticated peer's AUTH header declaring a 3 MiB meta (or any payload) is
    refused on the header: nothing more is read or buffered. Before, the server waited
    for (and would have allocated) the whole meta until the handshake deadline."""
    server = TransferServer(SECRET, RegionTable(), StreamTable(), handshake_timeout_s=60)
    endpoint = str(server.start())
    try:
        for meta_len, payload_len in ((3 << 20, 0), (100, 1 << 30)):
            sock = _stranger(endpoint)
            header = struct.pack("<4sBBHIQ", MAGIC, VERSION, int(Kind.AUTH), 0, meta_len,
                                 payload_len)  # fmt: skip
            sock.sendall(header + b"\0" * 8)  # the head check does not matter: cut before
            assert _closed_by_peer(sock, timeout_s=10), (meta_len, payload_len)
            sock.close()
    finally:
        server.close()


def test_connections_beyond_the_limit_are_closed_at_once():
    server = TransferServer(SECRET, RegionTable(), StreamTable(), max_connections=2)
    endpoint = str(server.start())
    try:
        held = [_stranger(endpoint) for _ in range(2)]  # each got its CHALLENGE
        host, port = endpoint.rsplit(":", 1)
        extra = socket.create_connection((host, int(port)), timeout=10)
        assert _closed_by_peer(extra, timeout_s=10)
        assert server.num_refused == 1
        for sock in [*held, extra]:
            sock.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    "sender_checks, receiver_checks", [(False, False), (False, True), (True, False)]
)
def test_engines_without_payload_checksums_push_put_pull_and_stream(
    make_engine, tmp_path, monkeypatch, sender_checks, receiver_checks
):
    """``checksum=False`` drops the xxh3 of the payloads an engine sends (pushes, puts,
    stream layers from a client; pull replies from a server) and nothing else: every
    operation lands the same bytes, whatever the other side does."""
    hashed: list[str] = []  # payload hashes begun by either side (links hash payloads only)

    class Counting:
        @staticmethod
        def xxh3_64_intdigest(data):
            hashed.append("one")
            return xxhash.xxh3_64_intdigest(data)

        @staticmethod
        def xxh3_64():
            hashed.append("chunked")
            return xxhash.xxh3_64()

    monkeypatch.setattr(link_module, "xxhash", Counting)
    store = TieredStore(StoreConfig(block_bytes=BLOCK, dram_capacity_bytes=8 * BLOCK))
    try:
        receiver = make_engine(transport="tcp", store=store, checksum=receiver_checks)
        sender = make_engine(transport="tcp", checksum=sender_checks)
        region = receiver.register_region("kv", 8 * BLOCK)
        client = sender.connect(receiver.endpoint)
        client.push("kv", [(i * BLOCK, block(i)) for i in range(3)])
        assert bytes(region.view[: 3 * BLOCK]) == b"".join(bytes(block(i)) for i in range(3))
        client.push("kv", [(5 * BLOCK, np.full(100, 7, dtype=np.uint8))])  # a small frame
        assert bytes(region.view[5 * BLOCK : 5 * BLOCK + 100]) == bytes([7] * 100)
        blocks = [PutBlock(100 + i, block(10 + i), BlockMeta(16, 0)) for i in range(2)]
        assert client.put_blocks(blocks) == 2
        dests = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(3)]
        metas = client.pull([100, 101, 999], dests)
        assert metas[2] is None and [m.num_tokens for m in metas[:2]] == [16, 16]
        assert bytes(dests[0]) == bytes(block(10)) and bytes(dests[1]) == bytes(block(11))
        layout = StreamLayout.contiguous(2, 2, BLOCK, base_offset=4 * BLOCK)
        rx = receiver.expect_stream("s", "kv", layout)
        with client.open_stream("s", 2, 2, BLOCK, timeout_s=5) as tx:
            for layer in range(2):
                tx.send_layer(layer, [block(20 + 2 * layer + b) for b in range(2)])
        rx.wait(5)
        assert bytes(region.view[4 * BLOCK : 8 * BLOCK]) == b"".join(
            bytes(block(20 + k)) for k in range(4)
        )
    finally:
        store.check_integrity()
        store.close()
    if not (sender_checks or receiver_checks):
        assert not hashed  # no payload was hashed, on either side
    else:
        assert hashed  # the checking side hashed its own payloads (and the other verified)

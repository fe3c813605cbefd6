"""Co-located puts and pulls of small blocks, pipelined on one connection
(halfmoon.transfer.store_client): the same results as the parallel path, replies matched
to their requests, and nothing reserved or pinned left behind, errors included."""

from __future__ import annotations

import numpy as np
import pytest
from transfer_testing import eventually

import halfmoon.transfer.store_client as store_client
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.transfer import ProtocolError, PutBlock, RemoteError
from halfmoon.transfer.protocol import Frame, Kind

BLOCK = 4096


def block(i: int) -> np.ndarray:
    out = np.full(BLOCK, i % 251, dtype=np.uint8)
    out[:8] = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)  # unique per block
    return out


@pytest.fixture
def co_located(make_engine, hub):
    """(client, store) of a store served by an engine, reached over ``transport``."""
    stores: list[TieredStore] = []

    def make(transport: str, num_slots: int, num_connections: int = 2):
        config = StoreConfig(BLOCK, num_slots * BLOCK, shared_dram=True)
        store = TieredStore(config)
        stores.append(store)
        receiver = make_engine(hub=hub, store=store)
        sender = make_engine(hub=hub, transport=transport, num_connections=num_connections)
        return sender.connect(receiver.endpoint), store

    yield make
    for store in stores:
        store.check_integrity()
        store.close()


def _puts(first: int, count: int) -> list[PutBlock]:
    return [
        PutBlock(2**100 + i, block(i), BlockMeta(16, 2**100 + i - 1), position=i)
        for i in range(first, first + count)
    ]


@pytest.mark.parametrize("transport", ["shm", "inproc"])
def test_a_pipelined_put_and_pull_match_what_was_put(co_located, transport):
    group = store_client.PIPELINE_GROUP_BLOCKS
    count = 2 * group + 37  # three groups, the last one short
    assert store_client._pipelined(count, BLOCK)
    client, store = co_located(transport, num_slots=4 * group)
    assert client.put_blocks(_puts(0, 40)) == 40  # some of the batch is there already
    assert client.put_blocks(_puts(0, count)) == count - 40
    wanted = [2**100 + i for i in range(count)][::-1] + [7]  # reversed, and one miss
    dests = np.zeros((len(wanted), BLOCK), np.uint8)
    metas = client.pull(wanted, list(dests))
    assert metas[-1] is None and not dests[-1].any()
    for h, meta, dest in zip(wanted[:-1], metas, dests, strict=False):
        i = h - 2**100
        assert meta == BlockMeta(16, h - 1)
        assert bytes(dest) == bytes(block(i))
    stats = store.stats()
    assert stats.num_reserved == 0
    assert stats.dram.num_blocks == count


@pytest.mark.parametrize("transport", ["shm", "inproc"])
def test_pipelined_puts_evict_and_pulls_release_every_lease(co_located, transport):
    group = store_client.PIPELINE_GROUP_BLOCKS
    client, store = co_located(transport, num_slots=2 * group + 8)
    for round_ in range(3):  # each put evicts the older blocks
        puts = _puts(round_ * 1000, 2 * group)
        assert client.put_blocks(puts) == 2 * group
        dests = np.zeros((len(puts), BLOCK), np.uint8)
        assert all(client.pull([p.block_hash for p in puts], list(dests)))
        assert all(bytes(d) == bytes(p.payload) for d, p in zip(dests, puts, strict=True))
    # RELEASE has no reply: the peer drops the last lease a moment after pull() returns.
    assert eventually(lambda: store.stats().num_pinned == 0)
    stats = store.stats()
    assert stats.num_reserved == 0
    assert stats.dram.num_evictions >= 4 * group - 8


def test_a_pipelined_put_that_finds_the_store_full_midway_fails_cleanly(co_located):
    group = store_client.PIPELINE_GROUP_BLOCKS
    client, store = co_located("shm", num_slots=2 * group + 10)
    pinned = _puts(0, group)
    assert client.put_blocks(pinned) == group
    for p in pinned:
        store.pin(p.block_hash)  # group + 10 slots take new blocks: the second group fails
    # Two groups: RESERVE 0 and 1 go out, slots 0 come back, the client copies group 0
    # and sends COMMIT 0, then reads the error for RESERVE 1, drops the link and raises.
    with pytest.raises(RemoteError, match="store is full"):
        client.put_blocks(_puts(5000, 2 * group))
    # The peer still commits group 0 (its COMMIT was sent before the error was read);
    # then nothing is left reserved.
    assert eventually(lambda: store.stats().num_reserved == 0)
    for i in range(2 * group):
        got = store.get(2**100 + 5000 + i)
        if i < group:
            assert got is not None and got[1] == bytes(block(5000 + i))
        else:
            assert got is None
    for p in pinned:
        store.unpin(p.block_hash)
    assert client.put_blocks(_puts(9000, group + 1)) == group + 1  # on a fresh link
    fresh = [2**100 + 9000 + i for i in range(group + 1)]
    dests = np.zeros((len(fresh), BLOCK), np.uint8)
    assert all(client.pull(fresh, list(dests)))
    assert bytes(dests[3]) == bytes(block(9003))
    assert eventually(lambda: store.stats().num_pinned == store.stats().num_reserved == 0)


def test_large_blocks_and_small_batches_keep_the_parallel_path():
    group = store_client.PIPELINE_GROUP_BLOCKS
    assert store_client._pipelined(group + 1, BLOCK)
    assert not store_client._pipelined(group, BLOCK)  # one group: nothing to overlap
    assert not store_client._pipelined(1000, store_client.PIPELINE_MAX_BLOCK_BYTES + 1)


class _Arena:
    """A stand-in for the client's segment cache: one named arena."""

    def __init__(self, num_bytes: int) -> None:
        self.buf = bytearray(num_bytes)

    def view(self, name: str) -> memoryview:
        if name != "arena":
            raise FileNotFoundError(f"no segment {name}")  # as attach_segment does
        return memoryview(self.buf)


class _NoLinks:
    endpoint = "127.0.0.1:1"


def _placing_client(arena: _Arena) -> store_client.StoreClient:
    return store_client.StoreClient(_NoLinks(), arena, lambda: "shm", lambda: "x")  # type: ignore[arg-type]


def test_placing_copies_into_offered_slots_and_returns_the_inline_rest():
    arena = _Arena(4 * 8)
    client = _placing_client(arena)
    views = [memoryview(bytes([i + 1]) * 8) for i in range(4)]
    slots = [16, store_client.SLOT_PRESENT, store_client.SLOT_INLINE, 0]
    inline = client._place({"segment": "arena", "slots": slots}, views)
    assert [bytes(v) for v in inline] == [bytes(views[2])]
    assert arena.buf == bytes([4]) * 8 + bytes(8) + bytes([1]) * 8 + bytes(8)


@pytest.mark.parametrize(
    "reply",
    [
        {"segment": "arena", "slots": [0]},  # fewer slots than blocks
        {"segment": "arena"},  # no slots
        {"segment": "arena", "slots": [0, 32]},  # past the arena's end
        {"segment": "arena", "slots": [0, -7]},  # an unknown code
        {"segment": "arena", "slots": [0, "8"]},  # not an offset
        {"slots": [0, 8]},  # no segment
        {"segment": "elsewhere", "slots": [0, 8]},
    ],
)
def test_a_bad_slot_reply_is_a_protocol_error_and_copies_nothing(reply):
    arena = _Arena(4 * 8)
    client = _placing_client(arena)
    with pytest.raises(ProtocolError):
        client._place(reply, [memoryview(b"\x01" * 8), memoryview(b"\x02" * 8)])
    assert arena.buf == bytes(32)


class _RecordingLink:
    def __init__(self) -> None:
        self.sent: list[tuple[object, dict]] = []

    def send(self, kind, meta, payloads=(), deadline=None) -> None:
        self.sent.append((kind, meta))


@pytest.mark.parametrize(
    ("segment", "offsets", "error"),
    [
        ("arena", [16, 0], None),  # good: both copied, then RELEASE
        ("arena", [0, 32], "bad place"),  # past the arena's end
        ("arena", [0, "8"], "bad place"),
        (None, [0, 8], "bad place"),
        ("elsewhere", [0, 8], "bad place"),
    ],
)
def test_pulled_blocks_are_copied_out_of_the_arena_and_always_released(segment, offsets, error):
    arena = _Arena(4 * 8)
    arena.buf[:] = bytes(range(32))
    client = _placing_client(arena)
    link = _RecordingLink()
    items = [[True, [16, bytes(16), 1], offset] for offset in offsets]
    reply = Frame(Kind.PULL_REPLY, {"xfer": "p1", "items": items, "segment": segment}, 0)
    dests = [memoryview(bytearray(8)) for _ in offsets]
    if error is None:
        client._copy_in_place(link, reply, dests, [0, 1], deadline=1e12)  # type: ignore[arg-type]
        assert [bytes(d) for d in dests] == [bytes(range(16, 24)), bytes(range(8))]
    else:
        with pytest.raises(ProtocolError, match=error):
            client._copy_in_place(link, reply, dests, [0, 1], deadline=1e12)  # type: ignore[arg-type]
    assert link.sent == [(Kind.RELEASE, {"xfer": "p1"})]


def test_a_connection_ending_after_its_store_closed_gives_back_nothing_quietly():
    """A process shutting down may close its store before a connection's thread ends:
    that connection's cleanup (a pull's lease, a put's reserved slot) has nothing left to
    give back and must not raise on the connection's thread (it did once in CI)."""
    from types import SimpleNamespace

    from halfmoon.store import StoreError
    from halfmoon.transfer.store_service import StoreSession

    store = TieredStore(StoreConfig(block_bytes=64, dram_capacity_bytes=64 * 8))
    store.put(7, bytes(64), BlockMeta(16, 0))
    server = SimpleNamespace(require_store=lambda: store, on_complete=None)
    session = StoreSession(link=None, server=server, deadline=lambda: 0.0)  # type: ignore[arg-type]
    session._leases["pull-1"] = store.lease([7]).lease_id
    store.close()
    session.cleanup(store)  # nothing raised
    assert not session._leases
    open_store = TieredStore(StoreConfig(block_bytes=64, dram_capacity_bytes=64 * 8))
    session._leases["pull-2"] = 12345  # an unknown lease of an open store: False, no raise
    session.cleanup(open_store)
    with pytest.raises(StoreError):  # closed: later calls of its own still raise
        store.release_lease(1)
    open_store.close()

import threading

import pytest
from store_testing import BLOCK_BYTES, meta, payload

from halfmoon.core.clock import ManualClock
from halfmoon.core.hashing import hash_blocks
from halfmoon.store import (
    BlockEvicted,
    BlockPinnedError,
    BlockStored,
    StoreError,
    StoreFullError,
    UnknownBlockError,
)

# Real chained 128-bit block hashes of one 16-token-block prompt.
H = hash_blocks(list(range(16 * 12)), 16).hashes


def put_all(store, indices, positions=None):
    for i in indices:
        store.put(H[i], payload(i), meta(i), position=i if positions is None else positions[i])


def test_put_get_round_trip_and_events(make_store, events):
    store = make_store()
    assert store.put(H[0], payload(0), meta(0)) == "dram"
    got = store.get(H[0])
    assert got == (meta(0), payload(0))
    out = bytearray(BLOCK_BYTES)
    assert store.get_into(H[0], out) == meta(0) and out == payload(0)
    assert store.get(H[1]) is None
    assert events == [BlockStored(H[0], "dram")]
    stats = store.stats()
    assert (stats.dram.num_hits, stats.num_misses, stats.dram.num_blocks) == (2, 1, 1)


def test_read_into_a_byte_view_counts_like_get_into(make_store, tmp_path):
    store = make_store(
        dram_capacity_bytes=BLOCK_BYTES, ssd_dir=str(tmp_path), ssd_capacity_bytes=2 * BLOCK_BYTES
    )
    put_all(store, [0, 1])  # block 0 is demoted to SSD
    out = memoryview(bytearray(BLOCK_BYTES))
    assert store.read_into(H[1], out) == meta(1) and out == payload(1)
    assert store.read_into(H[0], out) == meta(0) and out == payload(0)  # SSD hit, promoted
    assert store.tiers(H[0]) == ("dram", "ssd")
    assert store.read_into(H[2], out) is None and out == payload(0)  # a miss leaves it alone
    stats = store.stats()
    assert (stats.dram.num_hits, stats.ssd.num_hits, stats.num_misses) == (1, 1, 1)
    for bad in (memoryview(bytearray(BLOCK_BYTES - 1)), memoryview(bytes(BLOCK_BYTES))):
        with pytest.raises(ValueError, match="writable byte view"):
            store.read_into(H[1], bad)


def test_large_blocks_copy_through_every_put_and_read_path(make_store):
    """Blocks of GIL_FREE_BYTES and more are copied in and out with the GIL released
    (``core.buffers.copy_into``, tests/core/test_buffers.py), from read-only and
    writable payloads alike: every put and read path gives back the bytes."""
    import numpy as np

    from halfmoon.core.buffers import GIL_FREE_BYTES

    size = 16 * GIL_FREE_BYTES  # 1 MiB
    store = make_store(block_bytes=size, dram_capacity_bytes=4 * size)
    store.put(H[0], payload(0, size), meta(0))  # bytes: read-only, copied by numpy
    store.put_many([(H[1], np.frombuffer(bytearray(payload(1, size)), np.uint8), meta(1), 1)])
    out = np.zeros(size, np.uint8)
    assert store.get_into(H[0], out) == meta(0) and out.tobytes() == payload(0, size)
    outs = [bytearray(size), bytearray(size)]
    assert store.get_many_into([H[1], H[0]], outs) == [meta(1), meta(0)]
    assert outs == [payload(1, size), payload(0, size)]
    view = memoryview(bytearray(size))
    assert store.read_into(H[1], view) == meta(1) and view == payload(1, size)


def test_storing_a_present_hash_is_only_an_access(make_store, events):
    store = make_store()
    put_all(store, [0, 1, 2, 3])
    store.put(H[0], payload(99), meta(0))  # same hash: content is named by the hash
    assert store.get(H[0])[1] == payload(0)
    put_all(store, [4])
    assert events.of(BlockEvicted, "dram") == [H[1]]


@pytest.mark.parametrize(
    ("policy", "accesses", "expected_victims"),
    [
        # LRU: 0 was touched last, so 1 then 2 go first.
        ("lru", [0], [1, 2]),
        # LFU: counts 0:3, 1:1, 2:2, 3:1 -> the count-1 blocks, older first: 1, then 3.
        ("lfu", [0, 0, 2], [1, 3]),
        # length-aware: equal counts -> the later position in the request goes first.
        ("length-aware", [], [3, 2]),
    ],
)
def test_eviction_order_per_policy(make_store, events, policy, accesses, expected_victims):
    store = make_store(policy=policy)
    put_all(store, [0, 1, 2, 3])
    for i in accesses:
        store.get(H[i])
    put_all(store, [10, 11], positions={10: 0, 11: 0})
    assert events.of(BlockEvicted, "dram") == [H[i] for i in expected_victims]
    assert all(store.contains(H[i]) for i in (10, 11))


def test_demotion_to_ssd_and_promotion_back(make_store, events, tmp_path):
    store = make_store(
        dram_capacity_bytes=2 * BLOCK_BYTES,
        ssd_dir=str(tmp_path),
        ssd_capacity_bytes=4 * BLOCK_BYTES,
    )
    put_all(store, [0, 1, 2])
    assert store.tiers(H[0]) == ("ssd",)
    assert events[-3:] == [
        BlockStored(H[0], "ssd"),
        BlockEvicted(H[0], "dram"),
        BlockStored(H[2], "dram"),
    ]
    assert store.get(H[0]) == (meta(0), payload(0))  # SSD hit: promoted, B demoted for room
    assert store.tiers(H[0]) == ("dram", "ssd")
    assert store.tiers(H[1]) == ("ssd",)
    stats = store.stats()
    assert (stats.num_promotions, stats.num_demotions, stats.ssd.num_hits) == (1, 2, 1)
    assert events.of(BlockStored, "dram") == [H[0], H[1], H[2], H[0]]


def test_ssd_eviction_drops_the_ssd_victim(make_store, events, tmp_path):
    store = make_store(
        dram_capacity_bytes=BLOCK_BYTES, ssd_dir=str(tmp_path), ssd_capacity_bytes=2 * BLOCK_BYTES
    )
    put_all(store, [0, 1, 2, 3])
    assert events.of(BlockEvicted, "ssd") == [H[0]]
    assert not store.contains(H[0])
    assert [store.tiers(H[i]) for i in (1, 2, 3)] == [("ssd",), ("ssd",), ("dram",)]
    assert store.stats().ssd.num_evictions == 1


def test_pinned_blocks_are_never_victims(make_store, events):
    store = make_store(dram_capacity_bytes=2 * BLOCK_BYTES)
    put_all(store, [0, 1])
    store.pin(H[0])
    put_all(store, [2])  # LRU victim would be 0, but it is pinned
    assert events.of(BlockEvicted, "dram") == [H[1]]
    store.pin(H[2])
    with pytest.raises(StoreFullError, match="pinned"):
        store.put(H[3], payload(3), meta(3))
    # Nothing lost, nothing evicted by the failed put.
    assert store.get(H[0])[1] == payload(0) and store.get(H[2])[1] == payload(2)
    assert events.of(BlockEvicted, "dram") == [H[1]]
    store.check_integrity()
    store.unpin(H[0])
    put_all(store, [3])
    assert events.of(BlockEvicted, "dram") == [H[1], H[0]]
    assert store.is_pinned(H[2]) and not store.is_pinned(H[3])


def test_pins_nest_and_bad_pin_calls_fail(make_store):
    store = make_store(dram_capacity_bytes=BLOCK_BYTES)
    put_all(store, [0])
    store.pin(H[0])
    store.pin(H[0])
    store.unpin(H[0])
    with pytest.raises(StoreFullError):
        store.put(H[1], payload(1), meta(1))
    store.unpin(H[0])
    with pytest.raises(StoreError, match="not pinned"):
        store.unpin(H[0])
    with pytest.raises(UnknownBlockError):
        store.pin(H[5])


def test_full_dram_of_pins_spills_new_blocks_to_ssd(make_store, tmp_path):
    store = make_store(
        dram_capacity_bytes=BLOCK_BYTES, ssd_dir=str(tmp_path), ssd_capacity_bytes=2 * BLOCK_BYTES
    )
    put_all(store, [0])
    store.pin(H[0])
    assert store.put(H[1], payload(1), meta(1)) == "ssd"
    assert store.get(H[1])[1] == payload(1)  # read from SSD into a private buffer
    assert store.tiers(H[1]) == ("ssd",)


def test_acquire_pins_a_zero_copy_view(make_store):
    store = make_store(dram_capacity_bytes=BLOCK_BYTES)
    put_all(store, [0])
    with store.acquire(H[0]) as ref:
        assert ref.meta == meta(0) and bytes(ref.view) == payload(0)
        assert store.is_pinned(H[0])
        with pytest.raises(BlockPinnedError):
            store.delete(H[0])
    ref.release()  # a second release is harmless
    assert not store.is_pinned(H[0])
    assert store.acquire(H[3]) is None
    assert store.delete(H[0]) and not store.delete(H[0])


def test_lease_expires_on_the_clock(make_store):
    clock = ManualClock()
    store = make_store(clock=clock, dram_capacity_bytes=BLOCK_BYTES)
    put_all(store, [0])
    lease = store.lease([H[0]], ttl_s=10.0)
    assert store.is_pinned(H[0])
    clock.advance(9.0)
    assert store.is_pinned(H[0])
    clock.advance(2.0)
    assert not store.is_pinned(H[0])
    assert not store.release_lease(lease.lease_id)
    lease = store.lease([H[0]])
    assert store.release_lease(lease.lease_id) and not store.is_pinned(H[0])
    with pytest.raises(UnknownBlockError):
        store.lease([H[0], H[1]])
    assert not store.is_pinned(H[0])  # nothing pinned by the failed lease


def test_bad_input_is_rejected_and_nothing_changes(make_store, events):
    store = make_store()
    with pytest.raises(ValueError, match="4095 bytes"):
        store.put(H[0], bytes(BLOCK_BYTES - 1), meta(0))
    with pytest.raises(ValueError, match="2\\*\\*128"):
        store.put(2**128, payload(0), meta(0))
    with pytest.raises(ValueError, match="must be an int"):
        store.put("abc", payload(0), meta(0))
    with pytest.raises(ValueError, match="output buffer"):
        store.get_into(H[0], bytearray(10))
    assert events == [] and store.stats().dram.num_blocks == 0


def test_begin_put_then_abort_or_commit(make_store, events):
    store = make_store(dram_capacity_bytes=BLOCK_BYTES)
    pending = store.begin_put(H[0], meta(0))
    pending.view[:] = payload(0)
    store.check_integrity()  # a reserved slot is neither leaked nor free
    store.abort_put(pending)
    assert not store.contains(H[0]) and events == []
    pending = store.begin_put(H[0], meta(0))
    pending.view[:] = payload(0)
    assert store.commit_put(pending) == "dram"
    assert store.begin_put(H[0], meta(0)) is None
    assert store.get(H[0])[1] == payload(0)


def test_begin_puts_and_commit_puts_batch_under_one_lock(make_store, events):
    store = make_store(dram_capacity_bytes=3 * BLOCK_BYTES)
    put_all(store, [1])
    pendings = store.begin_puts([(H[i], meta(i), i) for i in (0, 1, 2)])
    assert pendings[1] is None  # already stored: only an access
    for i in (0, 2):
        pendings[i].view[:] = payload(i)
    store.check_integrity()
    assert store.commit_puts(pendings) == 2
    assert [store.get(H[i])[1] for i in (0, 1, 2)] == [payload(i) for i in (0, 1, 2)]
    assert events.of(BlockStored, "dram") == [H[1], H[0], H[2]]
    assert store.commit_puts([]) == 0 and store.begin_puts([]) == []


def test_put_many_and_get_many_into(make_store, events):
    store = make_store(dram_capacity_bytes=3 * BLOCK_BYTES)
    put_all(store, [1])
    blocks = [(H[i], payload(i), meta(i), i) for i in (0, 1, 2)]
    assert store.put_many(blocks) == 2  # block 1 was there
    outs = [bytearray(BLOCK_BYTES) for _ in range(4)]
    metas = store.get_many_into([H[2], H[9], H[0], H[1]], outs)
    assert metas == [meta(2), None, meta(0), meta(1)]
    assert [bytes(o) for o in outs] == [payload(2), bytes(BLOCK_BYTES), payload(0), payload(1)]
    assert store.stats().num_misses == 1 and store.stats().dram.num_hits == 3
    assert events.of(BlockStored, "dram") == [H[1], H[0], H[2]]


def test_put_many_and_get_many_into_check_everything_first(make_store, events):
    store = make_store()
    with pytest.raises(ValueError, match="4095 bytes"):
        store.put_many([(H[0], payload(0), meta(0), 0), (H[1], bytes(BLOCK_BYTES - 1), meta(1), 1)])
    assert not store.contains(H[0]) and store.stats().num_reserved == 0
    store.put_many([(H[0], payload(0), meta(0), 0)])
    with pytest.raises(ValueError, match="writable"):
        store.get_many_into([H[0], H[0]], [bytearray(BLOCK_BYTES), bytes(BLOCK_BYTES)])
    with pytest.raises(ValueError, match="2 hashes but 1 output"):
        store.get_many_into([H[0], H[1]], [bytearray(BLOCK_BYTES)])
    assert store.stats().dram.num_hits == 0  # nothing was read


def test_begin_puts_is_all_or_nothing(make_store, events):
    store = make_store(dram_capacity_bytes=2 * BLOCK_BYTES)
    put_all(store, [0])
    store.pin(H[0])  # one free slot left, and no victim
    with pytest.raises(StoreFullError):
        store.begin_puts([(H[1], meta(1), 1), (H[2], meta(2), 2)])
    store.check_integrity()  # the first reservation was given back
    assert store.stats().num_reserved == 0
    with pytest.raises(ValueError, match="must be an int"):
        store.begin_puts([(H[1], meta(1), 1), ("abc", meta(2), 2)])
    assert store.stats().num_reserved == 0
    [pending] = store.begin_puts([(H[1], meta(1), 1)])  # the slot is free again
    store.abort_put(pending)


def test_commit_puts_aborts_the_rest_when_one_fails(make_store, tmp_path):
    store = make_store(
        dram_capacity_bytes=BLOCK_BYTES, ssd_dir=str(tmp_path), ssd_capacity_bytes=BLOCK_BYTES
    )
    put_all(store, [0])
    store.pin(H[0])
    [to_ssd] = store.begin_puts([(H[1], meta(1), 1)])  # DRAM all pinned: bound for SSD
    assert to_ssd.dram_slot is None
    to_ssd.view[:] = payload(1)
    assert store.put(H[3], payload(3), meta(3)) == "ssd"  # fills the SSD...
    store.pin(H[3])  # ... with a pinned block
    store.unpin(H[0])
    [to_dram] = store.begin_puts([(H[2], meta(2), 2)])  # evicts block 0 for a DRAM slot
    assert to_dram.dram_slot is not None
    with pytest.raises(StoreFullError):
        store.commit_puts([to_ssd, to_dram])
    assert store.stats().num_reserved == 0  # the DRAM slot after the failure was given back
    assert not store.contains(H[1]) and not store.contains(H[2])
    store.unpin(H[3])


def test_lease_reads_pins_dram_hits_under_one_lease(make_store, tmp_path):
    clock = ManualClock()
    store = make_store(
        clock=clock,
        dram_capacity_bytes=2 * BLOCK_BYTES,
        ssd_dir=str(tmp_path),
        ssd_capacity_bytes=4 * BLOCK_BYTES,
        shared_dram=True,
    )
    put_all(store, [0, 1, 2])  # block 0 was demoted to SSD
    assert store.tiers(H[0]) == ("ssd",)
    lease, blocks = store.lease_reads([H[1], H[9], H[2], H[1]], ttl_s=5.0)
    assert blocks[1] is None
    for i, block in zip((1, 2, 1), (blocks[0], blocks[2], blocks[3]), strict=True):
        assert block.meta == meta(i) and bytes(block.view) == payload(i)
        assert block.arena_offset is not None
        assert store.is_pinned(H[i])
    assert lease.block_hashes == (H[1], H[2], H[1])  # pins nest: read twice, pinned twice
    assert store.stats().num_misses == 1
    store.pin(H[1])
    store.pin(H[2])  # DRAM is now all pinned: an SSD hit comes as a private copy
    lease2, [copy] = store.lease_reads([H[0]])
    assert lease2 is None and copy.arena_offset is None and bytes(copy.view) == payload(0)
    store.unpin(H[1])
    store.unpin(H[2])
    assert store.release_lease(lease.lease_id)
    assert not store.is_pinned(H[1]) and not store.is_pinned(H[2])
    lease, _ = store.lease_reads([H[1]], ttl_s=5.0)
    clock.advance(6.0)
    assert not store.is_pinned(H[1])  # expired
    assert not store.release_lease(lease.lease_id)
    store.check_integrity()


def test_match_prefix_and_listener_may_reenter(make_store):
    seen = []
    holder = {}

    def listener(event):
        seen.append((event, holder["store"].contains(event.block_hash)))

    store = make_store(listener=listener)
    holder["store"] = store
    put_all(store, [0, 1, 2])
    assert store.match_prefix([H[0], H[1], H[5], H[2]]) == 2
    assert seen == [(BlockStored(H[i], "dram"), True) for i in range(3)]


def test_concurrent_puts_and_gets_stay_consistent(make_store, tmp_path):
    store = make_store(
        dram_capacity_bytes=8 * BLOCK_BYTES,
        ssd_dir=str(tmp_path),
        ssd_capacity_bytes=16 * BLOCK_BYTES,
    )
    errors = []

    def worker(offset):
        try:
            for r in range(30):
                i = (offset * 3 + r) % 12
                store.put(H[i], payload(i), meta(i), position=i)
                got = store.get(H[(i + 5) % 12])
                assert got is None or got[1] == payload((i + 5) % 12)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store.check_integrity()


def test_clear_removes_every_unpinned_block_from_both_tiers(make_store, events, tmp_path):
    from halfmoon.store import StoreConfig, TieredStore

    ssd = {"ssd_dir": str(tmp_path), "ssd_capacity_bytes": 4 * BLOCK_BYTES}
    store = make_store(dram_capacity_bytes=2 * BLOCK_BYTES, **ssd)
    put_all(store, [0, 1, 2, 3])  # two demoted to SSD
    store.pin(H[3])  # being read
    events.clear()
    assert not store.clear()  # the pinned block stays
    assert [store.contains(H[i]) for i in range(4)] == [False, False, False, True]
    assert {e.block_hash for e in events} == {H[0], H[1], H[2]}
    assert all(isinstance(e, BlockEvicted) for e in events)
    store.unpin(H[3])
    assert store.clear() and not store.contains(H[3])
    assert store.stats().dram.num_blocks == store.stats().ssd.num_blocks == 0
    store.close()
    # the SSD journal forgets them too: a reopened store finds nothing
    again = TieredStore(
        StoreConfig(block_bytes=BLOCK_BYTES, dram_capacity_bytes=BLOCK_BYTES, **ssd)
    )
    assert again.stats().ssd.num_blocks == 0
    again.close()

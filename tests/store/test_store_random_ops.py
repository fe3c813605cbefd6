"""Random operation sequences: the store never serves wrong bytes, never loses a pinned
block, stays within capacity, and its allocators and indexes always agree."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_testing import BLOCK_BYTES, meta, payload

from halfmoon.store import StoreConfig, StoreFullError, TieredStore

OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "pin", "unpin", "delete"]), st.integers(0, 11)),
    min_size=1,
    max_size=60,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, policy=st.sampled_from(["lru", "lfu", "length-aware"]))
def test_random_operations_keep_the_store_consistent(tmp_path_factory, ops, policy):
    config = StoreConfig(
        block_bytes=BLOCK_BYTES,
        dram_capacity_bytes=3 * BLOCK_BYTES,
        ssd_dir=str(tmp_path_factory.mktemp("ssd")),
        ssd_capacity_bytes=4 * BLOCK_BYTES,
        policy=policy,
    )
    store = TieredStore(config)
    pins: dict[int, int] = {}
    try:
        for op, i in ops:
            h = 1000 + i
            if op == "put":
                try:
                    store.put(h, payload(i), meta(i), position=i)
                except StoreFullError:
                    assert len(pins) >= 3  # only when pins fill DRAM and pins/SSD fill SSD
            elif op == "get":
                got = store.get(h)
                assert got is None or got == (meta(i), payload(i))
            elif op == "pin" and store.contains(h):
                store.pin(h)
                pins[h] = pins.get(h, 0) + 1
            elif op == "unpin" and pins.get(h):
                store.unpin(h)
                pins[h] -= 1
                if not pins[h]:
                    del pins[h]
            elif op == "delete" and not pins.get(h):
                store.delete(h)
            assert all(store.contains(p) for p in pins)  # pinned blocks are never evicted
            stats = store.stats()
            assert stats.dram.num_blocks <= 3 and stats.ssd.num_blocks <= 4
            store.check_integrity()
    finally:
        store.close()

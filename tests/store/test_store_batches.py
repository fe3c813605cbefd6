"""The batch paths the transfer server uses (``begin_puts`` / ``commit_puts`` with
eviction, ``lease_reads`` / ``release_lease``) against a small model of an LRU DRAM store:
the same blocks stay resident, the same ones are evicted, every read returns its bytes,
and the events say what happened."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_testing import BLOCK_BYTES, meta, payload

from halfmoon.store import BlockEvicted, BlockStored, StoreConfig, StoreFullError, TieredStore

NUM_SLOTS = 6
KEYS = st.lists(st.integers(0, 14), min_size=1, max_size=8)
OPS = st.lists(st.tuples(st.sampled_from(["put", "lease", "release"]), KEYS), max_size=25)


class LRUModel:
    """Resident blocks in LRU order (oldest first), pinned counts, reserved slots."""

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()  # unpinned residents
        self.pins: dict[int, int] = {}
        self.evicted: list[int] = []
        self.stored: list[int] = []

    def resident(self) -> set[int]:
        return set(self.order) | set(self.pins)

    def put(self, keys: list[int]) -> bool:
        """begin_puts then commit_puts; False when the store is full. A failed batch
        stores nothing, but the victims it evicted on the way stay evicted."""
        free = NUM_SLOTS - len(self.resident())
        reserved: list[int] = []
        for k in keys:
            if k in self.order or k in self.pins:
                if k in self.order:
                    self.order.move_to_end(k)
                continue
            if free == 0:
                if not self.order:
                    return False
                self.evicted.append(self.order.popitem(last=False)[0])
                free += 1
            free -= 1
            reserved.append(k)
        for k in reserved:  # a hash twice in one batch is stored once
            if k not in self.order:
                self.order[k] = None
                self.stored.append(k)
        return True

    def lease(self, keys: list[int]) -> list[int]:
        pinned = []
        for k in keys:
            if k in self.order or k in self.pins:
                self.order.pop(k, None)
                self.pins[k] = self.pins.get(k, 0) + 1
                pinned.append(k)
        return pinned

    def release(self, pinned: list[int]) -> None:
        for k in pinned:
            self.pins[k] -= 1
            if not self.pins[k]:
                del self.pins[k]
                self.order[k] = None


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS)
def test_batched_puts_and_leases_match_an_lru_model(ops):
    events: list = []
    store = TieredStore(
        StoreConfig(BLOCK_BYTES, NUM_SLOTS * BLOCK_BYTES, shared_dram=True), events.append
    )
    model = LRUModel()
    leases: list[tuple[int, list[int]]] = []  # (lease id, model's pinned keys)
    try:
        for op, keys in ops:
            if op == "put":
                ok = model.put(keys)
                try:
                    store.put_many([(1000 + k, payload(k), meta(k), k) for k in keys])
                except StoreFullError:
                    assert not ok
                else:
                    assert ok
            elif op == "lease":
                lease, blocks = store.lease_reads([1000 + k for k in keys])
                pinned = model.lease(keys)
                for k, found in zip(keys, blocks, strict=True):
                    assert (found is not None) == (k in model.resident())
                    if found is not None:
                        assert found.meta == meta(k) and bytes(found.view) == payload(k)
                        assert found.arena_offset is not None
                if lease is not None:
                    leases.append((lease.lease_id, pinned))
                else:
                    assert not pinned
            elif leases:
                lease_id, pinned = leases.pop(0)
                assert store.release_lease(lease_id)
                model.release(pinned)
            resident = {h - 1000 for h in range(1000, 1015) if store.contains(h)}
            assert resident == model.resident()
            assert store.stats().num_pinned == len(model.pins)
            store.check_integrity()
        evicted = [e.block_hash - 1000 for e in events if isinstance(e, BlockEvicted)]
        assert evicted == model.evicted
        stored = [e.block_hash - 1000 for e in events if isinstance(e, BlockStored)]
        assert stored == model.stored
        assert store.stats().dram.num_evictions == len(model.evicted)
    finally:
        store.close()

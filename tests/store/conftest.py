"""Store fixtures: every store a test opens is integrity-checked and closed at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from store_testing import BLOCK_BYTES

from halfmoon.store import StoreConfig, StoreEvent, TieredStore


class EventLog(list):
    """Collects store events; ``of(kind, tier)`` filters them to block hashes."""

    def of(self, kind: type, tier: str) -> list[int]:
        return [e.block_hash for e in self if isinstance(e, kind) and e.tier == tier]


@pytest.fixture
def events() -> EventLog:
    return EventLog()


@pytest.fixture
def make_store(events: EventLog) -> Iterator[Callable[..., TieredStore]]:
    """Factory of stores (defaults: 4 KiB blocks, 4 DRAM slots, no SSD, LRU)."""
    opened: list[TieredStore] = []

    def make(
        listener: Callable[[StoreEvent], None] | None = None, clock=None, **overrides
    ) -> TieredStore:
        fields = {"block_bytes": BLOCK_BYTES, "dram_capacity_bytes": 4 * BLOCK_BYTES, **overrides}
        store = TieredStore(StoreConfig(**fields), listener=listener or events.append, clock=clock)
        opened.append(store)
        return store

    yield make
    try:
        for store in opened:
            try:
                store.check_integrity()
            except Exception as exc:
                if "closed" not in str(exc):
                    raise
    finally:
        for store in opened:
            store.close()

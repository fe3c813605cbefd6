"""Tiered KV block store: a DRAM slab arena over an SSD file, keyed by chained block hash.

Usage::

    store = TieredStore(StoreConfig(block_bytes=..., dram_capacity_bytes=..., ssd_dir=...,
                                    ssd_capacity_bytes=...), listener=on_event)
    store.put(block_hash, payload, BlockMeta(num_tokens=16, parent_hash=parent))
    meta = store.get_into(block_hash, out)          # None on a miss
    with store.acquire(block_hash) as ref: ...      # pinned zero-copy view

No torch here: payloads are bytes-like (bytes, bytearray, memoryview, numpy arrays).
"""

from halfmoon.store.errors import (
    BlockPinnedError,
    IntegrityError,
    StoreError,
    StoreFullError,
    UnknownBlockError,
)
from halfmoon.store.events import TIER_DRAM, TIER_SSD, BlockEvicted, BlockStored, StoreEvent
from halfmoon.store.handles import BlockRef, LeasedBlock, PendingPut
from halfmoon.store.lease import Lease
from halfmoon.store.meta import LAYOUT_VERSION, BlockMeta, StoreConfig, StoreStats, TierStats
from halfmoon.store.store import TieredStore

__all__ = [
    "LAYOUT_VERSION",
    "TIER_DRAM",
    "TIER_SSD",
    "BlockEvicted",
    "BlockMeta",
    "BlockPinnedError",
    "BlockRef",
    "LeasedBlock",
    "BlockStored",
    "IntegrityError",
    "Lease",
    "PendingPut",
    "StoreConfig",
    "StoreError",
    "StoreEvent",
    "StoreFullError",
    "StoreStats",
    "TierStats",
    "TieredStore",
    "UnknownBlockError",
]

"""Cache-state events a store emits: the Conductor's only view of what a worker holds.

The store calls its listener synchronously, after the operation that caused the event has
finished and with no store lock held, so a listener may call back into the store. The
worker forwards the events (adding its instance id) to the Conductor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Tier names used in events and statistics.
TIER_DRAM = "dram"
TIER_SSD = "ssd"
TIERS = (TIER_DRAM, TIER_SSD)


@dataclass(frozen=True)
class BlockStored:
    """``block_hash`` became readable from ``tier`` (a put, a promotion or a demotion)."""

    block_hash: int
    tier: str


@dataclass(frozen=True)
class BlockEvicted:
    """``block_hash`` left ``tier`` (eviction, demotion out of DRAM, deletion, corruption)."""

    block_hash: int
    tier: str


StoreEvent = BlockStored | BlockEvicted
#: A callback receiving every event, in the order the store produced them.
EventListener = Callable[[StoreEvent], None]

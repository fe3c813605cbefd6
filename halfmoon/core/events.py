"""The one cache-event vocabulary: a block hash became readable somewhere, or went away.

A store (DRAM/SSD tiers), an engine's KV pool and the simulator's caches all emit these;
the Conductor consumes them. An emitter leaves ``instance_id`` empty; whoever forwards the
event to the Conductor stamps it (:meth:`BlockStored.at`), so one record travels from the
pool to the index unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

#: Tier names of events and statistics (an engine's own pool reports as ``dram``).
TIER_DRAM = "dram"
TIER_SSD = "ssd"
TIERS = (TIER_DRAM, TIER_SSD)


@dataclass(frozen=True)
class BlockStored:
    """``block_hash`` became readable from ``tier`` (of ``instance_id``, once stamped): a
    put, a promotion, a demotion, or an engine committing a full block."""

    block_hash: int
    tier: str = TIER_DRAM
    instance_id: str = ""

    def at(self, instance_id: str) -> BlockStored:
        """The same event, stamped with the instance that holds the block."""
        return replace(self, instance_id=instance_id)


@dataclass(frozen=True)
class BlockEvicted:
    """``block_hash`` left ``tier`` (of ``instance_id``, once stamped): eviction, demotion
    out of DRAM, deletion, corruption, or an engine reusing the block."""

    block_hash: int
    tier: str = TIER_DRAM
    instance_id: str = ""

    def at(self, instance_id: str) -> BlockEvicted:
        """The same event, stamped with the instance that held the block."""
        return replace(self, instance_id=instance_id)


CacheEvent = BlockStored | BlockEvicted
_Event = TypeVar("_Event", BlockStored, BlockEvicted)
_new = object.__new__


def block_stored(block_hash: int, tier: str) -> BlockStored:
    """``BlockStored(block_hash, tier)`` for hot loops (the store's batch paths make one
    per block): the same frozen event, built without the dataclass ``__init__`` (which
    sets each field through ``object.__setattr__``: about 0.9 us here, this 0.4)."""
    return _built(BlockStored, block_hash, tier)


def block_evicted(block_hash: int, tier: str) -> BlockEvicted:
    """``BlockEvicted(block_hash, tier)`` for hot loops (see :func:`block_stored`)."""
    return _built(BlockEvicted, block_hash, tier)


def _built(cls: type[_Event], block_hash: int, tier: str) -> _Event:
    event = _new(cls)
    fields = event.__dict__
    fields["block_hash"] = block_hash
    fields["tier"] = tier
    fields["instance_id"] = ""
    return event

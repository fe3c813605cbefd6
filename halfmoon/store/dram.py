"""DRAM tier: a slab arena plus the index of which block lives in which slot.

A slot is *reserved* between ``reserve`` and ``commit`` (a writer is filling it, e.g. a
transfer receiving straight into it): it is neither free nor visible to readers.
"""

from __future__ import annotations

from typing import NamedTuple

from halfmoon.store.meta import BlockMeta
from halfmoon.store.slab import SlabArena, SlotAllocator


class DRAMEntry(NamedTuple):
    """A resident block: its slot and metadata (a tuple: one is made per stored block)."""

    slot: int
    meta: BlockMeta
    position: int


#: ``new_tuple(Cls, values)`` builds a NamedTuple without its Python-level ``__new__``
#: (about 0.4 us here, this 0.15): for loops that make one per block.
new_tuple = tuple.__new__


class DRAMTier:
    """``num_slots`` blocks of ``block_bytes`` in one preallocated (optionally shared) arena."""

    def __init__(self, block_bytes: int, num_slots: int, shared: bool = False) -> None:
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.arena = SlabArena(num_slots, block_bytes, shared=shared)
        self._allocator = SlotAllocator(num_slots)
        self._entries: dict[int, DRAMEntry] = {}
        self._reserved: set[int] = set()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_reserved(self) -> int:
        """Slots being written (between ``reserve`` and ``commit``/``unreserve``)."""
        return len(self._reserved)

    @property
    def num_free(self) -> int:
        """Slots neither holding a block nor reserved."""
        return self._allocator.num_free

    @property
    def index(self) -> dict[int, DRAMEntry]:
        """The resident blocks by hash (read it; change it only through this class)."""
        return self._entries

    def entry(self, block_hash: int) -> DRAMEntry | None:
        """The index entry of ``block_hash``, or None."""
        return self._entries.get(block_hash)

    def hashes(self) -> list[int]:
        """Every resident block hash."""
        return list(self._entries)

    def view(self, block_hash: int) -> memoryview:
        """Writable view of the block's slot."""
        return self.arena.view(self._entries[block_hash].slot)

    def reserve(self) -> int | None:
        """Take a free slot for a block being written; None when none is free."""
        slot = self._allocator.alloc()
        if slot is not None:
            self._reserved.add(slot)
        return slot

    def commit(self, slot: int, block_hash: int, meta: BlockMeta, position: int) -> None:
        """Publish a reserved slot as ``block_hash``."""
        self._reserved.remove(slot)
        self._entries[block_hash] = new_tuple(DRAMEntry, (slot, meta, position))

    def unreserve(self, slot: int) -> None:
        """Give a reserved slot back unused."""
        self._reserved.remove(slot)
        self._allocator.free(slot)

    def remove(self, block_hash: int) -> None:
        """Forget the block and free its slot."""
        self._allocator.free(self._entries.pop(block_hash).slot)

    def take_slot(self, block_hash: int) -> int:
        """Forget the block and reserve its slot for a block being written (eviction
        straight into a put: the slot never passes through the free list)."""
        slot = self._entries.pop(block_hash).slot
        self._reserved.add(slot)
        return slot

    def check_integrity(self) -> None:
        """Raise :class:`~halfmoon.store.errors.IntegrityError` on a leaked or shared slot."""
        used = [e.slot for e in self._entries.values()] + sorted(self._reserved)
        self._allocator.check_integrity(used)

    def close(self) -> None:
        """Release the arena."""
        self.arena.close()

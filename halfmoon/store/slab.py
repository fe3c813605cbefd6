"""Fixed-size slots: an index allocator and a preallocated memory arena.

The arena is one contiguous buffer of ``num_slots * slot_bytes``; slot ``i`` is the byte
range ``[i*slot_bytes, (i+1)*slot_bytes)``::

    | slot 0 | slot 1 | ... | slot n-1 |
    0        S        2S    (n-1)S     nS

Optionally the buffer is a named shared-memory segment that other processes attach to.
"""

from __future__ import annotations

from collections.abc import Iterable

from halfmoon.store.errors import IntegrityError
from halfmoon.store.shm import Segment, attach_segment, create_segment


class SlotAllocator:
    """Hands out slot indices ``[0, num_slots)``; LIFO reuse keeps recently freed slots warm."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # Pop from the end: slot 0 is handed out first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_slots

    @property
    def num_free(self) -> int:
        """Slots available to ``alloc``."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots handed out and not freed."""
        return self.num_slots - len(self._free)

    def alloc(self) -> int | None:
        """A free slot index, or None when all are in use."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def claim(self, slot: int) -> None:
        """Take a specific free slot (rebuilding state from a journal)."""
        self._check_range(slot)
        if not self._is_free[slot]:
            raise IntegrityError(f"slot {slot} claimed twice")
        self._is_free[slot] = 0
        self._free.remove(slot)

    def free(self, slot: int) -> None:
        """Return ``slot``; freeing a free slot is an :class:`IntegrityError`."""
        self._check_range(slot)
        if self._is_free[slot]:
            raise IntegrityError(f"slot {slot} freed twice")
        self._is_free[slot] = 1
        self._free.append(slot)

    def _check_range(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IntegrityError(f"slot {slot} outside [0, {self.num_slots})")

    def check_integrity(self, used_slots: Iterable[int] | None = None) -> None:
        """Raise :class:`IntegrityError` unless the free list is consistent.

        With ``used_slots`` (every slot the owner's index refers to) also check that each
        slot is exactly one of free or used: no leak, no slot shared by two entries.
        """
        if len(set(self._free)) != len(self._free):
            raise IntegrityError("a slot appears twice in the free list")
        flagged = [i for i in range(self.num_slots) if self._is_free[i]]
        if sorted(self._free) != flagged:
            raise IntegrityError("free list and free flags disagree")
        if used_slots is None:
            return
        used = list(used_slots)
        if len(set(used)) != len(used):
            raise IntegrityError("two index entries share a slot")
        overlap = set(used) & set(self._free)
        if overlap:
            raise IntegrityError(f"slots {sorted(overlap)[:5]} are both free and in use")
        leaked = self.num_slots - len(self._free) - len(used)
        if leaked:
            raise IntegrityError(f"{leaked} slot(s) leaked: neither free nor in the index")


class SlabArena:
    """``num_slots`` preallocated slots of ``slot_bytes``, private or in shared memory."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        shared: bool = False,
        *,
        _segment: Segment | None = None,
    ) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size_bytes = num_slots * slot_bytes
        self._owner = _segment is None
        self._segment: Segment | None = _segment
        if _segment is None and shared and size_bytes:
            self._segment = create_segment(size_bytes, prefix="hm-slab")
        if self._segment is not None:
            if self._segment.size < size_bytes:
                raise ValueError(
                    f"segment {self._segment.name!r} has {self._segment.size} bytes, need {size_bytes}"
                )
            self._buffer = self._segment.buf[:size_bytes]
        else:
            self._buffer = memoryview(bytearray(size_bytes))

    @classmethod
    def attach(cls, segment_name: str, num_slots: int, slot_bytes: int) -> SlabArena:
        """Map another process's shared arena (reading its slots needs no copy)."""
        return cls(num_slots, slot_bytes, _segment=attach_segment(segment_name))

    @property
    def segment_name(self) -> str | None:
        """Name other processes attach to, or None for a private arena."""
        return self._segment.name if self._segment is not None else None

    @property
    def buffer(self) -> memoryview:
        """The whole arena (writable)."""
        return self._buffer

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in the arena."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside [0, {self.num_slots})")
        return slot * self.slot_bytes

    def view(self, slot: int) -> memoryview:
        """Writable view of one slot's bytes (valid until ``close``)."""
        start = self.offset(slot)
        return self._buffer[start : start + self.slot_bytes]

    def close(self) -> None:
        """Release the memory; the owner of a shared arena also removes its name."""
        try:
            self._buffer.release()
        except BufferError:
            pass  # slot views still alive keep the memory until they are collected
        if self._segment is not None:
            self._segment.close(unlink=self._owner)
            self._segment = None

"""An instance's local prefix cache that reports every change to the Conductor.

The Conductor learns cache contents only from ``BlockStored`` / ``BlockEvicted`` events,
so every insertion and eviction here sends one, at the simulated time it happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from halfmoon.conductor.messages import BlockEvicted, BlockStored
from halfmoon.core.eviction import PrefixCache

Notify = Callable[[object], None]


class InstanceCache:
    """A :class:`PrefixCache` of ``capacity_blocks`` blocks (None: unbounded) with eviction
    ``policy``, owned by ``instance_id``; ``notify`` receives the block events (the
    Conductor's ``handle``)."""

    def __init__(
        self, instance_id: str, *, capacity_blocks: int | None, policy: str, notify: Notify
    ) -> None:
        self.instance_id = instance_id
        self._cache = PrefixCache(capacity_blocks, policy)
        self._notify = notify
        self.num_stored = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._cache)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._cache

    @property
    def capacity_blocks(self) -> int | None:
        """The capacity in blocks (None: unbounded)."""
        return self._cache.capacity_blocks

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading ``block_hashes`` held."""
        return self._cache.match_prefix(block_hashes)

    def touch(self, block_hashes: Sequence[int], start_position: int = 0) -> None:
        """Access (insert if absent) blocks at positions ``start_position``, ``+1``...
        of their request, evict down to capacity, and report what changed."""
        cache = self._cache
        new = [h for h in block_hashes if h not in cache]
        evicted = cache.touch(block_hashes, start_position)
        self._report(new, evicted)

    def insert(self, blocks: Sequence[tuple[int, int]]) -> None:
        """Insert ``(position, hash)`` blocks not yet held (replication: a copy is not an
        access of the blocks already here), evict down to capacity, report the changes."""
        cache = self._cache
        new = [(p, h) for p, h in blocks if h not in cache]
        evicted: list[int] = []
        for position, h in new:
            evicted += cache.touch((h,), position)
        self._report([h for _, h in new], evicted)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the events sent account for every block held
        (what the Conductor was told adds up to what is here) and capacity holds."""
        assert self.num_stored - self.num_evicted == len(self._cache), (
            self.num_stored,
            self.num_evicted,
            len(self._cache),
        )
        capacity = self._cache.capacity_blocks
        assert capacity is None or len(self._cache) <= capacity

    def _report(self, new: list[int], evicted: list[int]) -> None:
        gone = set(evicted)
        notify = self._notify
        iid = self.instance_id
        # A block inserted and evicted by the same call was never visible: no event.
        for h in new:
            if h not in gone:
                notify(BlockStored(block_hash=h, instance_id=iid))
                self.num_stored += 1
        fresh = set(new)
        for h in evicted:
            if h not in fresh:
                notify(BlockEvicted(block_hash=h, instance_id=iid))
                self.num_evicted += 1

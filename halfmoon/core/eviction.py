"""Eviction policies for content-hashed KV blocks, and a capacity-bounded prefix cache.

One implementation serves the trace cache replay (``halfmoon trace cache``), the
simulator's per-instance caches and the tiered store, so hit ratios agree everywhere.

Policies order *resident* keys; they do not own capacity. Each access records the block's
position in its request (block index; with chained hashes a given hash always sits at the
same index). Victim order, first evicted first:

- ``lru``: least recently accessed.
- ``lfu``: fewest accesses while resident; ties -> least recently accessed.
- ``length-aware``: fewest accesses; ties -> the block that occurs *later* in requests
  (larger index: a tail block is useless once its parent is gone, a head block serves
  every request that shares it, as the paper's LengthAwareCache does); then least
  recently accessed.

Access counts start at 1 on insertion and are forgotten on eviction.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

POLICY_NAMES = ("lru", "lfu", "length-aware")


class EvictionPolicy(Protocol):
    """Orders resident keys for eviction."""

    name: str

    def record_access(self, key: int, position: int) -> None:
        """Note an insertion or hit of ``key`` at block index ``position``."""

    def discard(self, key: int) -> None:
        """Forget ``key`` (it left for another reason: deleted, pinned); absent keys are ignored."""

    def pop_victim(self) -> int:
        """Forget and return the next key to evict; ``KeyError`` when empty."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first; O(1) per operation."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def record_access(self, key: int, position: int) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        else:
            self._order[key] = None

    def discard(self, key: int) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> int:
        if not self._order:
            raise KeyError("no key to evict")
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class _HeapPolicy(ABC):
    """A priority order kept in a heap with lazy deletion; subclasses define ``_priority``.

    Stale heap entries (superseded by a later access or discarded) are skipped on pop and
    compacted away when they outnumber live ones.
    """

    name = "heap"

    def __init__(self) -> None:
        self._live: dict[int, tuple] = {}
        self._counts: dict[int, int] = {}
        self._heap: list[tuple] = []
        self._seq = 0

    @abstractmethod
    def _priority(self, count: int, position: int, seq: int) -> tuple:
        """Heap order of a key after its ``count``-th access (smallest is evicted first)."""

    def record_access(self, key: int, position: int) -> None:
        self._seq += 1
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        entry = (*self._priority(count, position, self._seq), key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def discard(self, key: int) -> None:
        if self._live.pop(key, None) is not None:
            del self._counts[key]

    def pop_victim(self) -> int:
        while self._heap:
            entry = heapq.heappop(self._heap)
            key = entry[-1]
            if self._live.get(key) == entry:
                del self._live[key]
                del self._counts[key]
                return key
        raise KeyError("no key to evict")

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live


class LFUPolicy(_HeapPolicy):
    """Fewest accesses first; ties broken by least recent access."""

    name = "lfu"

    def _priority(self, count: int, position: int, seq: int) -> tuple:
        return (count, seq)


class LengthAwarePolicy(_HeapPolicy):
    """LFU whose ties evict blocks later in their request first, then least recent."""

    name = "length-aware"

    def _priority(self, count: int, position: int, seq: int) -> tuple:
        return (count, -position, seq)


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name (``lru``, ``lfu``, ``length-aware``)."""
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "length-aware":
        return LengthAwarePolicy()
    raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


class PrefixCache:
    """A set of block hashes bounded to ``capacity_blocks`` (None: unbounded).

    ``access`` implements the replay rule of the paper's Table 1: the hit is the number of
    leading blocks already resident (stopping at the first miss); then every block of the
    request is touched in order (inserted if absent) and the cache evicts down to capacity.
    """

    def __init__(self, capacity_blocks: int | None, policy: str = "lru") -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = make_policy(policy)

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` resident, stopping at the first miss."""
        num_hit = 0
        for h in hashes:
            if h not in self.policy:
                break
            num_hit += 1
        return num_hit

    def touch(self, hashes: Iterable[int], start_position: int = 0) -> list[int]:
        """Record an access of each block (inserting absent ones) and evict down to capacity.

        Returns the evicted hashes (possibly including some just touched, when a request
        is longer than the whole cache).
        """
        for position, h in enumerate(hashes, start_position):
            self.policy.record_access(h, position)
        return self.evict_to(self.capacity_blocks)

    def evict_to(self, capacity_blocks: int | None) -> list[int]:
        """Evict until at most ``capacity_blocks`` remain; returns the victims."""
        if capacity_blocks is None:
            return []
        evicted = []
        while len(self.policy) > capacity_blocks:
            evicted.append(self.policy.pop_victim())
        return evicted

    def access(self, hashes: Sequence[int]) -> int:
        """Look up then touch a whole request; returns its number of prefix-hit blocks."""
        num_hit = self.match_prefix(hashes)
        self.touch(hashes)
        return num_hit

    def remove(self, key: int) -> None:
        """Drop ``key`` if resident."""
        self.policy.discard(key)

"""Leases: time-bounded pins for remote readers that may die without unpinning."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    """Blocks pinned for a remote reader until ``release_lease`` or ``expires_at_s``."""

    lease_id: int
    block_hashes: tuple[int, ...]
    expires_at_s: float


class LeaseTable:
    """Live leases by id, with their expiry times in a heap."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._expiries: list[tuple[float, int]] = []
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, block_hashes: tuple[int, ...], expires_at_s: float) -> Lease:
        """Record a new lease."""
        lease = Lease(next(self._ids), block_hashes, expires_at_s)
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiries, (expires_at_s, lease.lease_id))
        return lease

    def pop(self, lease_id: int) -> Lease | None:
        """Remove and return a live lease (None if unknown or already gone)."""
        return self._leases.pop(lease_id, None)

    def pop_expired(self, now_s: float) -> list[Lease]:
        """Remove and return every lease that expired at or before ``now_s``."""
        expired = []
        while self._expiries and self._expiries[0][0] <= now_s:
            _, lease_id = heapq.heappop(self._expiries)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                expired.append(lease)
        return expired

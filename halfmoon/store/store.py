"""The tiered KV block store: DRAM slab -> SSD file, keyed by chained block hash.

``put`` writes to DRAM (demoting the eviction policy's victim to SSD when full, or going
straight to SSD when every DRAM block is pinned); a read that hits only SSD promotes the
block back to DRAM after verifying its checksum. Placement details are in
:mod:`halfmoon.store.tiering`. Pinned blocks (``pin``, ``acquire``, leases) are never
evicted; a put that needs room when every block is pinned raises
:class:`~halfmoon.store.errors.StoreFullError` and evicts nothing.

All methods are thread-safe (one lock). ``BlockStored`` / ``BlockEvicted`` events go to
the listener after the lock is released, in the order they happened. Payloads of 64 KiB
and more are copied in and out without the GIL (:func:`halfmoon.core.buffers.copy_into`),
so a thread storing a pull's blocks does not hold up a worker's loop thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from halfmoon.core.buffers import copy_into
from halfmoon.core.clock import Clock, WallClock
from halfmoon.store.errors import BlockPinnedError, StoreError, UnknownBlockError
from halfmoon.store.events import TIER_DRAM, TIER_SSD, EventListener, StoreEvent
from halfmoon.store.handles import BlockRef, LeasedBlock, PendingPut
from halfmoon.store.lease import Lease, LeaseTable
from halfmoon.store.meta import BlockMeta, StoreConfig, StoreStats
from halfmoon.store.tiering import TierSet


def as_block_view(buffer: object, what: str, block_bytes: int) -> memoryview:
    """``buffer`` as a flat byte view of exactly ``block_bytes``, else ``ValueError``."""
    try:
        view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
    except TypeError as exc:
        raise ValueError(f"{what} must be a contiguous bytes-like object: {exc}") from exc
    if view.nbytes != block_bytes:
        raise ValueError(f"{what} has {view.nbytes} bytes; this store's blocks have {block_bytes}")
    return view


class TieredStore:
    """Blocks of ``config.block_bytes`` in DRAM and (optionally) an SSD directory.

    ``listener`` receives every :class:`BlockStored` / :class:`BlockEvicted`, including one
    ``BlockStored(h, "ssd")`` per block recovered from the SSD journal at open. ``clock``
    times leases.
    """

    def __init__(
        self, config: StoreConfig, listener: EventListener | None = None, clock: Clock | None = None
    ) -> None:
        self.config = config
        self._clock = clock if clock is not None else WallClock()
        self._leases = LeaseTable()
        self._tiers = TierSet(config)
        self._guard = _Guard(self._tiers, self._leases, listener, self._clock)
        with self._locked():
            pass  # delivers the recovery events

    def _locked(self) -> _Guard:
        """``with self._locked() as tiers:`` holds the lock (see :class:`_Guard`)."""
        return self._guard

    # ---------------------------------------------------------------- writes
    def begin_put(self, block_hash: int, meta: BlockMeta, position: int = 0) -> PendingPut | None:
        """Reserve room for a block and return its writable slot; None if already stored.

        Fill ``pending.view`` (e.g. ``recv_into`` it), then ``commit_put`` or ``abort_put``.
        ``position`` is the block's index in its request (length-aware eviction).
        Raises :class:`StoreFullError` when every block is pinned.
        """
        with self._locked() as t:
            return t.begin_puts(((block_hash, meta, position),))[0]

    def begin_puts(self, blocks: Sequence[tuple[int, BlockMeta, int]]) -> list[PendingPut | None]:
        """:meth:`begin_put` for many ``(hash, meta, position)`` under one lock, all or
        nothing: if one fails (:class:`StoreFullError`, a bad hash) the slots reserved
        before it are given back and the error raised."""
        with self._locked() as t:
            return t.begin_puts(blocks)

    def commit_put(self, pending: PendingPut) -> str:
        """Publish a filled ``PendingPut``; returns the tier it landed in."""
        with self._locked() as t:
            t.commit_puts((pending,))
        return TIER_DRAM if pending.dram_slot is not None else TIER_SSD

    def commit_puts(self, pendings: Sequence[PendingPut | None]) -> int:
        """:meth:`commit_put` for every pending that is not None, under one lock; returns
        how many. If one fails (every SSD block pinned) the ones after it are aborted and
        the error raised."""
        with self._locked() as t:
            return t.commit_puts(pendings)

    def abort_put(self, pending: PendingPut) -> None:
        """Give back the slot of a put that will not be committed."""
        with self._locked() as t:
            if pending.dram_slot is not None:
                t.dram.unreserve(pending.dram_slot)

    def put(self, block_hash: int, payload: object, meta: BlockMeta, position: int = 0) -> str:
        """Store one block (``payload``: ``block_bytes`` bytes-like); returns its tier.

        Storing a hash already present only counts as an access (content is named by hash).
        """
        view = as_block_view(payload, "payload", self.config.block_bytes)
        pending = self.begin_put(block_hash, meta, position)
        if pending is None:
            return self.tiers(block_hash)[0]
        copy_into(pending.view, 0, view)
        return self.commit_put(pending)

    def put_many(self, blocks: Sequence[tuple[int, object, BlockMeta, int]]) -> int:
        """:meth:`put` for many ``(hash, payload, meta, position)`` under one lock per
        phase (reserve all, copy, commit all); returns how many were new. All or nothing:
        a bad payload or a full store raises before anything is stored."""
        size = self.config.block_bytes
        views = [as_block_view(payload, "payload", size) for _, payload, _, _ in blocks]
        pendings = self.begin_puts([(h, meta, position) for h, _, meta, position in blocks])
        for pending, view in zip(pendings, views, strict=True):
            if pending is not None:
                copy_into(pending.view, 0, view)
        return self.commit_puts(pendings)

    def clear(self) -> bool:
        """Remove every block from every tier (a cache reset; the listener hears each
        eviction, the SSD tier's journal forgets them); a pinned block (being read) stays,
        and then the answer is False."""
        with self._locked() as t:
            hashes = set(t.dram.hashes()) | set(t.ssd.hashes() if t.ssd is not None else ())
            for h in hashes:
                if not t.pins.get(h):
                    t.remove(h)
            return not any(t.contains(h) for h in hashes)

    def set_ssd_namespace(self, namespace: bytes) -> None:
        """Name another origin of the SSD tier's blocks from now on (new weights: a restart
        on the old ones opens the directory empty); only an empty tier can (ValueError)."""
        with self._locked() as t:
            if t.ssd is not None:
                t.ssd.set_namespace(namespace)

    def delete(self, block_hash: int) -> bool:
        """Remove a block from every tier; False if absent. A pinned block raises."""
        with self._locked() as t:
            if t.pins.get(block_hash):
                raise BlockPinnedError(f"block {block_hash:#x} is pinned")
            return t.remove(block_hash)

    # ---------------------------------------------------------------- reads
    def get_into(self, block_hash: int, out: object) -> BlockMeta | None:
        """Copy the payload into ``out`` (``block_bytes``, writable); None on a miss."""
        out_view = as_block_view(out, "output buffer", self.config.block_bytes)
        with self._locked() as t:
            found = t.lookup(block_hash)
            if found is None:
                return None
            copy_into(out_view, 0, found.view)
            return found.meta

    def get_many_into(
        self, block_hashes: Sequence[int], outs: Sequence[object]
    ) -> list[BlockMeta | None]:
        """:meth:`get_into` for many blocks under one lock: each payload copied into its
        ``out``; a miss gives None and leaves its ``out`` untouched."""
        if len(block_hashes) != len(outs):
            raise ValueError(f"{len(block_hashes)} hashes but {len(outs)} output buffers")
        size = self.config.block_bytes
        views = [as_block_view(out, "output buffer", size) for out in outs]
        if any(view.readonly for view in views):
            raise ValueError("output buffers must be writable")
        metas: list[BlockMeta | None] = []
        with self._locked() as t:
            for block_hash, view in zip(block_hashes, views, strict=True):
                found = t.lookup(block_hash)
                if found is None:
                    metas.append(None)
                else:
                    copy_into(view, 0, found.view)
                    metas.append(found.meta)
        return metas

    def read_into(self, block_hash: int, out: memoryview) -> BlockMeta | None:
        """:meth:`get_into` for a caller that already holds a flat byte view of exactly
        ``block_bytes`` (no conversion; the transfer server's per-read fast path)."""
        if out.nbytes != self.config.block_bytes or out.format != "B" or out.readonly:
            raise ValueError(
                f"output buffer must be a writable byte view of {self.config.block_bytes} bytes"
            )
        with self._guard as t:
            found = t.lookup(block_hash)
            if found is None:
                return None
            copy_into(out, 0, found.view)
            return found.meta

    def get(self, block_hash: int) -> tuple[BlockMeta, bytes] | None:
        """The block's metadata and a copy of its payload, or None on a miss."""
        out = bytearray(self.config.block_bytes)
        meta = self.get_into(block_hash, out)
        return None if meta is None else (meta, bytes(out))

    def acquire(self, block_hash: int) -> BlockRef | None:
        """Pin a block and return a zero-copy reference to its DRAM slot; None on a miss.

        The caller must ``release()`` it (a ``with`` block does). If DRAM is full of
        pinned blocks an SSD hit comes back as a private copy with nothing pinned.
        """
        with self._locked() as t:
            found = t.lookup(block_hash)
            if found is None:
                return None
            if found.dram_slot is None:
                return BlockRef(block_hash, found.meta, found.view, None, None, lambda: None)
            t.pin(block_hash)
            released = False

            def release() -> None:
                nonlocal released
                with self._guard as tiers:
                    if not released:  # a second release must not drop someone else's pin
                        released = True
                        tiers.unpin(block_hash)

            offset = t.dram.arena.offset(found.dram_slot)
            return BlockRef(block_hash, found.meta, found.view, self.segment_name, offset, release)

    def lease_reads(
        self, block_hashes: Sequence[int], ttl_s: float | None = None
    ) -> tuple[Lease | None, list[LeasedBlock | None]]:
        """Look up blocks for a reader that may die (a remote one) under one lock.

        Every hit in DRAM is pinned under one lease, returned with it (None when no
        block was pinned): ``release_lease`` it once the blocks are read, or it expires
        after ``ttl_s``. Such a hit comes with its offset in the shared arena (when the
        arena is shared); an SSD hit that found no DRAM room comes as a private copy,
        pinned by nothing; a miss as None. Hits and misses count as reads do.
        """
        with self._locked() as t:
            pinned, blocks = t.lease_reads(block_hashes)
            return (self._add_lease(pinned, ttl_s) if pinned else None), blocks

    # ---------------------------------------------------------------- pins and leases
    def pin(self, block_hash: int) -> None:
        """Keep a block from eviction until the matching ``unpin`` (pins nest)."""
        with self._locked() as t:
            if not t.contains(block_hash):
                raise UnknownBlockError(f"cannot pin unknown block {block_hash:#x}")
            t.pin(block_hash)

    def unpin(self, block_hash: int) -> None:
        """Undo one ``pin``; the block becomes evictable when no pin is left."""
        with self._locked() as t:
            t.unpin(block_hash)

    def lease(self, block_hashes: Sequence[int], ttl_s: float | None = None) -> Lease:
        """Pin ``block_hashes`` for a remote reader until ``release_lease`` or expiry.

        Every block must be present (else :class:`UnknownBlockError`, nothing pinned).
        """
        with self._locked() as t:
            missing = [h for h in block_hashes if not t.contains(h)]
            if missing:
                raise UnknownBlockError(
                    f"cannot lease {len(missing)} unknown block(s), e.g. {missing[0]:#x}"
                )
            for h in block_hashes:
                t.pin(h)
            return self._add_lease(block_hashes, ttl_s)

    def _add_lease(self, pinned: Sequence[int], ttl_s: float | None) -> Lease:
        """Record a lease over blocks the caller pinned (under the lock)."""
        ttl_s = self.config.lease_ttl_s if ttl_s is None else ttl_s
        return self._leases.add(tuple(pinned), self._clock.now() + ttl_s)

    def release_lease(self, lease_id: int) -> bool:
        """Unpin a lease's blocks; False if it already expired or was released."""
        with self._locked() as t:
            lease = self._leases.pop(lease_id)
            if lease is None:
                return False
            t.unpin_many(lease.block_hashes)
            return True

    # ---------------------------------------------------------------- queries
    @property
    def block_bytes(self) -> int:
        """Payload size of every block."""
        return self.config.block_bytes

    @property
    def segment_name(self) -> str | None:
        """Shared-memory name of the DRAM arena (``shared_dram``), else None."""
        return self._tiers.dram.arena.segment_name

    def arena_offset(self, dram_slot: int) -> int:
        """Byte offset of a DRAM slot in the arena (``segment_name``'s bytes for co-located
        writers filling a ``PendingPut``)."""
        return self._tiers.dram.arena.offset(dram_slot)

    def contains(self, block_hash: int) -> bool:
        """Whether the block is in any tier (no access recorded)."""
        with self._locked() as t:
            return t.contains(block_hash)

    def tiers(self, block_hash: int) -> tuple[str, ...]:
        """The tiers holding the block, DRAM first (empty when absent)."""
        with self._locked() as t:
            return t.tiers(block_hash)

    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        """Number of leading ``block_hashes`` present in any tier (no access recorded)."""
        with self._locked() as t:
            for i, h in enumerate(block_hashes):
                if not t.contains(h):
                    return i
            return len(block_hashes)

    def is_pinned(self, block_hash: int) -> bool:
        """Whether the block holds a pin or a lease."""
        with self._locked() as t:
            return block_hash in t.pins

    def ssd_file_offset(self, block_hash: int) -> int:
        """Byte offset of the block in the SSD data file (tools, corruption tests)."""
        with self._locked() as t:
            if not t.in_ssd(block_hash):
                raise UnknownBlockError(f"block {block_hash:#x} is not on SSD")
            assert t.ssd is not None
            return t.ssd.file_offset(block_hash)

    def stats(self) -> StoreStats:
        """A snapshot of the counters (hits and misses per tier, bytes, evictions)."""
        with self._locked() as t:
            return t.stats()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if allocators, indexes, policies or pins disagree."""
        with self._locked() as t:
            t.check_integrity()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._guard.closed

    def close(self) -> None:
        """Close the SSD files (blocks persist) and free DRAM; later calls raise."""
        with self._guard.lock:
            if not self._guard.closed:
                self._guard.closed = True
                self._tiers.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Guard:
    """The store's lock as a reusable context manager (cheaper than ``@contextmanager``).

    Entering expires due leases (outermost entry only); leaving delivers the events the
    operation queued, in order, after the lock is released, so listeners may call back
    into the store. Reentrant: public methods may call each other.
    """

    def __init__(
        self, tiers: TierSet, leases: LeaseTable, listener: EventListener | None, clock: Clock
    ) -> None:
        self.lock = threading.RLock()
        self.closed = False
        self._tiers = tiers
        self._leases = leases
        self._listener = listener
        self._clock = clock
        self._depth = 0

    def __enter__(self) -> TierSet:
        self.lock.acquire()
        if self.closed:
            self.lock.release()
            raise StoreError("the store is closed")
        self._depth += 1
        if self._depth == 1 and len(self._leases):
            try:
                for lease in self._leases.pop_expired(self._clock.now()):
                    self._tiers.unpin_many(lease.block_hashes)
            except BaseException:
                self.__exit__()
                raise
        return self._tiers

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        events: list[StoreEvent] = []
        if self._depth == 0 and self._tiers.events:
            events, self._tiers.events = self._tiers.events, []
        self.lock.release()
        if self._listener is not None:
            for event in events:
                self._listener(event)


__all__ = ["TIER_DRAM", "TIER_SSD", "TieredStore", "as_block_view"]

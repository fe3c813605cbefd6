"""Placement across the DRAM and SSD tiers: eviction, demotion, promotion, pins.

:class:`TierSet` is the single-threaded core of :class:`~halfmoon.store.TieredStore`
(which adds the lock, leases, events delivery and the public API). It appends the events
it causes to ``self.events``; the store hands them to its listener.

Rules (tiers are inclusive: a block may sit in both):

- Making DRAM room pops the DRAM policy's victim and *demotes* it to SSD (unless already
  there; if SSD has no unpinned victim left, the block is dropped). SSD eviction drops
  the victim for good.
- A read that hits only SSD *promotes*: the block is read and checksum-verified into a
  DRAM slot, keeping its SSD copy. A corrupt SSD copy is dropped.
- Pinned blocks are out of both policies, so they are never victims; the last unpin
  records a fresh access in each tier holding the block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from halfmoon.core.events import block_evicted, block_stored
from halfmoon.core.eviction import EvictionPolicy, make_policy
from halfmoon.store.dram import DRAMTier, new_tuple
from halfmoon.store.errors import IntegrityError, StoreError, StoreFullError
from halfmoon.store.events import TIER_DRAM, TIER_SSD, StoreEvent
from halfmoon.store.handles import LeasedBlock, PendingPut
from halfmoon.store.meta import (
    HASH_LIMIT,
    BlockMeta,
    StoreConfig,
    StoreStats,
    TierStats,
    check_block_hash,
)
from halfmoon.store.ssd import SSDTier

log = logging.getLogger(__name__)


@dataclass
class _TierCounters:
    num_hits: int = 0
    num_evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class Found(NamedTuple):
    """A block located for reading: its metadata, bytes, and DRAM slot (None: private copy)."""

    meta: BlockMeta
    view: memoryview
    dram_slot: int | None


class TierSet:
    """The DRAM and SSD tiers of one store with their policies, pins and counters."""

    def __init__(self, config: StoreConfig) -> None:
        self.block_bytes = config.block_bytes
        self.events: list[StoreEvent] = []
        self.pins: dict[int, int] = {}
        self.ssd: SSDTier | None = None
        if config.num_ssd_slots:
            assert config.ssd_dir is not None
            self.ssd = SSDTier(
                config.ssd_dir,
                config.block_bytes,
                config.num_ssd_slots,
                config.ssd_sync,
                config.ssd_namespace,
            )
        try:
            self.dram = DRAMTier(
                config.block_bytes, config.num_dram_slots, shared=config.shared_dram
            )
        except BaseException:
            if self.ssd is not None:
                self.ssd.close()  # release the directory lock
            raise
        self._policies: dict[str, EvictionPolicy] = {
            TIER_DRAM: make_policy(config.policy),
            TIER_SSD: make_policy(config.policy),
        }
        self._counters = {TIER_DRAM: _TierCounters(), TIER_SSD: _TierCounters()}
        self._num_misses = self._num_corrupt = self._num_promotions = self._num_demotions = 0
        for h in self.ssd.hashes() if self.ssd is not None else ():
            self.track(TIER_SSD, h)  # recovered blocks: the Conductor must learn of them
            self.events.append(block_stored(h, TIER_SSD))

    # ------------------------------------------------------------ membership
    def in_ssd(self, h: int) -> bool:
        """Whether the SSD tier holds ``h``."""
        return self.ssd is not None and h in self.ssd

    def contains(self, h: int) -> bool:
        """Whether any tier holds ``h``."""
        return h in self.dram or self.in_ssd(h)

    def tiers(self, h: int) -> tuple[str, ...]:
        """Tiers holding ``h``, fastest first."""
        return ((TIER_DRAM,) if h in self.dram else ()) + ((TIER_SSD,) if self.in_ssd(h) else ())

    def _position(self, h: int) -> int:
        entry = self.dram.entry(h) or (self.ssd.entry(h) if self.ssd is not None else None)
        return entry.position if entry is not None else 0

    def track(self, tier: str, h: int, position: int | None = None) -> None:
        """Record an access in ``tier``'s policy unless ``h`` is pinned (pins stay out)."""
        if h not in self.pins:
            self._policies[tier].record_access(
                h, self._position(h) if position is None else position
            )

    # ------------------------------------------------------------ pins
    def pin(self, h: int) -> None:
        """Add a pin; the first one takes ``h`` out of both policies."""
        count = self.pins.get(h, 0)
        if count == 0:
            for policy in self._policies.values():
                policy.discard(h)
        self.pins[h] = count + 1

    def unpin(self, h: int) -> None:
        """Remove a pin; the last one makes ``h`` evictable again."""
        count = self.pins.get(h, 0)
        if count == 0:
            raise StoreError(f"block {h:#x} is not pinned")
        if count > 1:
            self.pins[h] = count - 1
            return
        del self.pins[h]
        for tier in self.tiers(h):
            self.track(tier, h)

    # ------------------------------------------------------------ room
    def make_ssd_room(self) -> bool:
        """Evict SSD victims until a slot is free; False if every SSD block is pinned."""
        assert self.ssd is not None
        while self.ssd.num_free == 0:
            try:
                victim = self._policies[TIER_SSD].pop_victim()
            except KeyError:
                return False
            self.ssd.remove(victim)
            self._counters[TIER_SSD].num_evictions += 1
            self.events.append(block_evicted(victim, TIER_SSD))
        return True

    def ssd_has_room(self) -> bool:
        """Whether an SSD write could succeed (a free slot or an unpinned victim)."""
        return self.ssd is not None and (self.ssd.num_free > 0 or len(self._policies[TIER_SSD]) > 0)

    def _demote(self, victim: int) -> None:
        entry = self.dram.entry(victim)
        assert entry is not None
        if self.ssd is not None and victim not in self.ssd and self.make_ssd_room():
            self.ssd.write(victim, self.dram.view(victim), entry.meta, entry.position)
            self._counters[TIER_SSD].bytes_written += self.block_bytes
            self._num_demotions += 1
            self.track(TIER_SSD, victim)
            self.events.append(block_stored(victim, TIER_SSD))
        self.dram.remove(victim)
        self._counters[TIER_DRAM].num_evictions += 1
        self.events.append(block_evicted(victim, TIER_DRAM))

    def reserve_dram(self) -> int | None:
        """Reserve a DRAM slot, demoting unpinned victims as needed; None if impossible."""
        if self.dram.num_slots == 0:
            return None
        while self.dram.num_free == 0:
            try:
                victim = self._policies[TIER_DRAM].pop_victim()
            except KeyError:
                return None
            self._demote(victim)
        return self.dram.reserve()

    # ------------------------------------------------------------ writes
    def write_ssd(self, h: int, payload: memoryview, meta: BlockMeta, position: int) -> bool:
        """Write ``h`` straight to SSD; False if every SSD block is pinned."""
        assert self.ssd is not None
        if not self.make_ssd_room():
            return False
        self.ssd.write(h, payload, meta, position)
        self._counters[TIER_SSD].bytes_written += self.block_bytes
        self.track(TIER_SSD, h)
        self.events.append(block_stored(h, TIER_SSD))
        return True

    def remove(self, h: int) -> bool:
        """Drop ``h`` from every tier (the caller checked it is unpinned)."""
        tiers = self.tiers(h)
        for tier in tiers:
            self._policies[tier].discard(h)
            (self.dram if tier == TIER_DRAM else self.ssd).remove(h)  # type: ignore[union-attr]
            self.events.append(block_evicted(h, tier))
        return bool(tiers)

    # ------------------------------------------------------------ reads
    def _promote(self, h: int) -> Found | None:
        """Read an SSD-only block into DRAM (a private buffer if DRAM is full of pins)."""
        assert self.ssd is not None
        self.pin(h)  # making DRAM room demotes to SSD, which must not evict ``h`` itself
        try:
            slot = self.reserve_dram()
            buf = (
                self.dram.arena.view(slot)
                if slot is not None
                else memoryview(bytearray(self.block_bytes))
            )
            entry = self.ssd.read_into(h, buf)
            if entry is None:
                if slot is not None:
                    self.dram.unreserve(slot)
                self._policies[TIER_SSD].discard(h)
                self._num_corrupt += 1
                # Once per block: the block leaves the index, so it is never read again.
                log.warning("SSD block %032x failed its checksum: dropped, treated as a miss "
                            "(its tokens are recomputed); %d corrupt so far", h,
                            self._num_corrupt)  # fmt: skip
                self.events.append(block_evicted(h, TIER_SSD))
                return None
            self._counters[TIER_SSD].num_hits += 1
            self._counters[TIER_SSD].bytes_read += self.block_bytes
            if slot is not None:
                self.dram.commit(slot, h, entry.meta, entry.position)
                self._num_promotions += 1
                self.events.append(block_stored(h, TIER_DRAM))
            return Found(entry.meta, buf, slot)
        finally:
            self.unpin(h)  # records the access in each tier now holding ``h``

    def lookup(self, h: int) -> Found | None:
        """Find ``h`` for reading, counting the hit (promoting from SSD) or the miss."""
        entry = self.dram.entry(h)
        if entry is not None:
            counters = self._counters[TIER_DRAM]
            counters.num_hits += 1
            counters.bytes_read += self.block_bytes
            self.track(TIER_DRAM, h, entry.position)
            return Found(entry.meta, self.dram.arena.view(entry.slot), entry.slot)
        found = self._promote(h) if self.in_ssd(h) else None
        if found is None:
            self._num_misses += 1
        return found

    # ------------------------------------------------------------ batches
    # The transfer server's puts and pulls come in batches of up to 1,024 blocks. These
    # loops do what the per-block methods above do, block by block in the same order,
    # with the per-block calls inlined (at 4 KiB a block's bookkeeping costs more than
    # its copy).

    def begin_puts(self, blocks: Sequence[tuple[int, BlockMeta, int]]) -> list[PendingPut | None]:
        """Reserve a slot per ``(hash, meta, position)`` (None: already stored, counted as
        an access); all or nothing: on an error every slot reserved here is given back."""
        dram, ssd, size, events = self.dram, self.ssd, self.block_bytes, self.events
        index, reserve, take_slot = dram.index, dram.reserve, dram.take_slot
        buffer = dram.arena.buffer
        pop_victim = self._policies[TIER_DRAM].pop_victim
        pendings: list[PendingPut | None] = []
        num_dropped, num_free = 0, dram.num_free
        try:
            for h, meta, position in blocks:
                if type(h) is not int or not 0 <= h < HASH_LIMIT:
                    check_block_hash(h)  # raises, naming the problem
                if h in index or (ssd is not None and h in ssd):
                    for tier in self.tiers(h):
                        self.track(tier, h)
                    pendings.append(None)
                    continue
                slot = None
                if num_free:  # (the free list only shrinks in this loop)
                    slot = reserve()
                    num_free -= 1
                if slot is None and ssd is None and dram.num_slots:
                    # reserve_dram() without an SSD tier: drop the victim, take its slot
                    try:
                        victim = pop_victim()
                    except KeyError:
                        pass  # every block is pinned or being written
                    else:
                        slot = take_slot(victim)
                        num_dropped += 1
                        events.append(block_evicted(victim, TIER_DRAM))
                elif slot is None:
                    slot = self.reserve_dram()  # demotes to SSD to make room
                if slot is not None:
                    start = slot * size
                    view = buffer[start : start + size]
                    pendings.append(new_tuple(PendingPut, (h, meta, position, view, slot)))
                elif self.ssd_has_room():
                    staging = memoryview(bytearray(size))
                    pendings.append(PendingPut(h, meta, position, staging, None))
                else:
                    raise StoreFullError(
                        f"store is full: all {len(dram)} DRAM blocks"
                        + (f" and {len(ssd)} SSD blocks" if ssd is not None else "")
                        + " are pinned or being written"
                    )
        except BaseException:
            for pending in pendings:
                if pending is not None and pending.dram_slot is not None:
                    dram.unreserve(pending.dram_slot)
            raise
        finally:
            self._counters[TIER_DRAM].num_evictions += num_dropped
        return pendings

    def commit_puts(self, pendings: Sequence[PendingPut | None]) -> int:
        """Publish every filled pending that is not None; how many. If one fails (every
        SSD block pinned) the ones after it are given back and the error raised."""
        todo = [p for p in pendings if p is not None]
        dram, pins, events = self.dram, self.pins, self.events
        index, commit = dram.index, dram.commit
        record = self._policies[TIER_DRAM].record_access
        num_dram = done = 0
        try:
            for pending in todo:
                h, slot = pending.block_hash, pending.dram_slot
                if slot is None:
                    if not self.in_ssd(h) and not self.write_ssd(
                        h, pending.view, pending.meta, pending.position
                    ):
                        raise StoreFullError("store is full: every SSD block is pinned")
                elif h in index:  # a concurrent writer won; same hash, same contents
                    dram.unreserve(slot)
                else:
                    commit(slot, h, pending.meta, pending.position)
                    num_dram += 1
                    if h not in pins:
                        record(h, pending.position)
                    events.append(block_stored(h, TIER_DRAM))
                done += 1
        except BaseException:
            for rest in todo[done + 1 :]:
                if rest.dram_slot is not None:
                    dram.unreserve(rest.dram_slot)
            raise
        finally:
            self._counters[TIER_DRAM].bytes_written += num_dram * self.block_bytes
        return len(todo)

    def lease_reads(self, hashes: Sequence[int]) -> tuple[list[int], list[LeasedBlock | None]]:
        """Look up blocks for a reader, pinning every DRAM hit (:meth:`lookup` then
        :meth:`pin` per block); returns the pinned hashes and the blocks (None: a miss;
        an SSD hit DRAM had no room for comes as a private copy, pinned by nothing)."""
        dram, pins, size = self.dram, self.pins, self.block_bytes
        index, buffer = dram.index, dram.arena.buffer
        shared = dram.arena.segment_name is not None
        discard_dram = self._policies[TIER_DRAM].discard
        discard_ssd, has_ssd = self._policies[TIER_SSD].discard, self.ssd is not None
        blocks: list[LeasedBlock | None] = []
        pinned: list[int] = []
        num_hits = 0
        for h in hashes:
            entry = index.get(h)
            if entry is None:  # SSD, or a miss: the general path
                found = self.lookup(h)
                if found is None:
                    blocks.append(None)
                elif found.dram_slot is None:
                    blocks.append(LeasedBlock(found.meta, found.view, None))
                else:
                    self.pin(h)
                    pinned.append(h)
                    offset = found.dram_slot * size if shared else None
                    blocks.append(LeasedBlock(found.meta, found.view, offset))
                continue
            num_hits += 1
            # lookup() records the access and pin() takes the block out of the policies,
            # which also forgets that access: pinning alone leaves the same state.
            count = pins.get(h, 0)
            if count == 0:
                discard_dram(h)
                if has_ssd:  # (without an SSD tier its policy is empty)
                    discard_ssd(h)
            pins[h] = count + 1
            pinned.append(h)
            start = entry.slot * size
            view = buffer[start : start + size]
            blocks.append(new_tuple(LeasedBlock, (entry.meta, view, start if shared else None)))
        counters = self._counters[TIER_DRAM]
        counters.num_hits += num_hits
        counters.bytes_read += num_hits * size
        return pinned, blocks

    def unpin_many(self, hashes: Sequence[int]) -> None:
        """:meth:`unpin` each of ``hashes`` in order."""
        pins, index, ssd = self.pins, self.dram.index, self.ssd
        record_dram = self._policies[TIER_DRAM].record_access
        for h in hashes:
            count = pins.get(h, 0)
            if count != 1:
                self.unpin(h)  # nested pins, or an error for a block not pinned
                continue
            del pins[h]
            entry = index.get(h)
            if entry is not None:
                record_dram(h, entry.position)
            if ssd is not None and h in ssd:
                self.track(TIER_SSD, h)

    # ------------------------------------------------------------ bookkeeping
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        ssd = self.ssd
        has_ssd = ssd is not None  # (an empty tier is falsy: it has a length)
        tiers = {}
        for name, size, capacity in (
            (TIER_DRAM, len(self.dram), self.dram.num_slots),
            (TIER_SSD, len(ssd) if has_ssd else 0, ssd.num_slots if has_ssd else 0),
        ):
            c = self._counters[name]
            tiers[name] = TierStats(
                size, capacity, c.num_hits, c.num_evictions, c.bytes_written, c.bytes_read
            )
        return StoreStats(
            dram=tiers[TIER_DRAM],
            ssd=tiers[TIER_SSD],
            num_misses=self._num_misses,
            num_corrupt=self._num_corrupt,
            num_promotions=self._num_promotions,
            num_demotions=self._num_demotions,
            num_pinned=len(self.pins),
            num_reserved=self.dram.num_reserved,
            num_torn_records=ssd.num_torn_records if has_ssd else 0,
            num_foreign_blocks=ssd.num_foreign_blocks if has_ssd else 0,
        )

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` if allocators, indexes, policies or pins disagree."""
        self.dram.check_integrity()
        tiers: list[tuple[str, list[int]]] = [(TIER_DRAM, self.dram.hashes())]
        if self.ssd is not None:
            self.ssd.check_integrity()
            tiers.append((TIER_SSD, self.ssd.hashes()))
        for tier, hashes in tiers:
            unpinned = {h for h in hashes if h not in self.pins}
            policy = self._policies[tier]
            if len(policy) != len(unpinned) or any(h not in policy for h in unpinned):
                raise IntegrityError(f"{tier} eviction policy disagrees with the {tier} index")
        stray = [h for h in self.pins if not self.contains(h)]
        if stray:
            raise IntegrityError(f"{len(stray)} pinned block(s) are in no tier")

    def close(self) -> None:
        """Close the SSD files (blocks persist) and free the DRAM arena."""
        if self.ssd is not None:
            self.ssd.close()
        self.dram.close()

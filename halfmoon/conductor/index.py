"""The cluster-wide prefix index: which instance holds which block, fed by events.

Each block hash maps to a bitmask of instances (bit i = instance slot i), per tier and for
any tier. A prefix match walks the request's block hashes once, narrowing the mask of
instances still matching; an instance whose bit drops out at block i has matched i blocks::

    blocks:      h0    h1    h2    h3
    any-mask:   1011  1001  0001  0000
    alive:      1011  1001  0001  0000   -> slot0: 3 blocks, slot3: 2, slot1: 1, slot2: 0

That is O(prefix length) dictionary lookups and integer ANDs whatever the number of
instances, and the memory is one dict entry per distinct block per tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from halfmoon.conductor.messages import TIERS


class PrefixIndex:
    """Block hash -> set of instances (as bitmasks), per tier."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._ids_by_slot: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._any: dict[int, int] = {}
        self._by_tier: dict[str, dict[int, int]] = {tier: {} for tier in TIERS}
        #: Distinct blocks each instance holds in any tier (kept with ``_any``).
        self._held: dict[str, int] = {}

    # -- instances ---------------------------------------------------------------------
    def add_instance(self, instance_id: str) -> None:
        """Give ``instance_id`` a slot (idempotent)."""
        if instance_id in self._slots:
            return
        slot = self._free_slots.pop() if self._free_slots else len(self._slots)
        self._slots[instance_id] = slot
        self._ids_by_slot[slot] = instance_id
        self._held[instance_id] = 0

    def remove_instance(self, instance_id: str) -> None:
        """Forget an instance and every block it held (a scan: rare, O(index size))."""
        slot = self._slots.pop(instance_id, None)
        if slot is None:
            return
        del self._held[instance_id]
        del self._ids_by_slot[slot]
        keep = ~(1 << slot)
        for table in (self._any, *self._by_tier.values()):
            for h in [h for h, m in table.items() if m >> slot & 1]:
                mask = table[h] & keep
                if mask:
                    table[h] = mask
                else:
                    del table[h]
        self._free_slots.append(slot)

    @property
    def instances(self) -> tuple[str, ...]:
        """Known instance ids."""
        return tuple(self._slots)

    def __len__(self) -> int:
        """Number of distinct blocks held anywhere."""
        return len(self._any)

    # -- events --------------------------------------------------------------------------
    def _tier_table(self, tier: str) -> dict[int, int]:
        table = self._by_tier.get(tier)
        if table is None:
            raise ValueError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")
        return table

    def stored(self, instance_id: str, block_hash: int, tier: str = "dram") -> None:
        """``instance_id`` now holds ``block_hash`` in ``tier``."""
        self.add_instance(instance_id)
        bit = 1 << self._slots[instance_id]
        table = self._tier_table(tier)
        table[block_hash] = table.get(block_hash, 0) | bit
        held = self._any.get(block_hash, 0)
        if not held & bit:
            self._any[block_hash] = held | bit
            self._held[instance_id] += 1

    def evicted(self, instance_id: str, block_hash: int, tier: str = "dram") -> None:
        """``instance_id`` dropped ``block_hash`` from ``tier`` (unknown pairs are ignored)."""
        slot = self._slots.get(instance_id)
        if slot is None:
            return
        bit = 1 << slot
        table = self._tier_table(tier)
        mask = table.get(block_hash, 0) & ~bit
        if mask:
            table[block_hash] = mask
        else:
            table.pop(block_hash, None)
        if any(t.get(block_hash, 0) & bit for t in self._by_tier.values()):
            return  # still held in another tier
        held = self._any.get(block_hash, 0)
        if not held & bit:
            return
        self._held[instance_id] -= 1
        if held & ~bit:
            self._any[block_hash] = held & ~bit
        else:
            del self._any[block_hash]

    # -- queries -------------------------------------------------------------------------
    def holds(self, instance_id: str, block_hash: int) -> bool:
        """Whether ``instance_id`` holds ``block_hash`` in any tier."""
        slot = self._slots.get(instance_id)
        return slot is not None and bool(self._any.get(block_hash, 0) >> slot & 1)

    def num_held(self, instance_id: str) -> int:
        """Distinct blocks ``instance_id`` holds in any tier (kept as events come)."""
        return self._held.get(instance_id, 0)

    def holders(self, block_hash: int) -> list[str]:
        """Instances holding ``block_hash`` in any tier."""
        mask = self._any.get(block_hash, 0)
        return [i for i, s in self._slots.items() if mask >> s & 1]

    def match(self, block_hashes: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
        """Number of leading ``block_hashes`` held by each of ``instance_ids`` (any tier)."""
        result = dict.fromkeys(instance_ids, 0)
        result.update(self.match_holders(block_hashes, self.mask(instance_ids)))
        return result

    def mask(self, instance_ids: Sequence[str]) -> int:
        """The slot bitmask of the known ones of ``instance_ids`` (for :meth:`match_holders`)."""
        slot_of = self._slots
        return sum(1 << slot_of[iid] for iid in set(instance_ids) if iid in slot_of)

    def match_holders(self, block_hashes: Sequence[int], alive: int) -> dict[str, int]:
        """Number of leading ``block_hashes`` held by each instance of the slot mask
        ``alive`` that holds at least the first one (the others match 0 blocks): O(prefix
        length + holders), whatever the number of instances."""
        lengths: dict[int, int] = {}
        table = self._any
        position = 0
        for position, h in enumerate(block_hashes):  # noqa: B007 - position used after loop
            still = table.get(h, 0) & alive
            if still != alive:
                dropped = alive & ~still
                while dropped and position:
                    low = dropped & -dropped
                    lengths[low.bit_length() - 1] = position
                    dropped ^= low
                alive = still
                if not alive:
                    break
        else:
            position = len(block_hashes)
        while alive and position:
            low = alive & -alive
            lengths[low.bit_length() - 1] = position
            alive ^= low
        id_of = self._ids_by_slot
        return {id_of[slot]: n for slot, n in lengths.items()}

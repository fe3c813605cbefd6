"""Per-block metadata, store configuration and statistics (small frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from halfmoon.core.eviction import POLICY_NAMES

#: Version of the KV byte layout inside a block; bumped when the engine changes it.
LAYOUT_VERSION = 1
HASH_BITS = 128
HASH_LIMIT = 2**HASH_BITS
_U32_MAX = 2**32 - 1


def check_block_hash(block_hash: object) -> int:
    """Return ``block_hash`` if it is a valid 128-bit block hash, else raise ``ValueError``."""
    if type(block_hash) is int and 0 <= block_hash < HASH_LIMIT:  # the common case, fast
        return block_hash
    if isinstance(block_hash, bool) or not isinstance(block_hash, int):
        raise ValueError(f"block hash must be an int, got {type(block_hash).__name__}")
    if not 0 <= block_hash < HASH_LIMIT:
        raise ValueError(f"block hash {block_hash} is outside [0, 2**128)")
    return block_hash


@dataclass(frozen=True)
class BlockMeta:
    """What travels with a block's payload: tokens it covers, its parent, the byte layout."""

    num_tokens: int
    parent_hash: int
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not 0 <= self.num_tokens <= _U32_MAX:
            raise ValueError(f"num_tokens must lie in [0, 2**32), got {self.num_tokens}")
        parent = self.parent_hash
        if type(parent) is not int or not 0 <= parent < HASH_LIMIT:
            check_block_hash(parent)  # raises, naming the problem
        if not 0 <= self.layout_version <= 0xFFFF:
            raise ValueError(f"layout_version must lie in [0, 65535], got {self.layout_version}")


_new = object.__new__


def trusted_meta(num_tokens: int, parent_hash: int, layout_version: int) -> BlockMeta:
    """``BlockMeta(...)`` for decoders that have checked the three ranges themselves: the
    same frozen value without ``__init__`` and ``__post_init__`` (about 1 us a block here,
    this 0.35; a store batch decodes one per block)."""
    meta = _new(BlockMeta)
    fields = meta.__dict__
    fields["num_tokens"] = num_tokens
    fields["parent_hash"] = parent_hash
    fields["layout_version"] = layout_version
    return meta


#: The SSD namespace of a store that names none (tests, standalone peers).
NO_NAMESPACE = bytes(16)


def check_namespace(namespace: bytes) -> bytes:
    """``namespace`` when it is 16 bytes, else ValueError."""
    if not isinstance(namespace, bytes) or len(namespace) != 16:
        raise ValueError(f"an SSD namespace is 16 bytes, got {namespace!r}")
    return namespace


@dataclass(frozen=True)
class StoreConfig:
    """Sizes and policy of a :class:`~halfmoon.store.TieredStore`.

    ``block_bytes`` is fixed per store (one block's KV for all layers). Capacities are in
    bytes and rounded down to whole blocks. ``ssd_dir`` None means no SSD tier.
    ``shared_dram`` puts the DRAM slab in a named shared-memory segment so co-located
    processes (the shm transport) read blocks without a copy through a socket.
    ``ssd_sync`` fsyncs every SSD write (survives power loss, not only process death).
    ``ssd_namespace`` (16 bytes) names what computed the blocks, e.g. a model's
    fingerprint: an SSD directory written under another namespace is opened empty.
    """

    block_bytes: int
    dram_capacity_bytes: int
    ssd_dir: str | None = None
    ssd_capacity_bytes: int = 0
    policy: str = "lru"
    shared_dram: bool = False
    ssd_sync: bool = False
    lease_ttl_s: float = 30.0
    ssd_namespace: bytes = NO_NAMESPACE

    def __post_init__(self) -> None:
        if self.block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {self.block_bytes}")
        if self.dram_capacity_bytes < 0 or self.ssd_capacity_bytes < 0:
            raise ValueError("tier capacities must be >= 0 bytes")
        if self.policy not in POLICY_NAMES:
            raise ValueError(
                f"unknown eviction policy {self.policy!r}; choose from {', '.join(POLICY_NAMES)}"
            )
        if self.num_dram_slots == 0 and self.num_ssd_slots == 0:
            raise ValueError(
                f"store holds no block: DRAM capacity {self.dram_capacity_bytes} B and SSD "
                f"capacity {self.ssd_capacity_bytes} B are both below block_bytes {self.block_bytes}"
            )
        if self.ssd_dir is None and self.ssd_capacity_bytes > 0:
            raise ValueError("ssd_capacity_bytes > 0 needs an ssd_dir")
        if self.ssd_dir is not None and self.ssd_capacity_bytes < self.block_bytes:
            raise ValueError(
                f"ssd_capacity_bytes {self.ssd_capacity_bytes} holds no {self.block_bytes}-byte block"
            )
        check_namespace(self.ssd_namespace)
        if self.lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {self.lease_ttl_s}")

    @property
    def num_dram_slots(self) -> int:
        """Blocks the DRAM tier holds."""
        return self.dram_capacity_bytes // self.block_bytes

    @property
    def num_ssd_slots(self) -> int:
        """Blocks the SSD tier holds (0 without ``ssd_dir``)."""
        return self.ssd_capacity_bytes // self.block_bytes if self.ssd_dir else 0


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier since the store was opened."""

    num_blocks: int = 0
    capacity_blocks: int = 0
    num_hits: int = 0
    num_evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store's counters (``TieredStore.stats()``)."""

    dram: TierStats = field(default_factory=TierStats)
    ssd: TierStats = field(default_factory=TierStats)
    num_misses: int = 0
    num_corrupt: int = 0
    num_promotions: int = 0
    num_demotions: int = 0
    num_pinned: int = 0
    num_reserved: int = 0
    num_torn_records: int = 0
    #: Blocks the SSD directory held under another namespace when the store opened
    #: (another model's KV: never served, their slots reused).
    num_foreign_blocks: int = 0

    @property
    def num_hits(self) -> int:
        """Hits in any tier."""
        return self.dram.num_hits + self.ssd.num_hits

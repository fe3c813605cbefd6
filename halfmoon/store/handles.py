"""Handles the store gives out: a pinned zero-copy block reference, a block read under a
lease, and a pending put."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from halfmoon.store.meta import BlockMeta


class BlockRef:
    """A readable block, pinned until ``release()`` (or the ``with`` block ends).

    ``view`` is the DRAM slot itself (no copy) when ``arena_offset`` is set; then a
    co-located process attached to ``segment_name`` (a shared arena) can read the same
    bytes at that offset. When DRAM had no room the view is a private copy read from SSD
    and ``arena_offset`` is None. (A plain slotted class: it is made on every read.)
    """

    __slots__ = ("arena_offset", "block_hash", "meta", "segment_name", "view", "_release")

    def __init__(
        self,
        block_hash: int,
        meta: BlockMeta,
        view: memoryview,
        segment_name: str | None,
        arena_offset: int | None,
        release: Callable[[], None],
    ) -> None:
        self.block_hash = block_hash
        self.meta = meta
        self.view = view
        self.segment_name = segment_name
        self.arena_offset = arena_offset
        self._release = release

    def release(self) -> None:
        """Unpin the block (further calls do nothing)."""
        self._release()

    def __enter__(self) -> BlockRef:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PendingPut(NamedTuple):
    """A slot reserved for a block being written; fill ``view``, then commit or abort.

    ``dram_slot`` None means the block goes straight to SSD at commit (DRAM is absent or
    all pinned) and ``view`` is a private staging buffer.
    """

    block_hash: int
    meta: BlockMeta
    position: int
    view: memoryview
    dram_slot: int | None


class LeasedBlock(NamedTuple):
    """A block found by :meth:`~halfmoon.store.TieredStore.lease_reads`.

    ``view`` holds its bytes: its DRAM slot, pinned by the lease, or a private copy read
    from SSD when DRAM had no room (pinned by nothing). ``arena_offset`` is where the slot
    lies in the shared arena, for a co-located reader; None for a private copy or an
    arena that is not shared.
    """

    meta: BlockMeta
    view: memoryview
    arena_offset: int | None

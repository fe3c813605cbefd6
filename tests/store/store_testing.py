"""Shared helpers of the store tests (a uniquely named module, unlike ``conftest``)."""

from __future__ import annotations

from halfmoon.store import BlockMeta

BLOCK_BYTES = 4096


def payload(i: int, block_bytes: int = BLOCK_BYTES) -> bytes:
    """A recognizable block: one repeated byte per index."""
    return bytes([i % 251 + 1]) * block_bytes


def meta(i: int) -> BlockMeta:
    """Metadata of block i in a chain of 16-token blocks."""
    return BlockMeta(num_tokens=16, parent_hash=max(i - 1, 0))

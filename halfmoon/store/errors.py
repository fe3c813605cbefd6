"""Errors of the block store; all are :class:`HalfmoonError` (one-line messages)."""

from __future__ import annotations

from halfmoon.core.errors import HalfmoonError


class StoreError(HalfmoonError):
    """Base class of block-store errors."""


class StoreFullError(StoreError):
    """No slot can be freed: every resident block is pinned (nothing was evicted or lost)."""


class UnknownBlockError(StoreError):
    """The block hash is not in the store."""


class BlockPinnedError(StoreError):
    """The operation needs an unpinned block (e.g. delete)."""


class IntegrityError(StoreError):
    """An allocator and its index disagree (leaked or double-freed slot): a bug, not input."""

"""Where a buffer's bytes lie, a view over bytes that lie back to back, and buffers that
are about to be filled whole.

Used to treat blocks that are adjacent in memory (slices of one tensor or array, as an
engine's KV blocks often are) as one span: one copy or one encode instead of one per
block. Only writable buffers can be located (ctypes maps those).
"""

from __future__ import annotations

import ctypes

import numpy as np

_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def buffer_address(view: memoryview) -> int | None:
    """The address of ``view``'s first byte, or None for a read-only or empty buffer
    (~0.3 us; it runs per block where blocks are joined)."""
    try:
        return _addressof(_from_buffer(view))
    except (TypeError, ValueError):
        return None


def span_at(address: int, num_bytes: int) -> memoryview:
    """A flat byte view of ``num_bytes`` from ``address``. The caller keeps the buffers
    that own those bytes alive while the view is used."""
    return memoryview((ctypes.c_char * num_bytes).from_address(address)).cast("B")


def uninitialized(num_bytes: int) -> memoryview:
    """A writable flat byte buffer whose contents are undefined, for one that a receive,
    a read or a decode fills whole. ``bytearray(n)`` zero-fills with the GIL held (a
    90 MiB prefix pull spent ~75 ms on it); this costs microseconds, and the kernel
    zeroes each page when it is first written, outside Python."""
    return memoryview(np.empty(num_bytes, np.uint8))

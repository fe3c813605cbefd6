"""Where a buffer's bytes lie, a view over bytes that lie back to back, and buffers that
are about to be filled whole.

Used to treat blocks that are adjacent in memory (slices of one tensor or array, as an
engine's KV blocks often are) as one span: one copy or one encode instead of one per
block. Only writable buffers can be located (ctypes maps those). And copies of large
buffers that let other threads run meanwhile (:func:`copy_into`: the store's and the
transfer engine's).
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


#: Buffers at least this large are copied without the GIL (below it a slice assignment,
#: cheaper than a released-and-retaken GIL).
GIL_FREE_BYTES = 64 << 10


def copy_into(dest: memoryview, offset: int, src: memoryview) -> None:
    """Copy the bytes of ``src`` to ``dest[offset:]`` (both flat byte views); a range past
    either end of ``dest`` raises ``ValueError``. From ``GIL_FREE_BYTES`` on, the copy
    releases the GIL (``ctypes.memmove``, or numpy for a read-only source): a memoryview
    slice assignment holds it, and a thread copying block after block would keep every
    other Python thread (a worker's loop among them) waiting for the interpreter's
    switch interval, 5 ms."""
    n = src.nbytes
    check_range(dest, offset, n)
    if n >= GIL_FREE_BYTES:
        dest_address, src_address = buffer_address(dest), buffer_address(src)
        if dest_address is not None and src_address is not None:
            ctypes.memmove(dest_address + offset, src_address, n)
        else:  # a read-only source (bytes): numpy reads it, still without the GIL
            np.copyto(np.frombuffer(dest, np.uint8, n, offset), np.frombuffer(src, np.uint8))
    else:
        dest[offset : offset + n] = src


def check_range(dest: memoryview, offset: int, num_bytes: int) -> None:
    """Raise ``ValueError`` unless ``num_bytes`` from ``offset`` lie within ``dest``."""
    if offset < 0 or offset + num_bytes > dest.nbytes:
        raise ValueError(
            f"range [{offset}, {offset + num_bytes}) is outside the destination's "
            f"{dest.nbytes} bytes"
        )

"""Copies into another process's shared memory that let other threads run meanwhile.

A ``memoryview`` slice assignment copies while holding the GIL: the batch's other
connection threads (and, in a prefill worker, the engine) wait for it. Large blocks are
copied by numpy, which releases the GIL, so a batch's two connection threads copy on two
cores at once: with it a 64 MiB push of 1 MiB blocks into another process's shared
memory ran at 106% of a one-thread memcpy (96-114% per round), of 16 MiB blocks at 120%
(docs/benchmarks.md, "Store and transfer"). Small blocks keep the assignment, cheaper
than numpy's call below 64 KiB.
"""

from __future__ import annotations

import numpy as np

#: Blocks at least this large are copied without the GIL.
GIL_FREE_BYTES = 64 << 10


def copy_into(dest: memoryview, offset: int, src: memoryview) -> None:
    """Copy the bytes of ``src`` to ``dest[offset:]`` (both flat byte views; the caller
    has checked the range)."""
    n = src.nbytes
    if n >= GIL_FREE_BYTES:
        np.copyto(np.frombuffer(dest, np.uint8, n, offset), np.frombuffer(src, np.uint8))
    else:
        dest[offset : offset + n] = src

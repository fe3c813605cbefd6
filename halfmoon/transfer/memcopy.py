"""Copies into another process's shared memory that let other threads run meanwhile.

A ``memoryview`` slice assignment copies while holding the GIL: the batch's other
connection threads (and, in a prefill worker, the engine) wait for it. Large blocks are
copied by numpy, which releases the GIL, so a batch's two connection threads copy on two
cores at once: with it a 64 MiB push of 1 MiB blocks into another process's shared
memory ran at 106% of a one-thread memcpy (96-114% per round), of 16 MiB blocks at 120%
(docs/benchmarks.md, "Store and transfer"). Small blocks keep the assignment, cheaper
than numpy's call below 64 KiB. :func:`copy_blocks` copies a run of blocks that lie back
to back both in memory and at their destination as one (a request's blocks in an engine's
pool often do: 16-token blocks of one layer's K are ~12 KiB for SmolLM2).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from halfmoon.core.buffers import buffer_address, span_at

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


def copy_blocks(dest: memoryview, blocks: Iterable[tuple[int, memoryview]]) -> None:
    """Copy every ``(offset, src)`` into ``dest`` (flat byte views, ranges checked by the
    caller). Blocks adjacent in memory whose destinations are adjacent too are copied as
    one span: one call (and, from 64 KiB, without the GIL) instead of one per block."""
    run: list[memoryview] = []  # the current run's blocks, back to back from run_address
    run_offset = run_address = run_bytes = 0
    for offset, src in blocks:
        address = buffer_address(src)
        if (
            run
            and address is not None
            and offset == run_offset + run_bytes
            and address == run_address + run_bytes
        ):
            run.append(src)
            run_bytes += src.nbytes
            continue
        _copy_run(dest, run_offset, run, run_address, run_bytes)
        run, run_offset, run_address, run_bytes = [src], offset, address or 0, src.nbytes
        if address is None:  # cannot extend it: copy it alone
            _copy_run(dest, offset, run, 0, run_bytes)
            run = []
    _copy_run(dest, run_offset, run, run_address, run_bytes)


def _copy_run(
    dest: memoryview, offset: int, run: list[memoryview], address: int, num_bytes: int
) -> None:
    if len(run) == 1:
        copy_into(dest, offset, run[0])
    elif run:  # the run's blocks stay alive (in ``run``) while the span is read
        copy_into(dest, offset, span_at(address, num_bytes))

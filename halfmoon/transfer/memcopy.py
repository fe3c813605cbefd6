"""Copies into another process's shared memory that let other threads run meanwhile.

A ``memoryview`` slice assignment copies while holding the GIL: the batch's other
connection threads (and, in a prefill worker, the engine) wait for it. Large blocks are
copied by ``ctypes.memmove`` (or numpy), which release the GIL, so a batch's two
connection threads copy on two cores at once: with it a 64 MiB push of 1 MiB blocks into
another process's shared memory ran at 106% of a one-thread memcpy (96-114% per round),
of 16 MiB blocks at 120% (docs/benchmarks.md, "Store and transfer"). Small blocks keep
the assignment, cheaper than a released-and-retaken GIL below 64 KiB.

:func:`copy_blocks` copies a run of blocks of 64 KiB and more that lie at a constant
stride both in memory and at their destination with one call: blocks back to back as one
span, blocks with gaps between them (every other block of a pool that interleaves K and
V, say) as one strided numpy copy. Each call that releases the GIL is a hand-off between
the copying threads, so fewer and larger calls keep both cores copying: two threads
copying 1,024 scattered 64 KiB blocks ran at about 7 GiB/s with a numpy call per block,
9.6 with ``memmove`` per block and 12 with one strided copy each. Smaller blocks are
copied one by one: finding the runs (an address per block through ctypes) cost about
1 us a block, a 4 KiB slice assignment 0.3 (2026-12-03).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from halfmoon.core.buffers import GIL_FREE_BYTES, buffer_address, check_range, copy_into, span_at

#: Runs of at least this many blocks at a constant stride (not back to back) are copied
#: with one strided call; shorter ones block by block.
MIN_STRIDED_BLOCKS = 3


class _Run:
    """Blocks of one size at a constant stride in memory and at the destination."""

    __slots__ = ("offset", "address", "size", "blocks", "src_stride", "dest_stride")

    def __init__(self, offset: int, address: int | None, src: memoryview) -> None:
        self.offset, self.address, self.size = offset, address, src.nbytes
        self.blocks = [src]  # kept alive while a span over them is read
        self.src_stride = self.dest_stride = 0

    def extend(self, offset: int, address: int | None, src: memoryview) -> bool:
        """Take ``src`` if it continues the run's strides (the second block sets them)."""
        if self.address is None or address is None or src.nbytes != self.size:
            return False
        count = len(self.blocks)
        if count == 1:
            src_stride, dest_stride = address - self.address, offset - self.offset
            if src_stride < self.size or dest_stride < self.size:
                return False  # overlapping or descending: not a run
            self.src_stride, self.dest_stride = src_stride, dest_stride
        elif (
            address != self.address + count * self.src_stride
            or offset != self.offset + count * self.dest_stride
        ):
            return False
        self.blocks.append(src)
        return True

    def check(self, dest: memoryview) -> None:
        """``ValueError`` unless every block of the run fits in ``dest``."""
        check_range(dest, self.offset, (len(self.blocks) - 1) * self.dest_stride + self.size)

    def copy(self, dest: memoryview) -> None:
        """Copy the run into ``dest`` (its range checked)."""
        count, size = len(self.blocks), self.size
        if count == 1:
            copy_into(dest, self.offset, self.blocks[0])
            return
        assert self.address is not None  # runs of more than one block know their address
        if self.src_stride == size and self.dest_stride == size:  # back to back: one span
            copy_into(dest, self.offset, span_at(self.address, count * size))
        elif count >= MIN_STRIDED_BLOCKS:
            span = span_at(self.address, (count - 1) * self.src_stride + size)
            src = np.ndarray((count, size), np.uint8, span, 0, (self.src_stride, 1))
            out = np.ndarray((count, size), np.uint8, dest, self.offset, (self.dest_stride, 1))
            np.copyto(out, src)
        else:
            for i, block in enumerate(self.blocks):
                copy_into(dest, self.offset + i * self.dest_stride, block)

    def copy_out(self, src: memoryview) -> None:
        """The reverse of :meth:`copy`: the run's ranges of ``src`` into its blocks (its
        range checked)."""
        count, size, start = len(self.blocks), self.size, self.offset
        if count == 1:
            copy_into(self.blocks[0], 0, src[start : start + size])
            return
        assert self.address is not None
        if self.src_stride == size and self.dest_stride == size:
            copy_into(span_at(self.address, count * size), 0, src[start : start + count * size])
        elif count >= MIN_STRIDED_BLOCKS:
            span = span_at(self.address, (count - 1) * self.src_stride + size)
            out = np.ndarray((count, size), np.uint8, span, 0, (self.src_stride, 1))
            np.copyto(out, np.ndarray((count, size), np.uint8, src, start, (self.dest_stride, 1)))
        else:
            for i, block in enumerate(self.blocks):
                at = start + i * self.dest_stride
                copy_into(block, 0, src[at : at + size])


def copy_blocks(dest: memoryview, blocks: Iterable[tuple[int, memoryview]]) -> int:
    """Copy every ``(offset, src)`` into ``dest`` (flat byte views) and return the bytes
    copied. Every range is checked before anything is copied: one past either end of
    ``dest`` raises ``ValueError`` and leaves ``dest`` untouched. Blocks of 64 KiB and more
    of one size at a constant stride in memory whose destinations are at a constant stride
    too are copied as one run: one call without the GIL instead of one per block. Smaller
    blocks are copied one by one (a slice assignment: 0.3 us for 4 KiB here, where finding
    the runs cost 1 us a block)."""
    return _copy(dest, blocks, into=True)


def copy_out_blocks(src: memoryview, blocks: Iterable[tuple[int, memoryview]]) -> int:
    """The reverse of :func:`copy_blocks`: copy ``src[offset : offset + n]`` into each
    ``(offset, dest)`` (``dest`` writable, of ``n`` bytes), runs of large blocks at constant
    strides as one call; every range is checked before anything is copied
    (``ValueError``)."""
    return _copy(src, blocks, into=False)


def _copy(arena: memoryview, blocks: Iterable[tuple[int, memoryview]], into: bool) -> int:
    """Blocks into ``arena`` (``into``) or out of it; every range checked first."""
    items = _listed(blocks)
    if _small(items):
        for offset, view in items:
            check_range(arena, offset, view.nbytes)
        if into:
            for offset, view in items:
                arena[offset : offset + view.nbytes] = view
        else:
            for offset, view in items:
                view[:] = arena[offset : offset + view.nbytes]
        return sum(view.nbytes for _, view in items)
    runs, num_bytes = _runs(items)
    for run in runs:
        run.check(arena)
    for run in runs:
        if into:
            run.copy(arena)
        else:
            run.copy_out(arena)
    return num_bytes


def _listed(blocks: Iterable[tuple[int, memoryview]]) -> list[tuple[int, memoryview]]:
    return blocks if isinstance(blocks, list) else list(blocks)


def _small(items: list[tuple[int, memoryview]]) -> bool:
    """Whether every block is below ``GIL_FREE_BYTES`` (copied one by one)."""
    return all(view.nbytes < GIL_FREE_BYTES for _, view in items)


def _runs(items: list[tuple[int, memoryview]]) -> tuple[list[_Run], int]:
    """The blocks' runs at constant strides, and their bytes."""
    runs: list[_Run] = []
    num_bytes = 0
    for offset, view in items:
        num_bytes += view.nbytes
        address = buffer_address(view)
        if not runs or not runs[-1].extend(offset, address, view):
            runs.append(_Run(offset, address, view))
    return runs, num_bytes

"""Registered memory regions: the preallocated buffers remote peers write into.

A region is named, fixed in size, and either private to this process or a named
shared-memory segment (then a co-located sender attaches to it and copies blocks straight
in, the shm transport). Remote writes are bounds-checked against the region.
"""

from __future__ import annotations

import threading

from halfmoon.store.shm import Segment, attach_segment, create_segment
from halfmoon.transfer.errors import RemoteError
from halfmoon.transfer.link import as_bytes_view


class MemoryRegion:
    """``size_bytes`` of writable memory other peers may fill, by name."""

    def __init__(self, name: str, view: memoryview, segment: Segment | None, owner: bool) -> None:
        self.name = name
        self.view = view
        self._segment = segment
        self._owner = owner

    @classmethod
    def allocate(cls, name: str, size_bytes: int, shared: bool) -> MemoryRegion:
        """A new zero-filled region, in shared memory when ``shared``."""
        if size_bytes <= 0:
            raise ValueError(f"region {name!r} needs a positive size, got {size_bytes}")
        if shared:
            segment = create_segment(size_bytes, prefix="hm-region")
            return cls(name, segment.buf[:size_bytes], segment, owner=True)
        return cls(name, memoryview(bytearray(size_bytes)), None, owner=False)

    @classmethod
    def wrap(cls, name: str, buffer: object) -> MemoryRegion:
        """A region over an existing writable buffer (e.g. the engine's KV arena)."""
        view = as_bytes_view(buffer)
        if view.readonly:
            raise ValueError(f"region {name!r} must be writable")
        return cls(name, view, None, owner=False)

    @property
    def size_bytes(self) -> int:
        """Length of the region."""
        return self.view.nbytes

    @property
    def segment_name(self) -> str | None:
        """Shared-memory name for co-located writers, or None."""
        return self._segment.name if self._segment is not None else None

    def check_range(self, offset: int, length: int) -> None:
        """:class:`RemoteError` unless ``[offset, offset+length)`` lies inside the region."""
        if offset < 0 or length < 0 or offset + length > self.view.nbytes:
            raise RemoteError(
                f"range [{offset}, {offset + length}) is outside region {self.name!r} "
                f"of {self.view.nbytes} bytes"
            )

    def slice(self, offset: int, length: int) -> memoryview:
        """``[offset, offset+length)`` of the region; :class:`RemoteError` when out of range."""
        self.check_range(offset, length)
        return self.view[offset : offset + length]

    def slices(self, segments: list[list[int]]) -> tuple[list[memoryview], int]:
        """Views of ``[[offset, length], ...]`` for a payload that fills them in order,
        and their total bytes; a segment that starts where the one before it ended joins
        it (a frame of 256 blocks of 64 KiB back to back is one slice and one receive
        buffer, not 256: the per-block slicing cost ~1 ms a 64 MiB batch).
        :class:`RemoteError` when a segment is malformed or out of range."""
        size = self.view.nbytes
        runs: list[list[int]] = []
        total = 0
        for segment in segments:
            try:
                offset, length = segment
            except (TypeError, ValueError):
                raise RemoteError(f"malformed segment {segment!r}") from None
            if type(offset) is not int or type(length) is not int:
                raise RemoteError(f"malformed segment {segment!r}")
            if offset < 0 or length < 0 or offset + length > size:
                self.check_range(offset, length)  # raises, naming the range
            total += length
            if runs and runs[-1][1] == offset:
                runs[-1][1] = offset + length
            else:
                runs.append([offset, offset + length])
        view = self.view
        return [view[start:end] for start, end in runs], total

    def close(self) -> None:
        """Release the memory (a shared region's name is removed)."""
        try:
            self.view.release()
        except BufferError:
            pass  # slices still alive keep the memory until they are collected
        if self._segment is not None:
            self._segment.close(unlink=self._owner)
            self._segment = None


class RegionTable:
    """Regions of one engine by name (thread-safe)."""

    def __init__(self) -> None:
        self._regions: dict[str, MemoryRegion] = {}
        self._lock = threading.Lock()

    def add(self, region: MemoryRegion) -> MemoryRegion:
        """Register ``region``; its name must be new."""
        with self._lock:
            if region.name in self._regions:
                raise ValueError(f"region {region.name!r} is already registered")
            self._regions[region.name] = region
        return region

    def get(self, name: str) -> MemoryRegion:
        """The region called ``name``; :class:`RemoteError` when unknown."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise RemoteError(f"no region named {name!r} is registered")
        return region

    def remove(self, name: str) -> None:
        """Unregister and free a region."""
        with self._lock:
            region = self._regions.pop(name, None)
        if region is not None:
            region.close()

    def close(self) -> None:
        """Free every region."""
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.close()


class SegmentCache:
    """Shared-memory segments of other processes, attached once and kept mapped."""

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def view(self, name: str) -> memoryview:
        """Writable view of segment ``name`` (attached on first use)."""
        with self._lock:
            segment = self._segments.get(name)
            if segment is None:
                segment = self._segments[name] = attach_segment(name)
            return segment.buf

    def close(self) -> None:
        """Unmap every attached segment (the owners keep them)."""
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()

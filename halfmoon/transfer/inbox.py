"""A decode side's inbox: one preallocated region that KV streams land in, handed out
first-fit in contiguous ranges, one per arriving stream. halfmoon's decode role
(``halfmoon.serve.worker.decode``) and the vLLM KV connector (``halfmoon.vllm_kv``) both
keep one, in shared memory, so that a co-located sender copies straight into it."""

from __future__ import annotations

import bisect
import threading


class Inbox:
    """First-fit ranges of a ``size_bytes`` region; thread-safe."""

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError(f"an inbox needs a positive size, got {size_bytes}")
        self.size_bytes = size_bytes
        self._starts: list[int] = []  # sorted starts of the ranges in use
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int | None:
        """The start of a free range of ``size`` bytes, or None when none is left."""
        if size <= 0:
            raise ValueError(f"cannot allocate {size} bytes")
        with self._lock:
            cursor = 0
            for start in self._starts:
                if start - cursor >= size:
                    break
                cursor = start + self._sizes[start]
            if cursor + size > self.size_bytes:
                return None
            bisect.insort(self._starts, cursor)
            self._sizes[cursor] = size
            return cursor

    def free(self, start: int) -> None:
        """Give a range back (unknown starts are ignored: freeing twice is harmless)."""
        with self._lock:
            if self._sizes.pop(start, None) is not None:
                self._starts.remove(start)

    @property
    def used_bytes(self) -> int:
        """Bytes handed out."""
        with self._lock:
            return sum(self._sizes.values())

"""Named shared-memory segments for co-located processes (POSIX shm under /dev/shm).

The creating process owns a segment: it is registered with Python's resource tracker
(through ``multiprocessing.shared_memory``), so it is unlinked when the owner closes it
*or dies*. Mappings are plain ``mmap`` objects of the segment file, which lets a close
with views still alive simply leave the memory to the garbage collector instead of
failing. Other processes attach without registering, so their exit never removes a
segment they do not own.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import secrets
from multiprocessing.shared_memory import SharedMemory

from halfmoon.core.errors import HalfmoonError

SHM_DIR = "/dev/shm"


class Segment:
    """A mapped shared-memory segment: ``name``, ``size`` and a writable ``buf``."""

    def __init__(self, name: str, owner: SharedMemory | None) -> None:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise HalfmoonError(f"shared-memory segment {name!r} does not exist") from exc
        try:
            self.size = os.fstat(fd).st_size
            # Populate the page tables now: first-touch faults inside a transfer's recv_into
            # measured several times slower than the copy itself.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)
        self._owner = owner

    def close(self, unlink: bool = False) -> None:
        """Unmap (once no view is left; later otherwise) and, for the owner, remove the name."""
        if unlink and self._owner is not None:
            with contextlib.suppress(FileNotFoundError):  # already unlinked
                self._owner.unlink()
            self._owner = None
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes when they do


def create_segment(size_bytes: int, prefix: str = "hm") -> Segment:
    """Create a zero-filled segment of ``size_bytes`` with an unguessable name."""
    if size_bytes <= 0:
        raise ValueError(f"shared-memory segment size must be positive, got {size_bytes}")
    if not os.path.isdir(SHM_DIR):
        raise HalfmoonError(f"shared memory needs {SHM_DIR} (Linux)")
    name = f"{prefix}-{secrets.token_hex(8)}"
    try:
        owner = SharedMemory(name=name, create=True, size=size_bytes)
    except OSError as exc:
        raise HalfmoonError(
            f"cannot create a {size_bytes}-byte shared-memory segment: {exc}"
        ) from exc
    owner.close()  # keep only the registration; we map the file ourselves
    try:
        _reserve(os.path.join(SHM_DIR, name), size_bytes)
        return Segment(name, owner)
    except BaseException:
        owner.unlink()
        raise


def _reserve(path: str, size_bytes: int) -> None:
    """Allocate the segment's pages up front: a full /dev/shm fails here with a clear
    error instead of killing the process with SIGBUS on a later write."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as exc:
        raise HalfmoonError(
            f"shared memory ({SHM_DIR}) has no room for {size_bytes} bytes: {exc.strerror}"
        ) from exc
    finally:
        os.close(fd)


@functools.cache
def shm_namespace() -> str:
    """Which shared memory this process sees: the kernel's boot id with the device and
    inode of /dev/shm ("" where there is none). Two processes with the same value can
    attach each other's segments (same kernel, same /dev/shm mount); a container with its
    own /dev/shm, or another machine, has a different one."""
    try:
        status = os.stat(SHM_DIR)
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        return ""
    return f"{boot_id}:{status.st_dev}:{status.st_ino}" if boot_id else ""


def attach_segment(name: str) -> Segment:
    """Map an existing segment created by another process (never unlinked by this one)."""
    if "/" in name or name.startswith("."):
        raise HalfmoonError(f"invalid shared-memory segment name {name!r}")
    return Segment(name, owner=None)

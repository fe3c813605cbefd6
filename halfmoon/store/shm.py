"""Named shared-memory segments for co-located processes (POSIX shm under /dev/shm).

The creating process owns a segment: it is registered with Python's resource tracker
(through ``multiprocessing.shared_memory``), so it is unlinked when the owner closes it
or exits. Mappings are plain ``mmap`` objects of the segment file, which lets a close
with views still alive simply leave the memory to the garbage collector instead of
failing. Other processes attach without registering, so their exit never removes a
segment they do not own.

A process killed together with its resource tracker (SIGKILL to its process group, as
vLLM does to its workers on shutdown and a launcher to children that outstay SIGTERM)
leaves its segments behind, and /dev/shm is memory: a day of test runs once left 14 GiB
there and the machine's OOM killer took vLLM workers. So a segment's name carries its
owner (pid, the process's start time and its pid namespace), and
:func:`sweep_orphan_segments` removes those whose owner is gone; :func:`create_segment`
runs it (at most once a minute per process), as do the launcher's stop and the tests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import re
import secrets
import threading
import time
from multiprocessing.shared_memory import SharedMemory

from halfmoon.core.errors import HalfmoonError

SHM_DIR = "/dev/shm"
#: ``PREFIX-oPID.START.PIDNS-TOKEN``: the owner's pid, its start time (clock ticks after
#: boot, /proc/PID/stat) and its pid namespace's inode.
_OWNED = re.compile(r"^hm(?:-[a-z]+)*-o(\d+)\.(\d+)\.(\d+)-[0-9a-f]{16}$")
_SWEEP_EVERY_S = 60.0
_last_sweep = -float("inf")
_sweep_lock = threading.Lock()
log = logging.getLogger(__name__)


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
    global _last_sweep
    with _sweep_lock:
        due, now = False, time.monotonic()
        if now - _last_sweep >= _SWEEP_EVERY_S:
            due, _last_sweep = True, now
    if due:
        sweep_orphan_segments()
    own = owner_tag()
    tag = f"-o{own}" if own else ""
    name = f"{prefix}{tag}-{secrets.token_hex(8)}"
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


def _start_time(pid: int | str) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot), None if it is gone or
    a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@functools.cache
def _pid_namespace() -> str | None:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def owner_gone(tag: str) -> bool:
    """Whether the process an owner tag (``PID.START.PIDNS``, :func:`owner_tag`) names has
    died, or its pid now names another process. False while it runs, and for a tag of
    another pid namespace or one that does not parse (nothing to be sure of)."""
    parts = tag.split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return False
    pid, start, tag_namespace = parts
    if tag_namespace != _pid_namespace():
        return False
    return _start_time(pid) != start


def owner_tag() -> str | None:
    """``PID.START.PIDNS`` of this process, None where /proc cannot say (no sweeping)."""
    pid = os.getpid()
    start, namespace = _start_time(pid), _pid_namespace()
    return f"{pid}.{start}.{namespace}" if start and namespace else None


def sweep_orphan_segments() -> list[str]:
    """Remove the segments whose owner process has died (or whose pid now names another
    process); returns their names. Segments of other pid namespaces, and names without
    an owner, are left alone."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    removed, freed = [], 0
    for name in names:
        match = _OWNED.match(name)
        if match is None or not owner_gone(".".join(match.groups())):
            continue
        path = os.path.join(SHM_DIR, name)
        # Gone already (another sweep), or another user's (/dev/shm is sticky; with
        # /proc mounted hidepid their processes look dead): left alone.
        with contextlib.suppress(OSError):
            size = os.stat(path).st_blocks * 512
            os.unlink(path)
            freed += size
            removed.append(name)
    if removed:
        log.info("removed %d shared-memory segment(s) of processes that died (%.0f MiB)",
                 len(removed), freed / 2**20)  # fmt: skip
    return removed


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

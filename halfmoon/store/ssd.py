"""SSD tier: one preallocated data file of fixed-size slots, indexed by a journal.

``blocks.dat`` holds slot ``i`` at byte offset ``i * block_bytes``; ``journal.log`` records
which block lives where with its xxh3_64 checksum (see :mod:`halfmoon.store.journal`).
Every read lands in a caller-provided buffer and is verified against the checksum; a
mismatch (bit rot, a torn or lost data write, someone editing the file) drops the block
and reports a miss. An exclusive ``flock`` on the journal keeps a second store out of a
directory in use.
"""

from __future__ import annotations

import fcntl
import os
import stat
from dataclasses import dataclass

import xxhash

from halfmoon.core.errors import HalfmoonError
from halfmoon.store.journal import (
    OP_DEL,
    OP_PUT,
    JournalRecord,
    JournalWriter,
    read_journal,
)
from halfmoon.store.meta import NO_NAMESPACE, BlockMeta
from halfmoon.store.slab import SlotAllocator

DATA_FILE = "blocks.dat"
JOURNAL_FILE = "journal.log"
LOCK_FILE = "lock"


@dataclass(frozen=True)
class SSDEntry:
    """Where a block lives in the data file and what its bytes must hash to."""

    slot: int
    checksum: int
    meta: BlockMeta
    position: int


def check_writable_dir(directory: str) -> None:
    """Raise a one-line :class:`HalfmoonError` unless ``directory`` exists and is writable.

    A directory without any write permission bit counts as read-only even for root, who
    would otherwise bypass the mode.
    """
    if not os.path.exists(directory):
        raise HalfmoonError(f"SSD directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise HalfmoonError(f"SSD path {directory} is not a directory")
    mode = os.stat(directory).st_mode
    if not os.access(directory, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise HalfmoonError(f"SSD directory {directory} is read-only")


class SSDTier:
    """Blocks of ``block_bytes`` in ``num_slots`` slots of a file under ``directory``.

    ``namespace`` (16 bytes) names what computed the blocks (a model's fingerprint): a
    directory whose journal names another is opened empty, and ``num_foreign_blocks``
    counts the blocks it held."""

    def __init__(
        self, directory: str, block_bytes: int, num_slots: int, sync: bool = False,
        namespace: bytes = NO_NAMESPACE,
    ) -> None:  # fmt: skip
        check_writable_dir(directory)
        self.directory = directory
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self._sync = sync
        self._entries: dict[int, SSDEntry] = {}
        self._allocator = SlotAllocator(num_slots)
        try:
            self._lock_fd = os.open(
                os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600
            )
        except OSError as exc:
            raise HalfmoonError(f"cannot use SSD directory {directory}: {exc.strerror}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise HalfmoonError(f"SSD directory {directory} is in use by another store") from exc
        try:
            self._fd = self._open_data_file()
            journal_path = os.path.join(directory, JOURNAL_FILE)
            found = read_journal(journal_path, block_bytes, num_slots, namespace)
            self.num_torn_records = found.num_torn
            self.num_foreign_blocks = found.num_foreign
            self._replay(found.records)
            self._journal = JournalWriter(journal_path, block_bytes, num_slots, sync, namespace)
            self._compact()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _open_data_file(self) -> int:
        path = os.path.join(self.directory, DATA_FILE)
        size_bytes = self.num_slots * self.block_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(fd).st_size < size_bytes:
                # Reserve the blocks now: a full disk fails here, not in the middle of a write.
                os.posix_fallocate(fd, 0, size_bytes)
        except OSError as exc:
            raise HalfmoonError(
                f"cannot preallocate {size_bytes} bytes in {path}: {exc.strerror}"
            ) from exc
        return fd

    def _replay(self, records: list[JournalRecord]) -> None:
        by_slot: dict[int, int] = {}
        for r in records:
            old = self._entries.pop(r.block_hash, None)
            if old is not None:
                del by_slot[old.slot]
            if r.op != OP_PUT or r.slot >= self.num_slots:
                continue
            evicted = by_slot.pop(r.slot, None)  # a lost DEL: the later PUT owns the slot
            if evicted is not None:
                del self._entries[evicted]
            self._entries[r.block_hash] = SSDEntry(r.slot, r.checksum, r.meta, r.position)
            by_slot[r.slot] = r.block_hash
        for entry in self._entries.values():
            self._allocator.claim(entry.slot)

    def _compact(self) -> None:
        self._journal.rewrite(
            [
                JournalRecord(OP_PUT, h, e.slot, e.checksum, e.meta, e.position)
                for h, e in self._entries.items()
            ]
        )

    def set_namespace(self, namespace: bytes) -> None:
        """Name another origin of the blocks from now on (the weights that computed them
        were replaced): the journal is rewritten under it. Only an empty tier can (its
        blocks would be claimed for the new origin); else ValueError."""
        if self._entries:
            raise ValueError(f"{len(self._entries)} blocks of the old origin are on this tier")
        self._journal.set_namespace(namespace)
        self._compact()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        """Slots without a block."""
        return self._allocator.num_free

    def entry(self, block_hash: int) -> SSDEntry | None:
        """The index entry of ``block_hash``, or None."""
        return self._entries.get(block_hash)

    def hashes(self) -> list[int]:
        """Every block hash on this tier (in no particular order)."""
        return list(self._entries)

    def file_offset(self, block_hash: int) -> int:
        """Byte offset of the block's payload in ``blocks.dat`` (for tools and tests)."""
        return self._entries[block_hash].slot * self.block_bytes

    def write(self, block_hash: int, payload: memoryview, meta: BlockMeta, position: int) -> None:
        """Store ``payload`` in a free slot; the caller made room (``num_free > 0``)."""
        slot = self._allocator.alloc()
        if slot is None:
            raise HalfmoonError("SSD tier is full")
        try:
            written = os.pwrite(self._fd, payload, slot * self.block_bytes)
            if written != self.block_bytes:
                raise OSError(f"short write of {written} bytes")
            if self._sync:
                os.fdatasync(self._fd)
        except OSError as exc:
            self._allocator.free(slot)
            raise HalfmoonError(f"SSD write to {self.directory} failed: {exc}") from exc
        checksum = xxhash.xxh3_64_intdigest(payload)
        self._journal.append(JournalRecord(OP_PUT, block_hash, slot, checksum, meta, position))
        self._entries[block_hash] = SSDEntry(slot, checksum, meta, position)
        if self._journal.num_records > 2 * len(self._entries) + 1024:
            self._compact()

    def read_into(self, block_hash: int, out: memoryview) -> SSDEntry | None:
        """Read the block into ``out`` and verify it; None (block dropped) when corrupt."""
        entry = self._entries[block_hash]
        try:
            num_read = os.preadv(self._fd, [out], entry.slot * self.block_bytes)
        except OSError:
            num_read = -1
        if num_read != self.block_bytes or xxhash.xxh3_64_intdigest(out) != entry.checksum:
            self.remove(block_hash)
            return None
        return entry

    def remove(self, block_hash: int) -> None:
        """Forget the block and free its slot (a DEL record first, so replay agrees)."""
        entry = self._entries.pop(block_hash)
        self._journal.append(JournalRecord(OP_DEL, block_hash))
        self._allocator.free(entry.slot)

    def check_integrity(self) -> None:
        """Raise :class:`~halfmoon.store.errors.IntegrityError` on a leaked or shared slot."""
        self._allocator.check_integrity(e.slot for e in self._entries.values())

    def close(self) -> None:
        """Flush and close the files; the blocks stay for the next open."""
        if self._fd < 0:
            return
        self._journal.close()
        os.close(self._fd)
        os.close(self._lock_fd)
        self._fd = -1

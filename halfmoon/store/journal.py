"""Append-only journal that lets the SSD tier rebuild its index after a restart.

File layout (little-endian)::

    header : magic "HMSSDJ02" | block_bytes u64 | num_slots u64 | namespace 16B
             | xxh3_64 of the previous 40 bytes
    record : op u8 | hash 16B | slot u32 | checksum u64 | num_tokens u32 | parent 16B
             | layout u16 | position u32 | xxh3_64 of the previous 55 bytes        (63 bytes)

A ``PUT`` record is appended after the block's bytes are written, a ``DEL`` record before
its slot is reused. Replay stops at the first short or mis-checksummed record (a torn
write at the tail), counts it and truncates it away. A block whose data write was torn
still has a PUT record only if the data write came first; its payload checksum then fails
on the first read, so it is dropped, never served.

The header's ``namespace`` names what computed the blocks' KV (a worker writes its
model's fingerprint, :func:`halfmoon.engine.catalog.model_fingerprint`): a journal of
another namespace, or of the format before namespaces (``HMSSDJ01``), is read as empty
and counted, so a directory reused for other weights never serves their KV under the
same token hashes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from halfmoon.core.errors import HalfmoonError
from halfmoon.store.meta import NO_NAMESPACE, BlockMeta, check_namespace

_MAGIC = b"HMSSDJ02"
_OLD_MAGIC = b"HMSSDJ01"  # before namespaces: its blocks' origin is unknown
_HEADER = struct.Struct("<8sQQ16s")
_OLD_HEADER_BYTES = 32  # "HMSSDJ01" | block_bytes | num_slots | check
_RECORD = struct.Struct("<B16sIQI16sHI")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _HEADER.size + _CHECK.size
RECORD_BYTES = _RECORD.size + _CHECK.size
OP_PUT = 1
OP_DEL = 2


@dataclass(frozen=True)
class JournalRecord:
    """One journal entry: a block written to ``slot`` (PUT) or removed (DEL)."""

    op: int
    block_hash: int
    slot: int = 0
    checksum: int = 0
    meta: BlockMeta = BlockMeta(0, 0)
    position: int = 0

    def encode(self) -> bytes:
        """The record's 63 bytes, checksum included."""
        body = _RECORD.pack(
            self.op,
            self.block_hash.to_bytes(16, "little"),
            self.slot,
            self.checksum,
            self.meta.num_tokens,
            self.meta.parent_hash.to_bytes(16, "little"),
            self.meta.layout_version,
            self.position,
        )
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> JournalRecord | None:
        """Parse 63 bytes; None when the checksum or op code is wrong (a torn record)."""
        body = raw[: _RECORD.size]
        (check,) = _CHECK.unpack(raw[_RECORD.size : RECORD_BYTES])
        if xxhash.xxh3_64_intdigest(body) != check:
            return None
        op, h, slot, checksum, num_tokens, parent, layout, position = _RECORD.unpack(body)
        if op not in (OP_PUT, OP_DEL):
            return None
        meta = BlockMeta(num_tokens, int.from_bytes(parent, "little"), layout)
        return cls(op, int.from_bytes(h, "little"), slot, checksum, meta, position)


def _encode_header(block_bytes: int, num_slots: int, namespace: bytes) -> bytes:
    body = _HEADER.pack(_MAGIC, block_bytes, num_slots, namespace)
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


@dataclass(frozen=True)
class JournalContents:
    """What :func:`read_journal` found: the valid ``records``, how many torn records it
    dropped at the tail (``num_torn``) and how many blocks it listed that belong to another
    namespace or to the format before namespaces (``num_foreign``: not served)."""

    records: list[JournalRecord]
    num_torn: int = 0
    num_foreign: int = 0


def read_journal(
    path: str, block_bytes: int, num_slots: int, namespace: bytes = NO_NAMESPACE
) -> JournalContents:
    """The journal at ``path`` as a store of ``namespace`` may use it.

    A missing or header-less file is an empty journal. A journal of another namespace (or
    of the old format) is empty too, its blocks counted in ``num_foreign``: they hold
    another model's KV (the store reuses their slots). A header of this namespace for
    another geometry is a
    :class:`HalfmoonError`: the directory belongs to a store of a different block size.
    """
    check_namespace(namespace)
    if not os.path.exists(path):
        return JournalContents([])
    with open(path, "rb") as f:
        data = f.read()
    if data[: len(_OLD_MAGIC)] == _OLD_MAGIC:
        return JournalContents([], 0, _num_blocks(memoryview(data)[_OLD_HEADER_BYTES:]))
    if len(data) < HEADER_BYTES:
        return JournalContents([], int(len(data) > 0))
    body = data[: _HEADER.size]
    (check,) = _CHECK.unpack(data[_HEADER.size : HEADER_BYTES])
    if xxhash.xxh3_64_intdigest(body) != check:
        raise HalfmoonError(
            f"SSD journal {path} has a corrupt header; remove the directory to reset it"
        )
    magic, file_block_bytes, file_num_slots, file_namespace = _HEADER.unpack(body)
    if magic != _MAGIC:
        raise HalfmoonError(f"{path} is not a halfmoon SSD journal")
    if file_namespace != namespace:
        return JournalContents([], 0, _num_blocks(memoryview(data)[HEADER_BYTES:]))
    if (file_block_bytes, file_num_slots) != (block_bytes, num_slots):
        raise HalfmoonError(
            f"SSD directory holds {file_num_slots} slots of {file_block_bytes} bytes, but the "
            f"store is configured for {num_slots} slots of {block_bytes} bytes; use another directory"
        )
    records, num_torn = [], 0
    for record in _iter_records(memoryview(data)[HEADER_BYTES:]):
        if record is None:
            num_torn = 1
            break
        records.append(record)
    return JournalContents(records, num_torn)


def _num_blocks(data: memoryview) -> int:
    """How many blocks the records in ``data`` leave stored (up to a torn record)."""
    stored: set[int] = set()
    for record in _iter_records(data):
        if record is None:
            break
        (stored.add if record.op == OP_PUT else stored.discard)(record.block_hash)
    return len(stored)


def _iter_records(data: memoryview) -> Iterator[JournalRecord | None]:
    for start in range(0, len(data), RECORD_BYTES):
        raw = data[start : start + RECORD_BYTES]
        yield JournalRecord.decode(raw) if len(raw) == RECORD_BYTES else None


class JournalWriter:
    """Appends records to a journal file; ``rewrite`` replaces it atomically (compaction)."""

    def __init__(
        self, path: str, block_bytes: int, num_slots: int, sync: bool,
        namespace: bytes = NO_NAMESPACE,
    ) -> None:  # fmt: skip
        self.path = path
        self._block_bytes, self._num_slots = block_bytes, num_slots
        self._header = _encode_header(block_bytes, num_slots, check_namespace(namespace))
        self._sync = sync
        self._fd = -1
        self.num_records = 0

    def set_namespace(self, namespace: bytes) -> None:
        """Name another origin of the KV in the header from the next :meth:`rewrite` on."""
        self._header = _encode_header(self._block_bytes, self._num_slots,
                                      check_namespace(namespace))  # fmt: skip

    def rewrite(self, records: list[JournalRecord]) -> None:
        """Replace the journal with a header and ``records`` (write to a temp file, rename)."""
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(self._header + b"".join(r.encode() for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._close_fd()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.num_records = len(records)

    def append(self, record: JournalRecord) -> None:
        """Append one record (fsynced when the journal was opened with ``sync``)."""
        os.write(self._fd, record.encode())
        if self._sync:
            os.fsync(self._fd)
        self.num_records += 1

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        """Close the file (records already appended stay)."""
        self._close_fd()

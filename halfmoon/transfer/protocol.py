"""The wire format: length-prefixed frames with xxh3 checksums and msgpack headers.

Every frame is::

    prefix (20 B)  : magic "HMT1" | version u8 | kind u8 | flags u16 | meta_len u32
                     | payload_len u64
    head check (8) : xxh3_64 of prefix + meta
    meta           : msgpack map (str keys; ints, str, bytes, lists; never pickle)
    payload        : payload_len raw bytes (the block data, possibly many segments)
    trailer (8)    : xxh3_64 of the payload (only when payload_len > 0); 0 when the
                     sender set ``FLAG_UNCHECKED`` (its engine runs ``checksum=False``)

The payload checksum trails the payload so both ends hash each chunk while it is hot in
cache (the sender just before handing it to the kernel, the receiver just after
``recv_into``) instead of making an extra cold pass over the data. Hashing costs ~2.4 ms
a 64 MiB batch on each side here (26 GiB/s), ~10% of the batch's CPU on a 2-core host;
TCP checksums its segments anyway, so a sender may turn it off (``FLAG_UNCHECKED``): the
receiver then skips it for that frame. The head check (prefix and meta) always stays.

Block hashes are 128-bit and msgpack integers stop at 64, so hashes travel as 16-byte
little-endian ``bin`` values (:func:`hash_to_wire`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack
import xxhash

from halfmoon.transfer.errors import ProtocolError

MAGIC = b"HMT1"
#: Bumped when a message's fields change meaning (2: PUT_SLOTS as one offset per block,
#: pull replies that name the shared segment once); peers of another version are refused.
VERSION = 2
#: Frame flags (the prefix's u16): the payload carries no checksum (its trailer is 0).
FLAG_UNCHECKED = 1
_KNOWN_FLAGS = FLAG_UNCHECKED
_PREFIX = struct.Struct("<4sBBHIQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _PREFIX.size + _CHECK.size
TRAILER_BYTES = _CHECK.size
MAX_META_BYTES = 4 << 20
MAX_PAYLOAD_BYTES = 1 << 40


class Kind(IntEnum):
    """Frame types; requests and their replies."""

    CHALLENGE = 1
    AUTH = 2
    AUTH_OK = 3
    ERROR = 4
    PUSH = 10
    PUSH_ACK = 11
    PUT = 12
    PUT_ACK = 13
    PULL = 14
    PULL_REPLY = 15
    RELEASE = 16
    REGION = 17
    REGION_INFO = 18
    STREAM_OPEN = 20
    STREAM_READY = 21
    STREAM_LAYER = 22
    STREAM_END = 23
    STREAM_ACK = 24
    PUT_RESERVE = 25
    PUT_SLOTS = 26
    PUT_COMMIT = 27
    CANCEL = 30


_KINDS = {int(k): k for k in Kind}  # a dict lookup is much cheaper than Kind(value)


class Frame(NamedTuple):
    """A received frame's header; its payload (``payload_len`` bytes) is still unread."""

    kind: Kind
    meta: dict[str, Any]
    payload_len: int
    #: Whether the payload's trailer holds its checksum (the sender hashed it).
    checked: bool = True


def hash_to_wire(block_hash: int) -> bytes:
    """A 128-bit block hash as 16 little-endian bytes."""
    return block_hash.to_bytes(16, "little")


def hash_from_wire(raw: bytes) -> int:
    """Inverse of :func:`hash_to_wire`."""
    if not isinstance(raw, bytes) or len(raw) != 16:
        raise ProtocolError("a block hash on the wire must be 16 bytes")
    return int.from_bytes(raw, "little")


def hashes_to_wire(block_hashes: Iterable[int]) -> list[bytes]:
    """:func:`hash_to_wire` of each (one loop: a request carries up to 1,024)."""
    return [h.to_bytes(16, "little") for h in block_hashes]


def hashes_from_wire(raw: Any) -> list[int]:
    """:func:`hash_from_wire` of each; :class:`ProtocolError` unless ``raw`` is a list of
    16-byte strings."""
    if not isinstance(raw, list):
        raise ProtocolError("block hashes on the wire must be a list")
    from_bytes = int.from_bytes
    out = []
    for h in raw:
        if type(h) is not bytes or len(h) != 16:
            raise ProtocolError("a block hash on the wire must be 16 bytes")
        out.append(from_bytes(h, "little"))
    return out


def encode_trailer(checksum: int) -> bytes:
    """The 8-byte payload checksum that follows a payload."""
    return _CHECK.pack(checksum)


def decode_trailer(raw: bytes | bytearray | memoryview) -> int:
    """Inverse of :func:`encode_trailer`."""
    return int(_CHECK.unpack_from(raw)[0])


def encode_header(
    kind: Kind,
    meta: dict[str, Any],
    payload_len: int,
    pack: Callable[[Any], bytes] | None = None,
    flags: int = 0,
) -> bytes:
    """Prefix, head check and meta of a frame (the payload follows separately).

    ``pack`` is a reusable ``msgpack.Packer(use_bin_type=True).pack`` (cheaper than a new
    packer per frame); by default a fresh one is used. ``flags``: ``FLAG_*`` bits.
    """
    packed = msgpack.packb(meta, use_bin_type=True) if pack is None else pack(meta)
    if len(packed) > MAX_META_BYTES:
        raise ProtocolError(f"frame meta of {len(packed)} bytes exceeds {MAX_META_BYTES}")
    prefix = _PREFIX.pack(MAGIC, VERSION, int(kind), flags, len(packed), payload_len)
    return prefix + _CHECK.pack(xxhash.xxh3_64_intdigest(prefix + packed)) + packed


def decode_prefix(
    raw: bytes | bytearray | memoryview,
    max_meta_bytes: int = MAX_META_BYTES,
    max_payload_bytes: int = MAX_PAYLOAD_BYTES,
) -> tuple[Kind, int, int, int, int]:
    """(kind, meta_len, payload_len, head check, flags) of a ``HEADER_BYTES`` header;
    lengths over the caps and unknown flags are refused before anything more is read."""
    magic, version, kind, flags, meta_len, payload_len = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}: not a halfmoon transfer peer")
    if version != VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this side {VERSION}")
    if meta_len > max_meta_bytes or payload_len > max_payload_bytes:
        raise ProtocolError(f"frame lengths out of range (meta {meta_len}, payload {payload_len})")
    frame_kind = _KINDS.get(kind)
    if frame_kind is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    (head_check,) = _CHECK.unpack_from(raw, _PREFIX.size)
    return frame_kind, meta_len, payload_len, head_check, flags


def decode_meta(
    prefix: bytes | bytearray | memoryview, packed: bytes, head_check: int
) -> dict[str, Any]:
    """Verify the head check over prefix + meta and unpack the meta map."""
    if xxhash.xxh3_64_intdigest(bytes(prefix[: _PREFIX.size]) + packed) != head_check:
        raise ProtocolError("frame header checksum mismatch")
    try:
        meta = msgpack.unpackb(packed, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable frame meta: {exc}") from exc
    if not isinstance(meta, dict):
        raise ProtocolError("frame meta must be a map")
    return meta

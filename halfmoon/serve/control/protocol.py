"""The control-plane wire format: msgpack bodies signed with HMAC-SHA256.

Every message is a msgpack map with a string ``type``; it travels as two ZeroMQ frames::

    [ body = msgpack(message) | mac = HMAC-SHA256(secret, body) (32 bytes) ]

(a ROUTER socket prepends the peer's identity frame). A message whose MAC does not verify
is dropped with :class:`AuthError`; nothing is ever unpickled. msgpack integers stop at 64
bits, so 128-bit block hashes travel as one ``bin`` of 16 little-endian bytes each
(:func:`hashes_to_wire` / :func:`hashes_from_wire`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack

from halfmoon.core.errors import HalfmoonError

MAC_BYTES = 32
HASH_BYTES = 16
#: Messages larger than this are refused before unpacking (token ids of a 128k prompt are
#: well under 2 MiB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(HalfmoonError):
    """A malformed control-plane message."""


class AuthError(ProtocolError):
    """A message whose signature does not match the shared secret."""


def secret_bytes(secret: str | bytes) -> bytes:
    """The shared secret as bytes; an empty secret is refused."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the shared secret must not be empty")
    return raw


def encode(message: dict[str, Any], secret: bytes) -> list[bytes]:
    """Serialise and sign one message."""
    if not isinstance(message.get("type"), str):
        raise ProtocolError(f"a message needs a string 'type', got {message!r:.80}")
    try:
        body = msgpack.packb(message, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int beyond 64 bits
        raise ProtocolError(f"unencodable {message['type']!r} message: {exc}") from None
    return [body, hmac.new(secret, body, hashlib.sha256).digest()]


def decode(frames: Sequence[bytes], secret: bytes) -> dict[str, Any]:
    """Verify and deserialise one message (the two frames after any identity frame)."""
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames (body, mac), got {len(frames)}")
    body, mac = bytes(frames[0]), bytes(frames[1])
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    expected = hmac.new(secret, body, hashlib.sha256).digest()
    if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, expected):
        raise AuthError("message signature does not match the shared secret")
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # TypeError: a list key
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("a message must be a map with a string 'type'")
    return message


def hashes_to_wire(hashes: Iterable[int]) -> bytes:
    """Pack 128-bit block hashes into one byte string."""
    return b"".join(h.to_bytes(HASH_BYTES, "little") for h in hashes)


def hashes_from_wire(data: bytes) -> list[int]:
    """Inverse of :func:`hashes_to_wire`."""
    if len(data) % HASH_BYTES:
        raise ProtocolError(f"hash list of {len(data)} bytes is not a multiple of {HASH_BYTES}")
    return [
        int.from_bytes(data[i : i + HASH_BYTES], "little") for i in range(0, len(data), HASH_BYTES)
    ]

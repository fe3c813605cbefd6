import msgpack
import pytest

from halfmoon.serve.control.protocol import (
    AuthError,
    ProtocolError,
    decode,
    encode,
    hashes_from_wire,
    hashes_to_wire,
    secret_bytes,
)


def test_round_trip_and_signature():
    msg = {"type": "schedule", "n": 3, "blob": b"\x00\x01", "nested": {"a": [1, 2]}}
    frames = encode(msg, b"k")
    assert decode(frames, b"k") == msg
    with pytest.raises(AuthError):
        decode(frames, b"other")
    tampered = [frames[0][:-1] + bytes([frames[0][-1] ^ 1]), frames[1]]
    with pytest.raises(AuthError):
        decode(tampered, b"k")


def test_malformed_messages():
    with pytest.raises(ProtocolError, match="2 frames"):
        decode([b"x"], b"k")
    import hashlib
    import hmac

    body = msgpack.packb([1, 2])
    with pytest.raises(ProtocolError, match="map with a string 'type'"):
        decode([body, hmac.new(b"k", body, hashlib.sha256).digest()], b"k")
    with pytest.raises(ProtocolError, match="type"):
        encode({"no": "type"}, b"k")
    with pytest.raises(ValueError, match="empty"):
        secret_bytes("")


def test_128_bit_hashes_round_trip():
    hashes = [0, 1, 2**128 - 1, 12345678901234567890123456789]
    assert hashes_from_wire(hashes_to_wire(hashes)) == hashes
    with pytest.raises(ProtocolError):
        hashes_from_wire(b"\x00" * 15)

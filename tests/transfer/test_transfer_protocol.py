import dataclasses
import socket
import struct
import threading
import time

import numpy as np
import pytest
import xxhash

from halfmoon.store import BlockMeta
from halfmoon.transfer import (
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    TransferCancelled,
    TransferTimeout,
)
from halfmoon.transfer.deadline_socket import DeadlineSocket
from halfmoon.transfer.endpoint import Endpoint
from halfmoon.transfer.link import Link, coalesce
from halfmoon.transfer.messages import meta_from_wire, meta_to_wire, put_items_from_wire
from halfmoon.transfer.protocol import (
    FLAG_UNCHECKED,
    HEADER_BYTES,
    Kind,
    decode_meta,
    decode_prefix,
    encode_header,
    encode_trailer,
    hash_from_wire,
    hash_to_wire,
)


@pytest.fixture
def link_pair():
    a, b = socket.socketpair()
    left, right = Link(a, "left"), Link(b, "right")
    yield left, right
    left.close()
    right.close()


def test_header_round_trip():
    raw = encode_header(Kind.PUSH, {"xfer": "x1", "segs": [[0, 4]]}, 4)
    kind, meta_len, payload_len, head_check, flags = decode_prefix(raw)
    assert (kind, payload_len, flags) == (Kind.PUSH, 4, 0)
    meta = decode_meta(raw, raw[HEADER_BYTES : HEADER_BYTES + meta_len], head_check)
    assert meta == {"xfer": "x1", "segs": [[0, 4]]}
    unchecked = encode_header(Kind.PUSH, {}, 4, flags=FLAG_UNCHECKED)
    assert decode_prefix(unchecked)[4] == FLAG_UNCHECKED


def test_corrupt_or_foreign_headers_are_rejected():
    raw = bytearray(encode_header(Kind.PUSH, {"xfer": "x1"}, 0))
    _, meta_len, _, head_check, _ = decode_prefix(raw)
    raw[-2] ^= 0x01
    with pytest.raises(ProtocolError, match="header checksum"):
        decode_meta(raw, bytes(raw[HEADER_BYTES:]), head_check)
    with pytest.raises(ProtocolError, match="magic"):
        decode_prefix(b"GET / HTTP/1.1\r\n" + bytes(HEADER_BYTES))
    bad_kind = bytearray(encode_header(Kind.PUSH, {}, 0))
    bad_kind[5] = 250
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        decode_prefix(bad_kind)
    with pytest.raises(ProtocolError, match="unknown frame flags 0x4"):
        decode_prefix(encode_header(Kind.PUSH, {}, 0, flags=4))  # a future flag: not misread


def test_128_bit_hashes_survive_the_wire():
    for h in (0, 1, 2**64 + 5, 2**128 - 1):
        assert hash_from_wire(hash_to_wire(h)) == h
    with pytest.raises(ProtocolError):
        hash_from_wire(b"short")


def test_endpoint_parsing():
    assert str(Endpoint.parse("127.0.0.1:8080")) == "127.0.0.1:8080"
    assert Endpoint.parse("[::1]:9").host == "::1"
    for bad in ("localhost", "host:", ":80", "h:99999", "h:abc"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)


def test_scatter_gather_frame_lands_in_preallocated_buffers(link_pair):
    left, right = link_pair
    # Segments straddling the 256 KiB hashing chunks, plus tiny ones.
    parts = [
        memoryview(bytes([i]) * size) for i, size in enumerate((1000, 300 << 10, 7, 600 << 10))
    ]
    sender = threading.Thread(target=left.send, args=(Kind.PUSH, {"n": 3}, parts))
    sender.start()
    frame = right.recv(time.monotonic() + 5)
    dests = [memoryview(bytearray(p.nbytes)) for p in parts]
    right.recv_payload_into(frame, dests, time.monotonic() + 5)
    sender.join()
    assert frame.meta == {"n": 3} and [bytes(d) for d in dests] == [bytes(p) for p in parts]


def test_payload_checksum_mismatch_is_detected_and_link_survives():
    payload = b"k" * 64
    header = encode_header(Kind.PUSH, {}, len(payload))
    wrong_trailer = encode_trailer(xxhash.xxh3_64_intdigest(payload) ^ 1)
    raw, other = socket.socketpair()  # a raw socket plays the corrupting sender
    receiver = Link(other, "peer")
    try:
        raw.sendall(header + payload + wrong_trailer)
        frame = receiver.recv(time.monotonic() + 5)
        with pytest.raises(ChecksumError):
            receiver.recv_payload_into(frame, [memoryview(bytearray(64))], time.monotonic() + 5)
        raw.sendall(encode_header(Kind.RELEASE, {"xfer": "next"}, 0))
        assert receiver.recv(time.monotonic() + 5).meta == {"xfer": "next"}
    finally:
        raw.close()
        receiver.close()


@pytest.mark.parametrize("num_bytes", [100, 48 << 10, 3 << 20])
def test_an_unchecking_sender_skips_the_hash_on_both_ends(num_bytes):
    """A link with ``checksum=False`` marks its payloads unchecked and sends a zero
    trailer; the receiver takes them without hashing (a flipped bit passes: TCP's own
    checks are all that guard them), and checks the next sender's checked payload again."""
    a, b = socket.socketpair()
    sender, receiver = Link(a, "unchecked", checksum=False), Link(b, "receiver")
    try:
        src = np.arange(num_bytes, dtype=np.uint64).astype(np.uint8)
        rows = [memoryview(src[i : i + 4096]) for i in range(0, num_bytes, 4096)]
        thread = threading.Thread(target=sender.send, args=(Kind.PUSH, {"n": 1}, rows))
        thread.start()
        frame = receiver.recv(time.monotonic() + 5)
        assert not frame.checked
        dest = np.zeros(num_bytes, dtype=np.uint8)
        receiver.recv_payload_into(frame, [memoryview(dest)], time.monotonic() + 5)
        thread.join()
        assert (dest == src).all()
        assert frame.meta == {"n": 1}
    finally:
        sender.close()
        receiver.close()
    raw, other = socket.socketpair()  # unchecked and corrupted in flight: not detected
    receiver = Link(other, "peer")
    try:
        payload = bytes(range(256)) * 16
        header = encode_header(Kind.PUSH, {}, len(payload), flags=FLAG_UNCHECKED)
        raw.sendall(header + payload[:-1] + b"X" + encode_trailer(0))
        frame = receiver.recv(time.monotonic() + 5)
        dest = bytearray(len(payload))
        receiver.recv_payload_into(frame, [memoryview(dest)], time.monotonic() + 5)
        assert dest[-1:] == b"X"
        good = encode_trailer(xxhash.xxh3_64_intdigest(payload))
        raw.sendall(encode_header(Kind.PUSH, {}, len(payload)) + payload[:-1] + b"X" + good)
        frame = receiver.recv(time.monotonic() + 5)
        assert frame.checked
        with pytest.raises(ChecksumError):
            receiver.recv_payload_into(frame, [memoryview(dest)], time.monotonic() + 5)
    finally:
        raw.close()
        receiver.close()


def test_silent_peer_times_out_and_closed_peer_is_reported(link_pair):
    left, right = link_pair
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        right.recv(time.monotonic() + 0.2)
    assert time.monotonic() - started < 2
    assert right.closed  # a timed-out link is unusable: its frame position is unknown
    with pytest.raises(PeerClosedError):
        left.recv(time.monotonic() + 2)


def test_wait_readable_honours_cancel(link_pair):
    left, _ = link_pair
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(TransferCancelled):
        left.wait_readable(time.monotonic() + 5, cancel)
    assert time.monotonic() - started < 2


def test_wait_readable_polls_for_the_reply_before_sleeping(monkeypatch):
    """An awaited ack is busy-polled for (a sleeping thread's wake-up cost a 4 KiB push
    ~100 us more here); only once the poll finds nothing does the wait sleep in select."""
    from halfmoon.transfer import busypoll
    from halfmoon.transfer import link as link_module

    # On a loaded host (a parallel test run) the poll would stand down for threads
    # waiting for a CPU and sleep: that case is busypoll's own test.
    monkeypatch.setattr(busypoll, "crowded", lambda cpus: False)
    a, b = socket.socketpair()
    waiting, answering = Link(a, "waiting", busy_poll_s=5.0), Link(b, "answering")
    try:

        def no_select(*args):
            raise AssertionError("wait_readable slept in select while polling")

        monkeypatch.setattr(link_module.select, "select", no_select)
        threading.Timer(0.01, lambda: answering.send(Kind.PUSH_ACK, {"ok": True})).start()
        waiting.wait_readable(time.monotonic() + 5, threading.Event())
        monkeypatch.undo()
        assert waiting.recv(time.monotonic() + 5).meta == {"ok": True}
        assert not waiting.readable()
    finally:
        waiting.close()
        answering.close()


def test_payload_of_many_small_destinations_arrives_whole(link_pair):
    """Scatter receives: more destinations than one recvmsg takes (IOV_BATCH), sizes that
    do not divide a chunk, and a small frame queued before them (buffered bytes first)."""
    from halfmoon.transfer.deadline_socket import IOV_BATCH

    left, right = link_pair
    sizes = [4096 + (i % 7) * 1000 for i in range(IOV_BATCH + 300)] + [3 << 20, 1]
    payloads = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    sender = threading.Thread(
        target=lambda: (
            left.send(Kind.PUSH, {"first": True}, [memoryview(b"abc")]),
            left.send(Kind.PUSH, {"many": True}, [memoryview(p) for p in payloads]),
            left.send(Kind.PUSH_ACK, {"after": True}),
        )
    )
    sender.start()
    first = right.recv(time.monotonic() + 5)
    small = memoryview(bytearray(3))
    right.recv_payload_into(first, [small], time.monotonic() + 5)
    frame = right.recv(time.monotonic() + 5)
    dests = [memoryview(bytearray(size)) for size in sizes]
    right.recv_payload_into(frame, dests, time.monotonic() + 5)
    sender.join()
    assert bytes(small) == b"abc" and [bytes(d) for d in dests] == payloads
    assert right.recv(time.monotonic() + 5).meta == {"after": True}  # still aligned


def test_back_to_back_frames_split_correctly_from_one_read(link_pair):
    left, right = link_pair
    sizes = [0, 5, 4096, 70 << 10, 3, 200 << 10, 1]
    for i, size in enumerate(sizes):  # all queued before the receiver reads anything
        left.send(Kind.PUSH, {"i": i}, [memoryview(bytes([i + 1]) * size)] if size else [])
    for i, size in enumerate(sizes):
        frame = right.recv(time.monotonic() + 5)
        assert frame.meta == {"i": i} and frame.payload_len == size
        if size:
            dest = memoryview(bytearray(size))
            right.recv_payload_into(frame, [dest], time.monotonic() + 5)
            assert bytes(dest) == bytes([i + 1]) * size
    assert not right.readable()


def test_many_small_frames_across_the_receive_buffer_end(link_pair):
    left, right = link_pair
    # ~100 KiB of small frames: some straddle the end of the 64 KiB receive buffer.
    sizes = [(i * 977) % 3001 for i in range(70)]
    sender = threading.Thread(
        target=lambda: [
            left.send(Kind.PUSH, {"i": i}, [memoryview(bytes([i % 250 + 1]) * n)] if n else [])
            for i, n in enumerate(sizes)
        ]
    )
    sender.start()
    for i, size in enumerate(sizes):
        frame = right.recv(time.monotonic() + 5)
        assert frame.meta == {"i": i} and frame.payload_len == size
        if size:
            halves = [memoryview(bytearray(size // 2)), memoryview(bytearray(size - size // 2))]
            right.recv_payload_into(frame, halves, time.monotonic() + 5)
            assert bytes(halves[0]) + bytes(halves[1]) == bytes([i % 250 + 1]) * size
    sender.join()


def test_a_meta_larger_than_the_receive_buffer_arrives_whole(link_pair):
    left, right = link_pair
    hashes = [hash_to_wire(i) for i in range(6000)]  # ~110 KiB of meta
    sender = threading.Thread(target=left.send, args=(Kind.PULL, {"hashes": hashes}))
    sender.start()
    frame = right.recv(time.monotonic() + 5)
    sender.join()
    assert frame.kind == Kind.PULL and frame.meta["hashes"] == hashes


def test_small_payload_corruption_is_detected_from_the_buffer():
    raw, other = socket.socketpair()
    receiver = Link(other, "peer")
    try:
        payload = bytes(range(256)) * 16
        good = encode_trailer(xxhash.xxh3_64_intdigest(payload))
        flipped = bytearray(payload)
        flipped[1000] ^= 0x04  # one flipped bit in flight
        raw.sendall(encode_header(Kind.PULL_REPLY, {}, 4096) + bytes(flipped) + good)
        frame = receiver.recv(time.monotonic() + 5)
        with pytest.raises(ChecksumError):
            receiver.recv_payload_into(frame, [memoryview(bytearray(4096))], time.monotonic() + 5)
    finally:
        raw.close()
        receiver.close()


def test_a_wait_without_deadline_keeps_a_long_armed_timeout_and_clears_a_short_one():
    mine, theirs = socket.socketpair()
    try:
        io = DeadlineSocket(mine, "pair")

        def armed_s() -> float:
            sec, usec = struct.unpack(
                "ll", mine.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
            )
            return sec + usec / 1e6

        buf = memoryview(bytearray(4))
        theirs.sendall(b"abcd")
        io.recv_into(buf, time.monotonic() + 30)  # a server's request deadline
        assert 25 < armed_s() <= 31
        threading.Timer(0.05, theirs.sendall, (b"efgh",)).start()
        assert io.recv_into(buf, None) == 4 and bytes(buf) == b"efgh"  # the idle wait
        assert 25 < armed_s() <= 31  # left armed: no setsockopt per request
        with pytest.raises(TimeoutError):
            io.recv_into(buf, time.monotonic() + 0.02)  # nothing comes
        assert 0 < armed_s() < 1
        threading.Timer(0.05, theirs.sendall, (b"ijkl",)).start()
        assert io.recv_into(buf, None) == 4 and bytes(buf) == b"ijkl"
        assert armed_s() == 0  # a short timeout would wake an idle wait often: cleared
    finally:
        mine.close()
        theirs.close()


def test_coalesce_joins_small_pieces_that_lie_back_to_back():
    rng = np.random.default_rng(7)
    pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    views = memoryview(pool)
    pieces = [
        views[0:4096],  # a run of three adjacent small pieces ...
        views[4096:8192],
        views[8192:73728],
        views[100000:104096],  # ... a gap, then a piece alone
        memoryview(b"read-only bytes stay as they are"),
        views[200000:400000],  # larger than 64 KiB: never joined
        views[400000:401000],  # adjacent to the large one but joined only with the next
        views[401000:401001],
        views[401001:401001],  # empty: kept as it is
    ]
    joined = coalesce(pieces)
    assert [p.nbytes for p in joined] == [73728, 4096, 32, 200000, 1001, 0]
    assert b"".join(bytes(p) for p in joined) == b"".join(bytes(p) for p in pieces)
    joined[0][5000:5004] = b"abcd"  # a joined view is the pieces' own memory
    assert bytes(pieces[1][904:908]) == b"abcd"
    assert coalesce([]) == [] and coalesce(pieces[3:4])[0] is pieces[3]
    swapped = coalesce([views[4096:8192], views[0:4096]])  # adjacent, but in reverse order
    assert [p.nbytes for p in swapped] == [4096, 4096]


def test_a_payload_of_adjacent_blocks_arrives_whole_in_adjacent_destinations(link_pair):
    a, b = link_pair
    src = np.arange(64 * 4096, dtype=np.uint8).reshape(64, 4096) ^ 0x5A
    dest = np.zeros_like(src)
    sender = threading.Thread(
        target=a.send, args=(Kind.PUSH, {"x": 1}, [memoryview(r) for r in src])
    )
    sender.start()
    frame = b.recv(time.monotonic() + 5)
    b.recv_payload_into(frame, [memoryview(r) for r in dest], time.monotonic() + 5)
    sender.join()
    assert (dest == src).all()


def test_put_items_decode_like_their_per_field_codecs_and_reject_malformed_ones():
    wire = [
        [hash_to_wire(2**128 - 1 - i), meta_to_wire(BlockMeta(16, 2**127 + i, 3)), i]
        for i in range(5)
    ]
    expected = [(hash_from_wire(h), meta_from_wire(m), p) for h, m, p in wire]
    assert put_items_from_wire(wire) == expected
    good = wire[0]
    for bad in (
        [b"short", good[1], 0],
        [good[0], [16, b"short", 1], 0],
        [good[0], [16, 0, 1], 0],  # the parent as an int, not 16 bytes
        [good[0], [-1, good[1][1], 1], 0],  # BlockMeta's ranges, checked by the decoder
        [good[0], [2**32, good[1][1], 1], 0],
        [good[0], [16, good[1][1], 2**16], 0],
        [good[0], [16, good[1][1], -1], 0],
        [good[0], ["16", good[1][1], 1], 0],
        [good[0], [True, good[1][1], 1], 0],
        [good[0], good[1], "0"],  # a position that is not an integer
        [good[0], good[1]],  # no position
        "not a list",
    ):
        with pytest.raises(ProtocolError):
            put_items_from_wire([good, bad])
        if isinstance(bad, list) and len(bad) == 3 and bad[2] == 0 and len(bad[0]) == 16:
            with pytest.raises(ProtocolError):
                meta_from_wire(bad[1])


def test_decoded_metadata_is_an_ordinary_block_meta():
    meta = meta_from_wire(meta_to_wire(BlockMeta(7, 2**128 - 1, 65535)))
    assert meta == BlockMeta(7, 2**128 - 1, 65535)
    assert hash(meta) == hash(BlockMeta(7, 2**128 - 1, 65535))
    assert repr(meta) == repr(BlockMeta(7, 2**128 - 1, 65535))
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.num_tokens = 8  # type: ignore[misc]

import threading
import time

import pytest

from halfmoon.transfer import (
    ProtocolError,
    RemoteError,
    StreamLayout,
    TransferCancelled,
    TransferError,
)
from halfmoon.transfer.peer import layer_block_bytes

LAYERS, BLOCKS, SIZE = 4, 3, 4096


@pytest.fixture
def stream_pair(make_engine, hub):
    def make(transport="tcp", session="req-1"):
        receiver = make_engine(hub=hub)
        region = receiver.register_region("kv", LAYERS * BLOCKS * SIZE, shared=transport == "shm")
        seen: list[int] = []
        rx = receiver.expect_stream(
            session,
            "kv",
            StreamLayout.contiguous(LAYERS, BLOCKS, SIZE),
            on_layer=lambda _r, i: seen.append(i),
        )
        client = make_engine(hub=hub, transport=transport).connect(receiver.endpoint)
        return client, rx, region, seen

    return make


def layer(i: int) -> list[bytes]:
    return [layer_block_bytes(i, b, SIZE) for b in range(BLOCKS)]


@pytest.mark.parametrize("transport", ["tcp", "shm", "inproc"])
def test_layers_arrive_one_by_one_then_complete(stream_pair, transport):
    client, rx, region, seen = stream_pair(transport)
    with client.open_stream("req-1", LAYERS, BLOCKS, SIZE, timeout_s=5) as tx:
        assert tx.placed == (transport != "tcp")
        for i in range(LAYERS):
            tx.send_layer(i, layer(i))
            rx.wait_layer(i, timeout_s=5)  # the receiver sees layer i before layer i+1 exists
            assert rx.num_layers_done == i + 1 and not rx.done
    rx.wait(timeout_s=5)
    assert rx.done and seen == list(range(LAYERS))
    for i in range(LAYERS):
        for b in range(BLOCKS):
            start = (i * BLOCKS + b) * SIZE
            assert bytes(region.view[start : start + SIZE]) == layer_block_bytes(i, b, SIZE)


def test_sender_may_open_before_the_receiver_announces(make_engine):
    receiver = make_engine()
    receiver.register_region("kv", LAYERS * BLOCKS * SIZE)
    client = make_engine().connect(receiver.endpoint)
    layout = StreamLayout.contiguous(LAYERS, BLOCKS, SIZE)
    timer = threading.Timer(0.2, receiver.expect_stream, args=("late", "kv", layout))
    timer.start()
    tx = client.open_stream("late", LAYERS, BLOCKS, SIZE, wait_s=5)
    for i in range(LAYERS):
        tx.send_layer(i, layer(i))
    tx.finish()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_an_acceptor_places_unannounced_sessions_on_demand(make_engine, transport):
    receiver = make_engine()
    region = receiver.register_region("inbox", 2 * LAYERS * BLOCKS * SIZE, shared=True)
    placed: list[tuple[str, int, int, int]] = []

    def place(session: str, layers: int, blocks: int, size: int) -> tuple[str, StreamLayout]:
        if blocks > BLOCKS:
            raise RemoteError(f"no room for {blocks} blocks")
        placed.append((session, layers, blocks, size))
        base = (len(placed) - 1) * LAYERS * BLOCKS * SIZE
        return "inbox", StreamLayout.contiguous(layers, blocks, size, base_offset=base)

    receiver.accept_streams(place)
    client = make_engine(transport=transport).connect(receiver.endpoint)
    for session in ("a", "b"):
        with client.open_stream(session, LAYERS, BLOCKS, SIZE, wait_s=0) as tx:
            for i in range(LAYERS):
                tx.send_layer(i, layer(i))
    assert placed == [("a", LAYERS, BLOCKS, SIZE), ("b", LAYERS, BLOCKS, SIZE)]
    second = LAYERS * BLOCKS * SIZE + (2 * BLOCKS + 1) * SIZE  # session b, layer 2, block 1
    assert bytes(region.view[second : second + SIZE]) == layer_block_bytes(2, 1, SIZE)
    with pytest.raises(RemoteError, match="no room for 4 blocks"):
        client.open_stream("c", LAYERS, BLOCKS + 1, SIZE, wait_s=0)
    with pytest.raises(TransferError, match="already ended"):  # a finished session stays ended
        client.open_stream("a", LAYERS, BLOCKS, SIZE, wait_s=0)
    receiver.accept_streams(None)
    with pytest.raises(RemoteError, match="no stream session 'd'"):
        client.open_stream("d", LAYERS, BLOCKS, SIZE, wait_s=0.1)


def test_unknown_session_and_layout_mismatch_are_refused(stream_pair):
    client, rx, _, _ = stream_pair()
    started = time.monotonic()
    with pytest.raises(RemoteError, match="no stream session 'other'"):
        client.open_stream("other", LAYERS, BLOCKS, SIZE, wait_s=0.2)
    assert time.monotonic() - started < 3
    with pytest.raises(RemoteError, match="expects 4 layers x 3 blocks"):
        client.open_stream("req-1", LAYERS, BLOCKS + 1, SIZE)
    with pytest.raises(TransferError, match="does not match"):
        rx.wait(timeout_s=1)


def test_receiver_cancel_reaches_the_sender(stream_pair):
    client, rx, _, _ = stream_pair()
    tx = client.open_stream("req-1", LAYERS, BLOCKS, SIZE, timeout_s=5)
    tx.send_layer(0, layer(0))
    rx.wait_layer(0, timeout_s=5)
    rx.cancel()
    with pytest.raises(RemoteError, match="cancelled by the receiver"):
        for i in range(1, LAYERS):
            tx.send_layer(i, layer(i))
        tx.finish()
    with pytest.raises(TransferCancelled):
        rx.wait(timeout_s=1)


def test_sender_cancel_reaches_the_receiver(stream_pair):
    client, rx, _, _ = stream_pair()
    tx = client.open_stream("req-1", LAYERS, BLOCKS, SIZE, timeout_s=5)
    tx.send_layer(0, layer(0))
    tx.cancel()
    with pytest.raises(TransferCancelled, match="cancelled by the sender"):
        rx.wait(timeout_s=5)
    with pytest.raises(TransferError, match="already finished or cancelled"):
        tx.send_layer(1, layer(1))


def test_missing_layers_fail_both_sides(stream_pair):
    client, rx, _, _ = stream_pair()
    tx = client.open_stream("req-1", LAYERS, BLOCKS, SIZE, timeout_s=5)
    tx.send_layer(0, layer(0))
    with pytest.raises(RemoteError, match="ended after 1 of 4 layers"):
        tx.finish()
    with pytest.raises(TransferError, match="ended after 1 of 4 layers"):
        rx.wait(timeout_s=1)


def test_bad_layer_calls_are_value_errors(stream_pair):
    client, rx, _, _ = stream_pair()
    with client.open_stream("req-1", LAYERS, BLOCKS, SIZE, timeout_s=5) as tx:
        with pytest.raises(ValueError, match="needs 3 blocks of at most 4096 bytes"):
            tx.send_layer(0, layer(0)[:2])
        with pytest.raises(ValueError, match="outside"):
            tx.send_layer(LAYERS, layer(0))
        for i in range(LAYERS):
            tx.send_layer(i, layer(i))
        with pytest.raises(ValueError, match="already sent"):
            tx.send_layer(0, layer(0))
    rx.wait(timeout_s=5)


@pytest.mark.parametrize("transport", ["tcp", "shm", "inproc"])
def test_blocks_may_fill_part_of_their_slots(stream_pair, transport):
    """Payloads of varying size (compressed KV) land at their slots' starts; the receiver
    learns each length, and a layer of full blocks reports full lengths."""
    client, rx, region, _ = stream_pair(transport)
    short = {i: [layer_block_bytes(i, b, SIZE)[: 100 * (i + b)] for b in range(BLOCKS)]
             for i in range(LAYERS - 1)}  # fmt: skip
    with client.open_stream("req-1", LAYERS, BLOCKS, SIZE, timeout_s=5) as tx:
        with pytest.raises(ValueError, match="at most 4096 bytes"):
            tx.send_layer(0, [b"x" * (SIZE + 1)] * BLOCKS)
        for i, blocks in short.items():
            tx.send_layer(i, blocks)
        tx.send_layer(LAYERS - 1, layer(LAYERS - 1))
    rx.wait(timeout_s=5)
    for i, blocks in short.items():
        assert rx.lengths(i) == [len(b) for b in blocks]
        for b, data in enumerate(blocks):
            start = (i * BLOCKS + b) * SIZE
            assert bytes(region.view[start : start + len(data)]) == data
    assert rx.lengths(LAYERS - 1) == [SIZE] * BLOCKS


def test_bad_block_lengths_fail_the_session(stream_pair):
    client, rx, _, _ = stream_pair()
    with pytest.raises(ProtocolError, match="block lengths must be 3 integers"):
        rx.set_lengths(0, [1, 2])
    with pytest.raises(ProtocolError, match="block lengths"):
        rx.set_lengths(0, [1, 2, SIZE + 1])


def test_layout_must_fit_the_region(make_engine):
    receiver = make_engine()
    receiver.register_region("kv", SIZE)
    with pytest.raises(ValueError, match="outside region"):
        receiver.expect_stream("big", "kv", StreamLayout.contiguous(2, 1, SIZE))

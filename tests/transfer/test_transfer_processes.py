"""Round trips and failures across real processes on 127.0.0.1."""

import signal
import subprocess
import time

import numpy as np
import pytest
import xxhash

from halfmoon.store import BlockMeta
from halfmoon.transfer import (
    AuthenticationError,
    PeerClosedError,
    PutBlock,
    StreamLayout,
    TransferError,
    TransferTimeout,
)
from halfmoon.transfer.peer import layer_block_bytes

BLOCK = 256 << 10
REGION_BYTES = 8 * BLOCK


def serve_args(*extra: str) -> list[str]:
    return [
        "serve",
        "--region",
        f"kv:{REGION_BYTES}:shared",
        "--store-block-bytes",
        str(BLOCK),
        "--store-dram-bytes",
        str(8 * BLOCK),
        "--shared-dram",
        *extra,
    ]


@pytest.mark.parametrize("transport", ["tcp", "shm", "auto"])
def test_push_put_pull_round_trip_with_a_peer_process(spawn_peer, make_engine, transport):
    peer = spawn_peer(*serve_args("--digests"))
    endpoint = peer.next_line("endpoint")["endpoint"]
    client = make_engine(transport=transport, num_connections=2).connect(endpoint)
    # auto: the peer shares our /dev/shm, so blocks go through shared memory
    assert client.transport == ("shm" if transport == "auto" else transport)
    _round_trip(client, peer)


def _private_shm_prefix() -> list[str]:
    """A command prefix giving the peer its own /dev/shm (a mount namespace), or skip."""
    prefix = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs hm-test /dev/shm && exec "$@"', "-"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("unshare is not available")
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    return prefix


def test_auto_transport_falls_back_to_tcp_when_the_peer_has_other_shared_memory(
    spawn_peer, make_engine
):
    # The peer's shared DRAM arena lives in a /dev/shm this process cannot see: shm would
    # fail to attach it; auto must notice in the handshake and send bytes over tcp.
    peer = spawn_peer(*serve_args("--digests"), prefix=_private_shm_prefix())
    endpoint = peer.next_line("endpoint")["endpoint"]
    client = make_engine(num_connections=2).connect(endpoint)
    assert client.transport == "tcp"
    _round_trip(client, peer)


def _round_trip(client, peer) -> None:
    """Push into the peer's region, put blocks into its store and pull them back."""
    rng = np.random.default_rng(5)
    blocks = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(8)]
    client.push("kv", [(i * BLOCK, b) for i, b in enumerate(reversed(blocks))])
    expected = xxhash.xxh3_64_hexdigest(b"".join(b.tobytes() for b in reversed(blocks)))
    assert peer.next_line("completed")["regions"] == {"kv": expected}

    puts = [PutBlock(2**120 + i, b, BlockMeta(16, i)) for i, b in enumerate(blocks[:5])]
    assert client.put_blocks(puts) == 5
    dests = [np.empty(BLOCK, np.uint8) for _ in range(6)]
    metas = client.pull([2**120 + i for i in (4, 2, 0, 1, 3)] + [7], dests)
    assert metas == [BlockMeta(16, i) for i in (4, 2, 0, 1, 3)] + [None]
    for dest, i in zip(dests, (4, 2, 0, 1, 3), strict=False):
        assert (dest == blocks[i]).all()


def test_a_quiet_peer_prints_no_line_per_transfer(spawn_peer, make_engine):
    """Benchmarks run the peer --quiet: a printed line per push (and the benchmark's reader
    of it) would be timed with every operation."""
    peer = spawn_peer(*serve_args("--quiet"))
    client = make_engine(transport="tcp").connect(peer.next_line("endpoint")["endpoint"])
    block = np.arange(BLOCK, dtype=np.uint8)
    for _ in range(3):
        client.push("kv", [(0, block)])
    peer.kill()  # the reader thread has then read every line the peer printed
    printed = []
    while not peer._lines.empty():
        printed.append(peer._lines.get_nowait())
    assert printed == []


def test_stream_into_a_peer_process(spawn_peer, make_engine):
    layers, blocks, size = 6, 2, 32 << 10
    peer = spawn_peer(*serve_args("--expect-stream", f"s1:{layers}:{blocks}:{size}:kv"))
    client = make_engine().connect(peer.next_line("endpoint")["endpoint"])
    with client.open_stream("s1", layers, blocks, size, timeout_s=10) as tx:
        for i in range(layers):
            tx.send_layer(i, [layer_block_bytes(i, b, size) for b in range(blocks)])
            record = peer.next_line("layer")
            expected = xxhash.xxh3_64_hexdigest(
                b"".join(layer_block_bytes(i, b, size) for b in range(blocks))
            )
            assert record == {"layer": i, "xxh3": expected}
    assert peer.next_line("stream")["stream"] == "done"


def test_wrong_secret_is_refused_by_a_peer_process(spawn_peer, make_engine):
    peer = spawn_peer(*serve_args())
    endpoint = peer.next_line("endpoint")["endpoint"]
    intruder = make_engine(secret=b"an-entirely-different-secret!!")
    with pytest.raises(AuthenticationError, match="refused the connection: wrong shared secret"):
        intruder.connect(endpoint).push("kv", [(0, bytes(16))], timeout_s=5)
    make_engine().connect(endpoint).push("kv", [(0, bytes(16))], timeout_s=5)  # still serving


def test_sender_killed_mid_stream_fails_the_receiver_promptly(spawn_peer, make_engine):
    layers, blocks, size = 50, 2, 16 << 10
    receiver = make_engine()
    receiver.register_region("kv", layers * blocks * size)
    rx = receiver.expect_stream("s2", "kv", StreamLayout.contiguous(layers, blocks, size))
    sender = spawn_peer(
        "stream-send",
        "--to",
        receiver.endpoint,
        "--session",
        "s2",
        "--layers",
        str(layers),
        "--blocks",
        str(blocks),
        "--block-bytes",
        str(size),
        "--delay-s",
        "0.2",
    )
    rx.wait_layer(1, timeout_s=15)
    sender.signal(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(PeerClosedError, match="closed the connection after"):
        rx.wait(timeout_s=5)
    assert time.monotonic() - started < 3
    assert 2 <= rx.num_layers_done < layers


def test_receiver_killed_mid_stream_fails_the_sender_promptly(spawn_peer, make_engine):
    layers, blocks, size = 8, 2, 64 << 10
    peer = spawn_peer(*serve_args("--expect-stream", f"s3:{layers}:{blocks}:{size}:kv"))
    client = make_engine().connect(peer.next_line("endpoint")["endpoint"])
    tx = client.open_stream("s3", layers, blocks, size, timeout_s=3)
    tx.send_layer(0, [layer_block_bytes(0, b, size) for b in range(blocks)])
    peer.next_line("layer")
    peer.signal(signal.SIGKILL)
    peer.proc.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(TransferError):
        for i in range(1, layers):
            tx.send_layer(i, [layer_block_bytes(i, b, size) for b in range(blocks)])
        tx.finish()
    assert time.monotonic() - started < 5


def test_frozen_peer_gives_a_timeout(spawn_peer, make_engine):
    peer = spawn_peer(*serve_args())
    client = make_engine(num_connections=1).connect(peer.next_line("endpoint")["endpoint"])
    client.push("kv", [(0, bytes(BLOCK))], timeout_s=5)  # connect + authenticate first
    peer.freeze()
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        client.push("kv", [(i * BLOCK, bytes(BLOCK)) for i in range(8)], timeout_s=1.0)
    assert time.monotonic() - started < 3

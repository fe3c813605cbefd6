"""The streams out of a prefill worker: one thread per destination, sender-side deadlines,
and a stalled destination failing what is queued for it at once."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from halfmoon.serve.worker.kvstream import OutStream, StreamerPool, finish_all
from halfmoon.transfer import StreamLayout, TransferEngine

SECRET = bytes(range(7, 39))
BLOCK = 256


@pytest.mark.slow  # ~6 s here
def test_a_frozen_destination_fails_its_own_streams_only():
    """A peer that accepts TCP connections and never answers (a SIGSTOPped process looks
    like this) fails the first session within its deadline and the ones queued behind it
    at once; a healthy destination's session, submitted meanwhile, completes."""
    frozen = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    frozen_ep = f"127.0.0.1:{frozen.getsockname()[1]}"
    sender = TransferEngine(SECRET)
    receiver = TransferEngine(SECRET)
    sender.start()
    receiver.start()
    pool = StreamerPool()
    try:
        receiver.register_region("r", 2 * BLOCK)
        incoming = receiver.expect_stream("good", "r", StreamLayout.contiguous(2, 1, BLOCK))
        stuck = [
            OutStream(sender, frozen_ep, f"s{i}", (2, 1, BLOCK), "frozen", pool, timeout_s=0.5)
            for i in range(3)
        ]
        good = OutStream(sender, receiver.endpoint, "good", (2, 1, BLOCK), "good", pool)
        assert stuck[0].streamer is not good.streamer and len(pool) == 2
        done = {name: threading.Event() for name in ("stuck", "good")}
        for stream in stuck:
            stream.submit(lambda s=stream: s.send(0, [bytes(BLOCK)]))
        finish_all(stuck, done["stuck"].set)
        good.submit(lambda: good.send(0, [b"a" * BLOCK]))
        good.submit(lambda: good.send(1, [b"b" * BLOCK]))
        finish_all([good], done["good"].set)

        assert done["good"].wait(30)
        incoming.wait(10)
        assert not good.error
        assert bytes(receiver.regions.get("r").view) == b"a" * BLOCK + b"b" * BLOCK
        assert done["stuck"].wait(30)  # one deadline (+ the open's wait), not three
        assert "stream to frozen failed" in stuck[0].error
        for stream in stuck[1:]:
            assert "not started" in stream.error, stream.error
        assert pool.get(frozen_ep).stalled_for() > 0
    finally:
        pool.close()
        sender.close()
        receiver.close()
        frozen.close()


def test_finish_all_of_nothing_is_done_at_once():
    called = []
    finish_all([], lambda: called.append(time.monotonic()))
    assert called

"""The streams out of a prefill worker: one thread per destination, sender-side deadlines,
and a stalled destination failing what is queued for it at once."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from halfmoon.serve.worker.kvstream import OutStream, StreamerPool, finish_all
from halfmoon.serve.worker.metrics import WorkerMetrics
from halfmoon.transfer import RemoteError, StreamLayout, TransferEngine

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


@pytest.mark.parametrize(
    ("mode", "transport", "inbox_bytes"),
    [("none", "shm", 1 << 20), ("none", "tcp", 0), ("int8", "shm", 1 << 20),
     ("zstd", "tcp", 1 << 20), ("zstd", "tcp", 0)],
)  # fmt: skip
def test_stage_streams_land_in_the_export_layout(mode, transport, inbox_bytes):
    """A decode worker expecting a 2-stage (CPP) request: each stage's OutStream sends its
    stream layers (encoded with --kv-compression), they land in the decode role's inbox
    (shared memory: a co-located sender places them, no socket payload) or, without one,
    in a region of the request's own, compressed ones are decoded as they land, and the
    KV to import is the export layout ``[L, 2, n, B, H, D]`` as the codec gives it back."""
    import torch

    from halfmoon.core.request import SamplingParams
    from halfmoon.engine.kv_cache import KVLayout
    from halfmoon.engine.kvcodec import KVCodec
    from halfmoon.engine.stage import LayerSlice
    from halfmoon.serve.control.messages import Expect, WireParams
    from halfmoon.serve.worker.decode import DecodeRole
    from halfmoon.serve.worker.kvstream import kv_stream_layout
    from halfmoon.serve.worker.pipeline_job import kv_session

    layout = KVLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype="float32")
    codec = KVCodec.make(mode, layout)

    class Engine:  # what the decode role reads of its engine before the handoff
        class config:  # noqa: N801
            block_size = 16

    Engine.layout = layout
    worker = type("W", (), {"engine": Engine(), "kv_codec": codec, "metrics": WorkerMetrics()})()
    sender = TransferEngine(SECRET, transport=transport)
    receiver = TransferEngine(SECRET, transport=transport)
    sender.start()
    receiver.start()
    pool = StreamerPool()
    try:
        role = DecodeRole(worker, receiver, inbox_bytes=inbox_bytes)
        params = WireParams.of(SamplingParams(max_tokens=4))
        role._on_expect(b"gw", Expect(msg_id=1, request_id="r", params=params,
                                      num_prompt_tokens=40, num_stages=2))  # fmt: skip
        n = 3  # blocks of 40 tokens
        kv = torch.randn(layout.buffer_shape(n), generator=torch.Generator().manual_seed(1))
        half = layout.bytes_per_block // (2 * layout.num_layers)
        streams = []
        for s, layers in enumerate(LayerSlice.split(layout.num_layers, 2)):
            out = OutStream(sender, receiver.endpoint, kv_session("r", s, 2),
                            kv_stream_layout(layers.size, n, half, codec), f"stage {s}", pool,
                            codec=codec)  # fmt: skip
            for i, layer in enumerate(range(layers.first, layers.last)):
                keys = [memoryview(b.view(torch.uint8).reshape(-1).numpy()) for b in kv[layer, 0]]
                values = [memoryview(b.view(torch.uint8).reshape(-1).numpy()) for b in kv[layer, 1]]
                out.submit_kv(i, keys, values)
            streams.append(out)
        done = threading.Event()
        finish_all(streams, done.set)
        assert done.wait(30) and not any(s.error for s in streams), [s.error for s in streams]
        expected = role.expected["r"]
        for rx in expected.receivers:
            rx.wait(10)
        assert expected.landing.in_inbox == bool(inbox_bytes)
        # Co-located over shm with an inbox: each layer copied straight into it.
        placed = transport == "shm" and bool(inbox_bytes)
        assert all(s._sender.placed == placed for s in streams)
        raw = (expected.landing if expected.raw is None else expected.raw).view(receiver)
        got = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(kv.shape)
        assert torch.equal(got, codec.encode_tensor(kv))
        if mode in ("none", "zstd"):
            assert torch.equal(got, kv)
        if mode != "none":
            assert sum(s.bytes_sent for s in streams) < kv.numel() * 4
        assert sum(s.raw_bytes_sent for s in streams) == kv.numel() * 4
        role._release(expected.landing, abandoned=False)  # what the handoff does
        role._release(expected.raw, abandoned=False)
        if inbox_bytes:
            assert role.inbox.used_bytes == 0
            assert role.raw_inbox is None or role.raw_inbox.used_bytes == 0
        else:
            with pytest.raises(RemoteError, match="no region named"):
                receiver.regions.get(expected.landing.region)
    finally:
        pool.close()
        sender.close()
        receiver.close()


def test_an_abandoned_streams_inbox_range_waits_in_quarantine(monkeypatch):
    """An aborted request's inbox range is not handed out again at once (its sender may
    still place a layer there); ``tick`` frees it after the quarantine."""
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine.kv_cache import KVLayout
    from halfmoon.serve.control.messages import Expect, WireParams
    from halfmoon.serve.worker import decode

    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32")

    class Engine:
        class config:  # noqa: N801
            block_size = 16

        def abort_request(self, rid):
            return False

    Engine.layout = layout
    events = []
    worker = type("W", (), {"engine": Engine(), "kv_codec": None, "send": None,
                            "metrics": WorkerMetrics()})()  # fmt: skip
    worker.conductor = type("C", (), {"event": lambda self, *a, **k: events.append(a)})()
    receiver = TransferEngine(SECRET)
    receiver.start()
    try:
        role = decode.DecodeRole(worker, receiver, inbox_bytes=1 << 16)
        params = WireParams.of(SamplingParams(max_tokens=4))
        role._on_expect(b"gw", Expect(msg_id=1, request_id="r", params=params,
                                      num_prompt_tokens=20))  # fmt: skip
        used = role.inbox.used_bytes
        assert used == 2 * layout.bytes_per_block
        role.on_abort("r")
        assert role.inbox.used_bytes == used and events  # still held
        role.tick()
        assert role.inbox.used_bytes == used
        later = time.monotonic() + 60
        monkeypatch.setattr(decode.time, "monotonic", lambda: later)
        role.tick()
        assert role.inbox.used_bytes == 0
    finally:
        receiver.close()

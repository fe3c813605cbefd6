"""The streams out of a prefill worker: one sender thread per destination and the sending
end of a stream session (KV to a decode worker, hidden states to the next stage).

Only host bytes pass through here: the engine hands out its KV layers and hidden states
as host ``memoryview``s (``KVCache.layer_bytes``, ``StageExecutor.hidden_bytes``), whatever
device it computes on.

A peer that stops taking bytes (frozen, or its host unreachable) must not hold up the
others: each destination has a thread of its own, every step of a session has a
sender-side deadline of ``PEER_TIMEOUT_S``, and after one step timed out the destination
is *stalled* for as long again, so the sessions queued behind it fail at once instead of
each waiting its own deadline."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.transfer import TransferEngine, TransferError, TransferTimeout

#: A peer that does not take one step of a stream (a layer, the final ack) within this is
#: suspected: the session fails and the request is placed again.
PEER_TIMEOUT_S = 5.0


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class LayerStreamer:
    """Sends queued jobs on a background thread, so compute never waits for the wire.

    ``stalled_for()`` tells how much longer its destination counts as stalled (see the
    module docstring); ``mark_stalled`` starts that."""

    def __init__(self, name: str = "kv-streamer") -> None:
        self._queue: queue.Queue = queue.Queue()
        self._stalled_until = 0.0
        self.stall_reason = ""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], Any]) -> None:
        """Run ``job()`` after everything queued before it."""
        self._queue.put(job)

    def barrier(self, timeout_s: float) -> bool:
        """Wait until every job queued so far ran; False on timeout."""
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)

    def mark_stalled(self, reason: str, for_s: float = PEER_TIMEOUT_S) -> None:
        """The destination did not keep up: fail what is queued for it for ``for_s``."""
        self.stall_reason = reason
        self._stalled_until = time.monotonic() + for_s

    def stalled_for(self) -> float:
        """Seconds the destination still counts as stalled (0 when it does not)."""
        return max(0.0, self._stalled_until - time.monotonic())

    def close(self) -> None:
        """Stop the thread after the queued jobs."""
        self._queue.put(None)
        self._thread.join(5)


class StreamerPool:
    """One :class:`LayerStreamer` per destination endpoint, made on first use."""

    def __init__(self) -> None:
        self._streamers: dict[str, LayerStreamer] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str) -> LayerStreamer:
        """The streamer sending to ``endpoint``."""
        with self._lock:
            streamer = self._streamers.get(endpoint)
            if streamer is None:
                name = f"kv-streamer-{len(self._streamers)}"
                streamer = self._streamers[endpoint] = LayerStreamer(name)
            return streamer

    def __len__(self) -> int:
        return len(self._streamers)

    def close(self) -> None:
        """Stop every thread after its queued jobs."""
        with self._lock:
            streamers, self._streamers = list(self._streamers.values()), {}
        for streamer in streamers:
            streamer.close()


def kv_stream_layout(
    num_layers: int, num_blocks: int, half_block_bytes: int, codec: Any = None
) -> tuple[int, int, int]:
    """``(stream layers, blocks per layer, bytes per block)`` of a KV stream of
    ``num_layers`` model layers and ``num_blocks`` blocks: K and V of each layer, block by
    block; with a compressing ``codec`` (halfmoon.engine.kvcodec), one payload per stream
    layer (at most ``codec.max_encoded_bytes`` of the layer's raw bytes)."""
    if codec is None or codec.name == "none":
        return (2 * num_layers, num_blocks, half_block_bytes)
    return (2 * num_layers, 1, codec.max_encoded_bytes(num_blocks * half_block_bytes))


class OutStream:
    """The sending end of one transfer-engine stream session, driven from its
    destination's streamer thread (``streamers.get(endpoint)``): opened on the first send;
    the first failure is kept in ``error`` (naming ``peer``) and every later send is
    skipped. Every step has a deadline of ``timeout_s``. With a compressing ``codec`` each
    stream layer's blocks are encoded into one payload on that thread
    (:func:`kv_stream_layout`); ``bytes_sent`` counts wire bytes, ``raw_bytes_sent`` the
    KV they carry."""

    def __init__(
        self,
        transfer: TransferEngine,
        endpoint: str,
        session: str,
        layout: tuple[int, int, int],
        peer: str,
        streamers: StreamerPool,
        timeout_s: float = PEER_TIMEOUT_S,
        codec: Any = None,
    ) -> None:
        self.transfer = transfer
        self.endpoint = endpoint
        self.session = session
        self.layout = layout  # (num_layers, num_blocks, block_bytes)
        self.peer = peer
        self.timeout_s = timeout_s
        self.codec = None if codec is None or codec.name == "none" else codec
        self.error = ""
        self.bytes_sent = 0
        self.raw_bytes_sent = 0
        #: Seconds spent encoding on the streamer thread.
        self.encode_s = 0.0
        #: Seconds spent on the wire: opening, sending each layer, finishing.
        self.send_s = 0.0
        self.streamer = streamers.get(endpoint)
        self._sender: Any = None

    def _failed(self, exc: Exception) -> None:
        self.error = self.error or f"stream to {self.peer} failed: {exc}"
        if isinstance(exc, TransferTimeout):
            self.streamer.mark_stalled(self.error)

    # -- on the streamer thread ---------------------------------------------------------------
    def send(self, layer: int, blocks: list) -> None:
        """Send stream layer ``layer`` (its blocks' byte views)."""
        if self.error:
            return
        stalled = self.streamer.stalled_for()
        if stalled and self._sender is None:
            self.error = f"stream to {self.peer} not started: {self.streamer.stall_reason}"
            return
        try:
            if self._sender is None:
                client = self.transfer.connect(self.endpoint)
                self._sender = client.open_stream(
                    self.session, *self.layout, timeout_s=self.timeout_s
                )
            raw = sum(len(b) for b in blocks)
            if self.codec is not None:
                started = time.perf_counter()
                blocks = [self.codec.encode(blocks)]
                self.encode_s += time.perf_counter() - started
            started = time.perf_counter()
            self._sender.send_layer(layer, blocks)
            self.send_s += time.perf_counter() - started
            self.bytes_sent += sum(len(b) for b in blocks)
            self.raw_bytes_sent += raw
        except (TransferError, OSError, ValueError, HalfmoonError) as exc:
            self._failed(exc)

    def send_kv(self, layer: int, keys: list, values: list) -> None:
        """Send model layer ``layer``'s K then V (stream layers ``2*layer``, ``2*layer+1``:
        the export layout's order)."""
        self.send(2 * layer, keys)
        self.send(2 * layer + 1, values)

    def finish(self) -> None:
        """Close the session (the receiver checks every layer came)."""
        if self.error:
            return
        if self._sender is None:
            self.error = f"nothing was streamed to {self.peer}"
            return
        try:
            started = time.perf_counter()
            self._sender.finish()
            self.send_s += time.perf_counter() - started
        except (TransferError, OSError) as exc:
            self._failed(exc)

    def cancel(self) -> None:
        """Tell the receiver the session is abandoned (no-op when never opened)."""
        if self._sender is not None:
            with contextlib.suppress(TransferError, OSError):  # the peer may be gone already
                self._sender.cancel()

    # -- from the engine thread ---------------------------------------------------------------
    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job`` on this stream's destination thread."""
        self.streamer.submit(job)

    def submit_kv(self, layer: int, keys: list, values: list) -> None:
        """Queue :meth:`send_kv`."""
        self.streamer.submit(lambda: self.send_kv(layer, keys, values))

    def submit_cancel(self) -> None:
        """Queue :meth:`cancel` (after what is queued: the session may still be opening)."""
        self.streamer.submit(self.cancel)


def finish_all(streams: list[OutStream], done: Callable[[], None]) -> None:
    """Finish each stream on its destination's thread and call ``done()`` (from one of
    those threads) once every one has finished or failed. Never blocks the caller."""
    if not streams:
        done()
        return
    left = [len(streams)]
    lock = threading.Lock()

    def finish(stream: OutStream) -> None:
        stream.finish()
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()

    for stream in streams:
        stream.submit(lambda s=stream: finish(s))

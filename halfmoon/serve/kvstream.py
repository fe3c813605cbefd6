"""The streams out of a prefill worker: a sender thread and the sending end of a stream
session (KV to a decode worker, hidden states to the next stage).

Only host bytes pass through here: the engine hands out its KV layers and hidden states
as host ``memoryview``s (``KVCache.layer_bytes``, ``StageExecutor.hidden_bytes``), whatever
device it computes on."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

from halfmoon.transfer import TransferEngine, TransferError


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks holding ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class LayerStreamer:
    """Sends queued layers on a background thread, so compute never waits for the wire."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-streamer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job()

    def submit(self, job: Any) -> None:
        """Run ``job()`` after everything queued before it."""
        self._queue.put(job)

    def barrier(self, timeout_s: float) -> bool:
        """Wait until every job queued so far ran; False on timeout."""
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread after the queued jobs."""
        self._queue.put(None)
        self._thread.join(5)


class OutStream:
    """The sending end of one transfer-engine stream session, driven from a streamer
    thread: opened on the first send; the first failure is kept in ``error`` (naming
    ``peer``) and every later send is skipped."""

    def __init__(
        self,
        transfer: TransferEngine,
        endpoint: str,
        session: str,
        layout: tuple[int, int, int],
        peer: str,
    ) -> None:
        self.transfer = transfer
        self.endpoint = endpoint
        self.session = session
        self.layout = layout  # (num_layers, num_blocks, block_bytes)
        self.peer = peer
        self.error = ""
        self.bytes_sent = 0
        self._sender: Any = None

    def _failed(self, exc: Exception) -> None:
        self.error = self.error or f"stream to {self.peer} failed: {exc}"

    def send(self, layer: int, blocks: list) -> None:
        """Send stream layer ``layer`` (its blocks' byte views)."""
        if self.error:
            return
        try:
            if self._sender is None:
                client = self.transfer.connect(self.endpoint)
                self._sender = client.open_stream(self.session, *self.layout)
            self._sender.send_layer(layer, blocks)
            self.bytes_sent += sum(len(b) for b in blocks)
        except (TransferError, OSError, ValueError) as exc:
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
            self._sender.finish()
        except (TransferError, OSError) as exc:
            self._failed(exc)

    def cancel(self) -> None:
        """Tell the receiver the session is abandoned (no-op when never opened)."""
        if self._sender is not None:
            with contextlib.suppress(TransferError, OSError):  # the peer may be gone already
                self._sender.cancel()

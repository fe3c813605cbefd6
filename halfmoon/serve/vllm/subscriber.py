"""One vLLM instance's KV-event stream over ZeroMQ, with sequence-gap detection and replay.

What vLLM's ``ZmqEventPublisher`` does (docs/vllm.md, "KV events", has the source lines):

- its PUB socket *binds* when ``endpoint`` is a wildcard (``tcp://*:5557``, the default),
  ``::`` or ipc/inproc, and *connects* otherwise. So either vLLM binds and this
  subscriber connects (``bind=False``: one subscriber per instance, the usual), or this
  subscriber binds and vLLM's PUB connects to it (``bind=True``);
- each batch is ``[topic, seq, payload]``, ``seq`` counting from 0 per publisher process;
- its optional ROUTER socket at ``replay_endpoint`` (always bound) answers ``[b"",
  start_seq]`` (8 bytes big-endian) from a DEALER with ``[b"", topic, seq, payload]`` for
  every batch still buffered (the last ``buffer_steps``) with ``seq >= start_seq``, then
  ``[b"", b"", END_SEQ, b""]``. A REQ socket would accept only the first reply.

Sequence: a first batch with ``seq > 0`` (what was published before this SUB joined), or
a jump past the next expected ``seq``, is a gap: the missing batches are asked from the
replay endpoint and delivered first, in order; those replay cannot give (no endpoint, a
timeout, batches already out of vLLM's buffer) are counted in
:attr:`SubscriberStats.num_missed_batches`. A ``seq`` below the expected one is a new
publisher process: :class:`~halfmoon.serve.vllm.kv_events.PublisherRestarted` goes out
before its batches (the translator then forgets that instance's blocks).

Threads: a ZeroMQ socket belongs to one thread. Each vLLM instance gets one subscriber
and one thread, which creates it and runs :meth:`KVEventSubscriber.run`; the ``sink``
puts ``(instance_id, item)`` on the queue that the translator's single thread drains
(:mod:`halfmoon.serve.vllm.kv_events`). :attr:`~KVEventSubscriber.stats` are plain
counters any thread may read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from halfmoon.core.errors import HalfmoonError
from halfmoon.serve.vllm.kv_events import (
    END_SEQ,
    SEQ_BYTES,
    KVEventError,
    PublisherRestarted,
    VllmEventBatch,
    decode_frames,
)

log = logging.getLogger(__name__)

SubscriberItem = VllmEventBatch | PublisherRestarted


@dataclass
class SubscriberStats:
    """Counters of one subscriber (batches delivered include replayed ones)."""

    num_batches: int = 0
    num_gaps: int = 0
    num_replayed_batches: int = 0
    num_missed_batches: int = 0
    num_replay_timeouts: int = 0
    num_restarts: int = 0
    num_malformed: int = 0
    num_other_topic: int = 0


class KVEventSubscriber:
    """A SUB socket on one vLLM instance's KV events (and a DEALER on its replay socket).

    ``topic`` filters exactly (ZeroMQ's filter is a prefix match, so ``"vllm-1"`` would
    also receive ``"vllm-10"``; those are dropped and counted). Close it (or use it as a
    context manager) on the thread that used it.
    """

    def __init__(
        self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
        bind: bool = False, replay_timeout_s: float = 1.0, context: zmq.Context | None = None,
    ) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.stats = SubscriberStats()
        self._ctx = context or zmq.Context.instance()
        self._next_seq: int | None = None
        self._replay: zmq.Socket | None = None
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        try:
            (self._sub.bind if bind else self._sub.connect)(endpoint)
            if replay_endpoint is not None:
                self._replay = self._replay_socket(replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise HalfmoonError(f"KV-event subscriber on {endpoint}: {exc}") from None

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the sockets (pending messages are dropped)."""
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def run(self, sink: Callable[[SubscriberItem], None], stop: threading.Event,
            poll_s: float = 0.1) -> None:  # fmt: skip
        """The subscriber thread's body: deliver every item to ``sink`` until ``stop``."""
        while not stop.is_set():
            for item in self.poll(poll_s):
                sink(item)

    def poll(self, timeout_s: float) -> list[SubscriberItem]:
        """Wait up to ``timeout_s`` for one message; the items it brings, in sequence
        order (a gap's replayed batches first). Malformed messages are logged, counted
        and dropped."""
        if not self._sub.poll(max(0, int(timeout_s * 1000))):
            return []
        frames = self._sub.recv_multipart()
        try:
            batch = decode_frames(frames)
        except KVEventError as exc:
            self.stats.num_malformed += 1
            log.warning("dropped a KV-event message from %s: %s", self.endpoint, exc)
            return []
        if batch.topic != self.topic:
            self.stats.num_other_topic += 1
            return []
        return self._in_order(batch)

    def _in_order(self, batch: VllmEventBatch) -> list[SubscriberItem]:
        items: list[SubscriberItem] = []
        expected = 0 if self._next_seq is None else self._next_seq
        if batch.seq < expected:
            self.stats.num_restarts += 1
            items.append(PublisherRestarted(last_seq=expected - 1, seq=batch.seq))
            expected = 0
        if batch.seq > expected:
            items.extend(self._fill(expected, batch.seq))
        items.append(batch)
        self._next_seq = batch.seq + 1
        self.stats.num_batches += sum(isinstance(i, VllmEventBatch) for i in items)
        return items

    def _fill(self, start: int, stop: int) -> list[VllmEventBatch]:
        """Batches ``start..stop-1`` from the replay socket, as many as it still has."""
        self.stats.num_gaps += 1
        got = self._replayed(start, stop) if self._replay is not None else []
        self.stats.num_replayed_batches += len(got)
        self.stats.num_missed_batches += stop - start - len(got)
        if len(got) < stop - start:
            log.warning("KV events %d..%d from %s: %d missed", start, stop - 1,
                        self.endpoint, stop - start - len(got))  # fmt: skip
        return got

    def _replayed(self, start: int, stop: int) -> list[VllmEventBatch]:
        assert self._replay is not None and self.replay_endpoint is not None
        self._replay.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
        deadline = time.monotonic() + self.replay_timeout_s
        got: list[VllmEventBatch] = []
        while (left_s := deadline - time.monotonic()) > 0 and self._replay.poll(
            max(1, int(left_s * 1000))
        ):
            frames = self._replay.recv_multipart()
            if len(frames) != 4 or frames[0] != b"":
                self.stats.num_malformed += 1
                continue
            if frames[2] == END_SEQ:
                return got
            try:
                batch = decode_frames(frames[1:])
            except KVEventError:
                self.stats.num_malformed += 1
                continue
            if start <= batch.seq < stop and (not got or batch.seq > got[-1].seq):
                got.append(batch)
        # No end marker in time: a fresh socket, so late replies cannot answer the next ask.
        self.stats.num_replay_timeouts += 1
        self._replay.close(linger=0)
        self._replay = self._replay_socket(self.replay_endpoint)
        return got

    def _replay_socket(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

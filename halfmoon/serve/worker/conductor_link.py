"""A worker's link to the Conductor: its identity, its registration (refused when it
disagrees with the cluster), the events it streams (cache events, request lifecycle,
load reports) and the heartbeat that keeps it placed while a long step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.events import BlockStored, CacheEvent
from halfmoon.serve.control import messages
from halfmoon.serve.control.messages import (
    HeldBlocks,
    Refused,
    Registered,
    WeightsRecord,
    decode_message,
    encode_message,
    event_entry,
    to_wire,
)
from halfmoon.serve.control.protocol import ProtocolError, hashes_to_wire

log = logging.getLogger(__name__)
#: Events kept for a Conductor that stopped reading (a freeze); the oldest "load"
#: reports go first, then the oldest events.
MAX_PENDING_EVENTS = 100_000


class RegistrationRefused(HalfmoonError):
    """The Conductor refused this worker: it disagrees with the cluster (block size, model
    or dtype). The worker cannot serve; the message names the mismatch."""


@dataclass
class WorkerIdentity:
    """Who this worker is and where it listens."""

    role: str
    instance_id: str
    command_endpoint: str
    transfer_endpoint: str = ""


class Heartbeat:
    """Beats to the Conductor every ``interval_s`` from a thread and socket of its own,
    so a long engine step never looks like a dead worker. When the Conductor does not
    know this instance (it restarted), ``register_again`` is set for the main loop; when
    it drains this instance (scale-down), ``drain`` is."""

    def __init__(self, endpoint: str, secret: bytes, instance_id: str, interval_s: float = 0.25):
        self.register_again = threading.Event()
        self.drain = threading.Event()
        self._stop = threading.Event()
        self._args = (endpoint, secret, instance_id, interval_s)
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        endpoint, secret, instance_id, interval_s = self._args
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Beats are not queued while the Conductor is away: a restarted Conductor would
        # get a backlog of them at once and answer each with register_again.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(endpoint)
        beat = encode_message(messages.Heartbeat(instance_id=instance_id), secret)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(zmq.Again):  # no connection now: skip this beat
                    sock.send_multipart(beat, flags=zmq.NOBLOCK)
                if sock.poll(int(interval_s * 1000)):
                    try:
                        reply = decode_message(sock.recv_multipart(), secret)
                    except ProtocolError as exc:
                        log.warning("heartbeat answer dropped: %s", exc)
                        continue
                    if isinstance(reply, messages.RegisterAgain):
                        self.register_again.set()
                        self._stop.wait(1.0)  # give the main loop time to register
                        while sock.poll(0):  # answers to beats sent before it registered
                            sock.recv_multipart()
                    elif isinstance(reply, messages.Drain):
                        self.drain.set()
        finally:
            sock.close(0)

    def close(self) -> None:
        """Stop beating."""
        self._stop.set()
        self._thread.join(2)


class ConductorLink:
    """Registers with the Conductor and streams events to it (fire and forget). Any
    thread may queue events (a store's events come on the transfer threads that serve
    peers' pulls); the loop thread sends them."""

    def __init__(self, endpoint: str, secret: bytes, me: WorkerIdentity) -> None:
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._secret = secret
        self._me = me
        self._pending: list[messages.Event] = []
        self._pending_lock = threading.Lock()
        self._registration: messages.Register | None = None
        #: Tells this process apart from an earlier one with the same instance id.
        self.incarnation = f"{os.getpid()}-{time.time_ns()}"
        #: The cluster's TBT SLO, as the Conductor said when it accepted this worker (0
        #: until then); a decode worker's TBT guard holds its steps to it.
        self.tbt_slo_s = 0.0
        #: Called with the LoRA adapters loaded while the cluster serves, each time the
        #: Conductor accepts this worker (the worker loads those it lacks).
        self.on_adapters: Callable[[list[RuntimeAdapter]], None] | None = None
        #: Called with the weights installed while the cluster serves (None: those it
        #: started with), each time the Conductor accepts this worker (it installs them
        #: unless it has; HalfmoonError when it cannot, and the registration fails).
        self.on_weights: Callable[[WeightsRecord | None], None] | None = None

    def register(
        self,
        kv_capacity_tokens: int,
        kv_bytes_per_token: int = 0,
        profile: dict[str, Any] | None = None,
        timeout_s: float = 60.0,
        hidden_bytes_per_token: int = 0,
        block_size: int | None = None,
        model: str | None = None,
        dtype: str | None = None,
        kv_compression: str | None = None,
    ) -> None:
        """Announce this worker (with its measured cost profile and what the cluster must
        agree on: block size, model identity, dtype, KV compression); retries until the Conductor answers.
        Raises :class:`RegistrationRefused` when the Conductor refuses it."""
        msg = messages.Register(
            msg_id=0, instance_id=self._me.instance_id, role=self._me.role,
            command_endpoint=self._me.command_endpoint,
            transfer_endpoint=self._me.transfer_endpoint,
            kv_capacity_tokens=kv_capacity_tokens, kv_bytes_per_token=kv_bytes_per_token,
            profile=profile, incarnation=self.incarnation,
            hidden_bytes_per_token=hidden_bytes_per_token, block_size=block_size, model=model,
            dtype=dtype, kv_compression=kv_compression,
        )  # fmt: skip
        self._registration = msg
        self._send_registration(msg, timeout_s)

    def mark_draining(self) -> None:
        """From now on, registering again says this worker drains (stays out of placement)."""
        if self._registration is not None:
            self._registration = dataclasses.replace(self._registration, draining=True)

    def register_again(
        self, blocks: list[HeldBlocks], adapters: Sequence[RuntimeAdapter] = (),
        timeout_s: float = 60.0, weights: WeightsRecord | None = None,
    ) -> None:  # fmt: skip
        """Register anew (the Conductor restarted), announcing the blocks held (a role's
        snapshot), the LoRA adapters loaded and the weights installed while serving."""
        assert self._registration is not None, "register() first"
        registration = dataclasses.replace(
            self._registration, blocks=list(blocks),
            adapters=[messages.AdapterRecord.of(a) for a in adapters], weights=weights,
        )  # fmt: skip
        self._send_registration(registration, timeout_s)

    def _send_registration(self, msg: messages.Register, timeout_s: float) -> None:
        frames = encode_message(msg, self._secret)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(zmq.Again):  # queue full: the poll below waits
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            if self._sock.poll(1000):
                reply = decode_message(self._sock.recv_multipart(), self._secret)
                if isinstance(reply, Registered):
                    self.tbt_slo_s = reply.tbt_slo_s
                    if self.on_adapters is not None and reply.adapters:
                        self.on_adapters([r.adapter() for r in reply.adapters])
                    if self.on_weights is not None:
                        try:
                            self.on_weights(reply.weights)
                        except HalfmoonError as exc:
                            raise RegistrationRefused(
                                f"the cluster's weights cannot be installed here: {exc}"
                            ) from None
                    return
                if isinstance(reply, Refused):
                    raise RegistrationRefused(f"the Conductor refused this worker: {reply.error}")
                raise ProtocolError(f"conductor refused registration: {reply}")
        raise TimeoutError(f"no answer from the conductor within {timeout_s:.0f}s")

    def event(self, kind: str, **fields: Any) -> None:
        """Queue one event (``stored`` / ``evicted``: hashes, tier; a lifecycle kind:
        request_id; ``load``: the counters); :meth:`flush` sends the batch. A kind or field
        the events message does not have raises ProtocolError here, at its source."""
        entry = event_entry(kind, **fields)
        to_wire(messages.Events(instance_id="", events=[entry]))  # checks its field types
        with self._pending_lock:
            self._pending.append(entry)

    def cache_event(self, event: CacheEvent) -> None:
        """Queue a cache event of this worker's pool or store (this worker's id is the
        message's)."""
        kind = "stored" if isinstance(event, BlockStored) else "evicted"
        self.event(kind, hashes=hashes_to_wire([event.block_hash]), tier=event.tier)

    def flush(self) -> None:
        """Send queued events as one message; never blocks. While the Conductor is not
        reading (frozen, its queue full) they stay queued for the next flush, bounded by
        ``MAX_PENDING_EVENTS``."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        msg = messages.Events(instance_id=self._me.instance_id, events=pending)
        try:
            self._sock.send_multipart(encode_message(msg, self._secret), flags=zmq.NOBLOCK)
        except zmq.Again:
            with self._pending_lock:  # back in front of what came meanwhile
                pending += self._pending
                if len(pending) > MAX_PENDING_EVENTS:
                    kept = [e for e in pending if e.kind != "load"]
                    pending = kept[-MAX_PENDING_EVENTS:]
                self._pending = pending

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)

"""A worker process: one engine, a command socket, and a link to the Conductor.

Single-threaded loop: drain commands, run one engine step, hand the outputs to the role::

    while not stopped:
        handle every command waiting on the ROUTER socket (no wait while the engine is busy)
        outputs = engine.step()
        role.on_outputs(outputs)      # stream tokens, hand KV over, report events
        role.on_failure(failure)      # for each request the engine dropped
        role.tick()                   # expire what waited too long

Roles (:mod:`halfmoon.serve.worker.prefill`): ``coupled`` does prefill and decode (the vLLM-like
baseline); ``prefill`` and ``decode`` split the work and hand the KV over layer by layer.

Every command is decoded into its typed message (:mod:`halfmoon.serve.control.messages`)
before anything handles it: a malformed one is logged and answered with an ``error``
(unless it is one), never handled.
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
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.errors import HalfmoonError, Unsupported
from halfmoon.core.events import BlockStored, CacheEvent
from halfmoon.core.profiling import ProfileSession, parse_profiler_config
from halfmoon.costmodel.speculation import RecentSpeculation
from halfmoon.serve.control import messages
from halfmoon.serve.control.messages import (
    Abort,
    AdaptersOk,
    AdapterUpdate,
    CacheReset,
    Error,
    HeldBlocks,
    MalformedMessage,
    Message,
    MetricsQuery,
    MetricsText,
    Ping,
    Profile,
    ProfileState,
    Refused,
    Registered,
    ResetPrefixCache,
    Sleep,
    SleepState,
    UpdateWeights,
    WeightsOk,
    WeightsRecord,
    WorkerPong,
    decode_message,
    encode_message,
    event_entry,
    to_wire,
)
from halfmoon.serve.control.protocol import ProtocolError, hashes_to_wire
from halfmoon.serve.runtime import RateLimitedLog, bind_router
from halfmoon.serve.worker.metrics import WorkerMetrics

if TYPE_CHECKING:
    from halfmoon.engine.connector import EngineConnector, RequestFailure, RequestOutput
    from halfmoon.store import StoreStats, TieredStore
    from halfmoon.transfer.store_service import EncodedBlocks

log = logging.getLogger(__name__)
#: Longest a role's ``tick()`` blocks on what it awaits (a stream's end, a pull) while the
#: engine has nothing to do: it wakes the moment that arrives, not a poll later.
IDLE_WAIT_S = 0.005
LOAD_REPORT_INTERVAL_S = 0.5
#: A draining worker exits after this long with nothing to do: a request the Conductor
#: placed just before the drain may still be on its way from the gateway.
DRAIN_QUIET_S = 1.0
#: Commands handled between two engine steps, at most.
COMMANDS_PER_STEP = 256
#: Messages queued for a peer worker that stopped reading before sends to it fail.
PEER_QUEUE_MESSAGES = 1000
#: Events kept for a Conductor that stopped reading (a freeze); the oldest "load"
#: reports go first, then the oldest events.
MAX_PENDING_EVENTS = 100_000

#: A role's command handler: the sender's identity and the decoded command.
Handler = Callable[[bytes, Any], None]


class RequestsRunning(HalfmoonError):
    """New weights cannot be installed yet, or the engine cannot sleep: requests are still
    running on this worker."""


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


class Role(Protocol):
    """What a worker does with commands and engine outputs."""

    def handlers(self) -> dict[str, Handler]: ...

    def on_outputs(self, outputs: list[RequestOutput]) -> None: ...

    def on_abort(self, request_id: str) -> None: ...

    def on_failure(self, failure: RequestFailure) -> None:
        """The engine dropped a request (it is gone from the engine): its client must
        hear of it, the Conductor that it finished."""
        ...

    def tick(self) -> None: ...

    def has_work(self) -> bool: ...

    def num_pending(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...

    def snapshot(self) -> list[HeldBlocks]: ...

    def close(self) -> None: ...


class Worker:
    """Runs an engine for the gateway and the Conductor."""

    def __init__(
        self,
        me: WorkerIdentity,
        engine: EngineConnector,
        secret: bytes,
        conductor: ConductorLink,
        bind_endpoint: str,
    ) -> None:
        self.me = me
        self.engine = engine
        self.secret = secret
        self.conductor = conductor
        self._ctx = zmq.Context.instance()
        self._sock = bind_router(bind_endpoint)
        self._rejections = RateLimitedLog(log)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, zmq.Socket] = {}
        #: The worker's own commands; the role's (its ``handlers()``) by wire name.
        self._own: dict[type[Message], Callable[[bytes, Any], None]] = {
            Ping: self._on_ping, Abort: self._on_abort, MetricsQuery: self._on_metrics,
            AdapterUpdate: self._on_adapter_update, ResetPrefixCache: self._on_reset_prefix_cache,
            UpdateWeights: self._on_update_weights, Sleep: self._on_sleep,
            Profile: self._on_profile,
        }  # fmt: skip
        self._handlers: dict[str, Handler] = {}
        self.role: Role | None = None
        #: The block store whose counters ride on the load reports (a prefill worker's).
        self.store: TieredStore | None = None
        #: How its KV streams are compressed on the wire (prefill and decode roles;
        #: ``halfmoon.engine.kvcodec``); None: raw.
        self.kv_codec: Any = None
        self._last_report_s = 0.0
        self._reported_prefill = 0  # queued prefill tokens in the last load report
        #: Its engine's recent speculation (rows and tokens per sequence-step), read at
        #: every load report; the decode guard's step estimates and the Conductor's use it.
        self.speculation = RecentSpeculation()
        #: LoRA adapters loaded while the cluster serves, by name (told to a restarted
        #: Conductor when this worker registers again).
        self.runtime_adapters: dict[str, RuntimeAdapter] = {}
        #: The weights installed while serving (None: those it started with; told to a
        #: restarted Conductor when this worker registers again).
        self.weights: WeightsRecord | None = None
        #: A weight update's ``stage``: the checkpoint's path and what the engine read.
        self._staged_weights: tuple[str, object] | None = None
        #: Compressed blocks its transfer server keeps for peers' pulls (a prefill worker
        #: with ``--kv-compression``): KV too, forgotten with the store's.
        self.encoded_blocks: EncodedBlocks | None = None
        #: The SSD namespace of the KV of the weights at a path (None: no SSD tier names
        #: its blocks' origin): set on the store when new weights are installed.
        self.ssd_namespace_of: Callable[[str], bytes] | None = None
        self.num_steps = 0
        #: Its Prometheus metrics (the roles feed the request clocks), sent when asked.
        self.metrics = WorkerMetrics()
        #: Commands taken off the socket (signed or not).
        self.num_handled = 0
        self.heartbeat: Heartbeat | None = None
        #: When the Conductor told this worker to drain, and since when it has been idle.
        self.draining_since_s: float | None = None
        self._idle_since_s: float | None = None

    def set_role(self, role: Role) -> None:
        """Install the role's command handlers."""
        self.role = role
        self._handlers.update(role.handlers())

    # -- loop --------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()``, or until drained (told to drain, then idle)."""
        assert self.role is not None, "set_role() first"
        while not stop() and not self.drained():
            busy = self.engine.has_unfinished_requests() or self.role.has_work()
            timeout_ms = 0 if busy else 20
            # At most a batch of commands between two steps: a flood (of junk, or of
            # real requests) slows the batch down but never stops it.
            for _ in range(COMMANDS_PER_STEP):
                if not self._sock.poll(timeout_ms):
                    break
                self._handle(self._sock.recv_multipart())
                timeout_ms = 0
            # Before the step: a prefill's start must reach the Conductor before its end
            # (the Conductor learns an instance's speed from the busy time between them).
            self.conductor.flush()
            if self.engine.has_unfinished_requests():
                started_s = time.monotonic()
                outputs = self.engine.step()
                step_s = time.monotonic() - started_s
                self.num_steps += 1
                waiting = self.engine.stats().num_waiting
                self.metrics.observe_step(started_s, step_s, outputs, waiting)
                self.role.on_outputs(outputs)
            for failure in self.engine.take_failures():
                self.metrics.request_failed(failure.retryable)
                self.role.on_failure(failure)
            self.role.tick()
            if self.heartbeat is not None and self.heartbeat.register_again.is_set():
                self.heartbeat.register_again.clear()
                log.info("the Conductor does not know this worker: registering again")
                self.conductor.register_again(
                    self.role.snapshot(),
                    list(self.runtime_adapters.values()),
                    weights=self.weights,
                )
            self._maybe_report()
            self.conductor.flush()

    def drained(self, now_s: float | None = None) -> bool:
        """Whether a drain was asked for and nothing has been left to do for
        ``DRAIN_QUIET_S``: no request in the engine or held by the role (a decode worker's
        awaited KV, a prefill worker's handoffs and pipeline stages)."""
        if self.heartbeat is None or not self.heartbeat.drain.is_set():
            return False
        now_s = time.monotonic() if now_s is None else now_s
        if self.draining_since_s is None:
            log.info("draining: finishing %d requests, then exiting",
                     self.engine.stats().num_running)  # fmt: skip
            self.draining_since_s = now_s
            self.conductor.mark_draining()
        assert self.role is not None
        busy = self.engine.has_unfinished_requests() or self.role.num_pending() > 0
        if busy:
            self._idle_since_s = None
            return False
        if self._idle_since_s is None:
            self._idle_since_s = now_s
        return now_s - self._idle_since_s >= DRAIN_QUIET_S

    def close(self) -> None:
        """Close sockets and the role's resources."""
        if self.heartbeat is not None:
            self.heartbeat.close()
        if self.role is not None:
            self.role.close()
        for sock in self._peers.values():
            sock.close(0)
        self._sock.close(0)
        self.conductor.close()
        self.engine.close()

    def _handle(self, frames: list[bytes]) -> None:
        self.num_handled += 1
        identity, rest = frames[0], frames[1:]
        try:
            msg = decode_message(rest, self.secret)
        except MalformedMessage as exc:  # signed: the sender's bug, which it hears of
            self._rejections.warning("refused a command: %s", exc)
            if exc.kind != "error":  # (a complaint is never answered)
                self._refuse(identity, exc.request_id, exc.msg_id, str(exc))
            return
        except ProtocolError as exc:
            self._rejections.warning("dropped a command: %s", exc)
            return
        if isinstance(msg, Error):  # a peer worker's complaint: never answer it
            log.warning("peer reported: %s", msg.error)
            return
        try:
            own = self._own.get(type(msg))
            if own is not None:
                own(identity, msg)
                return
            handler = self._handlers.get(msg.wire_name)
            if handler is None:
                raise ProtocolError(
                    f"unknown command {msg.wire_name!r} for a {self.me.role} worker"
                )
            handler(identity, msg)
        except Exception as exc:  # a bad command must not take the worker down
            log.warning("command %s failed: %s", msg.wire_name, exc)
            self._refuse(identity, getattr(msg, "request_id", None), msg.msg_id, str(exc),
                         unsupported=isinstance(exc, Unsupported))  # fmt: skip

    def _refuse(
        self, identity: bytes, rid: str | None, msg_id: int | None, error: str,
        unsupported: bool = False,
    ) -> None:  # fmt: skip
        """Drop what the role holds of the request, and tell the sender why
        (``unsupported``: this engine cannot do what it asks)."""
        if rid is not None and self.role is not None:
            self.role.on_abort(rid)
        self.send(identity, Error(error=error, request_id=rid, msg_id=msg_id,
                                  unsupported=unsupported))  # fmt: skip

    def send(self, identity: bytes, msg: Message) -> None:
        """Send one signed message to a peer of the ROUTER socket."""
        self._sock.send_multipart([identity, *encode_message(msg, self.secret)])

    def send_to(self, endpoint: str, msg: Message) -> None:
        """Send one signed message to another worker's command socket; never blocks.

        Raises ConnectionError when the peer is not connected or has stopped reading
        (its queue is full): the caller fails the request instead of waiting on it."""
        sock = self._peers.get(endpoint)
        if sock is None:
            sock = self._peers[endpoint] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, PEER_QUEUE_MESSAGES)
            sock.connect(endpoint)
        frames = encode_message(msg, self.secret)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ConnectionError(f"worker {endpoint} is not taking messages") from None

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        stats = self.engine.stats()
        try:
            self.engine.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = f"broken: {exc}"
        self.send(identity, WorkerPong(
            msg_id=msg.msg_id, instance_id=self.me.instance_id, role=self.me.role,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks, num_steps=self.num_steps,
            integrity=integrity, stats=self.role.stats() if self.role is not None else {},
        ))  # fmt: skip

    def _on_metrics(self, identity: bytes, msg: MetricsQuery) -> None:
        text = self.metrics.render(self.engine.stats())
        # An engine in a server of its own (vLLM) adds that server's metrics, as polled.
        text += getattr(self.engine, "metrics_text", "")
        self.send(identity, MetricsText(
            msg_id=msg.msg_id, instance_id=self.me.instance_id, role=self.me.role, text=text,
        ))  # fmt: skip

    def load_adapters(self, adapters: list[RuntimeAdapter]) -> None:
        """Load the cluster's adapters loaded while it serves, those not loaded here yet
        (at registration, before any request can name them); one that fails is logged
        (requests naming it fail here, with its reason)."""
        for adapter in adapters:
            if self.runtime_adapters.get(adapter.name) == adapter:
                continue  # registering again: loaded already
            try:
                self.engine.load_lora(adapter)
            except HalfmoonError as exc:
                log.warning("LoRA adapter %r not loaded: %s", adapter.name, exc)
                continue
            self.runtime_adapters[adapter.name] = adapter

    def _on_adapter_update(self, identity: bytes, msg: AdapterUpdate) -> None:
        """Load or unload a LoRA adapter in the engine (the gateway's
        ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``); ``error`` says why not."""
        try:
            if msg.op == "load":
                adapter = msg.adapter.adapter()
                self.engine.load_lora(adapter)
                self.runtime_adapters[adapter.name] = adapter
            else:
                self.engine.unload_lora(msg.adapter.name)
                self.runtime_adapters.pop(msg.adapter.name, None)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            if not isinstance(exc, HalfmoonError):
                log.exception("LoRA adapter %s of %r failed", msg.op, msg.adapter.name)
            self.send(identity, Error(error=f"{self.me.instance_id}: {exc}", msg_id=msg.msg_id))
            return
        self.send(identity, AdaptersOk(msg_id=msg.msg_id))

    def _on_reset_prefix_cache(self, identity: bytes, msg: ResetPrefixCache) -> None:
        """Forget the engine's cached prefixes and, with ``external``, the block store's
        (vLLM's ``/reset_prefix_cache``); ``cache_reset`` says whether all of it went.
        The evictions reach the Conductor as cache events."""
        reasons = []
        try:
            if not self.engine.reset_prefix_cache():
                reasons.append("running requests hold KV blocks of its pool")
            if msg.external and not self._clear_store():
                reasons.append("blocks of its store are being read")
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            if not isinstance(exc, HalfmoonError):
                log.exception("resetting the prefix cache failed")
            self.send(identity, Error(error=f"{self.me.instance_id}: {exc}", msg_id=msg.msg_id))
            return
        log.info("prefix cache reset%s%s", " (with the store)" if msg.external else "",
                 f": not all of it, {'; '.join(reasons)}" if reasons else "")  # fmt: skip
        self.send(identity, CacheReset(success=not reasons, reason="; ".join(reasons),
                                       msg_id=msg.msg_id))  # fmt: skip

    def _clear_store(self) -> bool:
        """Forget the block store's blocks and the encoded copies kept for pulls; False
        when some are being read (they stay)."""
        if self.encoded_blocks is not None:
            self.encoded_blocks.clear()
        return self.store is None or self.store.clear()

    def _on_update_weights(self, identity: bytes, msg: UpdateWeights) -> None:
        """One step of a weight update (SGLang's ``/update_weights_from_disk``):
        :meth:`update_weights`; ``error`` says why not."""
        try:
            self.update_weights(msg.op, msg.weights)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            # (retryable: requests still ending here, e.g. aborted ones whose KV streams
            # finish: the same commit succeeds once they have)
            self._answer_failure(identity, msg, exc, f"weight update {msg.op}")
            return
        self.send(identity, WeightsOk(weights=self.weights, msg_id=msg.msg_id))

    def _on_sleep(self, identity: bytes, msg: Sleep) -> None:
        """vLLM's sleep mode, level 1 (:meth:`LLMEngine.sleep`): ``sleep`` once no request
        is here (else a retryable ``error``: those ending, say an aborted one finishing its
        KV stream, soon will be), ``wake``; answered ``sleep_state``. The forgotten
        prefixes reach the Conductor as cache events; the block store keeps its blocks."""
        released = 0
        try:
            if msg.op == "wake":
                self.engine.wake_up()
            else:
                assert self.role is not None
                if self.engine.has_unfinished_requests() or self.role.num_pending():
                    raise RequestsRunning("requests are running here: the engine sleeps once "
                                          "none is (pause generation first)")  # fmt: skip
                released = self.engine.sleep()
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            self._answer_failure(identity, msg, exc, f"sleep mode {msg.op}")
            return
        self.send(identity, SleepState(sleeping=self.engine.sleeping, released_bytes=released,
                                       msg_id=msg.msg_id))  # fmt: skip

    def _on_profile(self, identity: bytes, msg: Profile) -> None:
        """vLLM's ``/start_profile`` and ``/stop_profile`` on this worker's engine
        (:meth:`EngineConnector.start_profile`); answered ``profile_state`` with the
        traces a ``stop`` wrote."""
        traces: list[str] = []
        try:
            if msg.op == "start":
                config = parse_profiler_config(msg.config)
                if config is None:
                    raise HalfmoonError("a profile start names no profiler config")
                session = ProfileSession(
                    profile_prefix=msg.prefix or None,
                    delay_iterations=None if msg.delay_iterations < 0 else msg.delay_iterations,
                    max_iterations=None if msg.max_iterations < 0 else msg.max_iterations,
                )  # fmt: skip
                self.engine.start_profile(config, session, self.me.instance_id)
            else:
                traces = self.engine.stop_profile()
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            self._answer_failure(identity, msg, exc, f"profile {msg.op}")
            return
        self.send(identity, ProfileState(active=msg.op == "start", traces=traces,
                                         msg_id=msg.msg_id))  # fmt: skip

    def _answer_failure(self, identity: bytes, msg: Message, exc: Exception, what: str) -> None:
        """Answer ``msg`` with an ``error`` naming ``exc`` (retryable while requests are
        still ending here, ``unsupported`` where the engine cannot); one that is not a
        HalfmoonError is logged with its traceback."""
        if not isinstance(exc, HalfmoonError):
            log.exception("%s failed", what)
        self.send(identity, Error(error=f"{self.me.instance_id}: {exc}", msg_id=msg.msg_id,
                                  retryable=isinstance(exc, RequestsRunning),
                                  unsupported=isinstance(exc, Unsupported)))  # fmt: skip

    def update_weights(self, op: str, weights: WeightsRecord | None) -> None:
        """``stage``: read the checkpoint at ``weights.path`` beside the served weights;
        ``commit``: install those staged (HalfmoonError while this worker has requests:
        their KV is of the old weights) and forget every block of KV computed with the old
        ones, the engine's cached prefixes and the block store's; ``drop``: forget staged
        weights."""
        if op == "drop":
            self._staged_weights = None
            return
        if weights is None or op not in ("stage", "commit"):
            raise HalfmoonError(f"a worker does not take update_weights {op!r}")
        if op == "stage":
            self._staged_weights = None  # (the memory of an earlier one freed first)
            self._staged_weights = (weights.path, self.engine.stage_weights(weights.path))
            log.info("weights of %s read (version %s), waiting to be installed",
                     weights.path, weights.version)  # fmt: skip
            return
        if self._staged_weights is None or self._staged_weights[0] != weights.path:
            raise HalfmoonError(f"no weights of {weights.path} are staged here")
        assert self.role is not None
        if self.engine.has_unfinished_requests() or self.role.num_pending():
            raise RequestsRunning("requests are running here: new weights are installed once "
                                  "none is (pause generation first)")  # fmt: skip
        # The store first (nothing installed when it cannot be), then the engine, whose
        # reset demotes nothing; the store again for a block stored meanwhile.
        namespace = None if self.ssd_namespace_of is None else self.ssd_namespace_of(weights.path)
        if not self._clear_store():
            raise HalfmoonError("blocks of its store are being read: try again")
        self.engine.commit_weights(self._staged_weights[1])
        self._staged_weights = None
        self.weights = weights
        if not self._clear_store():
            log.warning("blocks of the store stored while the weights were installed are "
                        "being read: they stay until evicted")  # fmt: skip
        elif self.store is not None and namespace is not None:
            # (blocks on SSD from now on are of these weights: a restart on the old ones
            # does not serve them)
            self.store.set_ssd_namespace(namespace)
        log.info("weights of %s installed (version %s): cached KV forgotten", weights.path,
                 weights.version)  # fmt: skip

    def install_cluster_weights(self, weights: WeightsRecord | None) -> None:
        """Install the weights the cluster serves since an update (given as the Conductor
        accepts this worker), unless installed already; HalfmoonError when they cannot
        be (this worker must not serve other weights than the cluster's)."""
        if weights is None or weights == self.weights:
            return
        if not weights.path:  # a version label given to the weights it started with
            self.weights = weights
            return
        log.info("the cluster serves the weights of %s (version %s): installing them",
                 weights.path, weights.version)  # fmt: skip
        self.update_weights("stage", weights)
        self.update_weights("commit", weights)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        assert self.role is not None
        self.role.on_abort(msg.request_id)

    def _maybe_report(self) -> None:
        """A load report every ``LOAD_REPORT_INTERVAL_S``, and at once when the prefill
        queue the last one named has emptied: the Conductor drains a reported queue only
        at a second of work per second, so a report left standing after its work ended
        would steer requests away from an idle instance."""
        now = time.monotonic()
        due = now - self._last_report_s >= LOAD_REPORT_INTERVAL_S
        if not due and not self._reported_prefill:
            return
        stats = self.engine.stats()
        if not due and stats.num_prefill_tokens:
            return
        self._last_report_s = now
        self._reported_prefill = stats.num_prefill_tokens
        block = self.engine.config.block_size
        used_blocks = stats.num_blocks - stats.num_free_blocks
        extra: dict[str, Any] = {}
        if self.store is not None:
            extra["store"] = store_counters(self.store.stats())
        if (spec := stats.spec_decode) is not None:
            self.speculation.update(
                spec.num_sequence_steps, spec.num_draft_tokens, spec.num_accepted_tokens
            )
            rates = self.speculation.rates
            extra |= {"spec_rows_per_seq": rates.rows_per_seq,
                      "spec_tokens_per_step": rates.tokens_per_step}  # fmt: skip
        self.conductor.event(
            "load", num_running=stats.num_running, context_tokens=used_blocks * block,
            kv_used_tokens=used_blocks * block, kv_capacity_tokens=stats.num_blocks * block,
            num_waiting=stats.num_waiting, queued_prefill_tokens=stats.num_prefill_tokens,
            **extra,
        )  # fmt: skip


def store_counters(stats: StoreStats) -> dict[str, int]:
    """The store counters a load report carries to the Conductor (for its cluster page;
    ``/metrics`` reads the store itself: :mod:`halfmoon.serve.worker.metrics`)."""
    figures = {"corrupt": stats.num_corrupt, "misses": stats.num_misses}
    for tier, t in (("dram", stats.dram), ("ssd", stats.ssd)):
        figures |= {
            f"{tier}_hits": t.num_hits, f"{tier}_blocks": t.num_blocks,
            f"{tier}_capacity_blocks": t.capacity_blocks, f"{tier}_evictions": t.num_evictions,
        }  # fmt: skip
    return figures

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
(unless it is one), never handled. The worker's link to the Conductor (registration,
events, heartbeat) is :mod:`halfmoon.serve.worker.conductor_link`; the commands that
change its engine while the cluster serves (adapters, prefix-cache reset, weights, sleep,
profiler) are :mod:`halfmoon.serve.worker.controls`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.errors import Unsupported
from halfmoon.costmodel.speculation import RecentSpeculation
from halfmoon.serve.control.messages import (
    Abort,
    Error,
    HeldBlocks,
    MalformedMessage,
    Message,
    MetricsQuery,
    MetricsText,
    Ping,
    WeightsRecord,
    WorkerPong,
    decode_message,
    encode_message,
)
from halfmoon.serve.control.protocol import ProtocolError
from halfmoon.serve.runtime import RateLimitedLog, bind_router
from halfmoon.serve.worker.conductor_link import ConductorLink, Heartbeat, WorkerIdentity
from halfmoon.serve.worker.controls import ClusterControls
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

#: A role's command handler: the sender's identity and the decoded command.
Handler = Callable[[bytes, Any], None]


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


class Worker(ClusterControls):
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
            **self.control_handlers(),
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

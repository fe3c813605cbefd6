"""A worker process: one engine, a command socket, and a link to the Conductor.

Single-threaded loop: drain commands, run one engine step, send what it produced::

    while not stopped:
        handle every command waiting on the ROUTER socket (no wait while the engine is busy)
        outputs = engine.step()
        stream new tokens to the gateway that asked; report lifecycle events

Roles: ``coupled`` does prefill and decode (the vLLM-like baseline); ``prefill`` and
``decode`` split the work and hand the KV over (see :mod:`halfmoon.serve.handoff`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from halfmoon.core.hashing import hash_blocks
from halfmoon.serve.protocol import ProtocolError, decode, encode, hashes_to_wire
from halfmoon.serve.wire import params_from_wire

log = logging.getLogger(__name__)
LOAD_REPORT_INTERVAL_S = 0.5


@dataclass
class WorkerIdentity:
    """Who this worker is and where it listens."""

    role: str
    instance_id: str
    command_endpoint: str
    transfer_endpoint: str = ""


@dataclass
class _Client:
    identity: bytes
    prompt_token_ids: list[int]
    first_sent: bool = False


class ConductorLink:
    """Registers with the Conductor and streams events to it (fire and forget)."""

    def __init__(self, endpoint: str, secret: bytes, me: WorkerIdentity) -> None:
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._secret = secret
        self._me = me
        self._pending: list[dict[str, Any]] = []

    def register(self, kv_capacity_tokens: int, timeout_s: float = 60.0) -> None:
        """Announce this worker; retries until the Conductor answers."""
        deadline = time.monotonic() + timeout_s
        msg = {
            "type": "register", "msg_id": 0, "instance_id": self._me.instance_id,
            "role": self._me.role, "command_endpoint": self._me.command_endpoint,
            "transfer_endpoint": self._me.transfer_endpoint,
            "kv_capacity_tokens": kv_capacity_tokens,
        }  # fmt: skip
        while time.monotonic() < deadline:
            self._sock.send_multipart(encode(msg, self._secret))
            if self._sock.poll(1000):
                reply = decode(self._sock.recv_multipart(), self._secret)
                if reply.get("type") == "registered":
                    return
                raise ProtocolError(f"conductor refused registration: {reply}")
        raise TimeoutError(f"no answer from the conductor within {timeout_s:.0f}s")

    def event(self, kind: str, **fields: Any) -> None:
        """Queue one event; :meth:`flush` sends the batch."""
        self._pending.append({"kind": kind, **fields})

    def flush(self) -> None:
        """Send queued events as one message."""
        if not self._pending:
            return
        msg = {"type": "events", "instance_id": self._me.instance_id, "events": self._pending}
        self._sock.send_multipart(encode(msg, self._secret))
        self._pending = []

    def close(self) -> None:
        """Close the socket."""
        self._sock.close(0)


class Worker:
    """Runs an engine for the gateway and the Conductor."""

    def __init__(
        self,
        me: WorkerIdentity,
        engine: Any,
        secret: bytes,
        conductor: ConductorLink,
        bind_endpoint: str,
    ) -> None:
        self.me = me
        self.engine = engine
        self.secret = secret
        self.conductor = conductor
        self.block_size = engine.config.block_size
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind_endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._clients: dict[str, _Client] = {}
        self._handlers: dict[str, Callable[[bytes, dict[str, Any]], None]] = {
            "generate": self._on_generate,
            "abort": self._on_abort,
            "ping": self._on_ping,
        }
        self._last_report_s = 0.0
        self.num_steps = 0

    # -- loop --------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        """Serve until ``stop()``."""
        while not stop():
            busy = self.engine.has_unfinished_requests()
            timeout_ms = 0 if busy else 50
            while self._sock.poll(timeout_ms):
                self._handle(self._sock.recv_multipart())
                timeout_ms = 0
            if self.engine.has_unfinished_requests():
                self._emit(self.engine.step())
                self.num_steps += 1
            self._maybe_report()
            self.conductor.flush()

    def close(self) -> None:
        """Close sockets."""
        self._sock.close(0)
        self.conductor.close()

    def _handle(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        try:
            msg = decode(rest, self.secret)
        except ProtocolError as exc:
            log.warning("dropped a command: %s", exc)
            return
        handler = self._handlers.get(msg["type"])
        try:
            if handler is None:
                raise ProtocolError(f"unknown command {msg['type']!r} for a {self.me.role} worker")
            handler(identity, msg)
        except Exception as exc:  # a bad command must not take the worker down
            log.warning("command %s failed: %s", msg.get("type"), exc)
            rid = msg.get("request_id")
            if rid is not None:
                self._clients.pop(str(rid), None)
            self.send(identity, {"type": "error", "request_id": rid, "error": str(exc)})

    def send(self, identity: bytes, msg: dict[str, Any]) -> None:
        """Send one signed message to a peer of the ROUTER socket."""
        self._sock.send_multipart([identity, *encode(msg, self.secret)])

    # -- commands ------------------------------------------------------------------------------
    def _on_generate(self, identity: bytes, msg: dict[str, Any]) -> None:
        rid = str(msg["request_id"])
        token_ids = [int(t) for t in msg["token_ids"]]
        self.engine.add_request(rid, token_ids, params_from_wire(msg["params"]))
        self._clients[rid] = _Client(identity, token_ids)
        self.conductor.event("prefill_started", request_id=rid)

    def _on_abort(self, identity: bytes, msg: dict[str, Any]) -> None:
        rid = str(msg["request_id"])
        if self._clients.pop(rid, None) is not None or self.engine.abort_request(rid):
            self.engine.abort_request(rid)
            self.conductor.event("request_finished", request_id=rid)

    def _on_ping(self, identity: bytes, msg: dict[str, Any]) -> None:
        stats = self.engine.stats()
        self.send(identity, {
            "type": "pong", "msg_id": msg.get("msg_id"), "instance_id": self.me.instance_id,
            "role": self.me.role, "num_running": stats.num_running,
            "num_waiting": stats.num_waiting, "num_free_blocks": stats.num_free_blocks,
            "num_steps": self.num_steps,
        })  # fmt: skip

    # -- outputs -------------------------------------------------------------------------------
    def _emit(self, outputs: list[Any]) -> None:
        for out in outputs:
            client = self._clients.get(out.request_id)
            if client is None:
                continue
            msg: dict[str, Any] = {
                "type": "tokens", "request_id": out.request_id,
                "token_ids": list(out.new_token_ids), "finish_reason": out.finish_reason,
            }  # fmt: skip
            if not client.first_sent:
                msg["cached_tokens"] = out.num_cached_tokens
                client.first_sent = True
                self._report_prefill_done(out.request_id, client.prompt_token_ids)
            self.send(client.identity, msg)
            if out.finished:
                del self._clients[out.request_id]
                self.conductor.event("request_finished", request_id=out.request_id)

    def _report_prefill_done(self, rid: str, prompt_token_ids: list[int]) -> None:
        self.conductor.event("prefill_finished", request_id=rid)
        self.conductor.event("decode_started", request_id=rid)
        full = hash_blocks(prompt_token_ids, self.block_size).full
        if full:
            self.conductor.event("stored", hashes=hashes_to_wire(full), tier="dram")

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if now - self._last_report_s < LOAD_REPORT_INTERVAL_S:
            return
        self._last_report_s = now
        stats = self.engine.stats()
        used_blocks = stats.num_blocks - stats.num_free_blocks
        self.conductor.event(
            "load", num_running=stats.num_running, context_tokens=used_blocks * self.block_size,
            kv_used_tokens=used_blocks * self.block_size,
            kv_capacity_tokens=stats.num_blocks * self.block_size,
        )  # fmt: skip

"""Limits the gateway enforces on HTTP connections and requests before any route sees them.

- :class:`BodyLimit` (ASGI middleware): a declared ``Content-Length`` over the limit is
  refused before anything is read; any other body (``Transfer-Encoding: chunked``
  included) is counted while it arrives and refused the moment it passes the limit, so a
  client can never make the gateway hold, parse or tokenize more than ``max_bytes``. A
  body that takes longer than ``body_timeout_s`` to arrive gets a 408.
- :func:`server_config` (uvicorn): a connection that has not sent a whole request head
  within ``header_timeout_s`` — a new one, or a kept-alive one between requests — is
  closed (uvicorn alone keeps a silent new connection forever); idle keep-alive
  connections close after ``keep_alive_s``; beyond ``max_connections`` new requests get
  a 503 with a JSON body and ``Retry-After`` (:func:`busy_app`), sent once their body
  has been read, so that a client still sending one sees the answer, not a reset.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from halfmoon.serve.gateway.errors import error_payload
from halfmoon.serve.gateway.exposure import TlsOptions
from halfmoon.serve.gateway.openai_api import error_body

ASGIApp = Any


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with a 413 (OpenAI-shaped, or Anthropic's
    on its Messages API), whatever their
    framing; smaller bodies are read once and handed to ``app`` unchanged."""

    def __init__(self, app: ASGIApp, max_bytes: int, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, path=scope.get("path"))
            return
        chunks: list[bytes] = []
        total = 0
        deadline_s = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                left_s = deadline_s - asyncio.get_running_loop().time()
                message = await asyncio.wait_for(receive(), max(0.0, left_s))
            except TimeoutError:
                await self._refuse(send, 408, f"request body not received within "
                                              f"{self.body_timeout_s:g}s", scope.get("path"))  # fmt: skip
                return
            if message["type"] != "http.request":  # the client went away mid-body
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await self._refuse(send, path=scope.get("path"))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:  # the body once, then the client's own events (disconnects)
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(
        self, send: Any, status: int = 413, message: str = "", path: str | None = None
    ) -> None:
        message = message or f"request body over {self.max_bytes} bytes"
        payload = json.dumps(error_payload(status, message, "BadRequestError", path=path)).encode()
        await send({
            "type": "http.response.start", "status": status,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                        (b"connection", b"close")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": payload})


@dataclass(frozen=True)
class ConnectionLimits:
    """How long and how many HTTP connections the gateway keeps (see the module doc)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    #: Longer than the 5 s httpx (the OpenAI SDK's client) keeps an idle connection, so a
    #: client drops it before the gateway closes it: with both at 5 s, a pool reusing a
    #: connection just as the server closed it saw a ReadError (docs/reliability.md).
    keep_alive_s: int = 10
    max_connections: int = 2048
    #: A request refused beyond ``max_connections`` is read up to this much first.
    busy_drain_bytes: int = 4 * 1024 * 1024


def busy_app(drain_bytes: int, drain_timeout_s: float) -> ASGIApp:
    """What a request gets beyond the connection limit: its body is read and dropped (up to
    ``drain_bytes``, for at most ``drain_timeout_s``), then a 503 with an OpenAI-shaped JSON
    body, ``Retry-After: 1`` and ``Connection: close``.

    Reading first matters: a socket closed with unread data makes the kernel send a reset,
    and a client still sending its body then sees the connection die instead of the 503
    (uvicorn's own 503 is sent unread, as plain text: a 3 MB request got a reset)."""
    payload = json.dumps(
        error_body("server busy: too many connections", "ServiceUnavailable", 503)
    ).encode()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + drain_timeout_s
        num_bytes = 0
        while num_bytes <= drain_bytes:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline_s - loop.time()))
            except TimeoutError:
                break
            if message["type"] != "http.request":
                return  # the client went away
            num_bytes += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send({
            "type": "http.response.start", "status": 503,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                        (b"retry-after", b"1"), (b"connection", b"close")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": payload})

    return app


def guarded_protocol(header_timeout_s: float, limits: ConnectionLimits | None = None) -> type:
    """uvicorn's h11 protocol, closing a connection that sends no whole request head within
    ``header_timeout_s`` (the timer runs whenever no request is in progress). With
    ``limits``, a request that starts while ``max_connections`` connections are open or
    requests run is answered by :func:`busy_app` (the check uvicorn's ``limit_concurrency``
    makes, with a readable answer)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = None if limits is None else busy_app(limits.busy_drain_bytes, limits.body_timeout_s)

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _own_app: ASGIApp = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None and self._between_requests():
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._arm()  # a kept-alive connection starting its next request head
            if busy is not None and self._between_requests():
                self._choose_app()  # a request may start in this data
            super().data_received(data)
            if self._head_timer is not None and not self._between_requests():
                self._head_timer.cancel()  # the head is complete: the request runs
                self._head_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _choose_app(self) -> None:
            """The app of the request that starts next: ours, or the 503 when busy."""
            if self._own_app is None:
                self._own_app = self.app
            assert limits is not None
            cap = limits.max_connections
            over = len(self.connections) >= cap or len(self.tasks) >= cap
            self.app = busy if over else self._own_app

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol


def server_config(
    app: ASGIApp, host: str, port: int, limits: ConnectionLimits, tls: TlsOptions | None = None,
    log_level: str = "warning", root_path: str = "",
) -> Any:  # fmt: skip
    """The uvicorn configuration of a gateway serving ``app`` with ``limits``, over HTTPS
    with ``tls``; ``log_level``: uvicorn's own; ``root_path``: the prefix a proxy serves
    the app under."""
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="off", root_path=root_path,
        http=guarded_protocol(limits.header_timeout_s, limits),
        timeout_keep_alive=limits.keep_alive_s,
        **(tls.uvicorn_settings() if tls is not None else {}),
    )  # fmt: skip

"""Limits the gateway enforces on HTTP requests before any route sees them.

:class:`BodyLimit` is plain ASGI middleware: a declared ``Content-Length`` over the limit
is refused before anything is read, and any other body (``Transfer-Encoding: chunked``
included) is counted while it arrives and refused the moment it passes the limit, so a
client can never make the gateway hold, parse or tokenize more than ``max_bytes``.
"""

from __future__ import annotations

import json
from typing import Any

from halfmoon.serve.openai_api import error_body

ASGIApp = Any


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with an OpenAI-shaped 413, whatever their
    framing; smaller bodies are read once and handed to ``app`` unchanged."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away mid-body
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await self._refuse(send)
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

    async def _refuse(self, send: Any) -> None:
        message = f"request body over {self.max_bytes} bytes"
        payload = json.dumps(error_body(message, "BadRequestError", 413)).encode()
        await send({
            "type": "http.response.start", "status": 413,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                        (b"connection", b"close")],
        })  # fmt: skip
        await send({"type": "http.response.body", "body": payload})

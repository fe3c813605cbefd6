"""Request ids a client chooses, as vLLM takes them: the ``X-Request-Id`` header, or a
completion or chat request's ``request_id`` field (the header wins).

A generation answered under a client's id shows it in the response (``cmpl-<id>``,
``chatcmpl-<id>``) and on its access-log line; inside the cluster the request keeps an id
of the gateway's own, so two clients that pick the same id never meet (vLLM, too, makes
its internal ids unique). With ``halfmoon serve --enable-request-id-headers`` every
response carries ``X-Request-Id``: the client's, else the generation's response id, else
(a request that started none: a health check, a 401) a fresh random one.

Ids are kept to printable ASCII of at most :data:`MAX_ID_CHARS` characters (a longer or
odder one is a 400), so that a response id or a log line cannot be made arbitrarily long
or carry control characters.
"""

from __future__ import annotations

import uuid
from typing import Any

from halfmoon.serve.gateway.responses import HTTPError

#: The longest request id a client may choose.
MAX_ID_CHARS = 256
#: The header, as vLLM names it.
HEADER = "X-Request-Id"
_STATE_KEY = "halfmoon_request_id"

Scope = dict[str, Any]


def _problem(value: str) -> str | None:
    """What is wrong with ``value`` as a request id (None: nothing)."""
    if not 0 < len(value) <= MAX_ID_CHARS:
        return f"must have 1 to {MAX_ID_CHARS} characters"
    if not (value.isascii() and value.isprintable()):
        return "must be printable ASCII"
    return None


def client_request_id(header: str | None, field: str | None) -> str | None:
    """The id the client chose (``header`` before the body's ``field``), checked; None
    when it chose none. A 400 names the problem."""
    for value, where, param in ((header, f"the {HEADER} header", None),
                                (field, "request_id", "request_id")):  # fmt: skip
        if value is None:
            continue
        if (problem := _problem(value)) is not None:
            raise HTTPError(400, f"{where} {problem}", "BadRequestError", param=param)
        return value
    return None


def note_response_id(scope: Scope, response_id: str) -> None:
    """Remember the id a generation is answered under, for the response header."""
    scope.setdefault("state", {})[_STATE_KEY] = response_id


class RequestIdHeader:
    """ASGI middleware: every HTTP response carries ``X-Request-Id`` (see the module)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _header(scope)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                value = sent or scope.get("state", {}).get(_STATE_KEY) or uuid.uuid4().hex
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != b"x-request-id"]  # fmt: skip
                message = {**message, "headers": [*headers, (b"x-request-id", value.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _header(scope: Scope) -> str | None:
    """The request's ``X-Request-Id``, when it is one we would accept."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"x-request-id":
            text = value.decode("latin-1")  # (how HTTP headers arrive)
            return text if _problem(text) is None else None
    return None

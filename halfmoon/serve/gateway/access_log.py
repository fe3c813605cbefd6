"""One access-log line per HTTP request, as vLLM's server prints them, with the tokens.

::

    127.0.0.1:50412 "POST /v1/chat/completions" 200 prompt_tokens=12 completion_tokens=16 ttft=0.041s total=0.212s id=chatcmpl-5f1c09aa-7
    127.0.0.1:50413 "POST /v1/completions" 400 prompt_tokens=- completion_tokens=- ttft=- total=0.002s

:class:`AccessLog` is a plain ASGI middleware, outermost in the app, so it sees every
answer (a 401 of the key check, a 413 of the body limit, a 400 of validation, a 500 of
an unexpected exception) and the end of a streamed body: a stream is logged when its last
byte is sent, with its real totals. The gateway fills the token counts and the TTFT in
as each generation ends (:func:`note_generation`, called by ``Gateway._observe_end``);
a request with ``n`` choices reports its prompt once, the tokens of all its choices and
the earliest first token. A stream the client left early says ``(disconnected)``. A
generation's line ends with the id it was answered under, and the cluster's own id of it
when the client chose the id (``internal_id=``, the id the workers' logs name; see
halfmoon.serve.gateway.request_ids).

Lines go to the ``gateway.access`` logger: API calls (:data:`API_PREFIXES`: ``/v1/``,
``/tokenize``, SageMaker's, vLLM's and SGLang's generation routes, vLLM's ``/score`` and
``/rerank``, the control calls) and
every error at INFO; other successful requests (health checks, metrics scrapes, model
info, the live page's polling) at DEBUG, so a polling page does not flood the log. ``halfmoon serve --disable-access-log`` leaves the middleware out.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from halfmoon.serve.gateway.exposure import app_path

#: The logger of the access lines.
ACCESS_LOGGER = "gateway.access"
#: Paths whose successful requests are logged at INFO (the rest at DEBUG).
API_PREFIXES = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/admin/",
    "/invocations",
    "/inference/",
    "/generate",
    "/abort_request",
    "/separate_reasoning",
    "/pause",
    "/resume",
    "/reset_prefix_cache",
    "/sleep",
    "/wake_up",
    "/release_kv_cache_memory",
    "/release_memory_occupation",
    "/start_profile",
    "/stop_profile",
    "/update_weight",
    "/continue_generation",
    "/flush_cache",
    "/score",
    "/rerank",
    "/v2/",
)

Scope = dict[str, Any]
Receive = Any
Send = Any


@dataclass
class RequestRecord:
    """What the access line of one request says, filled in as the request runs."""

    start_s: float = field(default_factory=time.monotonic)
    status: int | None = None
    #: Whether the last byte of the body went out (False: the client left mid-stream).
    complete: bool = False
    num_prompt_tokens: int | None = None
    num_completion_tokens: int | None = None
    ttft_s: float | None = None
    #: The id the answer went out under (``cmpl-...``), and the cluster's own id of the
    #: request when that is not the same (the client chose the id: request_ids).
    response_id: str | None = None
    internal_id: str | None = None

    def add_generation(
        self, num_prompt_tokens: int, num_completion_tokens: int, ttft_s: float | None
    ) -> None:
        """Count one finished generation (one choice) of this request."""
        self.num_prompt_tokens = num_prompt_tokens  # the same prompt for every choice
        self.num_completion_tokens = (self.num_completion_tokens or 0) + num_completion_tokens
        if ttft_s is not None:
            self.ttft_s = ttft_s if self.ttft_s is None else min(self.ttft_s, ttft_s)


#: The record of the request the current task serves. Set by :class:`AccessLog` for the
#: duration of one request; the tasks a request starts (a stream's body, the choices of
#: ``n`` > 1) copy the context, so they all reach the same record.
_current: ContextVar[RequestRecord | None] = ContextVar("halfmoon_access_record", default=None)


def note_generation(
    num_prompt_tokens: int, num_completion_tokens: int, ttft_s: float | None
) -> None:
    """Add one finished generation to the access line of the request being served
    (nothing when no :class:`AccessLog` wraps the app)."""
    record = _current.get()
    if record is not None:
        record.add_generation(num_prompt_tokens, num_completion_tokens, ttft_s)


def note_request_id(response_id: str, internal_id: str | None = None) -> None:
    """Name the request being served on its access line: ``response_id``, and
    ``internal_id`` when the cluster knows it by another (nothing without :class:`AccessLog`)."""
    record = _current.get()
    if record is not None:
        record.response_id, record.internal_id = response_id, internal_id


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def access_line(method: str, path: str, client: str, record: RequestRecord, now_s: float) -> str:
    """The log line of a finished request."""
    ttft = "-" if record.ttft_s is None else f"{record.ttft_s:.3f}s"
    line = (
        f'{client} "{method} {path}" {_count(record.status)} '
        f"prompt_tokens={_count(record.num_prompt_tokens)} "
        f"completion_tokens={_count(record.num_completion_tokens)} "
        f"ttft={ttft} total={now_s - record.start_s:.3f}s"
    )
    if record.response_id is not None:
        line += f" id={record.response_id}"
        if record.internal_id is not None:
            line += f" internal_id={record.internal_id}"
    return line if record.complete else line + " (disconnected)"


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


class AccessLog:
    """ASGI middleware: one line per HTTP request on the ``gateway.access`` logger."""

    def __init__(self, app: Any, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.log = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord()

        async def send_and_watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                record.complete = True

        token = _current.set(record)
        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            if record.status is None:  # the server answers 500 for it
                record.status, record.complete = 500, True
            raise
        finally:
            _current.reset(token)
            self._write(scope, record)

    def _write(self, scope: Scope, record: RequestRecord) -> None:
        path = scope.get("path", "")
        important = app_path(scope).startswith(API_PREFIXES) or (record.status or 500) >= 400
        level = logging.INFO if important else logging.DEBUG
        if self.log.isEnabledFor(level):
            line = access_line(scope.get("method", "-"), path, _client(scope), record,
                               time.monotonic())  # fmt: skip
            self.log.log(level, "%s", line)

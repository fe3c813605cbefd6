"""Every error the gateway answers, in OpenAI's shape (Anthropic's on its Messages API).

``{"error": {"message", "type", "param", "code"}}`` (:func:`~halfmoon.serve.gateway.
openai_api.error_body`) for the routes' own refusals (:class:`~halfmoon.serve.gateway.
responses.HTTPError`) and for those raised before a route runs: an unknown path (404), a
wrong method (405, with the ``Allow`` header), a body that is not JSON or does not
validate (400, with ``param`` naming the offending field, OpenAI-style:
``messages.[0].content``), and an unexpected exception (500). FastAPI's own
``{"detail": ...}`` bodies never reach a client. Under ``/v1/messages`` (Anthropic's
Messages API, :mod:`halfmoon.serve.gateway.anthropic_messages`) the same errors come in
Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, as vLLM answers
there (:func:`error_payload`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from halfmoon.serve.gateway.openai_api import error_body
from halfmoon.serve.gateway.responses import HTTPError

log = logging.getLogger("gateway")

#: OpenAI's error ``type`` for each status the gateway answers.
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDenied",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}
#: Anthropic's error ``type`` for each status (on the Messages API's paths).
ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
#: Validation errors listed in one message, at most.
MAX_LISTED_ERRORS = 5


def anthropic_path(path: str | None) -> bool:
    """Whether ``path`` is the Messages API's (its errors are Anthropic-shaped)."""
    return path is not None and (path == "/v1/messages" or path.startswith("/v1/messages/"))


def error_payload(
    status: int, message: str, kind: str | None = None, param: str | None = None,
    path: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """An error's body: OpenAI's shape (``kind`` defaults by status: :data:`ERROR_TYPES`),
    or Anthropic's when ``path`` is the Messages API's."""
    if anthropic_path(path):
        kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    return error_body(message, kind or ERROR_TYPES.get(status, "APIError"), status, param)


def error_response(
    status: int, message: str, kind: str | None = None, headers: dict | None = None,
    param: str | None = None, path: str | None = None,
) -> JSONResponse:  # fmt: skip
    """An error response (:func:`error_payload`) for a request to ``path``."""
    return JSONResponse(error_payload(status, message, kind, param, path), status_code=status,
                        headers=headers)  # fmt: skip


def param_name(loc: Sequence[Any], body: Any, missing: bool = False) -> str | None:
    """The field a validation error's location names in ``body``, as OpenAI spells it
    (``("body", "messages", 0, "content")`` -> ``"messages.[0].content"``); None for the
    body as a whole; a query, path or header parameter by its name. The path stops where
    ``body`` does: pydantic adds the union member it tried (``content.str``), which is no
    field; a ``missing`` field ends it."""
    if len(loc) > 1 and loc[0] in ("query", "path", "header"):  # a parameter: its name
        return str(loc[1])
    steps = list(loc[1:] if loc and loc[0] == "body" else loc)
    parts, value = [], body

    def holds(value: Any, step: Any) -> bool:
        return (isinstance(value, dict) and step in value) or (
            isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value)
        )

    for i, step in enumerate(steps):
        if holds(value, step):
            value = value[step]
        elif i + 1 < len(steps) and holds(value, steps[i + 1]):
            continue  # the union member pydantic tried (an object's model): not a field
        elif not (missing and i == len(steps) - 1 and isinstance(value, dict)):
            break
        parts.append(f"[{step}]" if isinstance(step, int) else str(step))
    return ".".join(parts) or None


def validation_message(errors: Sequence[dict[str, Any]], body: Any) -> tuple[str, str | None]:
    """(message, param) of pydantic ``errors`` about ``body``: the first
    ``MAX_LISTED_ERRORS`` listed as ``field: why``; ``param`` is the first offending field."""
    if any(err.get("type") == "json_invalid" for err in errors):
        return "the request body is not valid JSON", None
    parts: list[str] = []
    params = []
    for err in errors[:MAX_LISTED_ERRORS]:
        loc = param_name(err.get("loc", ()), body, err.get("type") == "missing")
        msg = err.get("msg", "invalid")
        if loc is None and err.get("type") == "missing":
            msg = "a JSON request body is required"
        elif loc is None and not isinstance(body, dict):
            msg = "the request body must be a JSON object (sent as application/json)"
        part = f"{loc}: {msg}" if loc else msg
        if part not in parts:
            parts.append(part)
        params.append(loc)
    return "; ".join(parts) or "invalid request", params[0] if params else None


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(list(exc.errors()), exc.body)
    return error_response(400, message, param=param, path=request.url.path)


async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.kind, exc.headers, exc.param,
                          request.url.path)  # fmt: skip


async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        message = f"no such endpoint: {request.url.path}"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}" + (
            f" (allowed: {allowed})" if allowed else ""
        )
    else:
        message = str(exc.detail)
    return error_response(status, message, headers=dict(exc.headers or {}) or None,
                          path=request.url.path)  # fmt: skip


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", path=request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error ``app`` answers OpenAI-shaped (see the module docstring)."""
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPError, _http_error)
    app.add_exception_handler(StarletteHTTPException, _starlette_error)
    app.add_exception_handler(Exception, _unexpected)

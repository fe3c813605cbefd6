"""The Responses API's routes (``/v1/responses`` and the stored responses under
``/v1/responses/{id}``), on top of the gateway's chat path.

``POST /v1/responses`` turns the request into a chat request
(:mod:`halfmoon.serve.gateway.openai_responses`), continued from a stored response with
``previous_response_id``, and answers it whole, streamed or in the background (streamed
or not); answers are kept in the gateway's
:class:`~halfmoon.serve.gateway.response_store.ResponseStore` (``store``), read with
``GET`` (a streamed background one's events again with ``?stream=true``, from
``starting_after`` on, as vLLM's server does), listed (``/input_items``), cancelled
(``/cancel``, a background one) and deleted (``DELETE``), each only by the API key that
made it.

A background generation runs as a task of the gateway's loop: a client that goes away
does not stop it (``/cancel`` does). Its stream, when it has one, ends after
``response.completed``, after an ``error`` event when it failed, and with no more events
when it was cancelled (``GET`` then says ``cancelled``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from halfmoon.serve.gateway.openai_responses import (
    Keep,
    ResponsesRequest,
    collect_response,
    error_of,
    input_items,
    input_items_page,
    new_ids,
    response_body,
    response_events,
    sse_event,
    to_chat,
)
from halfmoon.serve.gateway.response_store import EventLog, EventLogs, StoredResponse
from halfmoon.serve.gateway.responses import Delta, HTTPError, Prepared, turned_away

#: ``start(body, request)``: the app's way to prepare a chat (or completion) request and
#: start it (its prepared request, first item and the rest; 429 / 503 when turned away).
Start = Callable[
    [ChatCompletionRequest | CompletionRequest, Request | None],
    Awaitable[tuple[Prepared, tuple[int, Delta], AsyncIterator]],
]
#: ``name(p, request, shown)``: the app's way to tell the access line and ``X-Request-Id``
#: the id an answer goes out under.
Name = Callable[[Prepared, Request | None, str], None]


def responses_router(
    gw: Gateway, start: Start, check_busy: Callable[[ChatCompletionRequest], None]
) -> APIRouter:
    """The routes of the Responses API over ``gw`` (``start`` and ``check_busy``: the
    app's, so these requests are limited and counted as every other)."""
    router = APIRouter()
    store = gw.responses
    # (ended logs within as many bytes again as the store keeps responses)
    logs = EventLogs(store.max_bytes)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        owner = getattr(request.state, "api_key", None)
        previous = None
        if body.previous_response_id is not None:
            previous = _stored(owner, body.previous_response_id, "previous_response_id")
        items = input_items(body)
        try:
            chat = to_chat(body, items, previous.conversation if previous else ())
        except ValueError as exc:  # (FieldError names the field)
            param = getattr(exc, "param", None)
            raise HTTPError(400, str(exc), "BadRequestError", param=param) from None
        keep = None
        if body.store is not False and store.enabled:

            def keep(answer: dict[str, Any]) -> None:
                store.put(owner, answer, items, previous)

        if body.background:
            if keep is None:
                raise HTTPError(400, "background responses need store (this server keeps "
                                "them for GET /v1/responses/{id})", "BadRequestError",
                                param="store")  # fmt: skip
            check_busy(chat)  # refused now, not in the background
            queued, log = _in_background(body, chat, request, keep, owner, items, previous)
            if log is not None:
                return StreamingResponse(log.follow(), media_type="text/event-stream")
            return JSONResponse(queued)
        p, first, stream = await start(chat, request)
        if body.stream:
            return StreamingResponse(
                response_events(body, p, first, stream, keep), media_type="text/event-stream"
            )
        try:
            return JSONResponse(await collect_response(body, p, first, stream, keep))
        except (Rejected, BackendError) as exc:
            raise turned_away(exc, gw.metrics) from None

    background: dict[str, asyncio.Task] = {}  # a background response's id -> its task

    def _in_background(
        body: ResponsesRequest, chat: ChatCompletionRequest, request: Request, keep: Keep,
        owner: str | None, items: list[dict[str, Any]], previous: StoredResponse | None,
    ) -> tuple[dict[str, Any], EventLog | None]:  # fmt: skip
        """Start ``body``'s generation as a task and store it as ``queued`` (then
        ``in_progress``, and its answer, ``failed`` or ``cancelled`` in the end); the
        queued response, and the log its events go to when it is streamed."""
        resp_id, msg_id = new_ids()
        created = time.time()
        queued = {**response_body(body, resp_id, created, body.model, None, None, None, True),
                  "status": "queued"}  # type: ignore[arg-type]  # fmt: skip
        log = logs.open(resp_id) if body.stream else None
        if log is not None:  # its first event at once, before the cluster takes it
            log.append(sse_event("response.created", 0, response=queued))

        def mark(status: str, **fields: Any) -> None:
            store.put(owner, {**queued, "status": status, **fields}, items, previous)

        def fail(message: str) -> None:
            mark("failed", error={"code": "server_error", "message": message})

        async def run() -> None:
            try:
                p, first, stream = await start(chat, request)
                mark("in_progress")
                ids = (resp_id, msg_id)
                if log is None:
                    await collect_response(body, p, first, stream, keep, ids, created)
                    return
                events = response_events(body, p, first, stream, keep, ids, created, True)
                async for event in events:
                    log.append(event)
                    if (message := error_of(event)) is not None:
                        fail(message)
            except asyncio.CancelledError:
                mark("cancelled")
            except (Rejected, BackendError, HTTPError) as exc:
                message = exc.message if isinstance(exc, HTTPError) else f"request failed: {exc}"
                fail(message)
                if log is not None:  # turned away before its first event
                    log.append(sse_event("error", len(log.events), code="server_error",
                                         message=message, param=None))  # fmt: skip
            finally:
                background.pop(resp_id, None)
                logs.end(resp_id)

        mark("queued")
        background[resp_id] = asyncio.get_running_loop().create_task(run())
        return queued, log

    def _stored(owner: str | None, response_id: str, param: str | None) -> StoredResponse:
        """``owner``'s stored response ``response_id``: a 400 naming ``param`` (a request
        field) or a 404 (a path) when there is none."""
        if not store.enabled:
            raise HTTPError(400 if param else 404, "this server stores no responses "
                            "(--responses-store-mb 0): send the conversation as input",
                            "BadRequestError" if param else "NotFoundError", param=param)  # fmt: skip
        entry = store.get(owner, response_id)
        if entry is None:
            raise HTTPError(
                400 if param else 404,
                f"response {response_id!r} not found (never stored, deleted, or evicted: "
                f"this server keeps the most recent {store.max_bytes >> 20} MiB of responses)",
                "BadRequestError" if param else "NotFoundError",
                param=param,
            )
        if param and entry.body["status"] in ("queued", "in_progress"):
            raise HTTPError(400, f"response {response_id!r} is still {entry.body['status']}: "
                            "continue it once it has finished", "BadRequestError", param=param)  # fmt: skip
        return entry

    async def _cancel(response_id: str) -> None:
        """Cancel a background response's generation (if it still runs) and wait until
        it has stored its end."""
        task = background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    @router.get("/v1/responses/{response_id}")
    async def get_response(
        response_id: str, request: Request, stream: bool = False,
        starting_after: int | None = None,
    ) -> Response:  # fmt: skip
        entry = _stored(getattr(request.state, "api_key", None), response_id, None)
        if not stream:
            return JSONResponse(entry.body)
        log = logs.get(response_id)
        if log is None:
            raise HTTPError(400, f"response {response_id!r} has no events to stream (only a "
                            "background response made with stream has them, kept for a "
                            "while after it ends): GET it without stream",
                            "BadRequestError", param="stream")  # fmt: skip
        if starting_after is not None and starting_after < -1:
            raise HTTPError(400, "starting_after must be a sequence number (>= -1)",
                            "BadRequestError", param="starting_after")  # fmt: skip
        start_at = 0 if starting_after is None else starting_after + 1
        return StreamingResponse(log.follow(start_at), media_type="text/event-stream")

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        owner = getattr(request.state, "api_key", None)
        _stored(owner, response_id, None)
        await _cancel(response_id)
        store.delete(owner, response_id)
        logs.drop(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
        owner = getattr(request.state, "api_key", None)
        if not _stored(owner, response_id, None).body.get("background"):
            raise HTTPError(400, "only a background response can be cancelled", "BadRequestError")
        await _cancel(response_id)
        return _stored(owner, response_id, None).body

    @router.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, request: Request, limit: int = 20, order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        entry = _stored(getattr(request.state, "api_key", None), response_id, None)
        return input_items_page(entry.input_items, limit, order, after)

    return router

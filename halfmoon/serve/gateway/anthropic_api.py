"""The routes of Anthropic's Messages API: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens`` (and ``/v1/messages/render``: its token-in, token-out
generate request, :mod:`halfmoon.serve.gateway.token_generation`), on top of the gateway's chat path
(:mod:`halfmoon.serve.gateway.anthropic_messages` translates). With API keys, Anthropic's
``x-api-key`` header is read as ``Authorization: Bearer`` is (its SDK sends that one).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halfmoon.serve.gateway.anthropic_messages import (
    CountTokensRequest,
    MessagesRequest,
    collect_message,
    message_events,
    to_chat,
)
from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.openai_api import ChatCompletionRequest
from halfmoon.serve.gateway.responses import HTTPError, turned_away
from halfmoon.serve.gateway.responses_api import Name, Start
from halfmoon.serve.gateway.token_generation import rendered
from halfmoon.serve.gateway.tokens_api import render_prepared


def _chat(body: CountTokensRequest, gw: Gateway) -> ChatCompletionRequest:
    try:
        return to_chat(body, reasoning=gw.config.reasoning_parser is not None)
    except ValueError as exc:  # (FieldError names the field)
        param = getattr(exc, "param", None)
        raise HTTPError(400, str(exc), "BadRequestError", param=param) from None


def messages_router(gw: Gateway, start: Start, name: Name) -> APIRouter:
    """The Messages API's routes over ``gw`` (``start``: the app's, so these requests are
    limited and counted as every other)."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        p, first, stream = await start(_chat(body, gw), request)
        msg_id = f"msg_{p.public_id}"
        name(p, request, msg_id)
        if body.stream:
            return StreamingResponse(
                message_events(body.model, p, first, stream, msg_id),
                media_type="text/event-stream",
            )
        try:
            return JSONResponse(await collect_message(body.model, p, first, stream, msg_id))
        except (Rejected, BackendError) as exc:
            raise turned_away(exc, gw.metrics) from None

    @router.post("/v1/messages/render")
    async def render_messages(body: MessagesRequest, request: Request) -> dict[str, Any]:
        """The token-in, token-out generate request of a message (vLLM's ``render``)."""
        chat = _chat(body, gw)
        p = await render_prepared(gw, chat, request)
        return rendered(p, body.model, body.stream, None, None)[0]

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, Any]:
        gw.check_model(body.model)
        chat = _chat(body, gw)
        messages = [m.for_template() for m in chat.messages]
        tokens = await gw.off_loop(gw.chat_prompt, messages, chat.template_options())
        return {"input_tokens": len(tokens)}

    return router

"""The routes of vLLM's token-in, token-out API (:mod:`halfmoon.serve.gateway.token_generation`
translates): ``POST /inference/v1/generate``; ``/v1/chat/completions/render`` and
``/v1/completions/render`` (Anthropic's ``/v1/messages/render`` is with the Messages API's
routes); ``/inference/v1/abort_requests`` and ``/abort_requests``, which end generations
of any route by their request ids (a client's, or an answer's id).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from halfmoon.serve.gateway import request_ids
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.openai_api import ChatCompletionRequest, CompletionRequest
from halfmoon.serve.gateway.responses import HTTPError, Prepared
from halfmoon.serve.gateway.responses_api import Name, Start
from halfmoon.serve.gateway.token_generation import (
    GenerateRequest,
    Shaper,
    rendered,
    streamed,
    whole,
)


class AbortRequests(BaseModel):
    """The body of ``/abort_requests``: the ids of the requests to end (none or empty:
    every running one, as vLLM's RL server reads it)."""

    request_ids: list[str] | None = Field(None, max_length=1024)


async def render_prepared(gw: Gateway, body: CompletionRequest | ChatCompletionRequest,
                          request: Request) -> Prepared:  # fmt: skip
    """``body`` validated and tokenized as its generation route would (nothing runs)."""
    if body.use_beam_search:
        raise HTTPError(400, "beam search cannot be rendered: it is many requests",
                        "BadRequestError", param="use_beam_search")  # fmt: skip
    return await gw.off_loop(gw.prepare, body, None, request.headers.get(request_ids.HEADER))


def tokens_router(gw: Gateway, start: Start, name: Name) -> APIRouter:
    """The token-in, token-out routes over ``gw`` (``start``: the app's, so generations
    are limited and counted as every other)."""
    router = APIRouter()
    config = gw.config

    @router.post("/inference/v1/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        completion = body.to_completion(
            config.model_names[0], gw.default_output(len(body.token_ids))
        )
        p, first, stream = await start(completion, request)
        shaper = Shaper(body, p, completion.model, gw.token_text)
        name(p, request, shaper.request_id)
        if body.stream:
            return StreamingResponse(streamed(shaper, first, stream, gw.metrics),
                                     media_type="text/event-stream")  # fmt: skip
        return JSONResponse(await whole(shaper, first, stream, gw.metrics))

    async def abort(body: AbortRequests) -> dict[str, Any]:
        """End the generations running under these ids (none: all of them), each answered
        as finished ``abort``; how many were running."""
        ended = await gw.abort_requests(body.request_ids or None)
        return {"status": "aborted", "aborted": ended}

    router.add_api_route("/inference/v1/abort_requests", abort, methods=["POST"])
    router.add_api_route("/abort_requests", abort, methods=["POST"])

    @router.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        p = await render_prepared(gw, body, request)
        return rendered(p, body.model, body.stream, body.stream_options, body.cache_salt)[0]

    @router.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest, request: Request) -> list[dict]:
        if body.echo or body.max_tokens == 0:
            raise HTTPError(400, "echo (and max_tokens 0) cannot be rendered: the generate "
                            "API answers the output only", "BadRequestError",
                            param="echo" if body.echo else "max_tokens")  # fmt: skip
        p = await render_prepared(gw, body, request)
        return rendered(p, body.model, body.stream, body.stream_options, body.cache_salt)

    return router

"""The routes of SGLang's native API (:mod:`halfmoon.serve.gateway.sglang_generation`
translates): ``POST /generate``, ``GET /model_info`` (and its older name
``/get_model_info``) and ``POST /abort_request``.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.responses_api import Name, Start
from halfmoon.serve.gateway.sglang_generation import (
    Answers,
    SglangGenerateRequest,
    streamed,
    whole,
)


class AbortRequest(BaseModel):
    """The body of SGLang's ``/abort_request``: one request's id, or every request."""

    rid: str = ""
    abort_all: bool = False


def sglang_router(gw: Gateway, start: Start, name: Name) -> APIRouter:
    """SGLang's native routes over ``gw`` (``start``: the app's, so generations are
    limited and counted as every other)."""
    router = APIRouter()
    config = gw.config

    @router.post("/generate")
    async def generate(body: SglangGenerateRequest, request: Request) -> Response:
        began = time.monotonic()
        completion = body.to_completion(config.model_names[0])
        p, first, stream = await start(completion, request)
        name(p, request, p.public_id)
        answers = Answers(body, p, began, p.token_text(gw.token_text), gw.weight_version)
        if body.stream:
            return StreamingResponse(streamed(answers, first, stream, gw.metrics),
                                     media_type="text/event-stream")  # fmt: skip
        return JSONResponse(await whole(answers, first, stream, gw.metrics))

    async def model_info() -> dict[str, Any]:
        """The served model, as SGLang describes it to its clients (``model_path`` and
        ``weight_version`` move with a weight update)."""
        updated_path, version = await gw.served_weights()
        return {
            "model_path": updated_path or config.model_names[0],
            "served_model_name": config.model_names[0],
            "tokenizer_path": config.model_names[0],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "max_model_len": config.max_model_len,
        }

    router.add_api_route("/model_info", model_info, methods=["GET"])
    router.add_api_route("/get_model_info", model_info, methods=["GET"])

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        """End the generation running under ``rid`` (``abort_all``: every one); each
        answers finished ``abort``. (SGLang answers an empty 200; this one counts them.)"""
        ended = await gw.abort_requests(None if body.abort_all else [body.rid])
        return {"status": "aborted", "aborted": ended}

    return router

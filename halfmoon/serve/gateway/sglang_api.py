"""The routes of SGLang's native API (:mod:`halfmoon.serve.gateway.sglang_generation`
translates): ``POST /generate``, ``GET /model_info`` (and its older name
``/get_model_info``), ``GET /server_info`` (and ``/get_server_info``),
``GET /health_generate``, ``POST /abort_request`` and ``POST /separate_reasoning`` (a
text read into reasoning and the rest by a reasoning parser,
:mod:`halfmoon.serve.gateway.reasoning`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from halfmoon import __version__
from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.reasoning import ReasoningMode, split_reasoning
from halfmoon.serve.gateway.responses import HTTPError
from halfmoon.serve.gateway.responses_api import Name, Start
from halfmoon.serve.gateway.sglang_generation import (
    Answers,
    SglangGenerateRequest,
    Started,
    streamed,
    streamed_parts,
    whole,
    whole_parts,
)

#: How long ``/health_generate`` waits for its token (SGLang's own check waits 20 s).
HEALTH_GENERATE_TIMEOUT_S = 20.0
log = logging.getLogger(__name__)


class SeparateReasoningRequest(BaseModel):
    """The body of SGLang's ``/separate_reasoning``: a model's text and the parser to
    read it with (SGLang's names: ``deepseek-r1``, ``qwen3``, ``qwen3-thinking``; vLLM's
    ``deepseek_r1`` too)."""

    text: str
    reasoning_parser: str


#: SGLang's reasoning parser names (and vLLM's): the parser, and whether the text starts
#: in the reasoning (``qwen3-thinking``: the template opened it, as SGLang's forced mode).
SGLANG_REASONING_PARSERS = {"deepseek-r1": ("deepseek_r1", False),
                            "deepseek_r1": ("deepseek_r1", False), "qwen3": ("qwen3", False),
                            "qwen3-thinking": ("qwen3", True)}  # fmt: skip


class AbortRequest(BaseModel):
    """The body of SGLang's ``/abort_request``: one request's id, or every request."""

    rid: str = ""
    abort_all: bool = False


def sglang_router(gw: Gateway, start: Start, name: Name) -> APIRouter:
    """SGLang's native routes over ``gw`` (``start``: the app's, so generations are
    limited and counted as every other)."""
    router = APIRouter()
    config = gw.config

    async def started(part: SglangGenerateRequest, request: Request, began: float) -> Started:
        completion = part.to_completion(config.model_names[0])
        p, first, stream = await start(completion, request)
        return (
            Answers(part, p, began, p.token_text(gw.token_text), gw.weight_version),
            first,
            stream,
        )

    async def generate_parts(parts: list[SglangGenerateRequest], request: Request,
                             stream: bool) -> Response:  # fmt: skip
        """A batch whose per-prompt options differ: a completion per prompt, at once."""
        if len(parts) > config.max_concurrent_requests:  # never fits: not a 429
            raise HTTPError(400, f"{len(parts)} prompts with options of their own; this server "
                            f"runs at most {config.max_concurrent_requests} requests at once",
                            "BadRequestError", param="sampling_params")  # fmt: skip
        began = time.monotonic()
        results = await asyncio.gather(*(started(part, request, began) for part in parts),
                                       return_exceptions=True)  # fmt: skip
        failed = [r for r in results if isinstance(r, BaseException)]
        ok = [r for r in results if not isinstance(r, BaseException)]
        if failed:  # one was turned away: the others stop (their requests abort)
            for _, _, rest in ok:
                await rest.aclose()
            raise failed[0]
        name(ok[0][0].p, request, ok[0][0].p.public_id)
        if stream:
            return StreamingResponse(streamed_parts(ok, gw.metrics),
                                     media_type="text/event-stream")  # fmt: skip
        return JSONResponse(await whole_parts(ok, gw.metrics))

    @router.post("/generate")
    async def generate(body: SglangGenerateRequest, request: Request) -> Response:
        parts = body.parts()
        if parts is not None:
            return await generate_parts(parts, request, body.stream)
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

    async def server_info() -> dict[str, Any]:
        """The server's configuration and live state in SGLang's shape (what its
        benchmark clients read): the served model and limits, and per instance that
        decodes (decode and coupled workers) an ``internal_states`` entry: its KV pool in
        tokens (``memory_usage.token_capacity``), the requests it runs and queues, the
        most the server runs at once (``--max-concurrent-requests``), the tokens a
        speculating step gains (``avg_spec_accept_length``)."""
        status = getattr(gw.backend, "cluster_status", None)
        cap = config.max_concurrent_requests
        states: list[dict[str, Any]] = []
        if status is not None:
            try:
                instances = (await status(num_decisions=0)).instances
            except BackendError as exc:
                raise HTTPError(503, f"no cluster status: {exc}", "ServiceUnavailable") from None
            states = [
                {"instance_id": i.instance_id, "role": i.role, "dp_size": 1,
                 "memory_usage": {"token_capacity": i.kv_capacity_tokens,
                                  "used_tokens": i.kv_used_tokens},
                 "num_running_reqs": i.num_running, "num_waiting_reqs": i.num_waiting,
                 "effective_max_running_requests_per_dp": cap,
                 "avg_spec_accept_length": i.spec_tokens_per_step}
                for i in instances if i.role in ("decode", "coupled")
            ]  # fmt: skip
        roles = {s["role"] for s in states}
        return {
            "model_path": config.model_names[0],
            "tokenizer_path": config.model_names[0],
            "served_model_name": config.model_names[0],
            "context_length": config.max_model_len,
            "max_running_requests": cap,
            "disaggregation_mode": "decode" if roles == {"decode"} else "null",
            "frontend": "halfmoon",
            "version": __version__,
            "internal_states": states,
        }

    @router.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's deep health check (its router polls it): one greedy token of a
        one-token prompt through the whole path (placement, prefill, KV hand-off,
        decode) within ``HEALTH_GENERATE_TIMEOUT_S``: 200 when it comes, else 503. Not
        counted as a request. A server paused on purpose (a weight update) answers 200
        without generating."""
        if gw.paused:
            return Response(status_code=200)
        request_id = f"health-generate-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        stream = gw.backend.generate(request_id, [0], params)

        async def first() -> None:
            async for _ in stream:
                return

        try:
            await asyncio.wait_for(first(), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, BackendError) as exc:
            log.warning("health_generate: no token within %.0f s: %r",
                        HEALTH_GENERATE_TIMEOUT_S, exc)  # fmt: skip
            return Response(status_code=503)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()
        return Response(status_code=200)

    router.add_api_route("/server_info", server_info, methods=["GET"])
    router.add_api_route("/get_server_info", server_info, methods=["GET"])

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        """End the generation running under ``rid`` (``abort_all``: every one); each
        answers finished ``abort``. (SGLang answers an empty 200; this one counts them.)"""
        ended = await gw.abort_requests(None if body.abort_all else [body.rid])
        return {"status": "aborted", "aborted": ended}

    @router.post("/separate_reasoning")
    async def separate_reasoning(body: SeparateReasoningRequest) -> dict[str, Any]:
        """``text`` read into its reasoning (``reasoning_text``) and the rest (``text``),
        as a chat answer is under ``--reasoning-parser``; a 400 names an unknown parser."""
        if body.reasoning_parser not in SGLANG_REASONING_PARSERS:
            raise HTTPError(400, f"unknown reasoning parser {body.reasoning_parser!r}: this "
                            f"server reads {', '.join(SGLANG_REASONING_PARSERS)}",
                            "BadRequestError", param="reasoning_parser")  # fmt: skip
        parser, opened = SGLANG_REASONING_PARSERS[body.reasoning_parser]
        reasoning, content = split_reasoning(ReasoningMode(parser, opened), body.text)
        return {"text": content or "", "reasoning_text": reasoning or ""}

    return router

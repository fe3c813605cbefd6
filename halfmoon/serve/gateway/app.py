"""The OpenAI-compatible HTTP gateway (FastAPI): the routes and what wraps them (API keys,
body limits, errors, docs, access log) around a :class:`~halfmoon.serve.gateway.gateway.Gateway`
(validation, tokenization, streaming).

The gateway is written against :class:`~halfmoon.serve.gateway.backend.Backend`; placement,
prefill and decode happen behind it. Routes: ``/v1/completions``,
``/v1/chat/completions`` (SSE when ``stream``), Anthropic's ``/v1/messages`` (and
``/v1/messages/count_tokens``: :mod:`halfmoon.serve.gateway.anthropic_api`), ``/v1/responses`` (OpenAI's Responses API,
served as a chat request, and its stored answers under ``/v1/responses/{id}``: the
routes of :mod:`halfmoon.serve.gateway.responses_api`), ``/v1/models``
(and ``/v1/models/{id}``),
``/tokenize``, ``/detokenize``, ``/version``, ``/health``, ``/metrics``, vLLM's ``/load``
and SageMaker's ``/ping`` and ``/invocations`` (a chat or a completion, by its body), vLLM's
``/reset_prefix_cache``, OpenAI's ``/v1/embeddings``
(:mod:`halfmoon.serve.gateway.embeddings_api`) and vLLM's ``/score`` and ``/rerank`` over
them (:mod:`halfmoon.serve.gateway.scoring_api`), its RL controls and weight updates
(:mod:`halfmoon.serve.gateway.weights_api`) and sleep mode
(:mod:`halfmoon.serve.gateway.sleep_mode`; only under ``VLLM_SERVER_DEV_MODE=1``, as
vLLM), and the API docs
(``/docs``, ``/redoc``: offline, :mod:`halfmoon.serve.gateway.openapi`); every error is
OpenAI-shaped, Anthropic-shaped under ``/v1/messages`` (:mod:`halfmoon.serve.gateway.errors`); the live cluster page ``/`` ->
``/dashboard`` (:mod:`halfmoon.serve.gateway.dashboard`);
extra routers under ``/admin/`` (e.g. scaling, :mod:`halfmoon.deploy.admin`) need the API key.
A client that disconnects mid-stream aborts its request, which frees its KV blocks.
Assembling the answer from the backend's streams is :mod:`halfmoon.serve.gateway.responses`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from halfmoon import __version__
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.serve.gateway import request_ids
from halfmoon.serve.gateway.access_log import AccessLog, note_request_id
from halfmoon.serve.gateway.anthropic_api import messages_router
from halfmoon.serve.gateway.backend import Backend, BackendError, Rejected
from halfmoon.serve.gateway.batch_chat import batch_chat_router
from halfmoon.serve.gateway.beam_search import search_beams
from halfmoon.serve.gateway.config import PUBLIC_PATHS, GatewayConfig
from halfmoon.serve.gateway.dashboard import ProcessStates, dashboard_router
from halfmoon.serve.gateway.embeddings_api import embeddings_router
from halfmoon.serve.gateway.errors import error_response, install_error_handlers
from halfmoon.serve.gateway.exposure import app_path
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.http_limits import BodyLimit
from halfmoon.serve.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    response_id,
)
from halfmoon.serve.gateway.openapi import install_docs, install_openapi
from halfmoon.serve.gateway.profiling import profiler_router
from halfmoon.serve.gateway.responses import (
    Delta,
    HTTPError,
    Prepared,
    collect,
    merge_choices,
    sse,
    turned_away,
)
from halfmoon.serve.gateway.responses_api import responses_router
from halfmoon.serve.gateway.scoring_api import scoring_router
from halfmoon.serve.gateway.scrape import scrape
from halfmoon.serve.gateway.sglang_api import sglang_router
from halfmoon.serve.gateway.sleep_mode import sleep_router
from halfmoon.serve.gateway.tenancy import matching_key
from halfmoon.serve.gateway.tokens_api import tokens_router
from halfmoon.serve.gateway.weights_api import forget_cached_prefixes, weights_router

__all__ = ["PUBLIC_PATHS", "Gateway", "GatewayConfig", "create_app"]


def _authorization(request: Request) -> str | None:
    """The request's ``Authorization`` header, or its ``x-api-key`` (Anthropic's) as one."""
    found = request.headers.get("authorization")
    if found is None and (key := request.headers.get("x-api-key")) is not None:
        return f"Bearer {key}"
    return found


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    config: GatewayConfig,
    admin_routers: Sequence[APIRouter] = (),
    process_states: ProcessStates | None = None,
) -> FastAPI:
    """The FastAPI application serving ``backend``; ``admin_routers`` are mounted under
    ``/admin`` and answer only with the API key (403 when the server has none);
    ``process_states`` (optional: the launcher's) tells the cluster page which worker
    processes are restarting."""
    gw = Gateway(backend, tokenizer, config)
    app = FastAPI(title="halfmoon", description="KV-cache-centric disaggregated LLM serving",
                  version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if config.docs else None)  # fmt: skip
    app.state.gateway = gw
    install_error_handlers(app)
    if config.docs:
        install_docs(app)
        pinned = () if config.allow_runtime_lora else config.model_names
        install_openapi(app, pinned, config.max_tokens_limit,
                        config.guarded_paths() if config.keys else (), tokenizer.vocab_size)  # fmt: skip
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # before auth: bounded
    for router in admin_routers:
        app.include_router(router, prefix="/admin")
    app.include_router(dashboard_router(gw, process_states))  # the live cluster page

    guarded = config.guarded_paths()

    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Response:
        path = app_path(request.scope)
        if path.startswith("/admin/") and not config.keys:
            return error_response(
                403, "admin endpoints need an API key (--api-key)", "PermissionDenied"
            )
        if config.keys and path.startswith(guarded):
            key = matching_key(_authorization(request), config.keys)
            if key is None:
                return error_response(401, "invalid or missing API key", "AuthenticationError",
                                      path=request.url.path)  # fmt: skip
            request.state.api_key = key  # the tenant (see GatewayConfig.cache_salt_from_api_key)
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        try:
            return {"status": "ok", **(await backend.health())}
        except Exception as exc:  # any failure means "not healthy"; say why
            raise HTTPError(503, f"not ready: {exc}", "ServiceUnavailable") from None

    # SageMaker's health check, as vLLM serves it: /health by another name (either method)
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], summary="Ping",
                          operation_id=f"ping_{method.lower()}")  # fmt: skip

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: the generations this gateway is serving or preparing."""
        return {"server_load": gw.in_flight + gw.preparing}

    @app.get("/metrics")
    async def metrics() -> Response:
        # The gateway's, the Conductor's and every worker's, labelled and merged.
        text = await scrape(backend, gw.metrics, config.model_name)
        return Response(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [gw.model_card(n) for n in gw.model_names]}

    @app.get("/v1/models/{model:path}")  # (a path: model names may hold a slash)
    async def model(model: str) -> dict[str, Any]:
        gw.check_model(model)
        return gw.model_card(model)

    if config.allow_runtime_lora:  # vLLM's, behind its VLLM_ALLOW_RUNTIME_LORA_UPDATING

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
            text = await gw.load_adapter(body.lora_name, body.lora_path, body.load_inplace)
            return PlainTextResponse(text)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
            return PlainTextResponse(await gw.unload_adapter(body.lora_name))

    if config.dev_endpoints:  # vLLM's RL controls, under its VLLM_SERVER_DEV_MODE

        @app.post("/pause")
        async def pause(mode: str = "abort", clear_cache: bool = True) -> dict[str, str]:
            """Pause generation (vLLM's): new requests wait until ``/resume``; running
            ones are aborted (``mode=abort``) or finish first (``wait``, answered once
            they have). ``clear_cache`` is accepted and ignored, as vLLM deprecates it."""
            if mode not in ("abort", "wait"):
                raise HTTPError(400, f"mode {mode!r}: this server pauses with 'abort' or "
                                "'wait' ('keep', freezing running requests in place, is not "
                                "supported)", "BadRequestError", param="mode")  # fmt: skip
            await gw.pause(mode)
            return {"status": "paused"}

        @app.post("/resume")
        async def resume() -> dict[str, str]:
            """Resume generation after ``/pause`` (a 400 while memory sleeps: ``/wake_up``)."""
            if gw.memory_asleep:
                raise HTTPError(400, f"the cluster's {' and '.join(sorted(gw.memory_asleep))} "
                                "sleep: POST /wake_up resumes generation", "BadRequestError")  # fmt: skip
            gw.resume()
            return {"status": "resumed"}

        @app.get("/is_paused")
        async def is_paused() -> dict[str, bool]:
            """Whether generation is paused."""
            return {"is_paused": gw.paused}

    if config.dev_endpoints:  # vLLM's development endpoint, under its VLLM_SERVER_DEV_MODE

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(
            reset_running_requests: bool = False, reset_external: bool = False
        ) -> dict[str, Any]:
            """Every worker forgets its engine's cached prefixes (with ``reset_external``
            its DRAM and SSD block store's too); ``success`` is false while running
            requests hold blocks somewhere (``failed`` says where), as on vLLM."""
            if reset_running_requests:
                raise HTTPError(400, "reset_running_requests is not supported: the reset "
                                "waits for running requests instead (retry once they end)",
                                "BadRequestError", param="reset_running_requests")  # fmt: skip
            reasons = await forget_cached_prefixes(gw, reset_external, "prefix cache not reset")
            failed = {iid: why for iid, why in reasons.items() if why}
            return {"success": not failed, **({"failed": failed} if failed else {})}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def _check_busy(body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.num_choices() > config.max_concurrent_requests:  # never fits: not a 429
            raise HTTPError(
                400,
                f"the request asks for {body.num_choices()} choices (n per prompt); this "
                f"server runs at most {config.max_concurrent_requests} requests at once",
                "BadRequestError",
                param="n",
            )
        busy = gw.in_flight + gw.preparing
        if busy + body.num_choices() > config.max_concurrent_requests:
            gw.metrics.rejections.inc()
            gw.series.rejected()
            raise HTTPError(
                429, f"server busy: {busy} requests in flight", "RateLimitError",
                {"Retry-After": "1"},
            )  # fmt: skip

    async def _prepare(
        body: CompletionRequest | ChatCompletionRequest, request: Request | None
    ) -> Prepared:
        """``body`` validated and tokenized, its place among the requests in flight held
        meanwhile (429 when there is none)."""
        _check_busy(body)  # refused at once, before tokenizing
        api_key = getattr(request.state, "api_key", None) if request is not None else None
        id_header = request.headers.get(request_ids.HEADER) if request is not None else None
        choices = body.num_choices()
        gw.preparing += choices  # holds its place while tokenized (see Gateway.preparing)
        try:
            p = await gw.off_loop(gw.prepare, body, api_key, id_header)
        finally:
            gw.preparing -= choices
        _check_busy(body)  # again: choices of n > 1 count only once their tasks start
        return p

    async def _start(
        body: CompletionRequest | ChatCompletionRequest, request: Request | None
    ) -> tuple[Prepared, tuple[int, Delta], AsyncIterator]:
        """Prepare ``body`` and start its choices: the prepared request, its first item
        and the rest (429 / 503 when the cluster turns it away before any item)."""
        p = await _prepare(body, request)
        stream = merge_choices([gw.run(choice) for choice in p.choices()])
        try:
            first = await anext(stream)
        except (Rejected, BackendError) as exc:
            await stream.aclose()
            if isinstance(exc, Rejected):
                gw.series.rejected()
            else:
                gw.series.failed()
            raise turned_away(exc, gw.metrics) from None
        return p, first, stream

    def _name(p: Prepared, request: Request | None, shown: str | None = None) -> None:
        """Tell the access line and the ``X-Request-Id`` header the response's id
        (``shown``; by default the chat or completion id)."""
        shown = shown or response_id(p.public_id, p.chat)
        note_request_id(shown, None if p.client_id is None else p.request_id)
        if request is not None:
            request_ids.note_response_id(request.scope, shown)

    async def _serve(
        body: CompletionRequest | ChatCompletionRequest, request: Request | None = None
    ) -> Response:
        if body.use_beam_search:
            p = await _prepare(body, request)
            _name(p, request)
            try:
                answer = await search_beams(p, body.model, body.length_penalty, gw)
            except (Rejected, BackendError) as exc:
                raise turned_away(exc, gw.metrics) from None
            return JSONResponse(answer)
        p, first, stream = await _start(body, request)
        _name(p, request)
        if body.stream:
            return StreamingResponse(
                sse(p, body.model, first, stream, gw.metrics, gw.token_text),
                media_type="text/event-stream",
            )
        return JSONResponse(await collect(p, body.model, first, stream, gw.metrics,
                                          gw.token_text))  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        gw.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give either prompt or messages", "BadRequestError")
        if body.messages is not None:
            messages = [m.for_template() for m in body.messages]
            tokens = await gw.off_loop(gw.chat_prompt, messages, body.template_options())
        else:
            tokens = await gw.off_loop(tokenizer.encode, body.prompt or "")
        return {"count": len(tokens), "max_model_len": config.max_model_len, "tokens": tokens}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """vLLM's: the served tokenizer's configuration (its ``tokenizer_config.json``,
        without file paths), its class and the chat template in use, so that a router can
        tokenize as this server does."""
        info = {k: v for k, v in tokenizer.config.items() if not k.endswith("_file")}
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if tokenizer.chat_template is not None:
            info["chat_template"] = tokenizer.chat_template
        return info

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        gw.check_model(body.model)
        ids = gw.checked_token_ids(body.tokens, "tokens")
        return {"prompt": await gw.off_loop(tokenizer.decode, ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(body, request)

    @app.post("/invocations")
    async def invocations(body: dict[str, Any], request: Request) -> Response:
        """SageMaker's one inference route, as vLLM serves it: a chat completion's body
        (``messages``) or a completion's (``prompt``)."""
        kind = ChatCompletionRequest if "messages" in body else CompletionRequest
        if "messages" not in body and "prompt" not in body:
            raise HTTPError(400, "an invocation is a chat completion (messages) or a "
                            "completion (prompt)", "BadRequestError")  # fmt: skip
        try:
            parsed = kind.model_validate(body)
        except ValidationError as exc:  # answered as any route's invalid body
            raise RequestValidationError(exc.errors(), body=body) from None
        return await _serve(parsed, request)

    app.include_router(responses_router(gw, _start, _check_busy))
    app.include_router(messages_router(gw, _start, _name))
    app.include_router(tokens_router(gw, _start, _name))
    app.include_router(sglang_router(gw, _start, _name))
    if config.dev_endpoints:  # RL weight updates and sleep mode, with vLLM's other RL controls
        app.include_router(weights_router(gw))
        app.include_router(sleep_router(gw))
    if config.profiler is not None:  # vLLM's, with its --profiler-config
        app.include_router(profiler_router(gw, config.profiler))
    app.include_router(batch_chat_router(gw, _start, _name))
    app.include_router(embeddings_router(gw))
    app.include_router(scoring_router(gw))

    if config.request_id_headers:  # outside the key check: a 401 carries one too
        app.add_middleware(request_ids.RequestIdHeader)
    if config.access_log:  # added late, so outer: it sees every answer (401, 413...)
        app.add_middleware(AccessLog)
    if config.cors is not None:  # outermost: preflights answered before the key check
        config.cors.install(app)
    return app

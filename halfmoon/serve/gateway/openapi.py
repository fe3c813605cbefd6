"""The gateway's OpenAPI schema as the server behaves, and its docs pages served offline.

FastAPI's generated schema documents a 422 with its own ``{"detail": ...}`` body and an
untyped 200 for routes that return dicts. :func:`install_openapi` rewrites it once:
every refusal is a 400 (or 401/404/413/429/503 where they apply) with OpenAI's error
object (Anthropic's under ``/v1/messages``), each route's 200 body is described (:data:`RESPONSE_MODELS`), the streaming
routes also answer ``text/event-stream`` and ``/metrics`` ``text/plain``; the request
bodies' ``model`` is pinned to the served model and ``max_tokens`` to the server's cap.

:func:`install_docs` serves ``/docs`` (Swagger UI) and ``/redoc`` from the JavaScript and
CSS files that the ``fastapi-offline`` package ships, under ``/docs/assets``: the pages
load nothing from outside the server (FastAPI's defaults come from a CDN and are blank
offline).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, RootModel

from halfmoon.serve.gateway.errors import anthropic_path

#: Where the docs pages' scripts and styles are served (under /docs: public with it).
DOCS_ASSETS_PATH = "/docs/assets"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(_Open):
    """Every error body the server answers."""

    error: ErrorDetail


class AnthropicError(_Open):
    """Anthropic's error object (its ``type``: ``invalid_request_error``, ...)."""

    type: str
    message: str


class AnthropicErrorResponse(_Open):
    """Every error body the Messages API's routes answer."""

    type: Literal["error"]
    error: AnthropicError


class MessageObject(_Open):
    """Body of a non-streaming ``POST /v1/messages`` (Anthropic's ``message``)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = None
    usage: dict[str, int]


class TokenCount(_Open):
    """Body of ``POST /v1/messages/count_tokens``: the prompt's length in tokens."""

    input_tokens: int


class Usage(_Open):
    """Token counts of a response (``prompt_tokens_details.cached_tokens``: prefix-cache hits)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(_Open):
    """One choice of a text completion."""

    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended it (None: any other reason).
    stop_reason: int | str | None = None


class CompletionResponse(_Open):
    """Body of a non-streaming ``POST /v1/completions``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Open):
    """The generated message of a chat choice."""

    role: Literal["assistant"]
    content: str | None = None


class ChatChoice(_Open):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended it (None: any other reason).
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Open):
    """Body of a non-streaming ``POST /v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ResponseObject(_Open):
    """Body of a non-streaming ``POST /v1/responses`` (OpenAI's ``response`` object; a
    background one starts ``queued``)."""

    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "incomplete", "queued", "in_progress", "failed", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponseDeleted(_Open):
    """Body of ``DELETE /v1/responses/{response_id}``."""

    id: str
    object: Literal["response"]
    deleted: bool


class InputItemList(_Open):
    """Body of ``GET /v1/responses/{response_id}/input_items``: a page of the response's
    own input items (``limit`` 1-100, ``order`` asc or desc, ``after`` an item id)."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ModelCard(_Open):
    """One served model; ``max_model_len`` (prompt + output tokens) and
    ``max_tokens_limit`` (output tokens) are the limits the server enforces."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    max_tokens_limit: int


class ModelList(_Open):
    """Body of ``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(_Open):
    """Body of ``GET /version``."""

    version: str


class HealthResponse(_Open):
    """Body of ``GET /health`` when ready (``mode``, ``instances``: the backend's view)."""

    status: Literal["ok"]


class LoadResponse(_Open):
    """Body of ``GET /load`` (vLLM's): generations being served or prepared."""

    server_load: int


class InvocationResponse(RootModel[ChatCompletionResponse | CompletionResponse]):
    """Body of a non-streaming ``POST /invocations``: a chat completion or a completion."""


class TokenizeResponse(_Open):
    """Body of ``POST /tokenize``."""

    count: int
    max_model_len: int
    tokens: list[int]


class EmbeddingDatum(_Open):
    """One input's embedding: floats, or (``encoding_format: base64``) float32 bytes."""

    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingResponse(_Open):
    """Body of ``POST /v1/embeddings``: each input's embedding, in input order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingDatum]
    usage: dict[str, Any]


class ScoreDatum(_Open):
    """One pair's score: the cosine similarity of its texts' embeddings."""

    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(_Open):
    """Body of ``POST /score`` (vLLM's): each pair's score, in pair order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreDatum]
    usage: dict[str, Any]


class RerankResult(_Open):
    """One document's place: its index in the request, its score and (unless
    ``return_documents`` is false) its text."""

    index: int
    relevance_score: float
    document: dict[str, Any] | None = None


class RerankResponse(_Open):
    """Body of ``POST /rerank`` (vLLM's, Jina's and Cohere's shape): most relevant first."""

    id: str
    model: str
    usage: dict[str, Any]
    results: list[RerankResult]


class TokenizerInfo(_Open):
    """Body of ``GET /tokenizer_info`` (vLLM's): the tokenizer's configuration as its
    ``tokenizer_config.json`` has it, with the chat template in use."""

    tokenizer_class: str
    chat_template: str | None = None


class DetokenizeResponse(_Open):
    """Body of ``POST /detokenize``."""

    prompt: str


class GenerateChoice(_Open):
    """One choice of a token-in, token-out generation: its token ids (and ``text`` with
    ``output_mode`` ``text``); log-probabilities by token id (by text in text mode)."""

    index: int
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int]
    logprobs: dict[str, Any] | None
    text: str | None = None


class GenerateResponse(_Open):
    """Body of a non-streaming ``POST /inference/v1/generate`` (vLLM's)."""

    request_id: str
    output_mode: Literal["tokens", "text"]
    model: str
    created: int
    choices: list[GenerateChoice]
    usage: dict[str, int]
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[Any] | None


class RenderedRequest(_Open):
    """A generate request a ``/render`` route answers (the body ``POST
    /inference/v1/generate`` takes, vLLM's too): the prompt's token ids and every
    sampling option, the served model's defaults filled in."""

    request_id: str
    token_ids: list[int]
    sampling_params: dict[str, Any]
    model: str | None
    stream: bool
    stream_options: dict[str, Any] | None
    cache_salt: str | None
    priority: int


class RenderedRequests(RootModel[list[RenderedRequest]]):
    """Body of ``POST /v1/completions/render``: one generate request per prompt."""


class SglangOutput(_Open):
    """One output of SGLang's ``POST /generate``: its text, token ids and ``meta_info``
    (``index`` in a batch or with ``n`` above 1)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None


class SglangAnswer(RootModel[SglangOutput | list[SglangOutput]]):
    """Body of a non-streaming ``POST /generate``: one output, or a list of them."""


class SglangModelInfo(_Open):
    """Body of ``GET /model_info`` (SGLang's)."""

    model_path: str
    is_generation: bool


class SeparatedReasoning(_Open):
    """Body of SGLang's ``POST /separate_reasoning``: the text without its reasoning, and
    the reasoning."""

    text: str
    reasoning_text: str


class AbortResponse(_Open):
    """Body of ``POST /abort_requests``: how many running generations were ended."""

    status: Literal["aborted"]
    aborted: int


class ProfileStarted(_Open):
    """Body of ``POST /start_profile`` (with ``--profiler-config``): the workers profiling."""

    status: Literal["profiling"]
    workers: list[str]


class ProfileStopped(_Open):
    """Body of ``POST /stop_profile``: the traces written, by worker (paths on its host),
    and the errors of any that failed to stop, by worker."""

    status: Literal["stopped"]
    traces: dict[str, list[str]]
    errors: dict[str, str]


#: The 200 body of each (path, method).
RESPONSE_MODELS: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/completions", "post"): CompletionResponse,
    ("/v1/chat/completions", "post"): ChatCompletionResponse,
    ("/v1/responses", "post"): ResponseObject,
    ("/v1/messages", "post"): MessageObject,
    ("/v1/messages/count_tokens", "post"): TokenCount,
    ("/v1/responses/{response_id}", "get"): ResponseObject,
    ("/v1/responses/{response_id}", "delete"): ResponseDeleted,
    ("/v1/responses/{response_id}/input_items", "get"): InputItemList,
    ("/v1/responses/{response_id}/cancel", "post"): ResponseObject,
    ("/v1/models", "get"): ModelList,
    ("/v1/models/{model}", "get"): ModelCard,
    ("/version", "get"): VersionResponse,
    ("/health", "get"): HealthResponse,
    ("/ping", "get"): HealthResponse,
    ("/ping", "post"): HealthResponse,
    ("/load", "get"): LoadResponse,
    ("/invocations", "post"): InvocationResponse,
    ("/tokenize", "post"): TokenizeResponse,
    ("/v1/embeddings", "post"): EmbeddingResponse,
    ("/score", "post"): ScoreResponse,
    ("/v1/score", "post"): ScoreResponse,
    ("/rerank", "post"): RerankResponse,
    ("/v1/rerank", "post"): RerankResponse,
    ("/v2/rerank", "post"): RerankResponse,
    ("/detokenize", "post"): DetokenizeResponse,
    ("/tokenizer_info", "get"): TokenizerInfo,
    ("/inference/v1/generate", "post"): GenerateResponse,
    ("/v1/chat/completions/render", "post"): RenderedRequest,
    ("/v1/messages/render", "post"): RenderedRequest,
    ("/v1/completions/render", "post"): RenderedRequests,
    ("/inference/v1/abort_requests", "post"): AbortResponse,
    ("/abort_requests", "post"): AbortResponse,
    ("/generate", "post"): SglangAnswer,
    ("/v1/chat/completions/batch", "post"): ChatCompletionResponse,
    ("/model_info", "get"): SglangModelInfo,
    ("/get_model_info", "get"): SglangModelInfo,
    ("/abort_request", "post"): AbortResponse,
    ("/separate_reasoning", "post"): SeparatedReasoning,
    ("/start_profile", "post"): ProfileStarted,
    ("/stop_profile", "post"): ProfileStopped,
}
#: Error statuses each (path, method) may answer besides 400 (bodies) and 401 (API keys).
ERROR_STATUSES: dict[tuple[str, str], tuple[int, ...]] = {
    ("/v1/completions", "post"): (404, 413, 429, 503),
    ("/v1/chat/completions", "post"): (404, 413, 429, 503),
    ("/v1/responses", "post"): (404, 413, 429, 503),
    ("/v1/messages", "post"): (404, 413, 429, 503),
    ("/v1/messages/count_tokens", "post"): (404, 413),
    ("/v1/responses/{response_id}", "get"): (400, 404),
    ("/v1/responses/{response_id}", "delete"): (404,),
    ("/v1/responses/{response_id}/input_items", "get"): (400, 404),
    ("/v1/responses/{response_id}/cancel", "post"): (400, 404),
    ("/v1/models/{model}", "get"): (404,),
    ("/tokenize", "post"): (404, 413),
    ("/v1/embeddings", "post"): (404, 413, 429, 503),
    ("/score", "post"): (404, 413, 429, 503),
    ("/v1/score", "post"): (404, 413, 429, 503),
    ("/rerank", "post"): (404, 413, 429, 503),
    ("/v1/rerank", "post"): (404, 413, 429, 503),
    ("/v2/rerank", "post"): (404, 413, 429, 503),
    ("/detokenize", "post"): (404, 413),
    ("/health", "get"): (503,),
    ("/ping", "get"): (503,),
    ("/ping", "post"): (503,),
    ("/invocations", "post"): (404, 413, 429, 503),
    ("/inference/v1/generate", "post"): (404, 413, 429, 503),
    ("/v1/chat/completions/render", "post"): (404, 413),
    ("/v1/completions/render", "post"): (404, 413),
    ("/v1/messages/render", "post"): (404, 413),
    ("/inference/v1/abort_requests", "post"): (413,),
    ("/abort_requests", "post"): (413,),
    ("/generate", "post"): (404, 413, 429, 503),
    ("/start_profile", "post"): (413, 503),
    ("/stop_profile", "post"): (503,),
    ("/v1/chat/completions/batch", "post"): (404, 413, 429, 503),
    ("/abort_request", "post"): (413,),
    ("/separate_reasoning", "post"): (413,),
}
STREAMING = {("/v1/completions", "post"), ("/v1/chat/completions", "post"),
             ("/v1/responses", "post"), ("/v1/responses/{response_id}", "get"),
             ("/v1/messages", "post"), ("/invocations", "post"),
             ("/inference/v1/generate", "post"), ("/generate", "post")}  # fmt: skip
#: Answers with no body: the status says it all.
EMPTY_ANSWERS = {
    ("/health_generate", "get"): ("A token came through the whole path (no body)",
                                  {503: "No token came in time (no body)"}),
}  # fmt: skip
#: Answers in plain text (SGLang's): their 200, and a 400 that may be text too.
TEXT_ANSWERS = {("/flush_cache", "get"), ("/flush_cache", "post")}
_DESCRIPTIONS = {
    400: "Invalid request (the body is not JSON, a field is out of range, the prompt and "
    "max_tokens exceed the context): ``param`` names the field",
    401: "Missing or invalid API key",
    404: "Unknown model, stored response (or path)",
    413: "Request body too large",
    429: "Server busy or request rejected by the Conductor (see Retry-After)",
    503: "Cluster not ready or the request failed",
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
#: One server-sent event of a streaming completion.
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk object as JSON (the "
                            "shape of the JSON response, with ``delta`` for chat), or [DONE]"}},
}  # fmt: skip


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    """``model``'s schema added to ``schemas`` (with the models it uses); its $ref."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _operation_responses(
    path: str, method: str, op: dict[str, Any], schemas: dict[str, Any], guarded: bool
) -> None:
    """Rewrite ``op["responses"]`` (see the module docstring)."""
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    key = (path, method)
    ok = responses.setdefault("200", {"description": "Successful Response"})
    if key in RESPONSE_MODELS:
        ok["content"] = _json(_ref(RESPONSE_MODELS[key], schemas))
    if key in STREAMING:  # (before OpenAPI 3.2, an SSE ``schema`` describes one event)
        ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
        ok["description"] = "The completion (a JSON object, or SSE chunks when streaming)"
    if path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        ok["description"] = "Prometheus metrics (text exposition format)"
    if key in EMPTY_ANSWERS:
        ok.pop("content", None)
        ok["description"], others = EMPTY_ANSWERS[key]
        for status, description in others.items():
            responses[str(status)] = {"description": description}
    if key in TEXT_ANSWERS:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    statuses = list(ERROR_STATUSES.get(key, ()))
    if "requestBody" in op:
        statuses.append(400)
    if guarded:
        statuses.append(401)
    error = _ANTHROPIC_ERROR_REF if anthropic_path(path) else _ERROR_REF
    for status in sorted(set(statuses)):
        responses[str(status)] = {"description": _DESCRIPTIONS[status], "content": _json(error)}
    if key in TEXT_ANSWERS:  # (workers that kept blocks are named in text)
        responses["400"] = {"description": "Not done: why, as text or an error object",
                            "content": {**_json(error),
                                        "text/plain": {"schema": {"type": "string"}}}}  # fmt: skip


def _cap_integers(schema: dict[str, Any], maximum: int) -> None:
    """Set ``maximum`` on ``schema`` or its integer alternatives."""
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "integer":
            option["maximum"] = maximum


def _bound_token_ids(schema: dict[str, Any], vocab_size: int) -> None:
    """Token id arrays in ``schema`` (or its alternatives) take ids of the vocabulary."""
    for option in schema.get("anyOf", [schema]):
        items = option.get("items", {})
        if option.get("type") == "array" and items.get("type") == "integer":
            items.update(minimum=0, maximum=vocab_size - 1)


def _pin_requests(
    schemas: dict[str, Any], model_names: Sequence[str], max_tokens_limit: int, vocab_size: int
) -> None:
    """The request bodies' ``model`` can only be a served model (the base model or a LoRA
    adapter); output lengths are
    capped at the server's limit, token ids at the vocabulary (what the gateway enforces
    with a 400). No names (adapters may be loaded while serving): ``model`` stays free."""
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
                 "DetokenizeRequest", "ResponsesRequest", "MessagesRequest",
                 "CountTokensRequest", "GenerateRequest", "GenerateSamplingParams",
                 "SglangGenerateRequest", "SglangSamplingParams", "EmbeddingRequest",
                 "ScoreRequest", "RerankRequest"):  # fmt: skip
        props = schemas.get(name, {}).get("properties", {})
        if "model" in props and model_names:
            pinned = {"type": "string", "enum": list(model_names)}
            nullable = any(o.get("type") == "null" for o in props["model"].get("anyOf", []))
            props["model"] = {"anyOf": [pinned, {"type": "null"}]} if nullable else pinned
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "max_new_tokens"):
            if field in props:
                _cap_integers(props[field], max_tokens_limit)
        for field in (
            "prompt",
            "tokens",
            "stop_token_ids",
            "token_ids",
            "allowed_token_ids",
            "input_ids",
        ):
            if field in props:
                _bound_token_ids(props[field], vocab_size)
        if name == "EmbeddingRequest" and "input" in props:  # (a Responses input is no ids)
            _bound_token_ids(props["input"], vocab_size)


def build_openapi(
    app: FastAPI, model_names: Sequence[str], max_tokens_limit: int, guarded_paths: tuple[str, ...],
    vocab_size: int,
) -> dict[str, Any]:  # fmt: skip
    """The schema of ``app`` rewritten as the module docstring says; ``guarded_paths``:
    path prefixes that answer 401 without an API key (empty: the server is open)."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)  # fmt: skip
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _ref(ErrorResponse, schemas)
    _ref(AnthropicErrorResponse, schemas)
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            guarded = path.startswith(guarded_paths) if guarded_paths else False
            _operation_responses(path, method, op, schemas, guarded)
    _pin_requests(schemas, model_names, max_tokens_limit, vocab_size)
    if guarded_paths:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
    return schema


def install_openapi(
    app: FastAPI, model_names: Sequence[str], max_tokens_limit: int, guarded_paths: tuple[str, ...],
    vocab_size: int,
) -> None:  # fmt: skip
    """Serve :func:`build_openapi`'s schema at ``app.openapi_url`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(
                app, model_names, max_tokens_limit, guarded_paths, vocab_size
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def docs_assets_dir() -> Path:
    """The directory of Swagger UI's and ReDoc's files in the ``fastapi-offline`` package."""
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def install_docs(app: FastAPI, openapi_url: str = "/openapi.json") -> None:
    """Serve ``/docs`` and ``/redoc`` from local assets (create ``app`` with
    ``docs_url=None, redoc_url=None``)."""
    app.mount(DOCS_ASSETS_PATH, StaticFiles(directory=docs_assets_dir()), name="docs-assets")
    title = f"{app.title} API"
    favicon = f"{DOCS_ASSETS_PATH}/favicon.png"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=title, swagger_favicon_url=favicon,
            swagger_js_url=f"{DOCS_ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS_PATH}/swagger-ui.css",
        )  # fmt: skip

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url, title=title, redoc_favicon_url=favicon,
            redoc_js_url=f"{DOCS_ASSETS_PATH}/redoc.standalone.js", with_google_fonts=False,
        )  # fmt: skip

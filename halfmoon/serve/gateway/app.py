"""The OpenAI-compatible HTTP gateway (FastAPI): validation, tokenization, streaming.

The gateway is written against :class:`~halfmoon.serve.gateway.backend.Backend`; placement,
prefill and decode happen behind it. Routes: ``/v1/completions``,
``/v1/chat/completions`` (SSE when ``stream``), ``/v1/models``, ``/health``, ``/metrics``;
extra routers under ``/admin/`` (e.g. scaling, :mod:`halfmoon.deploy.admin`) need the API key.
A client that disconnects mid-stream aborts its request, which frees its KV blocks.
Assembling the answer from the backend's streams is :mod:`halfmoon.serve.gateway.responses`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.serve.gateway.backend import Backend, BackendError, GenerationChunk, Rejected
from halfmoon.serve.gateway.http_limits import BodyLimit
from halfmoon.serve.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    usage,
)
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.responses import (
    Delta,
    HTTPError,
    Prepared,
    collect,
    merge_choices,
    sse,
)
from halfmoon.serve.gateway.tenancy import effective_salt, matching_key
from halfmoon.serve.gateway.text import OutputText

T = TypeVar("T")


#: What ``GatewayConfig.public`` may name, and the paths each opens without an API key.
PUBLIC_PATHS: dict[str, tuple[str, ...]] = {
    "metrics": ("/metrics",),
    "docs": ("/docs", "/redoc", "/openapi.json"),
}


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway serves and its limits."""

    model_name: str
    max_model_len: int
    default_max_tokens: int = 16
    max_tokens_limit: int = 4096
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    #: Requests in flight beyond this get 429 (back-pressure, never unbounded queues).
    max_concurrent_requests: int = 512
    #: Threads that tokenize and render chat templates, off the event loop (a 4 MB prompt
    #: takes ~1 s to tokenize; on the loop it froze every other client's stream).
    tokenizer_threads: int = 2
    #: More accepted API keys (``--api-key`` given several times), beside ``api_key``.
    api_keys: tuple[str, ...] = ()
    #: Salt each request's prefix-cache hashes with its API key: one tenant per key, and
    #: no tenant's ``cached_tokens`` reveal another's prompts (see halfmoon.serve.gateway.tenancy).
    cache_salt_from_api_key: bool = False
    #: With API keys, which of ``PUBLIC_PATHS`` stay readable without one (``metrics`` for
    #: a scraper without the key, ``docs`` for /docs, /redoc and /openapi.json).
    public: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.cache_salt_from_api_key and not self.keys:
            raise ValueError("cache_salt_from_api_key needs at least one API key")
        unknown = sorted(set(self.public) - set(PUBLIC_PATHS))
        if unknown:
            raise ValueError(f"unknown public paths {unknown}: choose from {sorted(PUBLIC_PATHS)}")

    def guarded_paths(self) -> tuple[str, ...]:
        """Path prefixes that need an API key (when the server has any): everything but
        /health and the paths made public."""
        private = [p for name, paths in PUBLIC_PATHS.items() if name not in self.public
                   for p in paths]  # fmt: skip
        return ("/v1/", "/admin/", "/tokenize", "/detokenize", *private)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (none: the server is open)."""
        return tuple(dict.fromkeys([*([self.api_key] if self.api_key else []), *self.api_keys]))


class Gateway:
    """Turns HTTP requests into backend generations (one instance per app)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: GatewayConfig) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = GatewayMetrics()
        # Request ids are unique across gateways and restarts (a random prefix per
        # gateway); the OpenAI responses show them as cmpl-<id> / chatcmpl-<id>.
        self._ids = IdGenerator(secrets.token_hex(4))
        self.in_flight = 0
        #: Requests being tokenized, counted against the limit too: before, a burst all
        #: passed the check (nothing in flight yet) and every request of it was tokenized
        #: before the excess was refused, behind the others on the tokenizer threads.
        self.preparing = 0
        self._cpu = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="gateway-cpu")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the gateway's CPU threads, so the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    # -- request preparation ---------------------------------------------------------------
    def prepare(
        self, body: CompletionRequest | ChatCompletionRequest, api_key: str | None = None
    ) -> Prepared:
        """Validate the model and lengths, tokenize, build sampling parameters; the
        caller's ``api_key`` salts its cache when the server salts by key."""
        cfg = self.config
        self.check_model(body.model)
        unsupported = body.unsupported()
        if unsupported:
            raise HTTPError(
                400, f"not supported by this server: {', '.join(unsupported)}", "BadRequestError"
            )
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt_ids = self.tokenizer.apply_chat_template(messages)
            max_tokens = body.output_limit(cfg.default_max_tokens)
        else:
            prompt_ids = self._completion_prompt(body)
            max_tokens = body.max_tokens
        if max_tokens > cfg.max_tokens_limit:
            raise HTTPError(
                400,
                f"max_tokens {max_tokens} exceeds this server's limit of {cfg.max_tokens_limit}",
                "BadRequestError",
            )
        if len(prompt_ids) + max_tokens > cfg.max_model_len:
            raise HTTPError(
                400,
                f"this model's maximum context length is {cfg.max_model_len} tokens; the "
                f"request has {len(prompt_ids)} prompt tokens and asks for {max_tokens} "
                "output tokens",
                "BadRequestError",
            )
        params = self._sampling_params(body, max_tokens)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(
            body.stream and include_usage and body.stream_options.continuous_usage_stats
        )
        return Prepared(
            self._ids.next(), prompt_ids, params, body.stop_strings(), include_usage, chat,
            continuous, self._echo_text(body, prompt_ids), body.n, body.include_stop_str_in_output,
            cache_salt=effective_salt(
                body.cache_salt, api_key if cfg.cache_salt_from_api_key else None
            ),
        )  # fmt: skip

    def _sampling_params(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int
    ) -> SamplingParams:
        """The request's sampling options, checked (a 400 names what is wrong)."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                stop=body.stop_strings(),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                top_k=body.top_k,
                logprobs=body.num_logprobs(),
                stop_token_ids=tuple(
                    self.checked_token_ids(body.stop_token_ids or (), "stop_token_ids")
                ),
                logit_bias=self._logit_bias(list((body.logit_bias or {}).items())),
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None

    def _echo_text(
        self, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int]
    ) -> str:
        """The prompt text a completion with ``echo`` sends first ("" otherwise)."""
        if not isinstance(body, CompletionRequest) or not body.echo:
            return ""
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            prompt = prompt[0]  # (one prompt in a list)
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)

    def _completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return self.checked_token_ids(prompt, "prompt token ids")

    def checked_token_ids(self, ids: Sequence[Any], what: str) -> list[int]:
        """``ids`` if they are all token ids of this vocabulary, else a 400 naming ``what``."""
        vocab = self.tokenizer.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise HTTPError(400, f"{what} must be integers in [0, {vocab})", "BadRequestError")
        return list(ids)

    def _logit_bias(self, pairs: list[tuple[str, float]]) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``{"token id": bias}`` as checked ``(id, bias)`` pairs, or a 400."""
        ids = []
        for key, _ in pairs:
            if not key.strip().isdigit():
                raise HTTPError(400, f"logit_bias key {key!r} is not a token id", "BadRequestError")
            ids.append(int(key))
        self.checked_token_ids(ids, "logit_bias keys")
        return tuple((token, float(bias)) for token, (_, bias) in zip(ids, pairs, strict=True))

    def check_model(self, model: str | None) -> None:
        """A 404 unless ``model`` is None or the one this server serves."""
        if model is not None and model != self.config.model_name:
            raise HTTPError(
                404,
                f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                "NotFoundError",
            )

    # -- generation --------------------------------------------------------------------------
    async def _chunks(self, p: Prepared) -> AsyncIterator[GenerationChunk]:
        self.metrics.running.inc()
        self.in_flight += 1
        try:
            # Only a salted request needs a backend that takes a salt.
            salt = {"cache_salt": p.cache_salt} if p.cache_salt is not None else {}
            async for chunk in self.backend.generate(p.request_id, p.prompt_ids, p.params, **salt):
                yield chunk
        finally:
            self.in_flight -= 1
            self.metrics.running.dec()

    def _observe_end(
        self,
        p: Prepared,
        arrival: float,
        times: list[float],
        out: OutputText,
        finish: str,
        cached: int | None,
        est_ttft: float | None,
    ) -> None:
        m = self.metrics
        if times:
            m.ttft.observe(times[0] - arrival)
            m.e2e.observe(times[-1] - arrival)
            if est_ttft is not None:
                m.ttft_estimate_error.observe(times[0] - arrival - est_ttft)
            for a, b in zip(times, times[1:], strict=False):
                m.itl.observe(b - a)
        m.prompt_tokens.inc(len(p.prompt_ids))
        m.generation_tokens.inc(out.num_tokens)
        m.prefix_cache_queries.inc(len(p.prompt_ids))
        m.prefix_cache_hits.inc(cached or 0)
        m.requests.labels(finished_reason=finish).inc()

    def token_text(self, token_id: int) -> str:
        """One token's text (for log-probabilities)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def run(self, p: Prepared) -> AsyncIterator[Delta]:
        """Yield (text delta, None, None, logprobs) as text arrives, then (tail, finish,
        usage, logprobs); ``logprobs`` are the entries of the tokens since the last yield."""
        arrival = time.monotonic()
        out = OutputText(self.tokenizer, p.prompt_ids, p.stop, p.include_stop)
        entries: list[tuple[int, TokenLogprob]] = []
        times: list[float] = []
        finish: str | None = None
        cached = est = None
        pending = ""
        try:
            async with aclosing(self._chunks(p)) as chunks:
                async for chunk in chunks:
                    if chunk.cached_tokens is not None:
                        cached, est = chunk.cached_tokens, chunk.est_ttft_s
                    self.metrics.kv_transfer_bytes.inc(chunk.kv_transfer_bytes)
                    if chunk.conductor_decision_s is not None:
                        self.metrics.conductor_decision.observe(chunk.conductor_decision_s)
                    if chunk.conductor_rtt_s is not None:
                        self.metrics.conductor_rtt.observe(chunk.conductor_rtt_s)
                    times += [time.monotonic()] * len(chunk.token_ids)
                    counted = out.num_tokens
                    delta = out.add(chunk.token_ids)
                    if chunk.logprobs:  # of the tokens the text kept (none past a stop)
                        kept = out.num_tokens - counted
                        entries += zip(chunk.token_ids[:kept], chunk.logprobs[:kept], strict=True)
                    finish = "stop" if out.stopped else chunk.finish_reason
                    if finish is not None:
                        pending = delta
                        if chunk.finish_reason is None:  # our stop string: end it upstream
                            await self.backend.abort(p.request_id)
                        break
                    if p.continuous_usage:  # every token batch, text or not
                        use = usage(len(p.prompt_ids), out.num_tokens, cached)
                        yield delta, None, use, entries
                        entries = []
                    elif delta:
                        yield delta, None, None, entries
                        entries = []
        except BaseException:
            await self.backend.abort(p.request_id)
            raise
        finish = finish or "abort"
        self._observe_end(p, arrival, times, out, finish, cached, est)
        use = usage(len(p.prompt_ids), out.num_tokens, cached)
        yield pending + out.flush(), finish, use, entries


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status, headers=headers)


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    config: GatewayConfig,
    admin_routers: Sequence[APIRouter] = (),
) -> FastAPI:
    """The FastAPI application serving ``backend``; ``admin_routers`` are mounted under
    ``/admin`` and answer only with the API key (403 when the server has none)."""
    gw = Gateway(backend, tokenizer, config)
    app = FastAPI(title="halfmoon", description="KV-cache-centric disaggregated LLM serving")
    app.state.gateway = gw
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # before auth: bounded
    for router in admin_routers:
        app.include_router(router, prefix="/admin")

    guarded = config.guarded_paths()

    @app.middleware("http")
    async def _guard(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/admin/") and not config.keys:
            return _error(403, "admin endpoints need an API key (--api-key)", "PermissionDenied")
        if config.keys and request.url.path.startswith(guarded):
            key = matching_key(request.headers.get("authorization"), config.keys)
            if key is None:
                return _error(401, "invalid or missing API key", "AuthenticationError")
            request.state.api_key = key  # the tenant (see GatewayConfig.cache_salt_from_api_key)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return _error(400, "; ".join(parts) or "invalid request", "BadRequestError")

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.headers)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        try:
            return {"status": "ok", **(await backend.health())}
        except Exception as exc:  # any failure means "not healthy"; say why
            raise HTTPError(503, f"not ready: {exc}", "ServiceUnavailable") from None

    @app.get("/metrics")
    async def metrics() -> Response:
        store_stats = getattr(backend, "store_stats", None)  # a cluster's workers' stores
        if store_stats is not None:
            try:  # cached by the backend; bounded anyway, so a scrape never hangs
                gw.metrics.store.stats = await asyncio.wait_for(store_stats(), 2.0)
            except (TimeoutError, BackendError):
                pass  # keep the last counters
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "halfmoon",
                    "max_model_len": config.max_model_len,
                }
            ],
        }

    def _check_busy(body: CompletionRequest | ChatCompletionRequest) -> None:
        busy = gw.in_flight + gw.preparing
        if busy + body.n > config.max_concurrent_requests:
            gw.metrics.rejections.inc()
            raise HTTPError(
                429, f"server busy: {busy} requests in flight", "RateLimitError",
                {"Retry-After": "1"},
            )  # fmt: skip

    async def _serve(
        body: CompletionRequest | ChatCompletionRequest, request: Request | None = None
    ) -> Response:
        _check_busy(body)  # refused at once, before tokenizing
        api_key = getattr(request.state, "api_key", None) if request is not None else None
        gw.preparing += body.n  # holds its place while tokenized (see Gateway.preparing)
        try:
            p = await gw.off_loop(gw.prepare, body, api_key)
        finally:
            gw.preparing -= body.n
        _check_busy(body)  # again: choices of n > 1 count only once their tasks start
        stream = merge_choices([gw.run(choice) for choice in p.choices()])
        try:
            first = await anext(stream)
        except Rejected as exc:
            await stream.aclose()
            gw.metrics.rejections.inc()
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
            raise HTTPError(
                429, f"request rejected: {exc.reason}", "RateLimitError", headers
            ) from None
        except BackendError as exc:
            await stream.aclose()
            gw.metrics.errors.inc()
            raise HTTPError(503, f"request failed: {exc}", "ServiceUnavailable") from None
        if body.stream:
            return StreamingResponse(
                sse(p, body.model, first, stream, gw.metrics, gw.token_text),
                media_type="text/event-stream",
            )
        return await collect(p, body.model, first, stream, gw.metrics, gw.token_text)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        gw.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give either prompt or messages", "BadRequestError")
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            tokens = await gw.off_loop(tokenizer.apply_chat_template, messages)
        else:
            tokens = await gw.off_loop(tokenizer.encode, body.prompt or "")
        return {"count": len(tokens), "max_model_len": config.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        gw.check_model(body.model)
        ids = gw.checked_token_ids(body.tokens, "tokens")
        return {"prompt": await gw.off_loop(tokenizer.decode, ids)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(body, request)

    return app

"""The gateway's request handling, without HTTP: :class:`GatewayConfig` (what it serves
and its limits) and :class:`Gateway` (validation, tokenization, sampling parameters, and
turning the backend's token streams into text deltas with usage and metrics). The routes
that call it are :func:`halfmoon.serve.gateway.app.create_app`'s.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from halfmoon.core.adapters import RuntimeAdapter, check_adapter_dir
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.hashing import adapter_salt
from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import (
    SCHEDULING_POLICIES,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)
from halfmoon.engine.structured import check, grammar_tokenizer
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.metrics.latency import tbt_gaps_s
from halfmoon.serve.gateway.access_log import note_generation
from halfmoon.serve.gateway.backend import Backend, BackendError, GenerationChunk
from halfmoon.serve.gateway.exposure import CorsPolicy
from halfmoon.serve.gateway.openai_api import (
    STRUCTURED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    Finish,
    usage,
)
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.request_ids import client_request_id
from halfmoon.serve.gateway.response_store import ResponseStore
from halfmoon.serve.gateway.responses import Delta, Entry, HTTPError, Prepared
from halfmoon.serve.gateway.tenancy import effective_salt
from halfmoon.serve.gateway.text import OutputText
from halfmoon.serve.gateway.timeseries import TimeSeries
from halfmoon.serve.gateway.tools import PARSERS, ToolMode

T = TypeVar("T")


#: What ``GatewayConfig.public`` may name, and the paths each opens without an API key.
PUBLIC_PATHS: dict[str, tuple[str, ...]] = {
    "metrics": ("/metrics",),
    "docs": ("/docs", "/redoc", "/openapi.json"),
}


@dataclass(frozen=True)
class GatewayConfig:
    """What the gateway serves and its limits: ``max_model_len`` caps prompt + output
    tokens, ``max_tokens_limit`` output tokens (None: ``max_model_len``, the only limit;
    ``/v1/models`` advertises both)."""

    model_name: str
    max_model_len: int
    max_tokens_limit: int | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    #: Requests in flight beyond this get 429 (back-pressure, never unbounded queues).
    max_concurrent_requests: int = 512
    #: Browser origins allowed to call the API (``--allowed-origins``; None: no CORS
    #: headers at all; halfmoon.serve.gateway.exposure).
    cors: CorsPolicy | None = None
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
    #: One log line per request: method, path, status, tokens, TTFT, total time
    #: (halfmoon.serve.gateway.access_log; ``halfmoon serve --disable-access-log``).
    access_log: bool = True
    #: Sampling options a request leaves out take these (the model's generation config,
    #: halfmoon.serve.gateway.generation; ``max_new_tokens``: a chat request's limit).
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)
    #: How ``tool_choice: "auto"`` reads the model's tool calls (``tools.PARSERS``; None:
    #: such requests are refused).
    tool_call_parser: str | None = None
    #: Bytes of Responses API answers kept for ``previous_response_id`` and
    #: ``GET /v1/responses/{id}`` (halfmoon.serve.gateway.response_store; 0: none kept).
    responses_store_bytes: int = 256 * 1024 * 1024
    #: The model's end-of-sequence token ids (generation.end_token_ids), where beam
    #: search ends a beam; the tokenizer's own is added.
    end_token_ids: tuple[int, ...] = ()
    #: The engines' queue order (``halfmoon serve --scheduling-policy``): a request's
    #: ``priority`` other than 0 is refused unless it is ``priority``, as vLLM does.
    scheduling_policy: str = "fcfs"
    #: LoRA adapters the engines serve, ``(name, path)``: a request whose ``model`` names
    #: one runs with it (``halfmoon serve --lora-modules``).
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: Serve vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    #: (``--allow-runtime-lora-updating``, or vLLM's environment switch).
    allow_runtime_lora: bool = False
    #: Every response carries ``X-Request-Id`` (``--enable-request-id-headers``;
    #: halfmoon.serve.gateway.request_ids).
    request_id_headers: bool = False
    #: vLLM's development endpoints (``POST /reset_prefix_cache``), as vLLM serves them
    #: under ``VLLM_SERVER_DEV_MODE=1`` (halfmoon.core.flags.dev_mode).
    dev_endpoints: bool = False

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}")
        names = [name for name, _ in self.lora_modules]
        if self.model_name in names or len(set(names)) < len(names):
            raise ValueError(f"LoRA adapter names must be unique and not {self.model_name!r}")
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}: {PARSERS}")
        if self.responses_store_bytes < 0:
            raise ValueError("responses_store_bytes must be >= 0")
        if self.max_model_len < 2 or (self.max_tokens_limit or 1) < 1:
            raise ValueError("max_model_len must be >= 2 and max_tokens_limit >= 1")
        if self.max_tokens_limit is None:  # frozen: set once, here
            object.__setattr__(self, "max_tokens_limit", self.max_model_len)
        if self.cache_salt_from_api_key and not self.keys:
            raise ValueError("cache_salt_from_api_key needs at least one API key")
        unknown = sorted(set(self.public) - set(PUBLIC_PATHS))
        if unknown:
            raise ValueError(f"unknown public paths {unknown}: choose from {sorted(PUBLIC_PATHS)}")

    def guarded_paths(self) -> tuple[str, ...]:
        """Path prefixes that need an API key (when the server has any): everything but
        /health (and /ping, its SageMaker name), the paths made public and the cluster page's shell (its data,
        /dashboard/state, needs the key)."""
        private = [p for name, paths in PUBLIC_PATHS.items() if name not in self.public
                   for p in paths]  # fmt: skip
        return ("/v1/", "/admin/", "/tokenize", "/detokenize", "/dashboard/state",
                "/reset_prefix_cache", "/invocations", "/load", *private)  # fmt: skip

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say: the base model, then each LoRA adapter."""
        return (self.model_name, *(name for name, _ in self.lora_modules))

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """A served model (the base one by default) as ``/v1/models`` lists it, with the
        limits it enforces; an adapter's card names its directory (``root``) and the base
        model (``parent``), as vLLM's does."""
        card = {
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "halfmoon",
            "root": self.model_name, "parent": None, "max_model_len": self.max_model_len,
            "max_tokens_limit": self.max_tokens_limit,
        }  # fmt: skip
        path = dict(self.lora_modules).get(name) if name is not None else None
        if path is not None:
            card.update(id=name, root=path, parent=self.model_name)
        return card

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (none: the server is open)."""
        return tuple(dict.fromkeys([*([self.api_key] if self.api_key else []), *self.api_keys]))


class Gateway:
    """Turns HTTP requests into backend generations (one instance per app)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: GatewayConfig) -> None:
        self.backend = backend
        #: One load or unload of a LoRA adapter at a time (each checks, then updates).
        self._adapter_lock = asyncio.Lock()
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = GatewayMetrics()
        #: Recent history for the live cluster page (halfmoon.serve.gateway.dashboard).
        self.series = TimeSeries()
        #: The re-planner's latest rounds, newest last (``--replan``; empty without it).
        self.replan_rounds: Sequence[dict[str, Any]] = ()
        #: Responses API answers kept for later turns.
        self.responses = ResponseStore(config.responses_store_bytes)
        eos = tokenizer.eos_token_id
        #: Where a beam ends (see halfmoon.serve.gateway.beam_search).
        self.end_token_ids = tuple(
            sorted({*config.end_token_ids, *([eos] if eos is not None else [])})
        )
        self.metrics.stored_responses.set_function(lambda: len(self.responses))
        self.metrics.stored_response_bytes.set_function(lambda: self.responses.bytes)
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
        self,
        body: CompletionRequest | ChatCompletionRequest,
        api_key: str | None = None,
        id_header: str | None = None,
    ) -> Prepared:
        """Validate the model and lengths, tokenize, build sampling parameters; the
        caller's ``api_key`` salts its cache when the server salts by key; the request's
        ``X-Request-Id`` (``id_header``) or ``request_id`` names its response."""
        cfg = self.config
        self.check_model(body.model)
        client_id = client_request_id(id_header, body.request_id)
        unsupported = body.unsupported()
        if unsupported:
            raise HTTPError(
                400,
                f"not supported by this server: {', '.join(unsupported)}",
                "BadRequestError",
                param=unsupported[0].split()[0],
            )
        self._check_priority(body.priority)
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            messages = [m.for_template() for m in body.messages]
            prompt_ids = self._truncated(self.chat_prompt(messages, body.template_options()),
                                         body.truncate_prompt_tokens)  # fmt: skip
            max_tokens = body.output_limit(0) or self._default_output(len(prompt_ids))
        else:
            batch = [self._truncated(self._completion_prompt(prompt, body.add_special_tokens),
                                     body.truncate_prompt_tokens)
                     for prompt in body.prompts()]  # fmt: skip
            prompt_ids = max(batch, key=len)  # the limits below hold for every prompt
            max_tokens = body.max_tokens or 1  # 0 (with echo): one is computed, none sent
        if max_tokens > cfg.max_tokens_limit:
            raise HTTPError(
                400,
                f"max_tokens {max_tokens} exceeds this server's limit of {cfg.max_tokens_limit}",
                "BadRequestError",
                param="max_completion_tokens"
                if chat and body.max_completion_tokens is not None
                else "max_tokens",
            )
        if len(prompt_ids) + max_tokens > cfg.max_model_len:
            raise HTTPError(
                400,
                f"this model's maximum context length is {cfg.max_model_len} tokens; the "
                f"request has {len(prompt_ids)} prompt tokens and asks for {max_tokens} "
                "output tokens",
                "BadRequestError",
                param="messages" if chat else "prompt",
            )
        tool_mode, tool_schema = self._tool_mode(body) if chat else (None, None)
        params = self._sampling_params(body, max_tokens, tool_schema)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(
            body.stream and include_usage and body.stream_options.continuous_usage_stats
        )
        if chat:  # (echo with tool calls: they would not parse)
            prompts = [(prompt_ids, "" if tool_mode else body.echo_text())]
        else:
            prompts = [(ids, self._echo_text(body, text, ids))
                       for text, ids in zip(body.prompts(), batch, strict=True)]  # fmt: skip
        (first_ids, first_echo), *more = prompts
        return Prepared(
            self._ids.next(), first_ids, params, body.stop_strings(), include_usage, chat,
            continuous, first_echo, body.n, body.include_stop_str_in_output,
            cache_salt=self._salt(body.cache_salt, api_key, params.lora),
            more=tuple(more),
            echo_logprobs=not chat and body.echo and body.logprobs is not None,
            echo_only=not chat and body.max_tokens == 0,
            show_prompt_logprobs=body.prompt_logprobs is not None,
            tool_mode=tool_mode,
            # (a tool-call format whose marker is a special token keeps them, as vLLM's
            # parser asks)
            skip_special_tokens=body.skip_special_tokens
            and not (tool_mode is not None and tool_mode.keeps_special_tokens),
            return_token_ids=bool(body.return_token_ids),
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            client_id=client_id,
        )  # fmt: skip

    def _default_output(self, num_prompt_tokens: int) -> int:
        """A chat request's output limit when it sets none, as in vLLM: the rest of the
        served context, within the server's limit and the model's ``max_new_tokens`` (at
        least 1: a prompt that fills the context is refused after)."""
        cfg = self.config
        limits = [cfg.max_model_len - num_prompt_tokens, cfg.max_tokens_limit]
        if "max_new_tokens" in cfg.sampling_defaults:
            limits.append(int(cfg.sampling_defaults["max_new_tokens"]))
        return max(1, min(limits))

    def chat_prompt(
        self, messages: list[dict[str, Any]], options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """``messages`` through the chat template (with ``options``: the request's
        :meth:`ChatTemplateOptions.template_options`), tokenized; a 400 when the model has
        no template or the template refuses them (``raise_exception``)."""
        try:
            return self.tokenizer.apply_chat_template(messages, **(options or {}))
        except HalfmoonError as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None

    def _tool_mode(self, body: ChatCompletionRequest) -> tuple[ToolMode | None, dict | None]:
        """:meth:`ChatCompletionRequest.tool_mode` under this server's tool-call parser
        (a 400 naming the field when malformed)."""
        try:
            return body.tool_mode(self.config.tool_call_parser)
        except FieldError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param=exc.param) from None

    def _sampling_params(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
        tool_schema: dict | None = None,
    ) -> SamplingParams:  # fmt: skip
        """The request's sampling options, checked (a 400 names what is wrong); an option
        the request leaves out takes the model's default where it has one; ``tool_schema``:
        what forced tool calls hold the output to."""
        defaults, given = self.config.sampling_defaults, body.model_fields_set

        def option(name: str) -> Any:
            return defaults[name] if name in defaults and name not in given else getattr(body, name)

        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=option("temperature"),
                top_p=option("top_p"),
                seed=body.seed,
                stop=body.stop_strings(),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                top_k=option("top_k"),
                min_p=option("min_p"),
                logprobs=body.num_logprobs(),
                prompt_logprobs=body.num_prompt_logprobs(),
                stop_token_ids=tuple(
                    self.checked_token_ids(body.stop_token_ids or (), "stop_token_ids")
                ),
                logit_bias=self._logit_bias(list((body.logit_bias or {}).items())),
                allowed_token_ids=tuple(
                    self.checked_token_ids(body.allowed_token_ids or (), "allowed_token_ids")
                ),
                presence_penalty=option("presence_penalty"),
                frequency_penalty=option("frequency_penalty"),
                repetition_penalty=option("repetition_penalty"),
                structured=self._structured(body, tool_schema),
                bad_words=self._bad_words(body.bad_words or ()),
                priority=body.priority,
                lora=self.lora_of(body.model),
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None

    def _check_priority(self, priority: int) -> None:
        """A 400 naming ``priority`` unless the engines schedule by it (or it is 0), or
        when it does not fit in 32 bits."""
        if priority and self.config.scheduling_policy != "priority":
            raise HTTPError(400, "priority other than 0 needs the priority scheduling "
                            "policy (halfmoon serve --scheduling-policy priority); this "
                            "server serves first come, first served", "BadRequestError",
                            param="priority")  # fmt: skip
        if not -(2**31) <= priority < 2**31:
            raise HTTPError(400, "priority must fit in 32 bits", "BadRequestError",
                            param="priority")  # fmt: skip

    def _bad_words(self, words: Sequence[str]) -> tuple[str, ...]:
        """``bad_words``, each checked to be some token (a 400 otherwise)."""
        try:
            self.tokenizer.bad_word_ids(words)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param="bad_words") from None
        return tuple(words)

    def _structured(
        self, body: CompletionRequest | ChatCompletionRequest, tool_schema: dict | None
    ) -> StructuredOutput | None:
        """The request's structured output, or the schema of its forced tool calls (both:
        a 400), compiled here once so that a bad schema, regex or grammar is a 400 naming
        its field, not a failure on a worker."""
        try:
            structured = body.structured_output()
            if tool_schema is not None:
                if structured is not None:
                    raise FieldError("tool_choice forces tool calls: give no other "
                                     "structured output", "tool_choice")  # fmt: skip
                # No whitespace of the model's choosing: programs read the arguments, and a
                # small model held to flexible JSON can wander in whitespace until max_tokens.
                structured = StructuredOutput("json", json.dumps(tool_schema), compact=True)
            if structured is not None:
                tok = self.tokenizer
                eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
                check(structured, grammar_tokenizer(tok, tok.vocab_size, eos))
        except (ValueError, HalfmoonError) as exc:
            fields = [f for f in STRUCTURED_FIELDS if getattr(body, f, None) is not None]
            param = getattr(exc, "param", None) or (fields[0] if fields else "tool_choice")
            raise HTTPError(400, str(exc), "BadRequestError", param=param) from None
        return structured

    def _echo_text(self, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> str:
        """The text of ``prompt`` (its token ``ids``, maybe truncated) a completion with
        ``echo`` sends first ("" otherwise)."""
        if not body.echo:
            return ""
        if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(ids)

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``keep`` prompt tokens (-1: as many
        as the context holds with one token of output); None keeps them all."""
        if keep is None:
            return ids
        limit = self.config.max_model_len - 1
        if keep > limit:
            raise HTTPError(400, f"truncate_prompt_tokens {keep} exceeds this model's context "
                            f"of {self.config.max_model_len} tokens (at most {limit})",
                            "BadRequestError", param="truncate_prompt_tokens")  # fmt: skip
        keep = limit if keep == -1 else keep
        return ids[-keep:] if keep else ids[:0]

    def _completion_prompt(self, prompt: str | list[int], special: bool = True) -> list[int]:
        """One prompt of a completion as token ids (token ids checked; text with the
        tokenizer's special tokens, e.g. BOS, unless ``special`` is False)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=special)
        return self.checked_token_ids(prompt, "prompt token ids")

    def checked_token_ids(self, ids: Sequence[Any], what: str) -> list[int]:
        """``ids`` if they are all token ids of this vocabulary, else a 400 naming ``what``."""
        vocab = self.tokenizer.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise HTTPError(400, f"{what} must be integers in [0, {vocab})", "BadRequestError",
                            param=what.split()[0])  # fmt: skip
        return list(ids)

    def _logit_bias(self, pairs: list[tuple[str, float]]) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``{"token id": bias}`` as checked ``(id, bias)`` pairs, or a 400."""
        ids = []
        for key, _ in pairs:
            if not key.strip().isdigit():
                raise HTTPError(400, f"logit_bias key {key!r} is not a token id",
                                "BadRequestError", param="logit_bias")  # fmt: skip
            ids.append(int(key))
        self.checked_token_ids(ids, "logit_bias keys")
        return tuple((token, float(bias)) for token, (_, bias) in zip(ids, pairs, strict=True))

    def _salt(self, cache_salt: str | None, api_key: str | None, lora: str | None) -> str | None:
        """The salt the request's blocks hash under: its own, its tenant's (API key) and
        its LoRA adapter's (:func:`~halfmoon.core.hashing.adapter_salt`); a 400 for a salt
        no request may send."""
        tenant = api_key if self.config.cache_salt_from_api_key else None
        try:
            return adapter_salt(effective_salt(cache_salt, tenant), self.adapter_key(lora))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param="cache_salt") from None

    # -- LoRA adapters ---------------------------------------------------------------------------
    @property
    def runtime_adapters(self) -> dict[str, RuntimeAdapter]:
        """LoRA adapters loaded while serving (the backend's view of the cluster's list)."""
        return getattr(self.backend, "adapters", {})

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say: the base model, the adapters it started
        with, then those loaded while serving."""
        static = self.config.model_names
        return (*static, *(n for n in self.runtime_adapters if n not in static))

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """:meth:`GatewayConfig.model_card`, for an adapter loaded while serving too."""
        adapter = self.runtime_adapters.get(name) if name is not None else None
        if adapter is None or name in self.config.model_names:
            return self.config.model_card(name)
        return {**self.config.model_card(), "id": name, "root": adapter.path,
                "parent": self.config.model_name}  # fmt: skip

    def adapter_key(self, lora: str | None) -> str | None:
        """What marks the prefix-cache chain of a request of adapter ``lora``
        (:func:`~halfmoon.core.adapters.lora_key`): its name, or ``name#tag`` for an
        adapter loaded while serving."""
        if lora is None or lora in self.config.model_names:
            return lora
        adapter = self.runtime_adapters.get(lora)
        return lora if adapter is None else adapter.key

    async def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> str:
        """vLLM's ``/v1/load_lora_adapter``: load the PEFT directory ``path`` as adapter
        ``name`` on every worker (all or none); its answer, or an HTTPError naming the
        problem (400: the request, 404: no adapter at ``path``)."""
        if not name or not path:
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                            "BadRequestError")  # fmt: skip
        if name == self.config.model_name:
            raise HTTPError(400, f"The lora adapter '{name}' conflicts with the base model "
                            "name.", "BadRequestError", param="lora_name")  # fmt: skip
        async with self._adapter_lock:
            if name in self.model_names:
                why = (
                    "reloading an adapter in place is not supported: unload it, then load it"
                    if load_inplace else f"The lora adapter '{name}' has already been loaded."
                )  # fmt: skip
                raise HTTPError(400, why, "BadRequestError", param="lora_name")
            try:
                adapter = RuntimeAdapter.new(name, path)
            except HalfmoonError as exc:
                raise HTTPError(400, str(exc), "BadRequestError", param="lora_name") from None
            try:
                check_adapter_dir(adapter.module)
            except HalfmoonError as exc:
                raise HTTPError(404, str(exc), "NotFoundError", param="lora_path") from None
            load = getattr(self.backend, "load_adapter", None)
            if load is None:
                raise HTTPError(400, "this server cannot load LoRA adapters while it serves",
                                "BadRequestError")  # fmt: skip
            try:
                await load(adapter)
            except BackendError as exc:
                raise HTTPError(400, f"LoRA adapter {name!r} not loaded: {exc}",
                                "BadRequestError", param="lora_path") from None  # fmt: skip
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_adapter(self, name: str) -> str:
        """vLLM's ``/v1/unload_lora_adapter``: no new request may name adapter ``name``;
        each worker drops it once the requests using it there have finished."""
        if not name:
            raise HTTPError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                            "BadRequestError")  # fmt: skip
        async with self._adapter_lock:
            if name in self.config.model_names:
                raise HTTPError(400, f"LoRA adapter '{name}' is served from the start "
                                "(--lora-modules) and stays", "BadRequestError",
                                param="lora_name")  # fmt: skip
            if name not in self.runtime_adapters:
                raise HTTPError(404, f"The lora adapter '{name}' cannot be found.",
                                "NotFoundError", param="lora_name")  # fmt: skip
            try:
                await self.backend.unload_adapter(name)
            except BackendError as exc:
                raise HTTPError(503, f"LoRA adapter {name!r} not unloaded: {exc}",
                                "ServiceUnavailable") from None  # fmt: skip
        return f"Success: LoRA adapter '{name}' removed successfully."

    def check_model(self, model: str | None) -> None:
        """A 404 unless ``model`` is None, the model this server serves or one of its LoRA
        adapters."""
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise HTTPError(
                404,
                f"model {model!r} does not exist; this server serves {served}",
                "NotFoundError",
                param="model",
            )

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the base model)."""
        return model if model is not None and model != self.config.model_name else None

    # -- generation --------------------------------------------------------------------------
    async def chunks(self, p: Prepared) -> AsyncIterator[GenerationChunk]:
        """The backend's chunks of ``p`` (one choice), counted as running meanwhile."""
        lora = p.params.lora
        self.metrics.running.inc()
        if lora is not None:
            self.metrics.lora_running.labels(lora_name=lora).inc()
        self.in_flight += 1
        try:
            # Only a salted request needs a backend that takes a salt.
            salt = {"cache_salt": p.cache_salt} if p.cache_salt is not None else {}
            async for chunk in self.backend.generate(p.request_id, p.prompt_ids, p.params, **salt):
                yield chunk
        finally:
            self.in_flight -= 1
            self.metrics.running.dec()
            if lora is not None:
                self.metrics.lora_running.labels(lora_name=lora).dec()

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
            for gap_s in tbt_gaps_s(times):
                m.itl.observe(gap_s)
        m.prompt_tokens.inc(len(p.prompt_ids))
        m.generation_tokens.inc(out.num_tokens)
        m.prefix_cache_queries.inc(len(p.prompt_ids))
        m.prefix_cache_hits.inc(cached or 0)
        m.requests.labels(finished_reason=finish).inc()
        if p.params.lora is not None:
            m.lora_requests.labels(lora_name=p.params.lora).inc()
        gaps_s = tbt_gaps_s(times)
        self.series.finished(times[0] - arrival if times else None, gaps_s, len(p.prompt_ids),
                             cached or 0, out.num_tokens)  # fmt: skip
        note_generation(len(p.prompt_ids), out.num_tokens, times[0] - arrival if times else None)

    def token_text(self, token_id: int) -> str:
        """One token's text (for log-probabilities)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def run(self, p: Prepared) -> AsyncIterator[Delta]:
        """Yield (text delta, None, None, logprobs, prompt) as text arrives, then (tail,
        finish, usage, logprobs, prompt); ``logprobs`` are the entries of the tokens since
        the last yield, ``prompt`` the prompt's entries (with the first yield, when the
        request asked for them; else None)."""
        arrival = time.monotonic()
        out = OutputText(self.tokenizer, p.prompt_ids, p.stop, p.include_stop,
                         p.skip_special_tokens)  # fmt: skip
        entries: list[Entry] = []
        prompt: list[Entry] | None = None
        times: list[float] = []
        finish: str | None = None
        cached = est = None
        pending = ""
        stopped_by: int | None = None  # the token that ended the request by itself
        try:
            async with aclosing(self.chunks(p)) as chunks:
                async for chunk in chunks:
                    if chunk.cached_tokens is not None:
                        cached, est = chunk.cached_tokens, chunk.est_ttft_s
                    if chunk.prompt_logprobs is not None:
                        prompt = self._prompt_entries(p.prompt_ids, chunk.prompt_logprobs)
                    self.metrics.kv_transfer_bytes.inc(chunk.kv_transfer_bytes)
                    self.series.kv_moved(chunk.kv_transfer_bytes)
                    if chunk.conductor_decision_s is not None:
                        self.metrics.conductor_decision.observe(chunk.conductor_decision_s)
                    if chunk.conductor_rtt_s is not None:
                        self.metrics.conductor_rtt.observe(chunk.conductor_rtt_s)
                    times += [time.monotonic()] * len(chunk.token_ids)
                    counted = out.num_tokens
                    if chunk.finish_reason == "stop" and chunk.token_ids:
                        if self._stop_token(p, chunk.token_ids[-1]):
                            stopped_by = chunk.token_ids[-1]
                    delta = out.add(chunk.token_ids, stopped_by is not None)
                    if p.echo_only:  # max_tokens 0: the prompt alone is the answer
                        delta = ""
                    elif chunk.logprobs or p.return_token_ids:  # only when they are shown:
                        kept = out.num_tokens - counted  # the tokens the text kept (none past
                        values = chunk.logprobs or (None,) * len(chunk.token_ids)  # a stop)
                        entries += zip(chunk.token_ids[:kept], values[:kept], strict=True)
                    finish = "stop" if out.stopped else chunk.finish_reason
                    if finish is not None:
                        pending = delta
                        if chunk.finish_reason is None:  # our stop string: end it upstream
                            await self.backend.abort(p.request_id)
                        break
                    if p.continuous_usage:  # every token batch, text or not
                        use = usage(len(p.prompt_ids), out.num_tokens, cached)
                        yield delta, None, use, entries, prompt
                        entries, prompt = [], None
                    elif delta:
                        yield delta, None, None, entries, prompt
                        entries, prompt = [], None
        except BaseException:
            await self.backend.abort(p.request_id)
            raise
        finish = finish or "abort"
        if finish == "stop":
            finish = Finish(finish, self._stop_reason(p, out, stopped_by))
        self._observe_end(p, arrival, times, out, finish, cached, est)
        if p.echo_only:
            use = usage(len(p.prompt_ids), 0, cached)
            yield "", finish, use, [], prompt
            return
        use = usage(len(p.prompt_ids), out.num_tokens, cached)
        yield pending + out.flush(), finish, use, entries, prompt

    def _stop_token(self, p: Prepared, token: int) -> bool:
        """Whether ``token`` ends ``p`` by itself: one of its ``stop_token_ids``, or an
        end-of-sequence token unless it ignores them (a backend that also ends requests
        at stop strings, as vLLM's do, says ``stop`` for those too)."""
        eos = token in self.end_token_ids and not p.params.ignore_eos
        return eos or token in p.params.stop_token_ids

    def _stop_reason(self, p: Prepared, out: OutputText, token: int | None) -> int | str | None:
        """What stopped a request that ended with ``stop`` (vLLM's ``stop_reason``): its
        stop string, or the ``token`` that ended it when that is one of its
        ``stop_token_ids`` and not an end-of-sequence token (vLLM answers None for those)."""
        if out.stop_string is not None:
            return out.stop_string
        if token in p.params.stop_token_ids and token not in self.end_token_ids:
            return token
        return None

    @staticmethod
    def _prompt_entries(prompt_ids: list[int], values: tuple[TokenLogprob, ...]) -> list[Entry]:
        """The prompt's ``(token id, log-probability)`` entries (None for the first
        token); a backend that sent the wrong number fails the request."""
        if len(values) != len(prompt_ids) - 1:
            raise BackendError(
                f"{len(values)} prompt log-probabilities for a prompt of {len(prompt_ids)} tokens"
            )
        return [(prompt_ids[0], None), *zip(prompt_ids[1:], values, strict=True)]

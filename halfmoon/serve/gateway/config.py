"""What a gateway serves and its limits (:class:`GatewayConfig`), and the paths that may
be opened without an API key (:data:`PUBLIC_PATHS`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.profiling import ProfilerConfig
from halfmoon.core.request import SCHEDULING_POLICIES
from halfmoon.serve.gateway.exposure import CorsPolicy
from halfmoon.serve.gateway.reasoning import PARSERS as REASONING_PARSERS
from halfmoon.serve.gateway.tools import PARSERS

#: What ``GatewayConfig.public`` may name, and the paths each opens without an API key.
PUBLIC_PATHS: dict[str, tuple[str, ...]] = {
    "metrics": ("/metrics",),
    "docs": ("/docs", "/redoc", "/openapi.json"),
}


def served_names(given: Sequence[str] | str | None) -> tuple[str, ...]:
    """``--served-model-name``'s values as a tuple (none given: empty; the first is the
    model's name, the rest its aliases)."""
    if given is None:
        return ()
    return (given,) if isinstance(given, str) else tuple(given)


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
    #: How chat answers' reasoning is told from their content (``reasoning.PARSERS``;
    #: None: the whole output is content).
    reasoning_parser: str | None = None
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
    #: torch's profiler over the workers' engine steps (``--profiler-config``): served
    #: ``POST /start_profile`` and ``/stop_profile`` (halfmoon.serve.gateway.profiling).
    profiler: ProfilerConfig | None = None
    #: vLLM's development endpoints (``POST /reset_prefix_cache``), as vLLM serves them
    #: under ``VLLM_SERVER_DEV_MODE=1`` (halfmoon.core.flags.dev_mode).
    dev_endpoints: bool = False
    #: More names a request's ``model`` may give the base model (``--served-model-name``'s
    #: further values, as vLLM's); metrics and SGLang's info name it by ``model_name``.
    model_aliases: tuple[str, ...] = ()
    #: vLLM's ``--default-chat-template-kwargs``: template variables every chat gets
    #: unless its ``chat_template_kwargs`` set them (e.g. ``{"enable_thinking": false}``).
    default_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: ``/openapi.json``, ``/docs`` and ``/redoc`` served (vLLM's
    #: ``--disable-fastapi-docs``: not).
    docs: bool = True
    #: vLLM's ``--return-tokens-as-token-ids``: every request's default.
    tokens_as_ids: bool = False
    #: vLLM's ``--enable-force-include-usage``: streamed answers end with their usage
    #: whether or not ``stream_options`` asks.
    force_include_usage: bool = False

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}")
        bases = self.base_names
        if len(set(bases)) < len(bases) or not all(bases):
            raise ValueError(f"the served model's names must be unique and not empty: {bases}")
        names = [name for name, _ in self.lora_modules]
        if set(bases) & set(names) or len(set(names)) < len(names):
            raise ValueError(f"LoRA adapter names must be unique and none of {bases}")
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}: {PARSERS}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r}: {REASONING_PARSERS}"
            )
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
        /health (and /ping, its SageMaker name), the paths made public and the cluster
        page's shell (its data, /dashboard/state, needs the key). (``/tokenize`` covers
        ``/tokenizer_info``; ``/abort_request``, ``/abort_requests``; ``/pause``,
        ``/pause_generation``; ``/update_weight``, ``/update_weights_from_disk`` and
        ``/update_weight_version``.)"""
        private = [p for name, paths in PUBLIC_PATHS.items() if name not in self.public
                   for p in paths]  # fmt: skip
        return ("/v1/", "/admin/", "/tokenize", "/detokenize", "/dashboard/state",
                "/reset_prefix_cache", "/invocations", "/load", "/inference/",
                "/abort_request", "/generate", "/model_info", "/get_model_info", "/pause",
                "/resume", "/is_paused", "/update_weight", "/weight_info", "/continue_generation",
                "/flush_cache", "/server_info", "/get_server_info", "/health_generate",
                "/score", "/rerank", "/v2/", "/sleep", "/wake_up", "/is_sleeping",
                "/release_kv_cache_memory", "/release_memory_occupation", "/start_profile",
                "/stop_profile", "/separate_reasoning", *private)  # fmt: skip

    @property
    def base_names(self) -> tuple[str, ...]:
        """The base model's names: its own, then its aliases."""
        return (self.model_name, *self.model_aliases)

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say: the base model (each of its names), then
        each LoRA adapter."""
        return (*self.base_names, *(name for name, _ in self.lora_modules))

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
        elif name in self.model_aliases:
            card["id"] = name
        return card

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (none: the server is open)."""
        return tuple(dict.fromkeys([*([self.api_key] if self.api_key else []), *self.api_keys]))

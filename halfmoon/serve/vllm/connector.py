"""A vLLM OpenAI server behind halfmoon's engine connector (coupled serving, #19 item 1).

:class:`VllmServerConnector` is an :class:`~halfmoon.engine.connector.EngineConnector`
whose engine is a vLLM server in another process, so a halfmoon worker (its coupled role,
its Conductor link, heartbeats, load reports, draining) runs unchanged in front of it:

- ``add_request`` streams ``POST /v1/completions`` (prompt as token ids,
  ``return_token_ids``, usage with ``cached_tokens`` at the end) on a thread of its own
  (an asyncio loop with one httpx client); ``step`` hands over the tokens that came since
  the last call, waiting at most :data:`STEP_WAIT_S` for the first;
- ``abort_request`` closes the request's stream (vLLM aborts a request whose client went);
- the server's KV events come in on a subscriber thread, are translated into halfmoon's
  ``BlockStored`` / ``BlockEvicted`` (:class:`~halfmoon.serve.vllm.kv_events.HashTranslator`)
  on the engine thread inside ``step``, and go to the cache listener like the events of
  halfmoon's own pool: the Conductor's index sees what each vLLM instance holds;
- load (requests waiting, KV usage) is read from the server's ``/metrics`` every
  :data:`METRICS_INTERVAL_S`;
- a request vLLM refuses (HTTP 4xx) fails with vLLM's message; one whose connection
  breaks fails *retryable*, so the gateway places it again on another instance; when the
  worker's own vLLM process dies, :meth:`has_unfinished_requests` raises and the worker
  exits (``halfmoon serve`` restarts it, with a new vLLM).

For disaggregated serving (#19 item 2) the KV moves inside vLLM, through halfmoon's KV
connector (:mod:`halfmoon.vllm_kv`): :meth:`VllmServerConnector.add_prefill` asks for a
prefill whose ``kv_transfer_params`` name the decode instance, and ``add_request`` with the
answer's params decodes (:mod:`halfmoon.serve.vllm.roles`). The in-process KV half of the
engine interface (handoff bytes, seeding, pipeline stages) raises here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from halfmoon.core.adapters import RUNTIME_LORA_ENV, RuntimeAdapter
from halfmoon.core.errors import HalfmoonError, Unsupported
from halfmoon.core.events import CacheEvent
from halfmoon.core.flags import DEV_MODE_ENV
from halfmoon.core.profiling import (
    STOP_TIMEOUT_S,
    ProfilerConfig,
    ProfileSession,
    parse_profiler_config,
)
from halfmoon.core.request import SamplingParams, StructuredOutput, TokenLogprob
from halfmoon.core.speculative import SpecDecodeCounts
from halfmoon.costmodel import CostProfile
from halfmoon.engine.config import EngineConfig, checkpoint_of, read_config
from halfmoon.engine.connector import (
    CacheListener,
    EngineConnector,
    EngineStats,
    HandoffState,
    KVLayout,
    PromptKVHook,
    RequestFailure,
    RequestOutput,
    StageConnector,
    model_kv_layout,
)
from halfmoon.engine.structured import after_reasoning
from halfmoon.serve.vllm.kv_events import HashTranslator
from halfmoon.serve.vllm.server import (
    ServerFacts,
    VllmEndpoints,
    VllmProcess,
    check_server,
    parse_metric_values,
    server_facts,
)
from halfmoon.serve.vllm.subscriber import KVEventSubscriber

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request

#: ``step`` waits at most this long for the first token (the worker loop then looks at
#: its commands again): short enough not to delay a new request, long enough not to spin.
STEP_WAIT_S = 0.005
METRICS_INTERVAL_S = 0.5
#: vLLM's metric names read for load reports.
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
#: vLLM's speculative-decoding counters (exported when it speculates), in
#: :class:`SpecDecodeCounts`' order; the per-position one by its ``position`` label.
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
#: vLLM's generated tokens: each sequence-step gave one plus its accepted drafts.
GENERATION_TOKENS = "vllm:generation_tokens_total"


#: Why an embedding (score, rerank) is refused behind ``--engine vllm``.
NO_POOLING = ("embeddings are served by halfmoon's engine: a vLLM server started to generate "
              "does not pool (--engine halfmoon)")  # fmt: skip


class VllmUnsupported(Unsupported):
    """What a vLLM server behind the coupled connector cannot do (moving KV in or out:
    that needs halfmoon's KV connector inside vLLM)."""


@dataclass
class _Request:
    """A request in flight at the server."""

    prompt_len: int
    future: Any = None
    tokens: list[int] = field(default_factory=list)
    cached: int = 0


def spec_counts(text: str) -> SpecDecodeCounts | None:
    """vLLM's speculative-decoding counters in a ``/metrics`` page, or None where it
    exports none (it does not speculate). Its sequence-steps are its generated tokens less
    the accepted drafts (each step of a sequence gave one token plus those)."""
    totals = parse_metric_values(text, (*SPEC_COUNTERS, GENERATION_TOKENS))
    if not totals.keys() & set(SPEC_COUNTERS):
        return None
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith(SPEC_PER_POSITION + "{") and 'position="' in line:
            position = line.split('position="', 1)[1].split('"', 1)[0]
            with contextlib.suppress(ValueError):
                value = float(line.rsplit(" ", 1)[1])
                per_position[int(position)] = per_position.get(int(position), 0.0) + value
    accepted = [int(per_position.get(i, 0)) for i in range(max(per_position, default=-1) + 1)]
    drafts, tokens, accepted_total = (int(totals.get(name, 0.0)) for name in SPEC_COUNTERS)
    steps = max(0, int(totals.get(GENERATION_TOKENS, 0.0)) - accepted_total)
    return SpecDecodeCounts(drafts, tokens, accepted_total, tuple(accepted), steps)


def prefill_tokens(requests: Iterable[_Request]) -> int:
    """Prompt tokens of the requests that have no token yet: the server is still to
    prefill them, as far as its answers tell (its metrics count requests, not tokens;
    prefix-cache hits are only known once a request finishes)."""
    return sum(req.prompt_len for req in requests if not req.tokens)


@dataclass
class _Chunk:
    """What one stream message brought (the stream thread -> the engine thread)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish: str | None = None
    cached: int | None = None
    failure: RequestFailure | None = None
    transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def request_body(
    model: str, token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None
) -> dict[str, Any]:
    """The ``/v1/completions`` body of one request (token ids in, token ids out)."""
    body: dict[str, Any] = {
        # (a LoRA adapter is its own model on vLLM's server: --lora-modules names it)
        "model": params.lora or model, "prompt": list(token_ids), "max_tokens": params.max_tokens,
        "temperature": params.temperature, "top_p": params.top_p, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "ignore_eos": params.ignore_eos, "min_tokens": params.min_tokens,
        "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids),
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        # Always sent, 0 (off) too: the gateway has applied the model's defaults already,
        # and an option left out would take the vLLM server's own.
        "top_k": params.top_k, "min_p": params.min_p,
        # The gateway cuts the text at a stop string from the token ids it gets.
        "include_stop_str_in_output": True,
    }  # fmt: skip
    if params.seed is not None:
        body["seed"] = params.seed
    if params.logit_bias:
        body["logit_bias"] = {str(tid): bias for tid, bias in params.logit_bias}
    if params.allowed_token_ids:
        body["allowed_token_ids"] = list(params.allowed_token_ids)
    if params.logprobs is not None:
        body["logprobs"] = params.logprobs
        body["return_tokens_as_token_ids"] = True
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if params.structured is not None:
        body["structured_outputs"] = structured_outputs_body(params.structured)
    if params.bad_words:
        body["bad_words"] = list(params.bad_words)
    if params.priority:  # (its server runs --scheduling-policy priority: the gateway checked)
        body["priority"] = params.priority
    if params.thinking_token_budget is not None:  # (its server has the reasoning tags)
        body["thinking_token_budget"] = params.thinking_token_budget
    if params.prompt_logprobs is not None:  # (vLLM returns them in a whole answer only)
        body["prompt_logprobs"] = params.prompt_logprobs
    return body


def whole_answer(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for one whole answer instead of a stream."""
    body["stream"] = False
    body.pop("stream_options", None)
    return body


def structured_outputs_body(structured: StructuredOutput) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` object for ``structured`` (on a disaggregated vLLM
    pair both sides get it: the decode side generates every output token). One held
    after a reasoning goes as the Lark grammar halfmoon's engine follows (vLLM's guidance
    backend reads it; its JSON options inside), so that the servers need no reasoning
    parser of their own."""
    if structured.reasoning:
        return {"grammar": after_reasoning(structured)}
    kind, spec = structured.kind, structured.spec
    value: Any = {"json": json.loads, "choice": json.loads}.get(kind, str)(spec)
    if kind == "structural_tag":  # vLLM takes it as JSON text, with its type
        value = json.dumps({"type": "structural_tag", **json.loads(spec)})
    out = {
        kind: True if kind == "json_object" else value,
        "disable_any_whitespace": structured.compact,
        "disable_additional_properties": structured.closed,
    }
    if structured.whitespace:
        out["whitespace_pattern"] = structured.whitespace
    return out


def _error_message(text: str) -> str:
    """The message of a vLLM error answer (its OpenAI-style ``error`` object), else the
    text's first 500 characters."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


def _refused(request_id: str, status: int, text: str) -> _Chunk:
    """A request vLLM answered with an HTTP error (5xx: retryable elsewhere)."""
    message = _error_message(text)
    failure = RequestFailure(
        request_id, f"vLLM refused the request ({status}): {message}", retryable=status >= 500
    )
    return _Chunk(request_id, [], [], failure=failure)


def _token_id(text: str) -> int:
    """``token_id:123`` (``return_tokens_as_token_ids``) -> 123."""
    return int(text.rsplit(":", 1)[1])


def parse_logprobs(raw: dict[str, Any] | None, num_tokens: int) -> list[TokenLogprob]:
    """A stream choice's ``logprobs`` as halfmoon's entries (empty when not asked for)."""
    if not raw:
        return []
    values = raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or [None] * len(values)
    out = []
    for value, top in zip(values[:num_tokens], tops[:num_tokens], strict=False):
        pairs = sorted(((_token_id(k), float(v)) for k, v in (top or {}).items()),
                       key=lambda p: -p[1])  # fmt: skip
        out.append(TokenLogprob(float(value), tuple(pairs)))
    return out


def parse_prompt_logprobs(
    raw: list[Any] | None, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprob]:
    """vLLM's ``prompt_logprobs`` of a whole answer (None at the first position, then per
    position ``{token id: {logprob, rank, decoded_token}}``: the prompt's token and the
    ``num_top`` likeliest) as halfmoon's entries for prompt tokens 1..n-1; ValueError when
    a position lacks its token."""
    out = []
    for position, entry in enumerate((raw or [])[1:], start=1):
        values = {int(tid): value for tid, value in (entry or {}).items()}
        target = token_ids[position]
        if target not in values:
            raise ValueError(f"vLLM's prompt_logprobs lack token {target} at {position}")
        top = sorted(((tid, float(v["logprob"])) for tid, v in values.items()
                      if v.get("rank") is not None and v["rank"] <= num_top),
                     key=lambda pair: -pair[1])[:num_top]  # fmt: skip
        mine = values[target]
        rank = mine.get("rank")
        out.append(TokenLogprob(float(mine["logprob"]), tuple(top),
                                None if rank is None else int(rank)))  # fmt: skip
    if len(out) != max(0, len(token_ids) - 1):
        raise ValueError(f"vLLM's prompt_logprobs cover {len(out) + 1} of "
                         f"{len(token_ids)} prompt tokens")  # fmt: skip
    return out


def parse_event(data: str, request_id: str) -> _Chunk:
    """One ``data:`` line of vLLM's completion stream."""
    chunk = json.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return _Chunk(request_id, [], [], failure=RequestFailure(request_id, f"vLLM: {message}"))
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish = None
    for choice in chunk.get("choices") or []:
        new = [int(t) for t in choice.get("token_ids") or []]
        ids += new
        logprobs += parse_logprobs(choice.get("logprobs"), len(new))
        finish = choice.get("finish_reason") or finish
    cached = None
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
    return _Chunk(request_id, ids, logprobs, finish, cached)


class StreamReader:
    """Turns the ``data:`` lines of one request's completion stream into chunks.

    The message that finishes the request is held until the stream ends (vLLM's usage
    message follows it), and its tokens go out with the finish: a reader of the chunks
    then sees the token that stopped the request (an end-of-sequence token or a
    ``stop_token_ids`` entry) together with the finish, and can leave its text out before
    any of it was shown. (Before, the finish waited and its tokens did not, so whether
    they arrived with it depended on timing.)"""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.last: _Chunk | None = None  # the finishing message, held
        self.done = False  # [DONE] seen

    def feed(self, line: str) -> _Chunk | None:
        """One line of the stream: the chunk to hand over now, or None (nothing, or held)."""
        if self.done or not line.startswith("data:"):
            return None
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return None
        chunk = parse_event(data, self.request_id)
        if chunk.failure:
            return chunk
        last = self.last
        if last is not None:  # after the finish (its usage): joins the held message
            last.token_ids += chunk.token_ids
            last.logprobs += chunk.logprobs
            last.cached = chunk.cached if chunk.cached is not None else last.cached
            last.finish = chunk.finish or last.finish
            return None
        if chunk.finish:
            self.last = chunk
            return None
        return chunk if chunk.token_ids or chunk.cached is not None else None

    def end(self) -> _Chunk:
        """The closing chunk once the stream ended: the held message with its finish, or
        a retryable failure when vLLM ended the request without finishing it."""
        last = self.last
        if last is None or last.finish in ("abort", "error"):
            finish = None if last is None else last.finish
            failure = RequestFailure(
                self.request_id, f"vLLM ended the request without finishing ({finish})",
                retryable=True,
            )  # fmt: skip
            return _Chunk(self.request_id, [], [], failure=failure)
        return last


def parse_completion(
    answer: dict[str, Any], request_id: str, prompt: tuple[Sequence[int], int] | None = None
) -> _Chunk:
    """A whole (not streamed) ``/v1/completions`` answer: its tokens (and their
    log-probabilities when asked for), finish, cached prompt tokens, the KV connector's
    ``kv_transfer_params``, and with ``prompt`` (its token ids and how many likeliest
    tokens were asked for) its prompt log-probabilities."""
    choice = (answer.get("choices") or [{}])[0]
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    ids = [int(t) for t in choice.get("token_ids") or []]
    return _Chunk(
        request_id, ids, parse_logprobs(choice.get("logprobs"), len(ids)),
        finish=choice.get("finish_reason") or "length",
        cached=int(details.get("cached_tokens") or 0),
        transfer_params=answer.get("kv_transfer_params"),
        prompt_logprobs=(
            None if prompt is None
            else parse_prompt_logprobs(choice.get("prompt_logprobs"), *prompt)
        ),
    )  # fmt: skip


class VllmServerConnector(EngineConnector):
    """A vLLM OpenAI server as this worker's engine (module docstring).

    ``process``: the server this worker started (its death ends the worker), or None for
    a server the user runs (``--vllm-url``)."""

    cached_tokens_at_finish = True  # vLLM reports them in the request's final usage

    def load_lora(self, adapter: RuntimeAdapter) -> None:
        """vLLM's own ``/v1/load_lora_adapter`` on this worker's server (started with its
        runtime switch by ``--allow-runtime-lora-updating``); HalfmoonError with the
        server's reason. (vLLM keys an adapter's prefix blocks by name and path; the
        requests' cache salt, which carries the load's tag, keeps a reload apart.)"""
        self._lora_call("load", {"lora_name": adapter.name, "lora_path": adapter.path})

    def unload_lora(self, name: str) -> None:
        """vLLM's own ``/v1/unload_lora_adapter`` on this worker's server."""
        self._lora_call("unload", {"lora_name": name})

    def reset_prefix_cache(self) -> bool:
        """vLLM's own ``/reset_prefix_cache`` on this worker's server, one of its
        development endpoints (the server runs with ``VLLM_SERVER_DEV_MODE=1``, which a
        server halfmoon starts inherits); its KV events tell the Conductor."""
        resp = self._dev_call("POST", "/reset_prefix_cache", 60.0)
        try:
            success = bool(resp.json()["success"])
        except (ValueError, KeyError, TypeError):
            success = True  # (older servers answer 200 with no body)
        if success:
            # vLLM queues its AllBlocksCleared event until its engine's next step, which
            # an idle server may not take for long: the Conductor hears the evictions now
            # (the events already here first; vLLM's own, when it comes, clears nothing
            # more, and what it stores after comes after it).
            self._drain_events()
            for event in self._translator.clear(self.instance_id):
                if self._listener is not None:
                    self._listener(event)
        return success

    def start_profile(self, config: ProfilerConfig, session: ProfileSession, name: str) -> None:
        """vLLM's own ``/start_profile`` on this worker's server, with the session's
        prefix and bounds: a server halfmoon starts runs with the cluster's
        ``--profiler-config``, writing into a directory of its own under the config's; an
        attached one with the profiler config it was started with (without one it has no
        such route: :class:`Unsupported`)."""
        body = {k: v for k, v in dataclasses.asdict(session).items() if v is not None}
        self._dev_call("POST", "/start_profile", 120.0, json=body or None,
                       missing="it was started without --profiler-config")  # fmt: skip
        self._profile_since = time.time()

    def stop_profile(self) -> list[str]:
        """vLLM's own ``/stop_profile`` on this worker's server (it writes its traces
        before it answers): the trace files written into its directory since the start
        (none listed for an attached server: its directory is its own)."""
        self._dev_call("POST", "/stop_profile", STOP_TIMEOUT_S,
                       missing="it was started without --profiler-config")  # fmt: skip
        since, self._profile_since = self._profile_since, None
        launch = getattr(self.process, "launch", None)
        config = parse_profiler_config(getattr(launch, "profiler_config", None))
        if since is None or config is None:
            return []
        directory = Path(config.torch_profiler_dir)
        return sorted(str(p) for p in directory.rglob("*")
                      if p.is_file() and p.stat().st_mtime >= since - 1.0)  # fmt: skip

    def stage_weights(self, model_path: str) -> object:
        """Check the checkpoint that :meth:`commit_weights` has vLLM read: what
        ``--model`` takes, of the served model's architecture (HalfmoonError naming what
        differs), for a server that reloads in place correctly: not vLLM's CPU build,
        whose reload (0.32) leaves a server started on one checkpoint answering as
        neither that one nor the new one (measured with SmolLM2, docs/serving.md). vLLM
        reads nothing ahead: a checkpoint whose tensors do not load fails at the
        commit."""
        served = read_config(Path(self._config.model))
        path = checkpoint_of(served, model_path)[0]
        device = self._server_config().get("device_config") or {}
        if "cpu" in (device.get("device_type"), str(device.get("device"))):
            raise HalfmoonError(
                f"the vLLM server at {self.endpoints.url} runs vLLM's CPU build, whose "
                "in-place reload does not install every weight (its answers then match "
                "neither checkpoint): restart it on the new checkpoint instead"
            )
        return path

    def _server_config(self) -> dict[str, Any]:
        """The server's configuration (its ``/server_info``, another development
        endpoint), as JSON."""
        resp = self._dev_call("GET", "/server_info", 120.0, params={"config_format": "json"})
        try:
            config = resp.json()["vllm_config"]
            assert isinstance(config, dict)
            return config
        except (ValueError, KeyError, TypeError, AssertionError):
            raise HalfmoonError(f"vLLM's /server_info answered {resp.status_code}: "
                                f"{_error_message(resp.text)}") from None  # fmt: skip

    def commit_weights(self, staged: object) -> None:
        """vLLM's own in-place reload of the staged checkpoint (its workers'
        ``reload_weights``, through its ``/collective_rpc`` development endpoint: the
        server runs with ``VLLM_SERVER_DEV_MODE=1``), then its prefix cache reset."""
        assert isinstance(staged, Path)
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(staged)}}
        self._dev_call("POST", "/collective_rpc", 600.0, json=body)
        if not self.reset_prefix_cache():
            raise HalfmoonError("vLLM reloaded its weights but kept its prefix cache: "
                                "requests hold blocks")  # fmt: skip
        log.info("vLLM at %s reloaded its weights from %s", self.endpoints.url, staged)

    def _dev_call(
        self, method: str, path: str, timeout_s: float, missing: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One of vLLM's development (or otherwise optional) endpoints on this worker's
        server: its 200 answer, else a HalfmoonError naming why (404: the server runs
        without ``VLLM_SERVER_DEV_MODE=1``, which a server halfmoon starts inherits; or,
        as :class:`Unsupported`, the ``missing`` reason)."""
        try:
            resp = httpx.request(method, f"{self.endpoints.url}{path}", timeout=timeout_s,
                                 **kwargs)  # fmt: skip
        except httpx.HTTPError as exc:
            raise HalfmoonError(f"vLLM at {self.endpoints.url}: {exc!r}") from None
        if resp.status_code == 404 and missing is not None:
            raise Unsupported(f"the vLLM server at {self.endpoints.url} has no {path}: {missing}")
        if resp.status_code == 404:
            raise HalfmoonError(f"the vLLM server at {self.endpoints.url} has no {path} "
                                f"(start it with {DEV_MODE_ENV}=1)")  # fmt: skip
        if resp.status_code != 200:
            raise HalfmoonError(f"vLLM's {path} ({resp.status_code}): "
                                f"{_error_message(resp.text)}")  # fmt: skip
        return resp

    def _lora_call(self, op: str, body: dict[str, str]) -> None:
        url = f"{self.endpoints.url}/v1/{op}_lora_adapter"
        try:
            resp = httpx.post(url, json=body, timeout=120.0)
        except httpx.HTTPError as exc:
            raise HalfmoonError(f"vLLM at {self.endpoints.url}: {exc!r}") from None
        if resp.status_code == 200:
            return
        if resp.status_code == 404 and resp.text.strip() == '{"detail":"Not Found"}':
            raise HalfmoonError(  # (the route itself is missing)
                f"the vLLM server at {self.endpoints.url} does not load LoRA adapters while "
                f"serving (start it with --enable-lora and {RUNTIME_LORA_ENV}=True)"
            )
        raise HalfmoonError(f"vLLM ({resp.status_code}): {_error_message(resp.text)}")

    def __init__(
        self, endpoints: VllmEndpoints, *, model_dir: str, instance_id: str,
        block_size: int = 16, dtype: str = "float32", process: VllmProcess | None = None,
    ) -> None:  # fmt: skip
        self.endpoints = endpoints
        self.instance_id = instance_id
        self.process = process
        #: When the profiling session on its server started (None: no session).
        self._profile_since: float | None = None
        self.facts: ServerFacts = server_facts(endpoints.url)
        check_server(self.facts, block_size, endpoints.url)
        self._layout = model_kv_layout(model_dir, block_size, dtype)
        # The pool in halfmoon's blocks (a vLLM block may hold several).
        self._num_blocks = self.facts.num_blocks * (self.facts.block_size // block_size)
        self._config = EngineConfig(
            model=model_dir, dtype=dtype, block_size=block_size,
            kv_cache_mb=max(1e-3, self._num_blocks * self._layout.bytes_per_block / 2**20),
            max_model_len=self.facts.max_model_len or None, prepack_weights=False,
        )  # fmt: skip
        self._requests: dict[str, _Request] = {}
        self._chunks: queue.SimpleQueue[_Chunk] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failures: list[RequestFailure] = []
        self._transfer_params: dict[str, dict[str, Any]] = {}
        self._translator = HashTranslator(block_size)
        self._listener: CacheListener | None = None
        #: The KV-event subscriber (its ``stats``: gaps, missed batches), once connected.
        self.subscriber: KVEventSubscriber | None = None
        self._warned_topic = False
        self._load = {WAITING: 0.0, KV_USAGE: 0.0}
        #: The server's speculative-decoding counters (None until it reports any).
        self._spec: SpecDecodeCounts | None = None
        #: The server's own ``/metrics`` text as last polled (vLLM's names): the worker's
        #: answer to a ``metrics_query`` carries it after its own.
        self.metrics_text = ""
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._loop_thread = threading.Thread(target=self._run_loop, name="vllm-http", daemon=True)
        self._loop_thread.start()
        self._events_thread = threading.Thread(
            target=self._run_events, name="vllm-events", daemon=True
        )
        self._events_thread.start()

    # -- threads -------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            base_url=self.endpoints.url, limits=limits,
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
        )  # fmt: skip
        self._loop.create_task(self._poll_metrics())
        self._loop.run_forever()

    def _run_events(self) -> None:
        try:
            sub = KVEventSubscriber(
                self.endpoints.events, topic=self.endpoints.topic,
                replay_endpoint=self.endpoints.replay,
            )  # fmt: skip
        except HalfmoonError as exc:
            log.error("no KV events from %s: %s", self.endpoints.url, exc)
            return
        self.subscriber = sub
        with sub:
            sub.run(self._events.put, self._stop)

    async def _poll_metrics(self) -> None:
        assert self._client is not None
        while not self._stop.is_set():
            try:
                resp = await self._client.get("/metrics", timeout=2.0)
                self._load.update(parse_metric_values(resp.text, (WAITING, KV_USAGE)))
                if resp.status_code == 200:
                    self.metrics_text = resp.text
                    self._spec = spec_counts(resp.text) or self._spec
            except httpx.HTTPError as exc:
                log.debug("metrics of %s: %s", self.endpoints.url, exc)
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def _stream(self, request_id: str, body: dict[str, Any]) -> None:
        assert self._client is not None
        put = self._chunks.put
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    put(_refused(request_id, resp.status_code, text))
                    return
                reader = StreamReader(request_id)
                async for line in resp.aiter_lines():
                    chunk = reader.feed(line)
                    if chunk is not None:
                        put(chunk)
                        if chunk.failure:
                            return
                    if reader.done:
                        break
                put(reader.end())
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, OSError, ValueError) as exc:
            failure = RequestFailure(
                request_id, f"lost vLLM at {self.endpoints.url}: {exc!r}", retryable=True
            )
            put(_Chunk(request_id, [], [], failure=failure))

    async def _complete(
        self, request_id: str, body: dict[str, Any],
        prompt: tuple[Sequence[int], int] | None = None,
    ) -> None:  # fmt: skip
        """One non-streamed completion (a disaggregated prefill: vLLM returns the KV
        connector's ``kv_transfer_params`` only in a whole response; a request for
        prompt log-probabilities, which vLLM streams in no form halfmoon reads: see
        :func:`parse_completion` for ``prompt``)."""
        assert self._client is not None
        try:
            resp = await self._client.post("/v1/completions", json=body)
            if resp.status_code != 200:
                self._chunks.put(_refused(request_id, resp.status_code, resp.text))
                return
            self._chunks.put(parse_completion(resp.json(), request_id, prompt))
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, OSError, ValueError, AttributeError, TypeError) as exc:
            failure = RequestFailure(
                request_id, f"lost vLLM at {self.endpoints.url}: {exc!r}", retryable=True
            )
            self._chunks.put(_Chunk(request_id, [], [], failure=failure))

    # -- shape ---------------------------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def hidden_bytes_per_token(self) -> int:
        return 0  # no pipeline stages over a vLLM server

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, *,
        keep_kv: bool = False, cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """Stream a request's tokens; ``kv_transfer_params`` go to the server's KV
        connector (a disaggregated decode: :mod:`halfmoon.serve.vllm.pd`)."""
        if keep_kv:
            raise VllmUnsupported("a vLLM server hands KV over through halfmoon's KV "
                                  "connector: use add_prefill")  # fmt: skip
        body = self._body(request_id, token_ids, params, cache_salt, kv_transfer_params)
        req = _Request(len(token_ids))
        self._requests[request_id] = req
        if params.prompt_logprobs is None:
            job = self._stream(request_id, body)
        else:  # the whole answer at once: vLLM returns them only there
            prompt = (list(token_ids), params.prompt_logprobs)
            job = self._complete(request_id, whole_answer(body), prompt)
        req.future = asyncio.run_coroutine_threadsafe(job, self._loop)

    def add_prefill(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, *,
        cache_salt: str | None, kv_transfer_params: dict[str, Any],
    ) -> None:  # fmt: skip
        """Prefill only (``max_tokens`` 1, not streamed): the server's KV connector streams
        the KV where ``kv_transfer_params`` say; the output's params for the decode side
        come from :meth:`take_transfer_params`."""
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(1, params.min_tokens))
        body = self._body(request_id, token_ids, first_only, cache_salt, kv_transfer_params)
        # Prompt log-probabilities are computed here and sent on with the handoff.
        k = params.prompt_logprobs
        prompt = None if k is None else (list(token_ids), k)
        req = _Request(len(token_ids))
        self._requests[request_id] = req
        req.future = asyncio.run_coroutine_threadsafe(
            self._complete(request_id, whole_answer(body), prompt), self._loop
        )

    def take_transfer_params(self, request_id: str) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a finished prefill answered with (once)."""
        return self._transfer_params.pop(request_id, None)

    def _body(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
        cache_salt: str | None, kv_transfer_params: dict[str, Any] | None,
    ) -> dict[str, Any]:  # fmt: skip
        if request_id in self._requests:
            raise HalfmoonError(f"request {request_id!r} is already running")
        if params.embed:
            raise VllmUnsupported(NO_POOLING)
        if len(token_ids) + params.max_tokens > self.max_model_len > 0:
            raise HalfmoonError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceed "
                f"the server's context of {self.max_model_len} tokens"
            )
        body = request_body(self.facts.model, token_ids, params, cache_salt)
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        self._transfer_params.pop(request_id, None)
        if req is None:
            return False
        req.future.cancel()  # closes the stream: vLLM aborts the request
        return True

    def step(self) -> list[RequestOutput]:
        chunks: list[_Chunk] = []
        with contextlib.suppress(queue.Empty):
            chunks.append(self._chunks.get(timeout=STEP_WAIT_S))
            while True:
                chunks.append(self._chunks.get_nowait())
        self._drain_events()
        merged: dict[str, list[_Chunk]] = {}
        for chunk in chunks:
            if chunk.request_id not in self._requests:
                continue  # aborted meanwhile
            if chunk.failure is not None:
                del self._requests[chunk.request_id]
                merged.pop(chunk.request_id, None)
                self._failures.append(chunk.failure)
                continue
            merged.setdefault(chunk.request_id, []).append(chunk)
        outputs = []
        for rid, parts in merged.items():
            req = self._requests[rid]
            new = [t for c in parts for t in c.token_ids]
            req.tokens += new
            for c in parts:
                if c.cached is not None:
                    req.cached = c.cached
                if c.transfer_params is not None:
                    self._transfer_params[rid] = c.transfer_params
            finish = next((c.finish for c in parts if c.finish), None)
            if not new and finish is None:
                continue  # only usage: it rides on the finishing output
            prompt = next((c.prompt_logprobs for c in parts if c.prompt_logprobs is not None),
                          None)  # fmt: skip
            if finish is not None:
                del self._requests[rid]
            outputs.append(RequestOutput(
                request_id=rid, new_token_ids=tuple(new), token_ids=tuple(req.tokens), text="",
                finished=finish is not None, finish_reason=finish,
                num_prompt_tokens=req.prompt_len, num_cached_tokens=req.cached,
                new_logprobs=tuple(lp for c in parts for lp in c.logprobs),
                prompt_logprobs=None if prompt is None else tuple(prompt),
            ))  # fmt: skip
        return outputs

    def _drain_events(self) -> None:
        while True:
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return
            events: list[CacheEvent] = self._translator.translate(self.instance_id, item)
            self._warn_other_topic()
            if self._listener is not None:
                for event in events:
                    self._listener(event)

    def _warn_other_topic(self) -> None:
        sub = self.subscriber
        if sub is not None and sub.stats.num_other_topic and not self._warned_topic:
            self._warned_topic = True
            log.warning(
                "KV events of another topic than %r arrive from %s and are dropped: routing "
                "cannot see this server's cache (give its topic in --attach URL,EVENTS,"
                "REPLAY,TOPIC)", self.endpoints.topic, self.endpoints.events,
            )  # fmt: skip

    def has_unfinished_requests(self) -> bool:
        if self.process is not None and not self.process.alive():
            raise HalfmoonError(
                f"the worker's vLLM server exited (code {self.process.proc.returncode})"
            )
        return bool(self._requests) or not self._events.empty() or not self._chunks.empty()

    def take_failures(self) -> list[RequestFailure]:
        out, self._failures = self._failures, []
        return out

    def stats(self) -> EngineStats:
        used = round(self._load.get(KV_USAGE, 0.0) * self._num_blocks)
        return EngineStats(
            num_waiting=int(self._load.get(WAITING, 0.0)), num_running=len(self._requests),
            num_blocks=self._num_blocks, num_free_blocks=max(0, self._num_blocks - used),
            num_cached_blocks=self._translator.num_held(self.instance_id), num_preemptions=0,
            num_prefill_tokens=prefill_tokens(self._requests.values()),
            spec_decode=self._spec,
        )  # fmt: skip

    def check_integrity(self) -> None:
        self._translator.check_integrity()

    # -- KV out / in: not over HTTP ----------------------------------------------------------
    def set_prompt_kv_hook(self, hook: PromptKVHook | None) -> None:
        if hook is not None:
            raise VllmUnsupported("a vLLM server's prompt KV needs halfmoon's KV connector")

    def set_cache_listener(self, listener: CacheListener | None) -> None:
        self._listener = listener

    def block_bytes(self, request_id: str, index: int) -> memoryview:
        raise VllmUnsupported("a vLLM server's KV bytes need halfmoon's KV connector")

    def take_handoff(self, request_id: str) -> HandoffState:
        raise VllmUnsupported("a vLLM server cannot hand a request over over HTTP")

    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        raise VllmUnsupported("ask the Conductor's index (fed by the server's KV events)")

    def seed_prefix(
        self, token_ids: Sequence[int], first_block: int,
        payloads: Sequence[bytes | bytearray | memoryview], cache_salt: str | None,
    ) -> int:  # fmt: skip
        raise VllmUnsupported("seeding a vLLM server's cache needs halfmoon's KV connector")

    def import_request(
        self, state: HandoffState, params: SamplingParams, kv: bytes | bytearray | memoryview
    ) -> None:
        raise VllmUnsupported("a vLLM server cannot take a handed-off request over HTTP")

    def cost_profile(self, model: str, cache_dir: Path) -> CostProfile:
        from halfmoon.serve.vllm.profile import cached_server_profile

        return cached_server_profile(self, model, cache_dir)

    def pipeline_stage(self, num_stages: int, stage: int) -> StageConnector:
        raise VllmUnsupported("chunked pipeline parallelism runs on halfmoon's engine only")

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the threads (and the server this worker started)."""
        self._stop.set()
        for req in self._requests.values():
            req.future.cancel()
        self._requests.clear()

        async def _close() -> None:
            if self._client is not None:
                await self._client.aclose()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(5)
        self._events_thread.join(2)
        if self.process is not None:
            self.process.stop()

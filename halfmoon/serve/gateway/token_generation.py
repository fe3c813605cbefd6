"""vLLM's token-in, token-out API ("disaggregated everything"), as halfmoon serves it.

``POST /inference/v1/generate`` takes prompt token ids and vLLM's ``SamplingParams`` (by
its field names) and answers the generated token ids (``output_mode`` ``tokens``, the
default) or also their text (``text``), whole or streamed; the ``/render`` routes turn a
chat completion, completion or Anthropic message request into such a request (the
prompt rendered and tokenized as the generation route would, every option the request
left out filled in with the served model's default). A client, a router or an RL trainer
can so template and tokenize once and generate anywhere: on halfmoon, or on a vLLM server,
whose routes take the same bodies.

A generate request runs as a completion of those token ids through the gateway's
completion path: the same placement, limits, metrics and errors. As on vLLM, an option
left out of ``sampling_params`` takes ``SamplingParams``' own default (temperature 1.0,
not the model's generation config: rendering is where those apply), except
``max_tokens``, which runs to the end of the served context (within the server's
``--max-tokens-limit`` and the model's ``max_new_tokens``), as a chat's does. Options of
vLLM's that change nothing here (how its engine hands outputs over) are accepted;
those this server does not do (watermarking, a thinking budget, repetition detection,
log-probabilities of chosen token ids, ``extra_args``, multimodal features, KV- and
encoder-transfer parameters) are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError

from halfmoon.core.request import MAX_LOGPROBS, SamplingParams, StructuredOutput
from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.openai_api import (
    CompletionRequest,
    StreamOptions,
    logprobs_body,
    merged_usage,
    stop_reason,
)
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.responses import (
    Delta,
    Entry,
    HTTPError,
    Prepared,
    all_items,
    failed_event,
    prompt_field,
    turned_away,
)

#: vLLM ``SamplingParams`` fields a completion request takes by the same name.
_PASSED = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
           "top_p", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
           "logprobs", "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output",
           "structured_outputs", "logit_bias", "allowed_token_ids", "bad_words",
           "thinking_token_budget")  # fmt: skip
#: vLLM ``SamplingParams`` fields this server does not do: refused unless left unset.
_REFUSED = ("watermarking", "repetition_detection",
            "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids",
            "extra_args")  # fmt: skip


def refuse(options: list[str]) -> None:
    """A 400 naming ``options`` (set options this server does not do), if any."""
    if options:
        raise HTTPError(400, f"not supported by this server: {', '.join(options)}",
                        "BadRequestError", param=options[0].split()[0])  # fmt: skip


def completion_from(
    fields: dict[str, Any], names: dict[str, str] | None = None
) -> CompletionRequest:
    """The completion request another API's request translates into; a value out of
    range is a 400 naming its field as that API spells it (``names``: completion field
    -> the API's name, e.g. ``max_tokens`` -> ``sampling_params.max_new_tokens``; by
    default ``sampling_params.<field>``)."""
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as exc:
        names = names or {}
        parts = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            name = names.get(field, f"sampling_params.{field}" if field else "sampling_params")
            parts.append(f"{name}: {err['msg']}")
        first = parts[0].split(":")[0] if parts else "sampling_params"
        raise HTTPError(400, "; ".join(parts), "BadRequestError", param=first) from None


class GenerateSamplingParams(BaseModel):
    """vLLM's ``SamplingParams`` by its field names and defaults (an unknown field is a
    400, as vLLM's own parsing refuses it)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, ge=-1)  # (0 and -1: every token, as on vLLM)
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    thinking_token_budget: int | None = Field(None, ge=-1)
    # how vLLM's engine hands outputs over: accepted, no effect here
    output_kind: int | None = None
    stream_interval: int | None = None
    skip_clone: bool | None = None
    output_text_buffer_length: int | None = None
    flat_logprobs: bool | None = None
    skip_reading_prefix_cache: bool | None = None
    routed_experts_prompt_start: int | None = None
    trace_decode_token_ids: Any = None
    # not done here (refused when set: GenerateRequest.refused)
    watermarking: Any = None
    repetition_detection: Any = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: Any = None
    logprob_token_ids: Any = None
    extra_args: dict[str, Any] | None = None


class GenerateRequest(BaseModel):
    """The body of ``POST /inference/v1/generate`` (vLLM's ``GenerateRequest``)."""

    request_id: str | None = None
    token_ids: list[NonNegativeInt] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0
    token_offsets: Any = None  # (informational: where the tokens came from)
    reasoning_ended: bool | None = None  # (token requests are not read for reasoning)
    reasoning_parser_kwargs: dict[str, Any] | None = None
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None

    def refused(self) -> list[str]:
        """The options set that this server does not do (empty: none)."""
        out = [f"sampling_params.{name}" for name in _REFUSED
               if getattr(self.sampling_params, name) not in (None, {}, [])]  # fmt: skip
        out += [name for name in ("features", "content_parts", "kv_transfer_params",
                                  "ec_transfer_params") if getattr(self, name)]  # fmt: skip
        if not self.sampling_params.spaces_between_special_tokens:
            out.append("sampling_params.spaces_between_special_tokens false")
        return out

    def to_completion(self, served_model: str, default_output: int) -> CompletionRequest:
        """The completion of these token ids that answers this request: every sampling
        option given (so that the model's defaults do not replace vLLM's; ``max_tokens``
        left out: ``default_output``), a 400 for what cannot be done."""
        refuse(self.refused())
        sp = self.sampling_params
        if self.output_mode == "text" and not sp.detokenize:
            raise HTTPError(400, "output_mode 'text' needs sampling_params.detokenize",
                            "BadRequestError", param="output_mode")  # fmt: skip
        max_tokens = sp.max_tokens if sp.max_tokens is not None else default_output
        fields: dict[str, Any] = {
            "model": self.model or served_model,
            "prompt": self.token_ids,
            "max_tokens": max_tokens,
            "request_id": self.request_id,
            "stream": self.stream,
            "stream_options": self.stream_options,
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "return_token_ids": True,  # (the entries carry every kept token's id)
            **{name: getattr(sp, name) for name in _PASSED},
            "top_k": max(0, sp.top_k),
        }
        if sp.temperature == 0.0:  # greedy: vLLM ignores top_p / top_k / min_p then
            fields.update(top_p=1.0, top_k=0, min_p=0.0)
        return completion_from(fields, {"prompt": "token_ids", "request_id": "request_id",
                                        "cache_salt": "cache_salt", "priority": "priority"})  # fmt: skip


# -- answers -------------------------------------------------------------------------------
def _token_logprobs(entries: list[Entry]) -> dict[str, Any]:
    """vLLM's generate-shaped log-probabilities: integer token ids, the sampled token's
    own log-probability and rank, its alternatives likeliest first."""
    content = []
    for token, value in entries:
        if value is None:
            content.append({"token_id": token, "logprob": -9999.0, "top_logprobs": []})
            continue
        content.append({
            "token_id": token, "logprob": max(value.logprob, -9999.0), "rank": value.rank,
            "top_logprobs": [{"token_id": t, "logprob": max(lp, -9999.0)} for t, lp in value.top],
        })  # fmt: skip
    return {"content": content}


class Shaper:
    """Builds one generate request's answer parts from the completion path's items."""

    def __init__(self, body: GenerateRequest, p: Prepared, model: str,
                 token_text: Callable[[int], str]) -> None:  # fmt: skip
        self.body, self.p, self.model = body, p, model
        self.text_mode = body.output_mode == "text"
        self.token_text = p.token_text(token_text)
        self.request_id = f"generate-tokens-{p.public_id}"

    def choice(self, index: int, text: str, finish: str | None, entries: list[Entry],
               whole: bool) -> dict[str, Any]:  # fmt: skip
        """One choice (``whole``: of an answer, whose finish reason is ``stop`` when none
        came, as vLLM's; else of a stream chunk)."""
        logprobs = None
        if self.p.params.logprobs is not None:
            logprobs = (logprobs_body(entries, self.token_text, True, 0) if self.text_mode
                        else _token_logprobs(entries))  # fmt: skip
        out: dict[str, Any] = {
            "index": index,
            "finish_reason": finish if finish is not None or not whole else "stop",
            "stop_reason": stop_reason(finish),
            "token_ids": [token for token, _ in entries],
            "logprobs": logprobs,
        }
        if self.text_mode:
            out["text"] = text
        return out

    def body_of(self, choices: list[dict[str, Any]], use: dict | None,
                prompt: list[Entry]) -> dict[str, Any]:  # fmt: skip
        """The whole answer."""
        return {
            "request_id": self.request_id,
            "output_mode": self.body.output_mode,
            "model": self.model,
            "created": int(time.time()),
            "choices": choices,
            "usage": use,
            "prompt_token_ids": self.p.prompt_ids if self.body.return_token_ids else None,
            "prompt_logprobs": prompt_field(prompt, self.token_text)
            if self.p.show_prompt_logprobs
            else None,
        }

    def event(self, choices: list[dict[str, Any]], use: dict | None = None,
              prompt_ids: list[int] | None = None) -> bytes:  # fmt: skip
        """One server-sent event of the stream (with the prompt's ids, when given)."""
        body: dict[str, Any] = {"request_id": self.request_id,
                                "output_mode": self.body.output_mode, "choices": choices,
                                "usage": use}  # fmt: skip
        if prompt_ids is not None:
            body["prompt_token_ids"] = prompt_ids
        return f"data: {json.dumps(body)}\n\n".encode()


async def whole(shaper: Shaper, first: tuple[int, Delta], rest: AsyncIterator,
                metrics: GatewayMetrics) -> dict[str, Any]:  # fmt: skip
    """A whole generate answer of every choice (the stream closed at the end)."""
    total = shaper.p.num_choices
    texts: list[list[str]] = [[] for _ in range(total)]
    entries: list[list[Entry]] = [[] for _ in range(total)]
    finishes: list[str | None] = [None] * total
    uses: list[dict] = [{}] * total
    prompt: list[Entry] = []
    try:
        async with aclosing(all_items(first, rest)) as items:
            async for index, (text, finish, use, new, prompt_entries) in items:
                texts[index].append(text)
                entries[index] += new
                if index == 0 and prompt_entries:
                    prompt += prompt_entries
                if finish is not None:
                    finishes[index], uses[index] = finish, use
    except (Rejected, BackendError) as exc:  # a later choice was turned away, or failed
        raise turned_away(exc, metrics) from None
    choices = [shaper.choice(i, "".join(texts[i]), finishes[i], entries[i], True)
               for i in range(total)]  # fmt: skip
    return shaper.body_of(choices, _usage(uses, shaper.p.n), prompt)


def _usage(uses: list[dict], n: int) -> dict[str, int]:
    """The usage of ``n`` choices of one prompt (:func:`merged_usage`), in the three counts
    vLLM's generate route answers."""
    merged = merged_usage(uses, n)
    return {key: merged[key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


async def streamed(shaper: Shaper, first: tuple[int, Delta], rest: AsyncIterator,
                   metrics: GatewayMetrics) -> AsyncIterator[bytes]:  # fmt: skip
    """The generate answer as server-sent events: a chunk per item with its tokens (and
    text), the prompt's ids with the first when asked for; a usage chunk at the end when
    ``stream_options.include_usage``; errors after the first byte as an error event."""
    p, body = shaper.p, shaper.body
    prompt_ids = p.prompt_ids if body.return_token_ids else None
    uses: list[dict] = [{}] * p.num_choices
    running = p.num_choices
    try:
        async with aclosing(all_items(first, rest)) as items:
            async for index, (text, finish, use, entries, _prompt) in items:
                if entries or finish is not None or (shaper.text_mode and text):
                    chunk = shaper.choice(index, text, finish, entries, False)
                    yield shaper.event([chunk], use if p.continuous_usage else None, prompt_ids)
                    prompt_ids = None
                if finish is not None:
                    uses[index] = use or {}
                    running -= 1
                    if not running:
                        if p.include_usage:
                            yield shaper.event([], _usage(uses, p.n))
                        break
    except (BackendError, Rejected) as exc:
        yield failed_event(exc, metrics)
    yield b"data: [DONE]\n\n"


# -- rendering -----------------------------------------------------------------------------
def structured_outputs_of(structured: StructuredOutput | None) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` of a request's :class:`StructuredOutput`."""
    if structured is None:
        return None
    kind, spec = structured.kind, structured.spec
    value: Any = {"json": lambda: json.loads(spec), "choice": lambda: json.loads(spec),
                  "json_object": lambda: True}.get(kind, lambda: spec)()  # fmt: skip
    out: dict[str, Any] = {kind: value}
    if structured.compact:
        out["disable_any_whitespace"] = True
    if structured.closed:
        out["disable_additional_properties"] = True
    if structured.whitespace:
        out["whitespace_pattern"] = structured.whitespace
    return out


def sampling_params_of(p: Prepared) -> dict[str, Any]:
    """vLLM's ``sampling_params`` of a prepared request: the fields away from
    ``SamplingParams``' defaults (as vLLM writes them), the model's defaults filled in."""
    s: SamplingParams = p.params
    fields: dict[str, Any] = {
        "n": p.n, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "repetition_penalty": s.repetition_penalty,
        "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
        "seed": s.seed, "stop": list(p.stop), "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos, "max_tokens": s.max_tokens, "min_tokens": s.min_tokens,
        "logprobs": s.logprobs, "prompt_logprobs": s.prompt_logprobs,
        "skip_special_tokens": p.skip_special_tokens,
        "include_stop_str_in_output": p.include_stop,
        "structured_outputs": structured_outputs_of(s.structured),
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None,
        "allowed_token_ids": list(s.allowed_token_ids) or None,
        "bad_words": list(s.bad_words),
        "thinking_token_budget": s.thinking_token_budget,
    }  # fmt: skip
    defaults = GenerateSamplingParams()
    out = {name: value for name, value in fields.items()
           if value != getattr(defaults, name) and value not in ([],)}  # fmt: skip
    out["max_tokens"] = s.max_tokens  # (always: its default is the context's end here)
    return out


def rendered(p: Prepared, model: str | None, stream: bool, stream_options: Any,
             cache_salt: str | None) -> list[dict[str, Any]]:  # fmt: skip
    """The generate requests of a prepared request: one per prompt (a batched
    completion's several), each with its token ids and sampling parameters."""
    prompts = [p.prompt_ids, *(ids for ids, _ in p.more)]
    params = sampling_params_of(p)
    out = []
    for i, ids in enumerate(prompts):
        rid = p.public_id if len(prompts) == 1 else f"{p.public_id}-{i}"
        out.append({
            "request_id": rid, "token_ids": ids, "sampling_params": params, "model": model,
            "stream": stream, "stream_options": stream_options if stream else None,
            "cache_salt": cache_salt, "priority": p.params.priority,
        })  # fmt: skip
    return out

"""One streamed ``/v1/completions`` request against any OpenAI-compatible server.

The prompt is sent as a list of token ids, so its length is exact whatever the server's
tokenizer. ``max_tokens`` is the trace's output length and, with ``vllm_extensions``
(the default), ``ignore_eos`` and ``min_tokens`` make the server generate exactly that
many tokens (vLLM and ``halfmoon serve`` understand them; OpenAI's own API does not).

When tokens arrived: each server-sent event that carries output counts as the arrival
of its tokens, timed when the client reads it. How many tokens an event carries comes
from its ``usage.completion_tokens`` when the server sends usage with every chunk
(vLLM's ``stream_options.continuous_usage_stats``); otherwise one token per event with
non-empty text. A server that sends nothing for a token without printable text (half of
a UTF-8 character, a special token) shows it with a later event: the client then sees
fewer events than tokens, as any streaming user would (:class:`StreamStats` counts
both). Tokens that the closing usage reports but no event showed are counted at the
finishing event, so a record always holds as many token times as the server generated.

Outcome: HTTP 429 -> ``rejected`` (the server's admission said no); any other failure
(another status, a connection error, an error event, a stream that ends without
``[DONE]``, the per-request timeout) -> ``error``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from halfmoon.metrics.records import RequestRecord


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send: ``base_url`` without ``/v1``; the served ``model`` name."""

    base_url: str
    model: str
    api_key: str | None = None
    temperature: float = 1.0
    vllm_extensions: bool = True
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout must be positive, got {self.timeout_s}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")

    @property
    def completions_url(self) -> str:
        """The completions endpoint."""
        return f"{self.base_url}/v1/completions"

    def headers(self) -> dict[str, str]:
        """Request headers (the bearer token when an API key is set)."""
        if self.api_key:
            return {"Authorization": f"Bearer {self.api_key}"}
        return {}


@dataclass
class StreamStats:
    """What the stream looked like: events carrying output, tokens the server reported
    (``usage.completion_tokens``; None when it sent no usage)."""

    num_events: int = 0
    num_reported_tokens: int | None = None


def completion_body(
    config: ClientConfig, prompt_ids: Sequence[int], max_tokens: int, priority: int = 0
) -> dict:
    """The JSON body of one streamed completion (``priority``: vLLM's, sent when not 0)."""
    body: dict[str, Any] = {
        "model": config.model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if priority:
        body["priority"] = priority
    if config.vllm_extensions:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
        body["stream_options"]["continuous_usage_stats"] = True
    return body


def _error_message(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI error body, else the start of the body."""
    try:
        obj = json.loads(raw)
        message = obj["error"]["message"] if isinstance(obj.get("error"), dict) else obj["error"]
        return str(message)
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw[:200].decode("utf-8", "replace").strip()


class _StreamReader:
    """Turns the server-sent events of one response into token times on ``record``."""

    def __init__(self, record: RequestRecord, stats: StreamStats, now: Callable[[], float]):
        self.record, self.stats, self.now = record, stats, now
        self.done = False
        self.finished_s: float | None = None

    def event(self, payload: str) -> None:
        """Handle one ``data:`` payload (raises ValueError on an error event)."""
        if payload == "[DONE]":
            self.done = True
            return
        obj = json.loads(payload)
        if not isinstance(obj, dict):
            raise ValueError(f"unexpected event {payload[:80]!r}")
        if "error" in obj:
            error = obj["error"]
            raise ValueError(str(error.get("message", error) if isinstance(error, dict) else error))
        arrived_s = self.now()
        usage = obj.get("usage")
        reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if isinstance(cached, int) and 0 <= cached <= self.record.input_length:
                self.record.cached_tokens = cached
        choices = obj.get("choices") or ()
        text = "".join(_choice_text(choice) for choice in choices)
        if isinstance(reported, int):
            self.stats.num_reported_tokens = reported
        seen = len(self.record.token_times_s)
        if choices and isinstance(reported, int):
            # Usage on an output chunk: the server counts this chunk's tokens for us. A
            # usage-only chunk (no choices) at the end is a total, not an arrival.
            num_new = max(0, reported - seen)
        else:
            num_new = 1 if text else 0
        if num_new:
            self.stats.num_events += 1
            self.record.token_times_s.extend([arrived_s] * num_new)
        if any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
            self.finished_s = arrived_s
        elif not choices and isinstance(reported, int) and self.finished_s is not None:
            # The closing usage counts tokens no event showed (their text was empty, e.g.
            # special tokens): they arrived, at the latest, with the finishing event.
            missing = reported - len(self.record.token_times_s)
            self.record.token_times_s.extend([self.finished_s] * max(0, missing))


def _choice_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    if isinstance(choice.get("text"), str):
        return choice["text"]
    delta = choice.get("delta")
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


async def _stream(
    client: httpx.AsyncClient, config: ClientConfig, body: dict, reader: _StreamReader
) -> None:
    record = reader.record
    async with client.stream(
        "POST", config.completions_url, json=body, headers=config.headers()
    ) as response:
        if response.status_code != 200:
            message = _error_message(await response.aread())
            if response.status_code == 429:
                record.rejected = True
                record.reject_reason = message or "HTTP 429"
            else:
                record.error = f"HTTP {response.status_code}: {message}"
            return
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                reader.event(line[5:].strip())
                if reader.done:
                    break
    if not reader.done:
        record.error = "stream ended before [DONE]"


async def send_request(
    client: httpx.AsyncClient,
    config: ClientConfig,
    record: RequestRecord,
    prompt_ids: Sequence[int],
    now: Callable[[], float],
    priority: int = 0,
) -> StreamStats:
    """Send one request (of ``priority``) and fill ``record`` in place (token times,
    finish, outcome).

    ``record.arrival_s`` must already be the send time on the ``now`` clock; the record
    keeps whatever tokens arrived even when the request fails or times out.
    """
    stats = StreamStats()
    reader = _StreamReader(record, stats, now)
    body = completion_body(config, prompt_ids, record.output_length, priority)
    try:
        await asyncio.wait_for(_stream(client, config, body, reader), config.timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timed out after {config.timeout_s:g} s"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except ValueError as exc:  # malformed JSON or an error event in the stream
        record.error = f"bad stream: {exc}"
    if record.token_times_s:
        # The first token means the prefill finished (for wasted-prefill counts).
        record.prefill_done_s = record.token_times_s[0]
    if not (record.error or record.rejected):
        if record.token_times_s:
            record.finish_s = now()
        else:
            record.error = "no output tokens"
    return stats

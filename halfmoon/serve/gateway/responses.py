"""From a prepared request to its OpenAI response: one backend stream per choice, merged
as they come, then assembled whole or sent as server-sent events.

:class:`Prepared` is a validated request (the gateway's :meth:`prepare`); each choice is
a request of its own to the backend (:meth:`Prepared.choices`), whose stream of
:data:`Delta` items (the gateway's ``run``) :func:`merge_choices` tags with the choice's
index; :func:`collect` builds the whole response and :func:`sse` the event stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.serve.gateway.backend import BackendError, BackendRefused, Rejected
from halfmoon.serve.gateway.openai_api import (
    choice_body,
    chunk_body,
    completion_body,
    error_body,
    logprobs_body,
    merged_usage,
    prompt_logprobs_body,
)
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.reasoning import ReasoningMode, shown_reasoning
from halfmoon.serve.gateway.tool_streams import streamed_calls
from halfmoon.serve.gateway.tools import (
    HeldText,
    ToolMode,
    split_answer,
    tool_call_id,
)


class HTTPError(Exception):
    """An error answered as an OpenAI error body with this status (and headers); ``param``
    names the request field at fault, when one is."""

    def __init__(
        self, status: int, message: str, kind: str, headers: dict | None = None,
        param: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers
        self.param = param


def turned_away(exc: Rejected | BackendError, metrics: GatewayMetrics) -> HTTPError:
    """The answer to a request the cluster refused (429 with ``Retry-After``), cannot
    serve at all (400: :class:`BackendRefused`) or failed (503), counted in ``metrics``."""
    if isinstance(exc, Rejected):
        metrics.rejections.inc()
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return HTTPError(429, f"request rejected: {exc.reason}", "RateLimitError", headers)
    if isinstance(exc, BackendRefused):
        return HTTPError(400, f"not supported by this cluster: {exc}", "BadRequestError")
    metrics.errors.inc()
    return HTTPError(503, f"request failed: {exc}", "ServiceUnavailable")


#: A token id and its log-probability record (None: an echoed prompt's first token, or a
#: generated token of a request that asked for its id, not its log-probability).
Entry = tuple[int, TokenLogprob | None]
#: What :meth:`Gateway.run` yields: text delta, finish reason, usage, the entries of the
#: tokens since the previous item, and (first item only, when asked for) the prompt's:
#: ``(prompt token id, its TokenLogprob)``, None for the first token's.
Delta = tuple[str, str | None, dict | None, list[Entry], list[Entry] | None]


@dataclass
class Prepared:
    """A validated request: token ids, sampling parameters and how to answer."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    include_usage: bool
    chat: bool
    #: Usage on every chunk, and a chunk for every token batch even without text.
    continuous_usage: bool = False
    #: The prompt's text, sent before the output (completions' ``echo``).
    echo: str = ""
    #: Choices asked for; each is its own request to the backend (see :meth:`choices`).
    n: int = 1
    #: Keep a stop string that ends the output in the text.
    include_stop: bool = False
    #: Roots its prefix-cache hashes (request ``cache_salt`` and/or API key; None: none).
    cache_salt: str | None = None
    #: The further prompts of a batched completion (``prompt`` a list of prompts), each
    #: with its ``echo`` text; each has ``n`` choices, numbered after the first's.
    more: tuple[tuple[list[int], str], ...] = ()
    #: Completions' ``echo`` with ``logprobs``: the prompt's tokens lead the log-probabilities.
    echo_logprobs: bool = False
    #: vLLM's ``prompt_logprobs`` field in the response (per choice; top level for chat).
    show_prompt_logprobs: bool = False
    #: Completions' ``max_tokens: 0`` with ``echo``: the prompt (and its log-probabilities)
    #: is the whole answer; one token is computed and not sent, as on vLLM.
    echo_only: bool = False
    #: Chat with tools and a ``tool_choice`` other than ``none``: the output is answered
    #: as tool calls (forced ones, or those its parser reads).
    tool_mode: ToolMode | None = None
    #: Chat under ``--reasoning-parser`` (unless its prompt closed the reasoning, or a
    #: grammar holds the whole output): how the output's reasoning is told from its
    #: content (the tool calls are read from the content alone).
    reasoning: ReasoningMode | None = None
    #: SGLang's ``stop_regex`` patterns (checked: :mod:`halfmoon.serve.gateway.stop_regex`).
    stop_regex: tuple[str, ...] = ()
    #: The answer streams (else it is whole: nothing of it goes out before its end).
    stream: bool = False
    #: vLLM's ``skip_special_tokens``: special tokens stay out of the text.
    skip_special_tokens: bool = True
    #: vLLM's ``return_token_ids``: the prompt's and output's token ids in the response.
    return_token_ids: bool = False
    #: vLLM's ``return_tokens_as_token_ids``: log-probability tokens as ``token_id:<id>``.
    tokens_as_ids: bool = False
    #: The id the client chose (``X-Request-Id`` or ``request_id``; request_ids), which
    #: the response shows instead of ``request_id`` (the cluster's, always unique).
    client_id: str | None = None

    @property
    def public_id(self) -> str:
        """The id the response is built on: the client's, else the cluster's."""
        return self.client_id if self.client_id is not None else self.request_id

    def token_text(self, text_of: Callable[[int], str]) -> Callable[[int], str]:
        """How this request's log-probabilities name a token (``text_of``, or its id)."""
        return (lambda token: f"token_id:{token}") if self.tokens_as_ids else text_of

    @property
    def num_choices(self) -> int:
        """Choices of the response: ``n`` per prompt."""
        return self.n * (1 + len(self.more))

    def _prompt_of(self, index: int) -> tuple[list[int], str]:
        """Choice ``index``'s prompt: its token ids and ``echo`` text."""
        prompt = index // self.n
        return (self.prompt_ids, self.echo) if prompt == 0 else self.more[prompt - 1]

    def echo_of(self, index: int) -> str:
        """The ``echo`` text of choice ``index`` (its prompt's)."""
        return self._prompt_of(index)[1]

    def prompt_ids_of(self, index: int) -> list[int]:
        """The prompt token ids of choice ``index``."""
        return self._prompt_of(index)[0]

    def choices(self) -> list[Prepared]:
        """One prepared request per choice: ``<id>.<k>`` for choice ``k`` (when more than
        one), its prompt's, seeded ``seed + i`` for its prompt's ``i``-th choice; each
        under this request's public id (which ``/abort_requests`` names)."""
        if self.num_choices == 1:
            return [self]
        seed = self.params.seed
        prompts = [(self.prompt_ids, self.echo), *self.more]
        return [
            replace(
                self,
                request_id=f"{self.request_id}.{j * self.n + i}",
                prompt_ids=ids,
                echo=echo,
                params=replace(self.params, seed=None if seed is None else seed + i),
                n=1,
                more=(),
                client_id=self.public_id,
            )
            for j, (ids, echo) in enumerate(prompts)
            for i in range(self.n)
        ]


async def all_items(
    first: tuple[int, Delta], rest: AsyncIterator
) -> AsyncIterator[tuple[int, Delta]]:
    """A request's items, ``first`` then the ``rest`` of its merged choice streams, which
    are closed when this is (also when its reader stops early: use it with ``aclosing``)."""
    item: tuple[int, Delta] | None = first
    try:
        while item is not None:
            yield item
            item = await anext(rest, None)
    finally:
        await rest.aclose()


def failed_event(exc: Exception, metrics: GatewayMetrics) -> bytes:
    """The server-sent event of a request that failed after its first byte (counted)."""
    metrics.errors.inc()
    error = error_body(f"request failed: {exc}", "ServiceUnavailable", 503)
    return f"data: {json.dumps(error)}\n\n".encode()


async def collect(
    p: Prepared,
    model: str,
    first: tuple[int, Delta],
    rest: AsyncIterator,
    metrics: GatewayMetrics,
    token_text: Callable[[int], str],
) -> dict:
    """A whole (non-streaming) response's body: every choice's text, log-probabilities,
    usage (and token ids, when asked for)."""
    token_text = p.token_text(token_text)
    total = p.num_choices
    parts: list[list[str]] = [[p.echo_of(i)] for i in range(total)]
    entries: list[list[Entry]] = [[] for _ in range(total)]
    prompts: list[list[Entry]] = [[] for _ in range(total)]
    finishes: list[str | None] = [None] * total
    uses: list[dict] = [{}] * total
    try:
        async with contextlib.aclosing(all_items(first, rest)) as items:
            async for index, (text, finish, use, new, prompt) in items:
                parts[index].append(text)
                entries[index] += new
                prompts[index] += prompt or ()
                if finish is not None:
                    finishes[index], uses[index] = finish, use
    except (Rejected, BackendError) as exc:  # a later choice was turned away, or failed
        raise turned_away(exc, metrics) from None
    choices = []
    for index in range(total):
        logprobs = None
        if p.params.logprobs is not None and p.echo_logprobs:
            logprobs = logprobs_body(prompts[index] + entries[index], token_text, p.chat, 0)
        elif p.params.logprobs is not None:
            logprobs = logprobs_body(entries[index], token_text, p.chat, len(p.echo_of(index)))
        text: str | None = "".join(parts[index])
        finish, calls, reasoning = finishes[index], None, None
        if p.reasoning is not None:
            reasoning, text = shown_reasoning(p.reasoning, text)
        if p.tool_mode is not None and text is not None:
            text, calls = split_answer(p.tool_mode, text)
            if calls is not None:
                finish = p.tool_mode.finish(finish)
        choice = choice_body(index, text, finish, p.chat, logprobs, calls, reasoning)
        if p.show_prompt_logprobs and not p.chat:
            choice["prompt_logprobs"] = prompt_field(prompts[index], token_text)
        if p.return_token_ids:  # (completions: the prompt's per choice, as on vLLM)
            choice["token_ids"] = [token for token, _ in entries[index]]
            if not p.chat:
                choice["prompt_token_ids"] = p.prompt_ids_of(index)
        choices.append(choice)
    use = merged_usage(uses, p.n)
    body = completion_body(p.public_id, model, choices, use, p.chat)
    if p.return_token_ids and p.chat:
        body["prompt_token_ids"] = p.prompt_ids
    if p.show_prompt_logprobs and p.chat:  # one prompt for every choice: at the top, as vLLM
        body["prompt_logprobs"] = prompt_field(prompts[0], token_text)
    return body


def prompt_field(prompt: list[Entry], token_text: Callable[[int], str]) -> list | None:
    """vLLM's ``prompt_logprobs`` of a choice from its prompt entries (None: none came)."""
    if not prompt:
        return None
    ids = [tid for tid, _ in prompt]
    values = tuple(entry for _, entry in prompt[1:] if entry is not None)
    return prompt_logprobs_body(ids, values, token_text)


_Item = TypeVar("_Item")


async def merge_choices(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The items of every choice's stream as they come, tagged with the choice's index.
    A stream ends after its item with a finish reason; closing this closes them all."""
    async with contextlib.aclosing(interleave(streams, lambda item: item[1] is not None)) as items:
        async for index, item in items:
            yield index, item


async def interleave(
    streams: list[AsyncIterator[_Item]], last: Callable[[_Item], bool] = lambda _: False
) -> AsyncIterator[tuple[int, _Item]]:
    """The items of every stream as they come, tagged with the stream's index. A stream
    ends when exhausted, or after an item ``last`` accepts; an exception of one ends the
    whole; closing this closes them all (each aborting what it runs as it ends)."""
    if len(streams) == 1:  # the common case: no tasks
        try:
            async for item in streams[0]:
                yield 0, item
                if last(item):
                    break
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()  # (a Rejected or BackendError ends the whole)
                except StopAsyncIteration:
                    continue
                yield index, item
                if not last(item):
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()


async def sse(
    p: Prepared,
    model: str,
    first: tuple[int, Delta],
    rest: AsyncIterator,
    metrics: GatewayMetrics,
    token_text: Callable[[int], str],
) -> AsyncIterator[bytes]:
    """Server-sent events; errors after the first byte become an error event."""

    def event(obj: dict) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    token_text = p.token_text(token_text)

    def with_ids(chunk: dict, index: int, entries: list[Entry], first: bool) -> dict:
        """``chunk`` with its tokens' ids (``return_token_ids``), and the prompt's with a
        choice's first chunk (chat: once, at the top, as vLLM sends them)."""
        if p.return_token_ids:
            chunk["choices"][0]["token_ids"] = [token for token, _ in entries]
            if first and not p.chat:
                chunk["choices"][0]["prompt_token_ids"] = p.prompt_ids_of(index)
            elif first and index == 0:
                chunk["prompt_token_ids"] = p.prompt_ids
        return chunk

    opening = [True] * p.num_choices
    offsets = [0] * p.num_choices  # of each choice's next token text (completions' text_offset)
    uses: list[dict] = [{}] * p.num_choices
    # Tool calls: a named function's arguments go out as they come, its first chunk
    # with the call's id and name (``call_ids``); any other choice's output is held back
    # where calls may be (all of it for ``required``) and sent as calls at its end (Hermes
    # calls as they are written: ``streamed``), its log-probabilities then too.
    named = p.tool_mode.name if p.tool_mode is not None else None
    call_ids: list[str | None] = [None] * p.num_choices
    held = (
        [HeldText(p.tool_mode) for _ in range(p.num_choices)] if p.tool_mode and not named else []
    )
    # Calls in a format read as it comes (Hermes, Llama 3 JSON, Qwen3-Coder) go out as
    # they are written (their arguments' text as it comes).
    streamers = [streamed_calls(p.tool_mode) for _ in held]
    streamed = streamers if streamers and streamers[0] is not None else []
    kept: list[list[Entry]] = [[] for _ in range(p.num_choices)]
    # Reasoning: each delta's reasoning goes out first, in its own chunk (with the
    # delta's log-probabilities when no content came with it); the content goes on below.
    thinking = [p.reasoning.splitter() for _ in range(p.num_choices)] if p.reasoning else []
    carried: list[list[Entry]] = [[] for _ in range(p.num_choices)]  # (of deltas held back)
    running = p.num_choices
    item: tuple[int, Delta] | None = first
    try:
        while item is not None:
            index, (text, finish, use, entries, prompt) = item
            if thinking:
                thought, text = thinking[index].add(text, finish is not None)
                entries, carried[index] = carried[index] + list(entries), []
                own = entries if thought and not text else []  # (else: with the content)
                if thought and p.reasoning.show:
                    logprobs = None
                    if p.params.logprobs is not None:
                        logprobs = logprobs_body(own, token_text, True, 0)
                    chunk = chunk_body(p.public_id, model, None, None, True, opening[index],
                                       logprobs, index, reasoning=thought)  # fmt: skip
                    if p.continuous_usage:
                        chunk["usage"] = use
                    yield event(with_ids(chunk, index, own, opening[index]))
                    opening[index] = False
                if own:
                    entries = []
                if not text and finish is None:  # nothing of the answer yet
                    carried[index] = entries
                    item = await anext(rest, None)
                    continue
            if named is not None and (text or call_ids[index] is None):
                call: dict = {"function": {"arguments": text}}
                if call_ids[index] is None:
                    call_ids[index] = tool_call_id()
                    call = {"id": call_ids[index], "type": "function",
                            "function": {"name": named, "arguments": text}}  # fmt: skip
                logprobs = None
                if p.params.logprobs is not None:
                    logprobs = logprobs_body(entries, token_text, True, 0)
                chunk = chunk_body(p.public_id, model, None, None, True, opening[index],
                                   logprobs, index, [call])  # fmt: skip
                yield event(with_ids(chunk, index, entries, opening[index]))
                opening[index], text, entries = False, "", []
            elif held:
                kept[index] += entries
                text, calls = held[index].add(text, finish is not None)
                entries = kept[index] if finish is not None and calls is None else []
                deltas = (
                    streamed[index].deltas(held[index].text, finish is not None) if streamed else []
                )
                if calls is None and finish is not None and streamed and streamed[index].started:
                    text = ""  # (calls went out in part and did not end whole: no content)
                if deltas or (calls is not None and text):
                    if text:
                        yield event(chunk_body(p.public_id, model, text, None, True,
                                               opening[index], None, index))  # fmt: skip
                        opening[index], text = False, ""
                    if deltas:
                        yield event(chunk_body(p.public_id, model, None, None, True,
                                               opening[index], None, index, deltas))  # fmt: skip
                        opening[index] = False
                if calls is not None:
                    finish = p.tool_mode.finish(finish)
                    unsent = streamed[index].rest(calls) if streamed else calls
                    logprobs = None
                    if p.params.logprobs is not None:
                        logprobs = logprobs_body(kept[index], token_text, True, 0)
                    if unsent:
                        chunk = chunk_body(p.public_id, model, None, None, True,
                                           opening[index], logprobs, index, unsent)  # fmt: skip
                        yield event(with_ids(chunk, index, kept[index], opening[index]))
                        opening[index] = False
                    else:  # (every call went out as it came: the finish carries them)
                        entries = kept[index]
                    text = ""
            echo = p.echo_of(index) if opening[index] else ""
            if echo:
                text, offsets[index] = echo + text, len(echo)
            generated = entries
            if prompt and p.echo_logprobs:  # the prompt's tokens lead, from offset 0
                entries, offsets[index] = prompt + entries, 0
            if text or finish or (opening[index] and p.chat) or p.continuous_usage or entries:
                logprobs = None
                if p.params.logprobs is not None:
                    logprobs = logprobs_body(entries, token_text, p.chat, offsets[index])
                    offsets[index] += sum(len(t) for t in logprobs.get("tokens", ()))
                chunk = chunk_body(
                    p.public_id, model, text, finish, p.chat, opening[index], logprobs, index
                )
                if p.continuous_usage:
                    chunk["usage"] = use
                yield event(with_ids(chunk, index, generated, opening[index]))
                opening[index] = False
            if finish is not None:
                uses[index] = use
                running -= 1
                if not running:
                    if p.include_usage:
                        body = chunk_body(p.public_id, model, None, None, p.chat)
                        body["choices"] = []
                        body["usage"] = merged_usage(uses, p.n)
                        yield event(body)
                    break
            item = await anext(rest, None)
    except (BackendError, Rejected) as exc:
        yield failed_event(exc, metrics)
    finally:
        await rest.aclose()
    yield b"data: [DONE]\n\n"

"""Anthropic's Messages API (``POST /v1/messages``), served through chat completions, as
vLLM serves it: clients written for Anthropic's API (its SDKs, coding agents) talk to the
cluster unchanged.

A request becomes a :class:`ChatCompletionRequest` (:func:`to_chat`): ``system`` (a
string or text blocks) the system message; each message's content a string or blocks:
``text``; an assistant's ``tool_use`` blocks its tool calls (``input`` as the arguments'
JSON); a user's ``tool_result`` blocks ``tool`` messages (first, so they follow the calls
they answer; ``is_error`` results are prefixed ``Error:``); ``thinking`` blocks of earlier
turns are dropped; ``cache_control`` marks are ignored (the prefix cache needs none); a
last assistant turn is a prefilled answer, which the output continues.
``tools`` (``name``, ``description``, ``input_schema``) become function tools,
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` the chat's ``auto`` /
``required`` / a named function / ``none`` (``disable_parallel_tool_use``: one call at
most); ``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``,
``top_k`` as they are (left out: the model's defaults); ``output_config.format`` (a JSON
schema) a structured output; ``thinking`` sets the chat template's ``enable_thinking``
(and under a reasoning parser an enabled one's ``budget_tokens`` is the request's
``thinking_token_budget``, as vLLM maps it).
vLLM's extras ``priority``, ``cache_salt``, ``request_id`` and ``chat_template_kwargs``
pass through, and so does a ``seed``.

The answer (:func:`message_body`) is a ``message``: a ``thinking`` block first where the
server has a reasoning parser and the model reasoned (``signature`` empty: nothing signs
it), a ``text`` block and/or ``tool_use`` blocks (``input`` an object), ``stop_reason`` ``end_turn`` / ``max_tokens`` /
``stop_sequence`` (with the ``stop_sequence`` that matched) / ``tool_use``, and ``usage``
as Anthropic counts it: ``input_tokens`` the prompt tokens not read from the prefix
cache, ``cache_read_input_tokens`` those that were. Streamed (:func:`message_events`):
``message_start``, ``ping``, per block ``content_block_start``, its
``content_block_delta`` events (``thinking_delta``, ``text_delta``; a tool's ``input_json_delta``, as
generated for a named tool, other calls' whole at the end), ``content_block_stop``,
then ``message_delta`` (stop reason, usage) and ``message_stop``; an ``error`` event when
the cluster fails mid-way.

Not served: image and document blocks, server tools (``web_search`` ...); each a 400
naming it. Errors on these routes are Anthropic-shaped (:mod:`halfmoon.serve.gateway.
errors`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from halfmoon.serve.gateway.answer_stream import Answer, answer_parts, whole_answer
from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.openai_api import (
    ChatCompletionRequest,
    FieldError,
    chat_request_of,
    stop_reason,
)
from halfmoon.serve.gateway.responses import Delta, Prepared
from halfmoon.serve.gateway.tools import split_answer, tool_call_id

#: Fields a request passes to the chat request as they are (when given).
_PASSED = ("temperature", "top_p", "top_k", "priority", "seed", "cache_salt", "request_id")
#: A request's ``tool_choice`` type -> the chat's ``tool_choice``.
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class Block(BaseModel):
    """One content block of a message (the fields read; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class Message(BaseModel):
    """One turn: its role and content (a string or blocks)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class CountTokensRequest(BaseModel):
    """Body of ``POST /v1/messages/count_tokens``: a conversation without sampling."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """Body of ``POST /v1/messages`` (the fields served; others are ignored)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # vLLM's extensions, as on its chat route
    priority: int | None = None
    seed: int | None = None
    cache_salt: str | None = None
    request_id: str | None = None


def _text_of(content: str | list[Any] | None, where: str) -> str:
    """The text of a tool result's content (a string or text blocks)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise FieldError(f"{where}.content[{i}]: blocks of type {kind!r} are not served "
                             "in tool results (this model reads text)", "messages")  # fmt: skip
        parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def _system(system: str | list[Block] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    for i, block in enumerate(system):
        if block.type != "text":
            raise FieldError(f"system[{i}]: only text blocks are served, not {block.type!r}",
                             "system")  # fmt: skip
    text = "\n".join(block.text or "" for block in system)
    return [{"role": "system", "content": text}] if text else []


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of ``req``'s system prompt and turns."""
    out = _system(req.system)
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and message.role == "assistant":
                arguments = json.dumps(block.input if block.input is not None else {})
                calls.append({"id": block.id or tool_call_id(), "type": "function",
                              "function": {"name": block.name, "arguments": arguments}})  # fmt: skip
            elif block.type == "tool_result" and message.role == "user":
                text = _text_of(block.content, where)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text})  # fmt: skip
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # an earlier turn's reasoning: not shown to the model again
            else:
                raise FieldError(f"{where}: blocks of type {block.type!r} are not served in "
                                 f"{message.role} messages", "messages")  # fmt: skip
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": "".join(texts) or None}
            if calls:
                turn["tool_calls"] = calls
            elif turn["content"] is None:
                turn["content"] = ""
            out.append(turn)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools as chat function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind != "custom" or not isinstance(tool.get("name"), str):
            raise FieldError(f"tools[{i}]: only client tools (name, input_schema) are "
                             f"served, not {kind!r}", "tools")  # fmt: skip
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """The chat's ``tool_choice`` and ``parallel_tool_calls`` of Anthropic's choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise FieldError('tool_choice of type "tool" needs a name', "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in _CHOICES:
        raise FieldError('tool_choice.type is "auto", "any", "tool" or "none", not '
                         f"{kind!r}", "tool_choice")  # fmt: skip
    return _CHOICES[kind], parallel


def _template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    kwargs = dict(req.chat_template_kwargs or {})
    kind = (req.thinking or {}).get("type")
    if kind in ("enabled", "adaptive", "disabled"):
        kwargs.setdefault("enable_thinking", kind != "disabled")
    return kwargs or None


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type", "json_schema") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise FieldError('output_config.format is {"type": "json_schema", "schema": {...}}',
                         "output_config")  # fmt: skip
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat(req: CountTokensRequest, reasoning: bool = False) -> ChatCompletionRequest:
    """The chat completion request that serves ``req`` (FieldError for what cannot be
    served); a :class:`CountTokensRequest` gives the prompt alone. ``reasoning``: the
    server reads reasoning (``--reasoning-parser``): an enabled ``thinking``'s
    ``budget_tokens`` is then the request's ``thinking_token_budget``, as on vLLM."""
    choice, parallel = _tool_choice(req.tool_choice)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "tools": _tools(req.tools) or None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": _template_kwargs(req),
    }
    last = body["messages"][-1] if body["messages"] else {}
    if last.get("role") == "assistant" and not last.get("tool_calls"):  # a prefilled answer
        body |= {"add_generation_prompt": False, "continue_final_message": True}
    if isinstance(req, MessagesRequest):
        body |= {"max_completion_tokens": req.max_tokens, "stream": req.stream,
                 "stop": req.stop_sequences or None,
                 "response_format": _response_format(req.output_config)}  # fmt: skip
        for name in _PASSED:
            body[name] = getattr(req, name)
        thinking = req.thinking or {}
        if reasoning and thinking.get("type") == "enabled":  # (vLLM's mapping)
            body["thinking_token_budget"] = thinking.get("budget_tokens")
    return chat_request_of(body)


def _tool_use(call: dict[str, Any]) -> dict[str, Any] | None:
    """A chat tool call as a ``tool_use`` block (None when its arguments are no object)."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}",
            "name": call["function"]["name"], "input": arguments}  # fmt: skip


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(p: Prepared, text: str, reasoning: str | None = None) -> list[dict[str, Any]]:
    """The ``content`` of an answer: its reasoning (when any), its text and/or its tool
    calls (a call whose arguments are not an object, as one cut by ``max_tokens``, stays
    text)."""
    content, calls = split_answer(p.tool_mode, text) if p.tool_mode else (text, None)
    uses = [_tool_use(call) for call in calls or ()]
    if calls is not None and None in uses:
        content, uses = text, []
    blocks: list[dict[str, Any]] = [] if reasoning is None else [_thinking(reasoning)]
    if content or not uses:
        blocks.append({"type": "text", "text": content or ""})
    return blocks + uses  # type: ignore[operator]


def stop_of(finish: str | None, tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a chat finish reason."""
    if finish == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    matched = stop_reason(finish)
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage_of(use: dict[str, Any] | None, prompt_tokens: int) -> dict[str, int]:
    """Anthropic's ``usage``: ``input_tokens`` excludes the prompt tokens read from the
    prefix cache (``cache_read_input_tokens``, when the cluster said)."""
    use = use or {}
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt = use.get("prompt_tokens", prompt_tokens)
    out = {"input_tokens": max(0, prompt - (cached or 0)),
           "output_tokens": use.get("completion_tokens", 0)}  # fmt: skip
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


def message_body(
    msg_id: str, model: str, content: list[dict[str, Any]] | None, finish: str | None,
    use: dict[str, Any] | None, prompt_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    """The ``message`` object (``content`` None: not started, as ``message_start``
    shows it)."""
    done = content is not None
    reason, sequence = stop_of(finish, any(b["type"] == "tool_use" for b in content or ()))
    usage = usage_of(use, prompt_tokens) if done else {"input_tokens": prompt_tokens,
                                                       "output_tokens": 0}  # fmt: skip
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content or [], "stop_reason": reason if done else None,
            "stop_sequence": sequence if done else None, "usage": usage}  # fmt: skip


async def collect_message(
    model: str, p: Prepared, first: tuple[int, Delta], rest: AsyncIterator, msg_id: str
) -> dict[str, Any]:
    """The whole ``message`` of one answer (BackendError / Rejected propagate)."""
    answer = await whole_answer(first, rest, p)
    content = content_blocks(p, answer.text, answer.reasoning)
    return message_body(msg_id, model, content, answer.finish, answer.usage, len(p.prompt_ids))


def _whole_tool_use_events(block: dict[str, Any], index: int) -> list[bytes]:
    """The events of a ``tool_use`` block sent whole at ``index``."""
    return [
        sse_event("content_block_start", index=index, content_block={**block, "input": {}}),
        sse_event("content_block_delta", index=index, delta={
            "type": "input_json_delta", "partial_json": json.dumps(block["input"])}),
        sse_event("content_block_stop", index=index),
    ]  # fmt: skip


def _call_events(
    deltas: list[dict[str, Any]], calls: dict[int, int], base: int, text_opened: bool
) -> list[bytes]:
    """The events of chat ``tool_calls`` deltas (Hermes calls as they are written): a new
    call stops the block before it (the text's, or the call's before) and starts its
    ``tool_use`` block; its arguments' text goes as ``input_json_delta``. ``calls``
    (call index -> block index) is updated."""
    out = []
    for delta in deltas:
        k = delta["index"]
        if "id" in delta:
            last = max(calls.values()) if calls else (base if text_opened else None)
            if last is not None:
                out.append(sse_event("content_block_stop", index=last))
            calls[k] = base if last is None else last + 1
            block = {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}",
                     "name": delta["function"]["name"], "input": {}}  # fmt: skip
            out.append(sse_event("content_block_start", index=calls[k], content_block=block))
        if delta["function"].get("arguments"):
            out.append(sse_event("content_block_delta", index=calls[k], delta={
                "type": "input_json_delta", "partial_json": delta["function"]["arguments"]}))  # fmt: skip
    return out


def sse_event(kind: str, **fields: Any) -> bytes:
    """One server-sent event of the Messages API."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def error_event(message: str, kind: str = "api_error") -> bytes:
    """The ``error`` event that ends a stream the cluster failed."""
    return sse_event("error", error={"type": kind, "message": message})


async def message_events(
    model: str, p: Prepared, first: tuple[int, Delta], rest: AsyncIterator, msg_id: str
) -> AsyncIterator[bytes]:
    """The server-sent events of one streamed answer (see the module docstring)."""
    prompt_tokens = len(p.prompt_ids)
    yield sse_event("message_start", message=message_body(msg_id, model, None, None, None,
                                                          prompt_tokens))  # fmt: skip
    yield sse_event("ping")
    named = p.tool_mode.name if p.tool_mode is not None else None
    opened, text, finish, use = False, "", None, None
    # A thinking block (the reasoning parts come first) is block 0, stopped before the
    # first other part; the answer's blocks then follow it (``base``).
    thinking, base = False, 0
    # Hermes calls as they are written: each a tool_use block after the text's (``calls``:
    # call index -> block index); the text block stops when the first call starts.
    calls: dict[int, int] = {}
    streamed = None
    try:
        async with aclosing(answer_parts(p, first, rest, stream_calls=True)) as parts:  # (closed
            async for part in parts:  # at once when the client goes away: the request is aborted)
                if isinstance(part, Answer):
                    text, finish, use, streamed = part.text, part.finish, part.usage, part.streamed
                    continue
                if part[0] == "reasoning":
                    if not thinking:
                        yield sse_event("content_block_start", index=0,
                                        content_block=_thinking(""))  # fmt: skip
                        thinking = True
                    yield sse_event("content_block_delta", index=0,
                                    delta={"type": "thinking_delta", "thinking": part[1]})  # fmt: skip
                    continue
                if thinking and not base:
                    yield sse_event("content_block_stop", index=0)
                    base = 1
                if part[0] == "calls":
                    for event in _call_events(part[1], calls, base, opened):
                        yield event
                    continue
                if not opened:  # the first block: the named tool's call, or the text
                    block = ({"type": "text", "text": ""} if part[0] == "text" else
                             {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}",
                              "name": named, "input": {}})  # fmt: skip
                    yield sse_event("content_block_start", index=base, content_block=block)
                    opened = True
                if part[1]:
                    delta = ({"type": "text_delta", "text": part[1]} if part[0] == "text" else
                             {"type": "input_json_delta", "partial_json": part[1]})  # fmt: skip
                    yield sse_event("content_block_delta", index=base, delta=delta)
    except (BackendError, Rejected) as exc:
        yield error_event(f"request failed: {exc}")
        return
    if thinking and not base:
        yield sse_event("content_block_stop", index=0)
        base = 1
    tool_use, index = named is not None, base
    if calls:  # (the text block stopped when the first call started)
        yield sse_event("content_block_stop", index=max(calls.values()))
        _, whole = split_answer(p.tool_mode, text)
        index = max(calls.values()) + 1
        for call in streamed.rest(whole or []) if streamed is not None else ():
            block = _tool_use(call)
            if block is None:
                continue
            for whole in _whole_tool_use_events(block, index):
                yield whole
            index += 1
        tool_use = True
    elif named is None:
        blocks = content_blocks(p, text)
        if blocks[0]["type"] == "text" and not opened:  # an empty answer: its block all the same
            yield sse_event("content_block_start", index=base,
                            content_block={"type": "text", "text": ""})  # fmt: skip
            opened = True
        if opened:
            yield sse_event("content_block_stop", index=base)
            index = base + 1
        for block in blocks:
            if block["type"] != "tool_use":
                continue
            tool_use = True
            for whole in _whole_tool_use_events(block, index):
                yield whole
            index += 1
    else:
        if not opened:  # no input at all (a cut answer): its block all the same
            block = {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": named,
                     "input": {}}  # fmt: skip
            yield sse_event("content_block_start", index=0, content_block=block)
        yield sse_event("content_block_stop", index=0)
    reason, sequence = stop_of(finish, tool_use)
    yield sse_event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage=usage_of(use, prompt_tokens))  # fmt: skip
    yield sse_event("message_stop")

"""OpenAI's Responses API (``POST /v1/responses``), served through chat completions.

A request becomes a :class:`ChatCompletionRequest` (:func:`to_chat`): ``instructions`` a
system message; ``input`` text, or items — messages (text content parts),
``function_call`` items (an assistant turn's tool calls) and ``function_call_output``
items (a ``tool`` message); ``tools`` (function tools, the Responses API's flat shape) and
``tool_choice``; ``text.format`` (``json_object``, ``json_schema``) a structured output;
``max_output_tokens``, ``temperature``, ``top_p`` (left out: the model's defaults), and
vLLM's ``seed``, ``priority`` and ``include_reasoning``, ``reasoning.effort`` (chat's
``reasoning_effort``). It then runs as any chat request,
and its answer is rendered as a ``response`` object (:func:`response_body`): an ``output``
of a ``reasoning`` item first where the server has a reasoning parser and the model
reasoned (its ``reasoning_text``), a ``message`` item (its ``output_text``) and/or
``function_call`` items; ``status`` ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the output was cut there. An input's ``reasoning`` items (an
earlier turn's) are not shown to the model again, as chat templates drop earlier
reasoning. Streamed (:func:`response_events`), the events are ``response.created``,
``response.in_progress``, a reasoning item's ``response.reasoning_text.delta`` ... and
``.done``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., their ``done`` events, a function call's
``response.function_call_arguments.delta`` (as generated for a named ``tool_choice``;
other calls' whole at the end) / ``.done``, and ``response.completed`` with the whole
object; each has a ``sequence_number``.

A response is stored (``store``, true unless the request says false; in the gateway's
:class:`~halfmoon.serve.gateway.response_store.ResponseStore`) with its input items
(:func:`input_items`: the request's ``input`` as items with ids) and the conversation so
far, which a later request's ``previous_response_id`` continues (:func:`to_chat`'s
``history``). With ``background`` the gateway answers at once (``queued``) and stores the
answer when it is done; with ``stream`` too, it streams the events as they are made, and
``GET /v1/responses/{id}?stream=true&starting_after=N`` streams them again from event
``N + 1`` (:mod:`halfmoon.serve.gateway.responses_api`, the routes).

Not served: built-in tools (web search, files, ...), non-text input, ``n``; each a 400
naming it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from halfmoon.serve.gateway.answer_stream import Answer, answer_parts, whole_answer
from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.openai_api import ChatCompletionRequest, FieldError, chat_request_of
from halfmoon.serve.gateway.responses import Delta, HTTPError, Prepared
from halfmoon.serve.gateway.tools import split_answer, tool_call_id


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses`` (the fields served; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    #: vLLM's request priority (as on chat completions: under ``--scheduling-policy
    #: priority``, lower first; else only 0).
    priority: int = 0
    #: vLLM's: the reasoning item (``--reasoning-parser``) goes out; false: the answer only.
    include_reasoning: bool = True
    #: OpenAI's ``{"effort": ...}``: chat's ``reasoning_effort`` (the template reads it).
    reasoning: dict[str, Any] | None = None


def _text_of(content: Any, where: str) -> str:
    """A Responses message's content as text (text parts only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}.content must be text or a list of text parts", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise FieldError(
                f"{where}: content parts of type {kind!r} are not supported (text only)", "input"
            )
        parts.append(part["text"])
    return "".join(parts)


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``req.input`` as the API lists a response's input items: each with an ``id`` (its
    own, or a new one), a message's text content as parts. Items that are not served stay
    as they are (:func:`to_chat` refuses them)."""
    if isinstance(req.input, str):
        content = [{"type": "input_text", "text": req.input}]
        return [{"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "user",
                 "content": content, "status": "completed"}]  # fmt: skip
    items = []
    for item in req.input:
        if not isinstance(item, dict):
            items.append(item)
            continue
        item = {"type": "message", **item}
        prefix = _ITEM_ID_PREFIX.get(item["type"], "item")
        item.setdefault("id", f"{prefix}_{secrets.token_hex(12)}")
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        items.append(item)
    return items


def input_items_page(
    items: Sequence[dict[str, Any]], limit: int, order: str, after: str | None
) -> dict[str, Any]:
    """A page of a response's input items as ``GET /v1/responses/{id}/input_items`` lists
    them: ``limit`` (1-100) items in ``order`` (``asc``, or ``desc``: newest first), those
    after the item ``after``; a 400 naming the parameter that is out of range."""
    if not 1 <= limit <= 100:
        raise HTTPError(400, f"limit must be 1-100, not {limit}", "BadRequestError", param="limit")
    if order not in ("asc", "desc"):
        raise HTTPError(400, f"order must be 'asc' or 'desc', not {order!r}", "BadRequestError",
                        param="order")  # fmt: skip
    ordered = list(items) if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise HTTPError(400, f"no input item {after!r} in this response", "BadRequestError",
                            param="after")  # fmt: skip
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }


def _messages(
    instructions: str | None, history: Sequence[Any], items: Sequence[Any]
) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and the conversation: ``history``'s items
    (earlier turns, served before), then ``items`` (this request's input)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate([*history, *items], -len(history)):
        where = f"input[{i}]" if i >= 0 else "an earlier turn's item"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(
                {"role": item.get("role"), "content": _text_of(item.get("content"), where)}
            )
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            last = messages[-1] if messages else None
            if (
                last
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)  # calls of one turn: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: not shown to the model again
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})  # fmt: skip
        else:
            raise FieldError(f"{where}: items of type {kind!r} are not supported", "input")
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) as chat tools (none for ``[]``: the Responses
    API's default, which clients send as it is)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise FieldError(f"tools[{i}]: only function tools are served, not {kind!r}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema",
                "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}}  # fmt: skip
    return {"type": fmt.get("type")}


def to_chat(
    req: ResponsesRequest, items: Sequence[dict[str, Any]] | None = None,
    history: Sequence[dict[str, Any]] = (),
) -> ChatCompletionRequest:  # fmt: skip
    """The chat completion request that serves ``req`` (FieldError / ValueError for what
    cannot be served): ``instructions``, then the items of ``history`` (the conversation
    of its ``previous_response_id``) and of ``items`` (its input; default
    :func:`input_items`)."""
    items = input_items(req) if items is None else items
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req.instructions, history, items),
        "stream": req.stream,
        "tools": _tools(req.tools),
        # (without tools, the API's default "auto" or a "none" mean plain text)
        "tool_choice": _tool_choice(req.tool_choice)
        if req.tools or req.tool_choice not in ("auto", "none")
        else None,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
    }
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    given = req.model_fields_set
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("seed", "seed"), ("priority", "priority"),
                         ("include_reasoning", "include_reasoning")):  # fmt: skip
        if ours in given and getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    return chat_request_of(body, messages_as="input")


def new_ids() -> tuple[str, str]:
    """A new response's id and its message's."""
    return f"resp_{secrets.token_hex(12)}", f"msg_{secrets.token_hex(12)}"


def output_items(
    p: Prepared, text: str, finish: str | None, msg_id: str, reasoning: str | None = None,
    reasoning_id: str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The ``output`` of an answer: its reasoning (when any), a message with its text,
    and/or its function calls."""
    status = "incomplete" if finish == "length" else "completed"
    content, calls = split_answer(p.tool_mode, text) if p.tool_mode else (text, None)
    items = []
    if reasoning is not None:
        items.append(_reasoning(reasoning_id or new_reasoning_id(), reasoning, "completed"))
    if content or calls is None:
        items.append(_message(msg_id, content or "", status))
    for call in calls or ():
        items.append(_function_call(call, status))
    return items


def new_reasoning_id() -> str:
    """A new reasoning item's id."""
    return f"rs_{secrets.token_hex(12)}"


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "encrypted_content": None, "status": status}  # fmt: skip


def _message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def _call_of(name: str) -> dict[str, Any]:
    """A new chat tool call of ``name`` with no arguments yet."""
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}


def _function_call(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{secrets.token_hex(12)}",
        "call_id": call.get("id") or tool_call_id(),
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _whole_call_events(
    event: Callable[..., bytes], item: dict[str, Any], index: int
) -> list[bytes]:
    """The events of a function call item sent whole at output ``index`` (``event``: the
    stream's event maker)."""
    return [
        event("response.output_item.added", output_index=index,
              item={**item, "arguments": "", "status": "in_progress"}),
        event("response.function_call_arguments.delta", item_id=item["id"],
              output_index=index, delta=item["arguments"]),
        event("response.function_call_arguments.done", item_id=item["id"],
              output_index=index, arguments=item["arguments"]),
        event("response.output_item.done", output_index=index, item=item),
    ]  # fmt: skip


def response_body(
    req: ResponsesRequest, resp_id: str, created: float, model: str,
    output: list[dict[str, Any]], finish: str | None, use: dict[str, Any] | None,
    stored: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The ``response`` object (``output`` None: still in progress; ``stored``: kept for
    later turns)."""
    done = output is not None
    incomplete = done and finish == "length"
    use = use or {}
    usage = None
    if done:
        usage = {
            "input_tokens": use.get("prompt_tokens", 0),
            "input_tokens_details": {
                "cached_tokens": (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            },
            "output_tokens": use.get("completion_tokens", 0),
            "output_tokens_details": {
                "reasoning_tokens": (use.get("completion_tokens_details") or {}).get(
                    "reasoning_tokens", 0
                )
            },
            "total_tokens": use.get("total_tokens", 0),
        }
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output if done else [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "store": stored,
        "background": req.background,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "truncation": "disabled",
        "usage": usage,
        "metadata": req.metadata or {},
        "user": req.user,
    }


#: Called with a finished ``response`` object to store it (see :mod:`response_store`).
Keep = Callable[[dict[str, Any]], None]


async def collect_response(
    req: ResponsesRequest, p: Prepared, first: tuple[int, Delta], rest: AsyncIterator,
    keep: Keep | None = None, ids: tuple[str, str] | None = None, created: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The whole ``response`` object of one answer (``ids``: its and its message's, and
    ``created``, when given beforehand: a background response's), handed to ``keep``
    (when given) before it is returned (BackendError / Rejected propagate)."""
    resp_id, msg_id = ids or new_ids()
    created = time.time() if created is None else created
    answer = await whole_answer(first, rest, p)
    output = output_items(p, answer.text, answer.finish, msg_id, answer.reasoning)
    body = response_body(req, resp_id, created, req.model, output, answer.finish, answer.usage,
                         keep is not None)  # fmt: skip
    if keep is not None:
        keep(body)
    return body


def sse_event(kind: str, seq: int, **fields: Any) -> bytes:
    """One server-sent event of the Responses API: ``kind`` with ``sequence_number``
    ``seq``."""
    body = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


def error_of(event: bytes) -> str | None:
    """The message of an ``error`` event (None for any other event)."""
    if not event.startswith(b"event: error\n"):
        return None
    data = event.split(b"\ndata: ", 1)[1]
    return str(json.loads(data).get("message", ""))


async def response_events(
    req: ResponsesRequest, p: Prepared, first: tuple[int, Delta], rest: AsyncIterator,
    keep: Keep | None = None, ids: tuple[str, str] | None = None, created: float | None = None,
    announced: bool = False,
) -> AsyncIterator[bytes]:  # fmt: skip
    """The server-sent events of one streamed answer (an ``error`` event when the
    cluster fails mid-way); the finished ``response`` goes to ``keep`` (when given) before
    ``response.completed``, so a client may continue it as soon as it reads that event.
    ``ids`` and ``created``: as :func:`collect_response`'s; ``announced``: its
    ``response.created`` went out already (a background response's, ``queued``, before it
    started), so these begin with ``response.in_progress``."""
    stored = keep is not None
    resp_id, msg_id = ids or new_ids()
    created = time.time() if created is None else created
    seq = 1 if announced else 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse_event(kind, seq - 1, **fields)

    pending = response_body(req, resp_id, created, req.model, None, None, None, stored)  # type: ignore[arg-type]
    if not announced:
        yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    named = p.tool_mode.name if p.tool_mode is not None else None
    call: dict[str, Any] | None = None  # a named function's call, its arguments streamed
    opened, text, finish, use = False, "", None, None
    # The reasoning (its parts come first): item 0 while it streams, closed before the
    # first other part; the answer's items then follow it (``base``).
    thought_id, thought, base = new_reasoning_id(), "", 0

    def close_reasoning() -> Iterator[bytes]:
        nonlocal base
        if thought and not base:
            item = _reasoning(thought_id, thought, "completed")
            yield event("response.reasoning_text.done", item_id=thought_id, output_index=0,
                        content_index=0, text=thought)  # fmt: skip
            yield event("response.content_part.done", item_id=thought_id, output_index=0,
                        content_index=0, part=item["content"][0])  # fmt: skip
            yield event("response.output_item.done", output_index=0, item=item)
            base = 1

    # Hermes calls as they are written (``calls`` parts): each a function_call item after
    # the message, which is done when the first call starts (``said``: its text).
    streamed: dict[int, tuple[int, dict[str, Any]]] = {}  # call index -> (output index, item)
    said, open_call = "", None

    def close_message() -> Iterator[bytes]:
        if opened and not streamed:
            part = {"type": "output_text", "text": said, "annotations": [], "logprobs": []}
            yield event("response.output_text.done", item_id=msg_id, output_index=base,
                        content_index=0, text=said, logprobs=[])  # fmt: skip
            yield event("response.content_part.done", item_id=msg_id, output_index=base,
                        content_index=0, part=part)  # fmt: skip
            yield event("response.output_item.done", output_index=base,
                        item=_message(msg_id, said, "completed"))  # fmt: skip

    def close_call(k: int | None, status: str = "completed") -> Iterator[bytes]:
        if k is None:
            return
        index, item = streamed[k]
        item["status"] = status
        yield event("response.function_call_arguments.done", item_id=item["id"],
                    output_index=index, arguments=item["arguments"])  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)

    try:
        async with aclosing(answer_parts(p, first, rest, stream_calls=True)) as parts:  # (closed
            async for part in parts:  # at once when the client goes away: the request is aborted)
                if isinstance(part, Answer):
                    text, finish, use = part.text, part.finish, part.usage
                    continue
                if part[0] == "reasoning":
                    if not thought:
                        yield event("response.output_item.added", output_index=0,
                                    item=_reasoning(thought_id, "", "in_progress"))  # fmt: skip
                        yield event("response.content_part.added", item_id=thought_id,
                                    output_index=0, content_index=0,
                                    part={"type": "reasoning_text", "text": ""})  # fmt: skip
                    thought += part[1]
                    yield event("response.reasoning_text.delta", item_id=thought_id,
                                output_index=0, content_index=0, delta=part[1])  # fmt: skip
                    continue
                for closing in close_reasoning():
                    yield closing
                if part[0] == "calls":
                    for delta in part[1]:
                        k, args = delta["index"], delta["function"].get("arguments", "")
                        if "id" in delta:
                            for closing in [*close_message(), *close_call(open_call)]:
                                yield closing
                            item = {"type": "function_call", "id": f"fc_{secrets.token_hex(12)}",
                                    "call_id": delta["id"], "name": delta["function"]["name"],
                                    "arguments": "", "status": "in_progress"}  # fmt: skip
                            streamed[k] = (base + int(opened) + len(streamed), item)
                            open_call = k
                            yield event("response.output_item.added", output_index=streamed[k][0],
                                        item=dict(item))  # fmt: skip
                        if args:
                            index, item = streamed[k]
                            item["arguments"] += args
                            yield event("response.function_call_arguments.delta",
                                        item_id=item["id"], output_index=index, delta=args)  # fmt: skip
                    continue
                if part[0] == "call":  # the output is the call's arguments: out as they come
                    if call is None:
                        call = _function_call(_call_of(named or ""), "in_progress")
                        yield event("response.output_item.added", output_index=base, item=call)
                    if part[1]:
                        yield event("response.function_call_arguments.delta", item_id=call["id"],
                                    output_index=base, delta=part[1])  # fmt: skip
                else:
                    if not opened:
                        yield event("response.output_item.added", output_index=base,
                                    item={**_message(msg_id, "", "in_progress"), "content": []})  # fmt: skip
                        yield event("response.content_part.added", item_id=msg_id,
                                    output_index=base, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
                        opened = True
                    yield event("response.output_text.delta", item_id=msg_id, output_index=base,
                                content_index=0, delta=part[1], logprobs=[])  # fmt: skip
                    said += part[1]
    except (BackendError, Rejected) as exc:
        yield event("error", code="server_error", message=f"request failed: {exc}", param=None)
        return
    for closing in close_reasoning():
        yield closing
    if streamed:
        status = "incomplete" if finish == "length" else "completed"
        for closing in close_call(open_call, status):
            yield closing
        head = [_reasoning(thought_id, thought, "completed")] if thought else []
        if opened:  # (done when the first call started)
            head.append(_message(msg_id, said, "completed"))
        output = head + [item for _, item in sorted(streamed.values(), key=lambda s: s[0])]
        _, whole = split_answer(p.tool_mode, text)
        for k, whole_call in enumerate(whole or ()):
            if k in streamed:
                continue
            out = _function_call(whole_call, status)
            for whole_event in _whole_call_events(event, out, len(output)):
                yield whole_event
            output.append(out)
    else:
        output = output_items(p, text, finish, msg_id, thought or None, thought_id)
    if call is not None:  # the item streamed already: its ids
        output[base].update(id=call["id"], call_id=call["call_id"])
    index = base
    for out in output[base:] if not streamed else ():
        if call is not None:
            yield event("response.function_call_arguments.done", item_id=out["id"],
                        output_index=base, arguments=out["arguments"])  # fmt: skip
            yield event("response.output_item.done", output_index=base, item=out)
        elif out["type"] == "message":
            if not opened:  # an empty answer: its message all the same
                yield event("response.output_item.added", output_index=base,
                            item={**out, "status": "in_progress", "content": []})  # fmt: skip
                yield event("response.content_part.added", item_id=msg_id, output_index=base,
                            content_index=0, part={"type": "output_text", "text": "",
                                                   "annotations": []})  # fmt: skip
            part = out["content"][0]
            yield event("response.output_text.done", item_id=msg_id, output_index=base,
                        content_index=0, text=part["text"], logprobs=[])  # fmt: skip
            yield event("response.content_part.done", item_id=msg_id, output_index=base,
                        content_index=0, part=part)  # fmt: skip
            yield event("response.output_item.done", output_index=base, item=out)
        else:
            for whole_event in _whole_call_events(event, out, index):
                yield whole_event
        index += 1
    done = response_body(req, resp_id, created, req.model, output, finish, use, stored)
    if keep is not None:
        keep(done)
    yield event("response.completed", response=done)

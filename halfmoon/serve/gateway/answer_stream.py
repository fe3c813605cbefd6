"""One choice's stream read as an answer, for the APIs served through chat completions
(OpenAI's Responses API, Anthropic's Messages API): whole (:func:`whole_answer`), or as
the parts that may go out while it streams (:func:`answer_parts`), which each API then
words as its own events.

Under a tool mode the output is held as the chat route holds it: a named function's
output is its call's arguments, out as generated (``call`` parts); otherwise content goes
out only where it cannot be, or begin, a call (``text`` parts;
:class:`~halfmoon.serve.gateway.tools.HeldText`), and the calls are read from the whole
answer at the end (calls of the formats read as they come, with ``stream_calls``, also as
they are written: ``calls`` parts). Under a reasoning parser the reasoning comes first, apart
(``reasoning`` parts, the answer's ``reasoning``; dropped with ``include_reasoning:
false``), and only the content is read for calls. Both close the stream, also when the
cluster fails mid-way (BackendError / Rejected propagate).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from halfmoon.serve.gateway.reasoning import shown_reasoning
from halfmoon.serve.gateway.responses import Delta, Prepared, all_items
from halfmoon.serve.gateway.tool_streams import StreamedCalls, streamed_calls
from halfmoon.serve.gateway.tools import HeldText


@dataclass(frozen=True)
class Answer:
    """A finished answer: its whole text (the content, under a reasoning parser), finish
    reason, usage and reasoning (None: none, or not to be shown)."""

    text: str
    finish: str | None
    usage: dict | None
    reasoning: str | None = None
    #: The calls that went out as they were written (``calls`` parts), or None.
    streamed: StreamedCalls | None = None


async def whole_answer(
    first: tuple[int, Delta], rest: AsyncIterator, p: Prepared | None = None
) -> Answer:
    """The whole answer of a one-choice stream (its first item, then the rest; ``p``:
    the request, whose reasoning parser splits it)."""
    parts, finish, use = [], None, None
    async with aclosing(all_items(first, rest)) as items:
        async for _, (text, fin, u, _entries, _prompt) in items:
            parts.append(text)
            if fin is not None:
                finish, use = fin, u
    text, reasoning = "".join(parts), None
    if p is not None and p.reasoning is not None:
        reasoning, content = shown_reasoning(p.reasoning, text)
        text = content or ""
    return Answer(text, finish, use, reasoning)


async def answer_parts(
    p: Prepared, first: tuple[int, Delta], rest: AsyncIterator, stream_calls: bool = False
) -> AsyncIterator[tuple[str, Any] | Answer]:
    """``("reasoning", delta)``, ``("call", delta)`` (a named function's arguments),
    ``("text", delta)`` (content) and ``("calls", deltas)`` (calls as they are written,
    as chat ``tool_calls`` deltas: :func:`~halfmoon.serve.gateway.tool_streams.streamed_calls`;
    with ``stream_calls``, else whole at the end) parts as they may go out, then the
    :class:`Answer`."""
    named = p.tool_mode.name if p.tool_mode is not None else None
    held = HeldText(p.tool_mode) if p.tool_mode is not None and named is None else None
    streamed = streamed_calls(p.tool_mode) if stream_calls and held is not None else None
    thinking = p.reasoning.splitter() if p.reasoning is not None else None
    text, finish, use, reasoning = "", None, None, []
    async with aclosing(all_items(first, rest)) as items:
        async for _, (delta, fin, u, _entries, _prompt) in items:
            if fin is not None:
                finish, use = fin, u
            if thinking is not None:
                thought, delta = thinking.add(delta, fin is not None)
                if thought and p.reasoning.show:
                    reasoning.append(thought)
                    yield "reasoning", thought
                if not delta and fin is None:  # nothing of the answer yet
                    continue
            if named is not None:
                text += delta
                yield "call", delta
            elif held is None:
                text += delta
                if delta:
                    yield "text", delta
            else:  # text before calls (there may be none): as it may go out
                out, calls = held.add(delta, fin is not None)
                text = held.text
                deltas = streamed.deltas(text, fin is not None) if streamed is not None else []
                if calls is None and fin is not None and streamed is not None and streamed.started:
                    out = ""  # (calls went out in part and did not end whole: no content)
                if out:
                    yield "text", out
                if deltas:
                    yield "calls", deltas
    yield Answer(text, finish, use, "".join(reasoning) if reasoning else None, streamed)

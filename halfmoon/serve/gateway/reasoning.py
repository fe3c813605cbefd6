"""Reasoning parsers: a thinking model's ``<think>...</think>`` text kept apart from its
answer, as vLLM's and SGLang's ``--reasoning-parser`` do.

``halfmoon serve --reasoning-parser NAME`` reads each chat answer as reasoning, then
content: chat completions carry the reasoning as the message's (or a streamed delta's)
``reasoning`` field and the rest as ``content``; the Responses API answers it as a
``reasoning`` output item before the message; Anthropic's Messages API as a ``thinking``
block. A request's ``include_reasoning: false`` (vLLM's field) drops it. The text is
parsed, not the token ids, so the parsers serve every engine behind the gateway alike
(the tags must survive detokenization: thinking models' ``<think>`` tokens are not
special tokens).

- ``deepseek_r1``: the output is reasoning up to ``</think>`` (DeepSeek-R1's chat
  template opens ``<think>`` in the prompt; one at the output's start is dropped), the
  rest content; an output that never closes it (cut by ``max_tokens``) is all reasoning.
- ``qwen3``: reasoning only where it was opened, by the prompt (a template that ends the
  prompt in ``<think>``, as Qwen3's thinking models do) or by the output's first text;
  otherwise all content.

With either, a prompt that closes the reasoning itself (ends in ``</think>``, as Qwen3's
template does with ``enable_thinking: false``) has an answer of content alone.

Streamed, text goes out as it comes, except a tail that may still become a tag (held
until the next delta tells). A structured output (``response_format``, a JSON schema, a
regex, choices, forced tool calls) holds after the reasoning, as on vLLM: the model
reasons freely, then the grammar holds the rest (:func:`halfmoon.engine.structured.
after_reasoning`); a Lark/GBNF grammar or a structural tag holds the whole output, which
is then all content.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from halfmoon.core.request import AFTER_REASONING_KINDS, REASONING_TAGS, SamplingParams

#: ``--reasoning-parser`` choices.
PARSERS = ("deepseek_r1", "qwen3")
_OPEN, _CLOSE = REASONING_TAGS


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is read: by ``parser``, reasoning first when ``opened``
    (its prompt ended in the start tag); ``show``: the reasoning goes out (vLLM's
    ``include_reasoning``)."""

    parser: str
    opened: bool = False
    show: bool = True

    @classmethod
    def for_prompt(cls, parser: str, prompt_tail: str, show: bool = True) -> ReasoningMode | None:
        """The mode of a request whose rendered prompt ends in ``prompt_tail``; None when
        the prompt closed the reasoning itself (``</think>``, as Qwen3's template does
        with ``enable_thinking: false``): the output is all content."""
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: {PARSERS}")
        tail = prompt_tail.rstrip()
        if tail.endswith(_CLOSE):
            return None
        return cls(parser, tail.endswith(_OPEN), show)

    @property
    def reasoning_first(self) -> bool:
        """Whether the output starts in the reasoning (DeepSeek-R1's always does)."""
        return self.parser == "deepseek_r1" or self.opened

    def splitter(self) -> ReasoningSplit:
        """A new reader of one choice's output."""
        return ReasoningSplit(self.reasoning_first)


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """Reads one output, delta by delta, into reasoning and content (:meth:`add`); the
    parts of a whole output are the same however it was cut into deltas."""

    def __init__(self, reasoning_first: bool):
        # "start": the output's opening, which may be the start tag; "reasoning"; "content"
        self._state = "start"
        self._reasoning_first = reasoning_first
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether text coming now is reasoning (at the start: where it would go)."""
        return self._state == "reasoning" or (self._state == "start" and self._reasoning_first)

    def add(self, delta: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` that may go out after ``delta`` (``final``: the last
        delta; everything held goes out)."""
        text, self._held = self._held + delta, ""
        reasoning = content = ""
        if self._state == "start":
            opening = text.lstrip()
            if opening.startswith(_OPEN):
                self._state, text = "reasoning", opening[len(_OPEN) :]
            elif _OPEN.startswith(opening) and not final:  # (may still be the tag)
                self._held = text
                return "", ""
            else:
                self._state = "reasoning" if self._reasoning_first else "content"
        if self._state == "reasoning":
            before, closed, after = text.partition(_CLOSE)
            if closed:
                reasoning, self._state, text = before, "content", after
            else:
                keep = 0 if final else _tag_prefix(text, _CLOSE)
                reasoning, self._held = text[: len(text) - keep], text[len(text) - keep :]
                return reasoning, ""
        content = text
        return reasoning, content


def held_after_reasoning(
    mode: ReasoningMode, params: SamplingParams
) -> tuple[SamplingParams, ReasoningMode | None]:
    """``params`` and ``mode`` for a request read by ``mode``: its structured output (if
    any) held after the reasoning; a kind that cannot be holds the whole output, which
    then has no reasoning (mode None)."""
    structured = params.structured
    if structured is None:
        return params, mode
    if structured.kind not in AFTER_REASONING_KINDS:
        return params, None
    place = "first" if mode.reasoning_first else "optional"
    return replace(params, structured=replace(structured, reasoning=place)), mode


def split_reasoning(mode: ReasoningMode, text: str) -> tuple[str | None, str | None]:
    """A whole output's ``(reasoning, content)``: reasoning None where there is none,
    and then the content the whole text; else content None where none followed it."""
    reasoning, content = mode.splitter().add(text, final=True)
    if not reasoning:
        return None, content
    return reasoning, content or None


def shown_reasoning(mode: ReasoningMode, text: str) -> tuple[str | None, str | None]:
    """:func:`split_reasoning` as an answer shows it: the reasoning None unless the
    request shows it (``include_reasoning``)."""
    reasoning, content = split_reasoning(mode, text)
    return (reasoning if mode.show else None), content

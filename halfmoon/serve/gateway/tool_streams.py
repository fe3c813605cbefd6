"""Tool calls streamed as the model writes them (``tool_choice: auto``), as vLLM streams
them: a call's id and name once its text names the function, then its arguments' JSON
in parts, joined into the same value as the whole answer's calls
(:func:`halfmoon.serve.gateway.tools.tool_calls`). One streamer per format read as it
comes (:func:`streamed_calls`): Hermes ``<tool_call>`` blocks (:class:`StreamedCalls`),
Llama 3 JSON objects (:class:`StreamedJsonCalls`), Qwen3-Coder ``<function=...>``
blocks (:class:`StreamedCoderCalls`); each gives chat ``tool_calls`` deltas, which the
chat, Responses and Messages streams word as their own events."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from halfmoon.serve.gateway.tools import (
    HERMES_OPEN,
    OPENERS,
    PYTHON_TAG,
    ToolMode,
    schema_kinds,
    tool_call_id,
    typed,
)

#: A Hermes call's head: its function's name, then the key of its arguments.
_HERMES_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


class _JsonScan:
    """Where a JSON object or array ends, read as its text grows (each character once)."""

    def __init__(self, start: int) -> None:
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False

    def end(self, text: str) -> int | None:
        """Just after the value's end in ``text`` (its text so far), or None while open."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


class StreamedCalls:
    """Hermes calls (``--tool-call-parser hermes``) streamed as they are written, as vLLM
    streams them: a call's id and name once its JSON has named the function, then its
    arguments' text as it comes (the object as the model writes it). A call whose JSON
    begins otherwise (its arguments first, or as a string) goes whole at the end."""

    def __init__(self) -> None:
        #: Per block: its id, name, how far its arguments were sent, where they end (None
        #: while open) and their scan; None for a block sent whole at the end.
        self.calls: list[dict[str, Any] | None] = []

    def deltas(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """The chat ``tool_calls`` deltas (each with its ``index``) that ``text``, the
        output so far (``final``: whole), adds to what went out before."""
        out: list[dict[str, Any]] = []
        for k, at in enumerate(self._block_starts(text)):
            if k == len(self.calls):
                head = _HERMES_HEAD.match(text, at)
                if head is None or head.end() >= len(text):
                    break  # (not named yet; or another shape, read at the end)
                if text[head.end()] != "{":
                    self.calls.append(None)
                else:
                    start = head.end()
                    call = {"id": tool_call_id(), "name": json.loads(head.group(1)),
                            "sent": start, "end": None, "scan": _JsonScan(start)}  # fmt: skip
                    self.calls.append(call)
                    out.append({"index": k, "id": call["id"], "type": "function",
                                "function": {"name": call["name"], "arguments": ""}})  # fmt: skip
            call = self.calls[k]
            if call is not None and call["end"] is None:
                call["end"] = call["scan"].end(text)
                upto = len(text) if call["end"] is None else call["end"]
                if upto > call["sent"]:
                    out.append({"index": k, "function": {"arguments": text[call["sent"] : upto]}})
                    call["sent"] = upto
                if call["end"] is None:
                    break
        return out

    def _block_starts(self, text: str) -> Iterator[int]:
        """Where each call's JSON begins in ``text`` (after its ``<tool_call>``)."""
        at = text.find(HERMES_OPEN)
        while at >= 0:
            yield at + len(HERMES_OPEN)
            at = text.find(HERMES_OPEN, at + 1)

    @property
    def started(self) -> bool:
        """Whether any call went out (in part)."""
        return any(call is not None for call in self.calls)

    def rest(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Of the whole answer's ``calls``, those not streamed, each with its ``index``."""
        return [{"index": k, **call} for k, call in enumerate(calls)
                if k >= len(self.calls) or self.calls[k] is None]  # fmt: skip


class StreamedJsonCalls(StreamedCalls):
    """Llama 3.x JSON calls (``--tool-call-parser llama3_json``) streamed as they are
    written: the answer's ``{"name": ..., "parameters": {...}}`` objects (``;`` between
    them, after an optional ``<|python_tag|>``), each as a Hermes call's JSON."""

    def __init__(self) -> None:
        super().__init__()
        #: Each object's scan, and its end once known, to find the next one.
        self._scans: list[_JsonScan] = []
        self._ends: list[int] = []

    def _block_starts(self, text: str) -> Iterator[int]:
        """Where each call's object begins: the answer's first ``{``, then each after the
        end of the one before (past whitespace and ``;``)."""
        pos = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_TAG, pos):
            rest = text[pos + len(PYTHON_TAG) :]
            pos += len(PYTHON_TAG) + len(rest) - len(rest.lstrip())
        k = 0
        while pos < len(text) and text[pos] == "{":
            yield pos
            if k == len(self._scans):
                self._scans.append(_JsonScan(pos))
            if k == len(self._ends):
                end = self._scans[k].end(text)
                if end is None:
                    return
                self._ends.append(end)
            pos = self._ends[k]
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            k += 1


#: What may end a Qwen3-Coder parameter's value (after the format's newline).
_CODER_ENDS = ("</parameter>", "<parameter=", "</function>")
_CODER_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]*)>")


class StreamedCoderCalls(StreamedCalls):
    """Qwen3-Coder calls (``--tool-call-parser qwen3_coder``) streamed as they are
    written: a call's id and name once its ``<function=NAME>`` is whole, then its
    arguments as JSON, each parameter once its value ends (typed by the tool's schema,
    as the whole answer reads it), a ``string`` one as its text comes (the format's
    newlines around it left out, a tail that may begin an end tag held back)."""

    def __init__(self, functions: Mapping[str, dict[str, Any]]) -> None:
        super().__init__()
        self.functions = functions

    def deltas(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """As :meth:`StreamedCalls.deltas`; ``final``: the output is whole (a call or a
        value left open at its end ends there, as the whole answer reads it)."""
        out: list[dict[str, Any]] = []
        starts = [at for at in (text.find(o) for o in OPENERS["qwen3_coder"]) if at >= 0]
        pos, k = (min(starts) if starts else len(text)), 0
        while (head := _CODER_FUNCTION.search(text, pos)) is not None:
            close = text.find("</function>", head.end())
            body = text[head.end() : len(text) if close < 0 else close]
            if k == len(self.calls):
                name = head.group(1).strip()
                if not name:
                    break
                self.calls.append({"id": tool_call_id(), "name": name, "done": 0, "value": None,
                                   "closed": False})  # fmt: skip
                out.append({"index": k, "id": self.calls[k]["id"], "type": "function",
                            "function": {"name": name, "arguments": ""}})  # fmt: skip
            call = self.calls[k]
            if not call["closed"]:
                piece = self._arguments(call, body, close >= 0 or final)
                if piece:
                    out.append({"index": k, "function": {"arguments": piece}})
                if close < 0 and not final:
                    break
                call["closed"] = True
            pos, k = (len(text) if close < 0 else close + len("</function>")), k + 1
        return out

    def _arguments(self, call: dict[str, Any], body: str, whole: bool) -> str:
        """The next text of ``call``'s arguments JSON from its ``body`` so far (``whole``:
        the body is all there is). ``call`` keeps ``done`` (parameters sent whole) and
        ``value`` (a string parameter's text sent so far, None between parameters)."""
        properties = (self.functions.get(call["name"]) or {}).get("properties") or {}
        params = list(_CODER_PARAMETER.finditer(body))
        piece = ""
        for j, param in enumerate(params[call["done"] :], call["done"]):
            key = param.group(1).strip()
            nxt = params[j + 1].start() if j + 1 < len(params) else None
            end = body.find("</parameter>", param.end())
            if end < 0 or (nxt is not None and end > nxt):
                end = nxt if nxt is not None else (len(body) if whole else -1)
            raw = body[param.end() :] if end < 0 else body[param.end() : end]
            raw = raw.removeprefix("\n")
            lead = ("{" if j == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
            is_string = "string" in schema_kinds(properties.get(key))
            if end < 0:  # the value is still being written: a string's text so far
                if is_string:
                    if call["value"] is None:
                        piece, call["value"] = piece + lead + '"', ""
                    shown = _held_tail(raw)
                    piece += json.dumps(shown[len(call["value"]) :], ensure_ascii=False)[1:-1]
                    call["value"] = shown
                break
            value = raw.removesuffix("\n")
            if call["value"] is not None:  # (a string streamed so far: its rest, closed)
                piece += json.dumps(value[len(call["value"]) :], ensure_ascii=False)[1:-1] + '"'
                call["value"] = None
            else:
                piece += lead + json.dumps(typed(value, properties.get(key)), ensure_ascii=False)
            call["done"] = j + 1
        if whole and call["value"] is None and (call["done"] == len(params)):
            piece += "}" if params else "{}"
        return piece


def _held_tail(value: str) -> str:
    """``value`` (a string parameter's text so far) without a tail that may still be its
    format's closing newline or the start of an end tag."""
    for cut in range(min(len(value), 1 + max(map(len, _CODER_ENDS))), 0, -1):
        tail = value[-cut:]
        if any(("\n" + end).startswith(tail) or end.startswith(tail) for end in _CODER_ENDS):
            return value[:-cut]
    return value


def streamed_calls(mode: ToolMode) -> StreamedCalls | None:
    """What streams ``mode``'s calls as they are written (its parser's format), or None
    (read whole at the end)."""
    if mode.parser == "hermes":
        return StreamedCalls()
    if mode.parser == "llama3_json":
        return StreamedJsonCalls()
    if mode.parser == "qwen3_coder":
        return StreamedCoderCalls(mode.functions)
    return None

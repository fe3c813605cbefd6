"""Tool calling on chat completions: OpenAI's ``tools`` and ``tool_choice``, as vLLM
serves them without a model-specific tool-call parser.

- ``tool_choice`` a named function (``{"type": "function", "function": {"name": ...}}``):
  the output is held to that function's ``parameters`` schema (a structured output, JSON
  without free whitespace: arguments are read by programs, and a small model held to
  flexible JSON can wander in whitespace until ``max_tokens``) and
  answered as one tool call whose ``arguments`` are the output; ``finish_reason`` stays
  the generation's (``stop``; ``length`` when ``max_tokens`` cut the arguments short), as
  OpenAI's API does for a forced function. Streamed, the arguments go out as they are
  generated (the first chunk carries the call's id and name).
- ``"required"``: the output is held to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each (at most one with ``parallel_tool_calls: false``), and
  answered as those tool calls; ``finish_reason`` ``tool_calls``.
- ``"none"``: plain text (the tools still reach the chat template).
- ``"auto"`` (the default when tools are given): the model decides, and its own
  tool-call format is parsed out of the text: ``hermes`` (``halfmoon serve
  --tool-call-parser hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, as Qwen2.5/3, Hermes and many other templates ask for; the text before the
  first block is the message's ``content``; ``finish_reason`` ``tool_calls`` when there
  are calls); ``llama3_json`` (Llama 3.x: the whole answer one or more ``{"name",
  "parameters"}`` objects, ``;`` between them, after an optional ``<|python_tag|>``;
  streamed, an answer is held back while it may still be a call); ``pythonic`` (Llama
  3.2 and 4, and others: the whole answer a Python list of calls with keyword arguments,
  ``[weather(city="Paris"), clock()]``, optionally between ``<|python_start|>`` and
  ``<|python_end|>``; the values Python literals, read with :mod:`ast`, never run);
  ``mistral`` (Mistral's instruct models: text, then ``[TOOL_CALLS]`` and either a JSON
  array of ``{"name", "arguments"}`` objects, as tokenizers before v11 write it, or
  ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]``, as v11 and later
  do; ``[TOOL_CALLS]`` is a special token, so such requests keep special tokens in their
  text, as vLLM's parser asks; call ids are 9 letters and digits, which Mistral's chat
  templates require of the ``tool_call_id`` that answers them); ``qwen3_coder``
  (Qwen3-Coder's XML-like calls: ``<tool_call><function=NAME><parameter=KEY>value
  </parameter>...</function></tool_call>``, the wrapper optional; each value's text read
  as its parameter's schema types it: a string as written, numbers, booleans and null as
  such, objects and arrays as JSON (or Python literals); a parameter the schema does not
  type as JSON where it parses, else text).
  Without a parser, a 400 saying so, as vLLM answers without
  ``--enable-auto-tool-choice``. Streamed, text goes out as it comes until a block may
  begin (a tail that could start ``<tool_call>`` is held back); Hermes, Llama 3 JSON
  and Qwen3-Coder calls then follow as they are written
  (:mod:`halfmoon.serve.gateway.tool_streams`), the other formats' whole.

The tools reach the chat template as its ``tools`` variable, and earlier turns' tool calls
and results as the messages' ``tool_calls`` (``arguments`` as objects, which templates
expect) and ``tool_call_id``. A streamed answer sends a named function's arguments as
they come, Hermes, Llama 3 JSON and Qwen3-Coder calls as they are written, and any
other choice's tool calls whole, in one chunk before its finish (a client joining the
deltas gets the same calls).
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: An empty parameters object: the schema of a function that declares none.
NO_PARAMETERS = {"type": "object", "properties": {}}


#: ``--tool-call-parser`` choices: the formats ``tool_choice: "auto"`` can read.
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
#: Mistral's marker before its calls, and between a v11+ call's name and arguments.
_TOOL_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"
#: Parsers whose calls follow the content after a marker: the marker.
OPENERS = {"hermes": (HERMES_OPEN,), "mistral": (_TOOL_CALLS,),
            "qwen3_coder": (HERMES_OPEN, "<function=")}  # fmt: skip
#: Qwen3-Coder's calls and their parameters (either may be left open at the end).
_QWEN_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
#: Llama 3.x's marker before a tool call (a special token: usually not in the text).
PYTHON_TAG = "<|python_tag|>"
#: Llama 4's markers around pythonic calls (special tokens too).
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
#: Parsers whose calls are the whole answer: how an answer that is calls may begin
#: (its marker, then the first character of its calls).
_WHOLE_ANSWER_STARTS = {"llama3_json": (PYTHON_TAG, "{"), "pythonic": (_PYTHON_START, "[")}


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output becomes tool calls: ``name`` a forced function;
    ``parser`` the model's own format (``auto``; ``functions``: the tools' parameter
    schemas, which a format of text values is read by); neither: ``required`` (a JSON
    array)."""

    name: str | None = None
    parser: str | None = None
    functions: Mapping[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output's text must keep special tokens (its calls' marker is one)."""
        return self.parser == "mistral"

    def finish(self, reason: str | None) -> str | None:
        """The finish reason of an answer with calls: ``tool_calls`` for ``required`` or
        ``auto`` calls that ended on their own, else the generation's (vLLM's rule)."""
        return "tool_calls" if self.name is None and reason == "stop" else reason

    def held_from(self, text: str) -> int:
        """Where ``text`` (the output so far) stops being plain content that may go out
        now: 0 for held calls; for ``auto``, the first block's start, or a tail that
        could begin one."""
        if self.parser is None:
            return 0
        if self.parser in _WHOLE_ANSWER_STARTS:  # calls are the whole answer: its start decides
            marker, first = _WHOLE_ANSWER_STARTS[self.parser]
            head = text.lstrip()
            undecided = not head or marker.startswith(head[: len(marker)])
            return 0 if undecided or head.startswith((first, marker)) else len(text)
        openers = OPENERS[self.parser]
        starts = [at for at in (text.find(opener) for opener in openers) if at >= 0]
        if starts:
            return min(starts)
        for k in range(min(max(map(len, openers)) - 1, len(text)), 0, -1):
            if any(text.endswith(opener[:k]) for opener in openers):
                return len(text) - k
        return len(text)


def tool_call_id() -> str:
    """A fresh tool call id (vLLM's shape)."""
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def mistral_tool_call_id() -> str:
    """A fresh tool call id as Mistral's templates require it: 9 letters and digits."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each tool (ValueError for a malformed tool)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tools[{i}].function needs a name")
        name = function["name"]
        if not name or name in out:
            raise ValueError(f"tools[{i}].function.name {name!r} is empty or given twice")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params or NO_PARAMETERS
    return out


def tool_schema(
    tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None,
    parser: str | None = None,
) -> tuple[ToolMode | None, dict[str, Any] | None]:  # fmt: skip
    """The mode and the JSON schema that ``tool_choice`` ``choice`` holds the output to
    (None, None: plain text; a mode without a schema: ``auto``, read by ``parser``);
    ValueError naming what is wrong."""
    if tools is not None and not tools:
        raise ValueError("tools must not be empty (leave the field out instead)")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        if tools:
            _functions(tools)
        return None, None
    if not tools:
        raise ValueError("tool_choice needs tools")
    functions = _functions(tools)
    if choice == "auto" and parser is not None:
        return ToolMode(parser=parser, functions=functions), None
    if choice == "auto":
        raise ValueError(
            'tool_choice "auto" (the default when tools are given) needs a parser of the '
            "model's tool-call format (halfmoon serve --tool-call-parser), which this "
            'server was not started with: set tool_choice to "required", a named '
            'function, or "none"'
        )
    if choice == "required":
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [name]},
                                "parameters": params},
                 "required": ["name", "parameters"]}
                for name, params in functions.items()
            ]},
        }  # fmt: skip
        if parallel is False:
            calls["maxItems"] = 1
        return ToolMode(), calls
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            'tool_choice is "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if function["name"] not in functions:
        raise ValueError(f"tool_choice names {function['name']!r}, which is not in tools")
    return ToolMode(function["name"]), functions[function["name"]]


def tool_calls(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The tool calls of an output held to ``mode``'s schema, or written in its parser's
    format (None when there are none, or the output is not whole: cut by ``max_tokens``
    or a stop string, it is answered as text; except a named function's, whose output
    is its call's arguments, as far as they got, as OpenAI and vLLM answer it). With a
    parser, the text before :meth:`ToolMode.held_from` is the message's content."""
    if mode.parser == "llama3_json":
        return _llama3_json(text)
    if mode.parser == "pythonic":
        return _pythonic(text)
    if mode.parser == "mistral":
        return _mistral(text)
    if mode.parser == "qwen3_coder":
        return _qwen3_coder(text, mode.functions)
    if mode.parser is not None:
        return _hermes(text)
    if mode.name is not None:  # the output is the arguments (cut short: as far as they got)
        return [_call(mode.name, text)]
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _calls(value) if isinstance(value, list) else None


def split_answer(mode: ToolMode, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A whole answer as (content, calls): without calls, the text as it is; with forced
    calls, content ""; with parsed ones, the text before them (None when there is none)."""
    calls = tool_calls(mode, text)
    if calls is None:
        return text, None
    return text[: mode.held_from(text)].strip() or (None if mode.parser else ""), calls


class HeldText:
    """One streamed choice's output under a tool mode: what may go out as content now
    (never text that may still be, or is, a call; nor whitespace alone before one),
    and at the end the calls."""

    def __init__(self, mode: ToolMode):
        self.mode, self.text, self._sent = mode, "", 0

    def add(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """Take the next ``delta`` (``final``: the last); the content to send now, and the
        calls once they are whole."""
        self.text += delta
        calls = tool_calls(self.mode, self.text) if final else None
        plain_end = final and calls is None
        upto = len(self.text) if plain_end else self.mode.held_from(self.text)
        if upto <= self._sent or not (plain_end or self.text[:upto].strip()):
            return "", calls
        out, self._sent = self.text[self._sent : upto], upto
        return out, calls


def _calls(items: list[Any], make_id=tool_call_id) -> list[dict[str, Any]] | None:
    """JSON objects ``{"name", "parameters" (or "arguments")}`` as tool calls (None if
    any is not one), their ids from ``make_id``."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item["parameters"] if "parameters" in item else item.get("arguments", {})
        calls.append(_call(item["name"], json.dumps(arguments, ensure_ascii=False), make_id()))
    return calls


def _mistral(text: str) -> list[dict[str, Any]] | None:
    """Mistral's calls after the first ``[TOOL_CALLS]``: a JSON array of ``{"name",
    "arguments"}`` objects (tokenizers before v11), or ``name[ARGS]{...}`` after each
    ``[TOOL_CALLS]`` (v11 and later)."""
    start = text.find(_TOOL_CALLS)
    if start < 0:
        return None
    items: list[Any] = []
    for part in text[start:].split(_TOOL_CALLS)[1:]:
        part = part.strip()
        try:
            if part.startswith("["):
                found = json.loads(part)
                if not isinstance(found, list):
                    return None
                items += found
            elif _ARGS in part:
                name, arguments = part.split(_ARGS, 1)
                if not name.strip():
                    return None
                items.append({"name": name.strip(), "arguments": json.loads(arguments)})
            else:
                return None
        except ValueError:
            return None
    return _calls(items, mistral_tool_call_id) if items else None


def _qwen3_coder(text: str, functions: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Qwen3-Coder's calls from the first ``<tool_call>`` or ``<function=``: each
    ``<function=NAME>`` block's ``<parameter=KEY>`` values (a newline after the tag and
    before its end is the format's, not the value's), read by the function's schema."""
    starts = [at for at in (text.find(opener) for opener in OPENERS["qwen3_coder"]) if at >= 0]
    if not starts:
        return None
    calls = []
    for match in _QWEN_FUNCTION.finditer(text, min(starts)):
        name = match.group(1).strip()
        if not name:
            return None
        properties = (functions.get(name) or {}).get("properties") or {}
        arguments = {}
        for param in _QWEN_PARAMETER.finditer(match.group(2)):
            key, value = param.group(1).strip(), param.group(2)
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed(value, properties.get(key))
        calls.append(_call(name, json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def schema_kinds(schema: Any) -> list[str]:
    """The JSON types a parameter's ``schema`` names (its ``type``, one or a list)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    return [kinds] if isinstance(kinds, str) else list(kinds or [])


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says (as vLLM's qwen3_coder parser reads
    it): ``string`` as written; ``integer``, ``number``, ``boolean``, ``null`` as such
    where the text is one; ``object``/``array`` (and an untyped parameter) as JSON, or a
    Python literal; else the text."""
    kinds = schema_kinds(schema)
    if "string" in kinds:
        return value
    stripped = value.strip()
    if "null" in kinds and stripped.lower() in ("null", "none"):
        return None
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "integer" in kinds or "number" in kinds:
        with contextlib.suppress(ValueError):
            return int(stripped)
        if "number" in kinds:
            with contextlib.suppress(ValueError):
                number = float(stripped)
                if math.isfinite(number):  # (JSON has no inf or nan)
                    return number
    if not kinds or "object" in kinds or "array" in kinds:
        with contextlib.suppress(ValueError):
            return json.loads(stripped)
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
            literal = ast.literal_eval(stripped)
            if isinstance(literal, dict | list | tuple | int | float | bool) or literal is None:
                return list(literal) if isinstance(literal, tuple) else literal
    return value


def _hermes(text: str) -> list[dict[str, Any]] | None:
    """Hermes-style calls: ``<tool_call>{"name", "arguments"}</tool_call>`` blocks (the
    last one may be left open, as models often end it at EOS)."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    items = []
    for block in text[start:].split(HERMES_OPEN)[1:]:
        try:
            items.append(json.loads(block.split(_HERMES_CLOSE, 1)[0]))
        except ValueError:
            return None
    return _calls(items)


def _llama3_json(text: str) -> list[dict[str, Any]] | None:
    """Llama 3.x JSON calls: the answer is one or more ``{"name", "parameters"}`` objects
    (``;`` between them), after an optional ``<|python_tag|>``."""
    body = text.strip()
    body = body[len(PYTHON_TAG) :].lstrip() if body.startswith(PYTHON_TAG) else body
    if not body.startswith("{"):
        return None
    decoder, items, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            item, pos = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        items.append(item)
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return _calls(items)


def _pythonic(text: str) -> list[dict[str, Any]] | None:
    """Pythonic calls: the answer is a list of calls with keyword arguments whose values
    are Python literals (``[f(a=1, b="x"), g()]``), optionally between Llama 4's
    ``<|python_start|>`` and ``<|python_end|>``. Parsed, never evaluated."""
    body = text.strip()
    if body.startswith(_PYTHON_START):
        body = body[len(_PYTHON_START) :].removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                return None
            if call.args or any(k.arg is None for k in call.keywords):
                return None  # positional or **-arguments: not a call with named parameters
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append(_call(call.func.id, json.dumps(arguments, ensure_ascii=False)))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None  # (literal_eval: ValueError for a name or an expression; json: a set)
    return calls


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as templates read it: text ``content`` ("" when none), and tool
    calls' ``arguments`` as objects where they are JSON text (as vLLM renders them)."""
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    calls = []
    for call in out.get("tool_calls") or ():
        call = dict(call)
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):  # else the text as it came
            with contextlib.suppress(ValueError):
                function["arguments"] = json.loads(function["arguments"])
        call["function"] = function
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out

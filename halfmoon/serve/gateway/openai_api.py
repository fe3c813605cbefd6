"""OpenAI-compatible request schemas (pydantic, at the edge only) and response builders.

Supported: ``/v1/completions`` and ``/v1/chat/completions`` with ``max_tokens``
(``max_completion_tokens`` for chat), ``temperature``, ``top_p``, ``seed``, ``stop``,
``stream``, ``stream_options.include_usage`` (and vLLM's ``continuous_usage_stats``),
``n`` (up to 16 choices, each its own request to the cluster; seeds ``seed + i``),
batched completion prompts (up to 64, ``n`` choices each),
log-probabilities of the generated tokens (``logprobs`` 0-20 for completions;
``logprobs`` + ``top_logprobs`` for chat), ``echo`` (completions; with ``logprobs`` the
prompt tokens' log-probabilities come first, as lm-evaluation-harness reads them), vLLM's
``prompt_logprobs`` (0-20, not streamed; prompt positions are then computed, never taken
from a prefix cache),
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and vLLM's
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``top_k``, ``min_p``, ``stop_token_ids``,
``allowed_token_ids``, ``bad_words``, structured outputs (vLLM's ``structured_outputs``: ``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, ``disable_any_whitespace``,
``disable_additional_properties``, ``whitespace_pattern``, ``structural_tag`` (the
structures-and-triggers form); its older ``guided_*`` fields; OpenAI's ``response_format``
``json_object`` and ``json_schema``, and vLLM's ``structural_tag`` there),
tool calls on chat (``tools`` with ``tool_choice`` a named function, ``required``,
``none``, or ``auto`` with ``--tool-call-parser``: :mod:`halfmoon.serve.gateway.tools`),
a thinking model's reasoning apart from its answer (``--reasoning-parser``: the
message's ``reasoning``, and vLLM's ``include_reasoning``:
:mod:`halfmoon.serve.gateway.reasoning`),
``include_stop_str_in_output``, SGLang's ``stop_regex``, ``truncate_prompt_tokens``,
``skip_special_tokens``,
``add_special_tokens`` (completions), ``return_token_ids`` and
``return_tokens_as_token_ids``, chat
``echo`` (the final assistant message's text first), vLLM's ``use_beam_search`` with
``length_penalty`` (``n`` beams, not streamed: :mod:`halfmoon.serve.gateway.beam_search`),
``cache_salt`` (a non-empty string of at most 256 characters: prefix-cache hits only
among requests with the same salt, see
:mod:`halfmoon.serve.gateway.tenancy`); vLLM's ``/tokenize`` and ``/detokenize``. Known options
this server does not implement (``best_of``, ``suffix``, ``tool_choice: "auto"`` without a
parser, the older
``functions``, the ``format`` form of vLLM's structural tags, a ``priority`` other than 0
unless the server schedules by priority (``--scheduling-policy priority``), chat's
``add_special_tokens``)
are refused with a 400 naming them, never silently ignored; vLLM's chat-template options
(``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) work;
unknown fields are ignored, as OpenAI's own server does. A sampling option a request
leaves out takes the served model's default where it has one, as on vLLM
(:mod:`halfmoon.serve.gateway.generation`); the field defaults below are the API's.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from halfmoon.core.request import MAX_LOGPROBS, StructuredOutput, TokenLogprob
from halfmoon.engine.tokenizer import RESERVED_TEMPLATE_NAMES
from halfmoon.serve.gateway.stop_regex import parse_stop_regex
from halfmoon.serve.gateway.tenancy import MAX_CACHE_SALT_CHARS
from halfmoon.serve.gateway.tools import ToolMode, template_message, tool_schema

#: Most choices (``n``) one request may ask for; each is a request to the cluster.
MAX_CHOICES = 16
#: Token ids one request may allow at most (``allowed_token_ids``).
MAX_ALLOWED_TOKENS = 4096
#: Words one request may ban at most (``bad_words``; vLLM's default limit is 128 token
#: sequences, a word giving one or two).
MAX_BAD_WORDS = 64
#: Prompts in one batched completion at most (each with its ``n`` choices).
MAX_BATCH_PROMPTS = 64
#: Seeds are 64-bit signed integers (as vLLM's); choice i of ``n`` uses ``seed + i``.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1 - MAX_CHOICES


def checked_salt(value: object) -> object:
    """A request's ``cache_salt`` (None, or a non-empty string of at most
    :data:`MAX_CACHE_SALT_CHARS` characters of valid text), or a ValueError; meant to run
    before pydantic's own parsing, so every bad salt gets this one message."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
        )
    return check_text(value, "cache_salt")


def check_text(value: str, what: str) -> str:
    """``value`` unchanged, or a ValueError when it is not valid Unicode text (a lone
    UTF-16 surrogate such as ``"\\ud800"`` parses from JSON but cannot be tokenized)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode text: lone surrogate {value[exc.start]!r} at "
            f"character {exc.start}"
        ) from None
    return value


class StreamOptions(BaseModel):
    """``stream_options`` of a streaming request. ``continuous_usage_stats`` (vLLM's
    extension, with ``include_usage``): every chunk carries the running ``usage``, and a
    chunk is sent for every generated token batch even when its text is empty, so a
    client can time every token."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    #: vLLM's: the id the response is answered under (``cmpl-<id>``); the
    #: ``X-Request-Id`` header wins over it (halfmoon.serve.gateway.request_ids).
    request_id: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    #: SGLang's: the output ends where it first matches one of these regular expressions
    #: (:mod:`halfmoon.serve.gateway.stop_regex`).
    stop_regex: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: str | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    include_stop_str_in_output: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    #: vLLM's per-tenant prefix-cache isolation: hits only among requests with this salt.
    cache_salt: str | None = None
    #: vLLM's: the log-probability of every prompt token after the first, with this many
    #: alternatives (in the response, not in a stream).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    #: A structured output: vLLM's ``structured_outputs``, OpenAI's ``response_format``,
    #: or vLLM's older ``guided_*`` fields (:meth:`structured_output`).
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    #: vLLM's: words never generated.
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    #: vLLM's: keep only the last k prompt tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    #: vLLM's: leave special tokens (EOS, chat markers) out of the text (the default).
    skip_special_tokens: bool = True
    #: vLLM's: the prompt's and the output's token ids in the response (``prompt_token_ids``,
    #: ``token_ids``; streamed: the prompt's with a choice's first chunk, each chunk's own).
    return_token_ids: bool = False
    #: vLLM's: log-probability tokens as ``token_id:<id>`` instead of their text.
    return_tokens_as_token_ids: bool = False
    #: vLLM's request priority: lower is served earlier, under ``halfmoon serve
    #: --scheduling-policy priority``; under ``fcfs`` (the default) only 0, as vLLM answers.
    priority: int = 0
    #: vLLM's beam search: ``n`` beams, the ``n`` best answers (halfmoon.serve.gateway.beam_search).
    use_beam_search: bool = False
    #: Beam search's length penalty: a beam's score is its summed log-probability over
    #: its length to this power.
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    #: vLLM's: only these tokens may be generated (checked against the vocabulary).
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKENS)
    #: vLLM's: at most this many tokens of a reasoning before its end tag is forced
    #: (needs ``--reasoning-parser``, as vLLM needs its reasoning config; -1: no limit).
    thinking_token_budget: int | None = Field(None, ge=-1)

    def num_choices(self) -> int:
        """Choices of the response, each its own request to the cluster."""
        return self.n

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token, or None (no prompt log-probabilities)."""
        return self.prompt_logprobs

    def unsupported(self) -> list[str]:
        """The options set to something this server cannot do (empty: all fine)."""
        out = (
            ["prompt_logprobs with stream"]
            if self.prompt_logprobs is not None and self.stream
            else []
        )
        if self.use_beam_search:
            out += [f"{name} with use_beam_search" for name in self.beam_conflicts()]
        return out

    def beam_conflicts(self) -> list[str]:
        """The options set that beam search cannot honour (it ranks whole sequences by
        the model's own log-probabilities, token by token)."""
        neutral = {"stream": False, "stop": None, "stop_token_ids": None, "min_tokens": 0,
                   "logit_bias": None, "bad_words": None, "allowed_token_ids": None,
                   "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0, "prompt_logprobs": None, "echo": False,
                   "tools": None, "thinking_token_budget": None}  # fmt: skip
        out = [name for name, value in neutral.items()
               if (given := getattr(self, name, value)) != value and given not in ([], {})]  # fmt: skip
        if self.num_logprobs() is not None:
            out.append("logprobs")
        with contextlib.suppress(ValueError):  # (a malformed one is refused by its own 400)
            if self.structured_output() is not None:
                out.append("structured outputs")
        if not 1 <= self.n <= MAX_BEAM_WIDTH:
            out.append(f"n above {MAX_BEAM_WIDTH} (the beam width)")
        return out

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > 16 or any(not s for s in items):
            raise ValueError("stop takes at most 16 non-empty strings")
        for item in items:
            check_text(item, "a stop string")
        return value

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt(cls, value: object) -> object:
        return checked_salt(value)

    def structured_output(self) -> StructuredOutput | None:
        """The request's structured output, from vLLM's ``structured_outputs`` (``json``,
        ``regex``, ``choice``, ``grammar``, ``json_object``, ``disable_any_whitespace``),
        OpenAI's ``response_format`` (``json_object``, ``json_schema``; vLLM's
        ``structural_tag`` there and in ``structured_outputs``) or vLLM's older
        ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; None
        without one. ValueError naming the field when one is malformed, unsupported, or
        more than one is set."""
        so = self.structured_outputs or {}
        whitespace = so.get("whitespace_pattern") or ""
        if not isinstance(whitespace, str):
            raise ValueError("structured_outputs.whitespace_pattern takes a regex")
        given = [(f"structured_outputs.{kind}", kind, so.get(kind)) for kind in
                 ("json", "regex", "choice", "grammar", "json_object", "structural_tag")]  # fmt: skip
        given += [(f"guided_{kind}", kind, getattr(self, f"guided_{kind}"))
                  for kind in ("json", "regex", "choice", "grammar")]  # fmt: skip
        if self.response_format is not None:
            given.append(_response_format(self.response_format))
        given = [g for g in given if g[2] is not None and g[2] is not False]
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _, _ in given)
            raise ValueError(f"only one structured output may be given, got {names}")
        name, kind, value = given[0]
        if kind == "json_object":
            spec = ""
        elif kind == "json":
            if not isinstance(value, str | dict | bool):
                raise ValueError(f"{name} takes a JSON schema (an object, or its text)")
            spec = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            if not isinstance(value, list):  # its items are checked as the spec compiles
                raise ValueError(f"{name} takes a list of strings")
            spec = json.dumps(value)
        elif kind == "structural_tag":
            spec = _structural_tag(name, value)
        else:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} takes a non-empty string")
            spec = value
        return StructuredOutput(
            kind, spec, compact=bool(so.get("disable_any_whitespace")),
            closed=bool(so.get("disable_additional_properties")), whitespace=whitespace,
        )  # fmt: skip

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def stop_patterns(self) -> tuple[str, ...]:
        """``stop_regex`` as a tuple of checked patterns (FieldError naming what is wrong)."""
        try:
            return parse_stop_regex(self.stop_regex)
        except ValueError as exc:
            raise FieldError(str(exc), "stop_regex") from None


class FieldError(ValueError):
    """A bad value of request field ``param`` (the 400's ``param``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


#: The fields that may set a structured output (:meth:`_Common.structured_output`).
STRUCTURED_FIELDS = ("structured_outputs", "response_format", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")  # fmt: skip
#: The widest beam of ``use_beam_search`` (each step asks for 2n log-probabilities).
MAX_BEAM_WIDTH = 10


def _structural_tag(name: str, value: Any) -> str:
    """A structural tag's spec (``{"structures": ..., "triggers": ...}`` as JSON) from
    ``value``: vLLM's ``structured_outputs.structural_tag`` (its JSON text, or the object)
    or a ``response_format`` of type ``structural_tag`` (the structures and triggers are
    checked as the spec compiles). vLLM's newer ``format`` form is refused by name."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{name} takes a structural tag as JSON") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} takes a structural tag (structures and triggers)")
    if "format" in value:
        raise ValueError(f"{name}: the structural tag's 'format' form is not supported "
                         "(its 'structures' and 'triggers' form is)")  # fmt: skip
    return json.dumps({"structures": value.get("structures"), "triggers": value.get("triggers")})


def _response_format(value: dict[str, Any]) -> tuple[str, str, Any]:
    """OpenAI's ``response_format`` as (field, kind, value); ``text`` sets nothing."""
    kind = value.get("type", "text")
    if kind == "structural_tag":  # vLLM's
        return "response_format", "structural_tag", value
    if kind == "text":
        return "response_format", "json_object", None
    if kind == "json_object":
        return "response_format", "json_object", True
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict | bool):
            raise ValueError("response_format json_schema needs json_schema.schema (an object)")
        return "response_format", "json", inner["schema"]
    raise ValueError(
        f"response_format {kind!r} is not supported (text, json_object, json_schema and "
        "vLLM's structural_tag are)"
    )


#: ``reasoning_effort`` values (OpenAI's, and vLLM's ``max``).
REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatTemplateOptions(BaseModel):
    """vLLM's chat-template options (chat completions and ``/tokenize`` with messages):
    ``add_generation_prompt`` (default true: end with the assistant's turn opened),
    ``continue_final_message`` (leave the final message open, for the model to go on
    with it; needs ``add_generation_prompt: false``, as in vLLM) and
    ``chat_template_kwargs`` (more variables for the template, e.g. a model's
    ``enable_thinking``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: OpenAI's tool definitions: the template's ``tools`` variable (and, with
    #: ``tool_choice``, what the output may call: :mod:`halfmoon.serve.gateway.tools`).
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_open_turn(self) -> ChatTemplateOptions:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt: false to continue the final message)"
            )
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
        return self

    def template_options(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`Tokenizer.apply_chat_template`."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:
            kwargs["tools"] = self.tools
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": kwargs,
        }


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``."""

    #: One prompt (text or token ids) or a batch of them (texts or token-id lists), as
    #: OpenAI's and vLLM's completions take; each prompt gets ``n`` choices.
    prompt: str | list[int] | list[str] | list[list[int]]
    #: 0 only with ``echo``: the prompt (with its log-probabilities) is the answer.
    max_tokens: int = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    #: vLLM's: a text prompt gets the tokenizer's special tokens (BOS); false: it does not.
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: true)")
        return self

    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token, or None (no log-probabilities)."""
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, else ``logprobs`` when ``echo`` sends the prompt (its
        tokens then come with their log-probabilities, as on vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.best_of not in (None, 1):
            out.append("best_of")
        if self.suffix:
            out.append("suffix")
        return out

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            if len(value) > MAX_BATCH_PROMPTS:
                raise ValueError(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts")
            if any(not item for item in value):
                raise ValueError("no prompt of a batch may be empty")
        for text in [value] if isinstance(value, str) else value:
            if isinstance(text, str):
                check_text(text, "the prompt")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a batch, each text or token ids."""
        value = self.prompt
        if isinstance(value, list) and isinstance(value[0], (str, list)):
            return list(value)
        return [value]  # type: ignore[list-item]

    def num_choices(self) -> int:
        return self.n * len(self.prompts())


class ChatMessage(BaseModel):
    """One chat message (text content, or a list of text parts)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    #: Text, or a list of text parts; None only on an assistant turn of tool calls.
    content: str | list[dict[str, Any]] | None = None
    #: An assistant turn's tool calls (OpenAI's shape), for the chat template.
    tool_calls: list[dict[str, Any]] | None = None
    #: A ``tool`` message's answer to this call id.
    tool_call_id: str | None = None
    name: str | None = None
    #: An assistant turn's reasoning (vLLM's ``reasoning``, or its older
    #: ``reasoning_content``), which templates read as ``reasoning_content``.
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (only an assistant's tool calls need none)")
        return self

    @field_validator("content")
    @classmethod
    def _text_only(
        cls, value: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        # Refused while parsing (a 400), not later in the route.
        parts = [value] if isinstance(value, str) else value or []
        for part in parts:
            if isinstance(part, str):
                check_text(part, "message content")
                continue
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"content part of type {kind!r} is not supported: only text parts "
                    "(this server serves a text-only model)"
                )
            check_text(part["text"], "message content")
        return value

    def text(self) -> str:
        """The message's text (its text parts joined; "" when it has none)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content or [])

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (:func:`tools.template_message`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return template_message(out)


class ChatCompletionRequest(_Common, ChatTemplateOptions):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's older name for tools
    echo: bool = False  # vLLM's: the final (assistant's) message's text before the output
    #: vLLM's: the reasoning (``--reasoning-parser``) goes out; false: only the content.
    include_reasoning: bool = True
    #: SGLang's: false reads no reasoning (the whole output is content, tags and all).
    separate_reasoning: bool = True
    #: OpenAI's: how hard a reasoning model thinks; the template reads it as
    #: ``reasoning_effort``, and (unless ``chat_template_kwargs`` sets it) as
    #: ``enable_thinking`` (false for ``none``), as vLLM passes it.
    reasoning_effort: REASONING_EFFORTS | None = None
    #: vLLM's: special tokens added to the rendered template too (its BOS usually is already).
    add_special_tokens: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def num_logprobs(self) -> int | None:
        """Top alternatives per generated token, or None (no log-probabilities)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.functions:
            out.append("functions")
        if self.add_special_tokens:
            out.append("add_special_tokens on chat (the template writes them)")
        return out

    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the final message's text, when it is the assistant's
        (the answer goes on with it, e.g. with ``continue_final_message``), else ""."""
        final = self.messages[-1]
        return final.text() if self.echo and final.role == "assistant" else ""

    def tool_mode(self, parser: str | None = None) -> tuple[ToolMode | None, dict[str, Any] | None]:
        """How the output becomes tool calls, and the schema that holds it
        (:func:`tools.tool_schema`, ``auto`` read by ``parser``; None, None: plain text);
        FieldError when malformed."""
        try:
            return tool_schema(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        except ValueError as exc:
            field = "tool_choice" if "tool_choice" in str(exc) else "tools"
            raise FieldError(str(exc), field) from None

    def template_options(self) -> dict[str, Any]:
        """:meth:`ChatTemplateOptions.template_options`, with ``reasoning_effort``."""
        options = super().template_options()
        if self.reasoning_effort is not None:
            kwargs = options["template_kwargs"]
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            kwargs["reasoning_effort"] = self.reasoning_effort
        return options

    def output_limit(self, default: int) -> int:
        """The requested output length, or ``default``."""
        return self.max_completion_tokens or self.max_tokens or default


class TokenizeRequest(ChatTemplateOptions):
    """Body of ``POST /tokenize`` (vLLM's): a prompt, or chat messages (with the chat
    template applied, as ``/v1/chat/completions`` would)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value is not None and not value:
            raise ValueError("messages must not be empty")
        return value


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body: the adapter's name (what a request's
    ``model`` will say) and its PEFT directory on the workers' hosts; ``load_inplace``
    (reloading a loaded name) is refused: unload it first."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (its ``lora_int_id`` is ignored)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None


class DetokenizeRequest(BaseModel):
    """Body of ``POST /detokenize`` (vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """The ``usage`` object (with vLLM/OpenAI's cached-token detail)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def response_id(rid: str, chat: bool) -> str:
    """The OpenAI-facing id of request ``rid``: ``chatcmpl-...`` or ``cmpl-...``."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{rid}"


class Finish(str):
    """A ``finish_reason`` that also says what stopped the output (vLLM's ``stop_reason``):
    the stop string that matched, or the request's ``stop_token_ids`` entry that ended it;
    None for an end-of-sequence token or any other reason. Still the plain string
    wherever a finish reason is compared or written."""

    stop_reason: int | str | None

    def __new__(cls, reason: str, stop_reason: int | str | None = None) -> Finish:
        finish = super().__new__(cls, reason)
        finish.stop_reason = stop_reason
        return finish


def stop_reason(finish: str | None) -> int | str | None:
    """vLLM's ``stop_reason`` of a choice that ended with ``finish`` (None when unknown)."""
    return getattr(finish, "stop_reason", None)


def choice_body(
    index: int, text: str | None, finish: str | None, chat: bool, logprobs: dict[str, Any] | None,
    tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One choice of a complete (non-streaming) response (chat: with its tool calls and
    any reasoning)."""
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning"] = reasoning
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish, "stop_reason": stop_reason(finish)}  # fmt: skip
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason(finish)}  # fmt: skip


def completion_body(
    rid: str, model: str, choices: list[dict[str, Any]], use: dict | None, chat: bool
) -> dict[str, Any]:
    """A complete (non-streaming) response object."""
    return {
        "id": response_id(rid, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def chunk_body(
    rid: str,
    model: str,
    delta: str | None,
    finish: str | None,
    chat: bool,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One streaming chunk of choice ``index``; ``delta=None`` with ``finish=None`` makes
    a usage-only chunk. Chat ``tool_calls`` go whole, each with its ``index``; chat
    ``reasoning`` is the delta's reasoning text."""
    if chat:
        d: dict[str, Any] = {}
        if first:
            d["role"] = "assistant"
        if reasoning:
            d["reasoning"] = reasoning
        if delta:
            d["content"] = delta
        if tool_calls:
            d["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish
        }  # fmt: skip
        obj = "text_completion"
    choice["stop_reason"] = stop_reason(finish)
    return {
        "id": response_id(rid, chat),
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def merged_usage(uses: list[dict[str, Any]], per_prompt: int | None = None) -> dict[str, Any]:
    """The ``usage`` of a response's choices, ``per_prompt`` (default: all) consecutive
    ones for each prompt: every prompt (and its cached tokens) counted once."""
    firsts = uses[:: per_prompt or len(uses)]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in uses)
    out = {**firsts[0], "prompt_tokens": prompt, "completion_tokens": completion}
    out["total_tokens"] = prompt + completion
    if len(firsts) > 1 and "prompt_tokens_details" in out:
        cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in firsts)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    if any("completion_tokens_details" in u for u in uses):
        reasoning = sum(u.get("completion_tokens_details", {}).get("reasoning_tokens", 0)
                        for u in uses)  # fmt: skip
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def chat_request_of(body: dict[str, Any], messages_as: str = "messages") -> ChatCompletionRequest:
    """The chat request another API's request is served as (its fields that are None left
    out); a FieldError naming the first invalid field, in one line as the API's other
    400s (``messages`` named ``messages_as``: the other API's name for the turns)."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        field = messages_as if where.startswith("messages") else where.split(".")[0]
        raise FieldError(f"{field}: {first['msg']}", field) from None


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def logprobs_body(
    entries: list[tuple[int, TokenLogprob | None]], token_text: Any, chat: bool, text_offset: int
) -> dict[str, Any]:
    """The ``logprobs`` object of a choice for ``(token id, TokenLogprob)`` entries.

    ``token_text(id)`` is a token's text. Completions get the legacy shape (``tokens``,
    ``token_logprobs``, ``top_logprobs`` with the sampled token among the alternatives,
    as vLLM returns it, and ``text_offset`` counted from ``text_offset``; an entry of
    None, an echoed prompt's first token, has null log-probabilities); chat gets
    ``content`` items with ``bytes``. A log-probability of -inf reads -9999.0, as vLLM's.
    """
    if chat:
        content = []
        for tid, entry in entries:
            if entry is None:  # (a token the backend sent no log-probability for)
                continue
            text = token_text(tid)
            content.append(
                {
                    "token": text,
                    "logprob": _finite(entry.logprob),
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": (t := token_text(i)),
                            "logprob": _finite(lp),
                            "bytes": list(t.encode()),
                        }
                        for i, lp in entry.top
                    ],  # fmt: skip
                }
            )
        return {"content": content}
    tokens, offsets, values, tops = [], [], [], []
    for tid, entry in entries:
        text = token_text(tid)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_finite(entry.logprob))
        top = {token_text(i): _finite(lp) for i, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def prompt_logprobs_body(
    prompt_ids: list[int], entries: tuple[TokenLogprob, ...], token_text: Any
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a map
    from token id to ``logprob``, ``rank`` and ``decoded_token``: the prompt's own token
    first, then the top alternatives (ranks 1..)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for tid, entry in zip(prompt_ids[1:], entries, strict=True):
        items = {str(tid): {"logprob": _finite(entry.logprob), "rank": entry.rank,
                            "decoded_token": token_text(tid)}}  # fmt: skip
        for rank, (alt, lp) in enumerate(entry.top, start=1):
            items.setdefault(
                str(alt), {"logprob": _finite(lp), "rank": rank, "decoded_token": token_text(alt)}
            )
        out.append(items)
    return out


def _finite(value: float) -> float:
    """JSON has no infinities: -inf (a banned token) reads -9999.0, as vLLM's."""
    return max(value, -9999.0)

"""Structured outputs: a request's output held to a JSON schema, a regular expression, a
list of choices or a grammar, by masking the logits of every token it samples.

The matching is llguidance's (the Rust library behind Guidance, one of vLLM's backends):
a :class:`StructuredOutput` compiles to an llguidance grammar (:func:`grammar_text`,
cached), a :class:`Constraint` follows one request through it — which tokens may come
next (:meth:`Constraint.allowed`), then the token drawn (:meth:`Constraint.finish_after`).
A request ends (``stop``) as soon as its grammar admits nothing more; until then the
model's EOS is allowed only where the grammar may end. The grammar compiles against the
model's tokenizer (:func:`grammar_tokenizer`, built once per tokenizer: ~0.25 s for a
49K vocabulary). Torch-free at import: the gateway checks specs with :func:`check`.

As in vLLM: JSON schemas allow free whitespace between items unless ``compact`` (or
as ``whitespace`` says), and ``closed`` closes objects (:func:`closed_objects`); a
``grammar`` is Lark (llguidance's dialect) or GBNF (llama.cpp's); ``json_object`` is any
JSON object; a ``structural_tag`` (vLLM's structures-and-triggers form) is free text in
which each trigger starts one of its structures (:func:`_structural_tag`). Under a
reasoning parser a JSON, ``json_object``, regex or choice constraint holds after the
model's reasoning (free text up to ``</think>``; :func:`after_reasoning`), as vLLM
starts its grammar where the reasoning ends.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import REASONING_TAGS, StructuredOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise HalfmoonError("structured outputs need the llguidance package") from None
    return llguidance


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """llguidance's view of ``tokenizer`` (a :class:`halfmoon.engine.tokenizer.Tokenizer`)
    over ``vocab_size`` logits, ending at ``eos_token_ids``; built once per tokenizer."""
    eos = sorted(set(eos_token_ids))
    key = (vocab_size, tuple(eos))
    built = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in built:
        ll = _llguidance()
        built[key] = ll.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos)
    return built[key]


@functools.lru_cache(maxsize=256)
def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of ``structured`` (HalfmoonError naming what is wrong when
    its spec does not parse)."""
    ll = _llguidance()
    kind, spec = structured.kind, structured.spec
    options = _json_options(structured)
    try:
        if structured.reasoning:
            return ll.LLMatcher.grammar_from_lark(after_reasoning(structured))
        if kind == "json_object":
            return ll.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind == "json":
            schema = json.dumps(_schema(structured))
            return ll.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return ll.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return ll.LLMatcher.grammar_from_lark("start: " + _choices(spec))
        if kind == "structural_tag":
            return _structural_tag(spec, options, structured.closed)
        return ll.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise HalfmoonError(f"structured output ({kind}): {exc}") from None


def _json_options(structured: StructuredOutput) -> dict[str, Any]:
    """llguidance's JSON options of ``structured`` (its whitespace)."""
    options: dict[str, Any] = {"whitespace_flexible": not structured.compact}
    if structured.whitespace:
        options["whitespace_pattern"] = structured.whitespace
    return options


def _schema(structured: StructuredOutput) -> Any:
    """A ``json`` structured output's schema (closed where it asks)."""
    schema = json.loads(structured.spec)
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema is an object (or true/false)")
    return closed_objects(schema) if structured.closed else schema


def _choices(spec: str) -> str:
    """A ``choice`` spec (a JSON list of strings) as a Lark alternation."""
    choices = json.loads(spec)
    if (
        not isinstance(choices, list)
        or not choices
        or any(not isinstance(c, str) or not c for c in choices)
    ):
        raise ValueError("choice takes a non-empty list of non-empty strings")
    return " | ".join(json.dumps(c) for c in choices)


def after_reasoning(structured: StructuredOutput) -> str:
    """The Lark grammar (llguidance's dialect) of ``structured`` held after a reasoning:
    free text up to the end tag (a lazy lexeme: the first end tag ends it), then the
    constraint (JSON inline as ``%json``, with the request's JSON options; a regex as a
    terminal; choices as strings). ``first``: the output starts in the reasoning (a start
    tag may open it); ``optional``: a reasoning between the tags may come first.
    ValueError when the spec does not parse."""
    opening, closing = (json.dumps(tag) for tag in REASONING_TAGS)
    kind, spec = structured.kind, structured.spec
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(structured)
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        options = {**schema.get("x-guidance", {}), **_json_options(structured)}
        body = "%json " + json.dumps({**schema, "x-guidance": options})
    elif kind == "regex":
        body = "/" + spec.replace("/", "\\/") + "/"
    elif kind == "choice":
        body = _choices(spec)
    else:
        raise ValueError(f"a {kind} structured output cannot follow a reasoning")
    start = (f"{opening}? think body" if structured.reasoning == "first"
             else f"({opening} think)? body")  # fmt: skip
    return f"start: {start}\nthink[stop={closing}]: /(.|\\n)*/\nbody: {body}\n"


def _structural_tag(spec: str, options: dict[str, Any], closed: bool) -> str:
    """The llguidance grammar of a structural tag (``{"structures": [...], "triggers":
    [...]}``): free text in which a trigger may only go on as the ``begin`` of one of its
    structures, then JSON of that structure's schema (with the request's JSON options),
    then its ``end`` (llguidance's ``StructTag``, as vLLM's guidance backend builds it)."""
    ll = _llguidance()
    tag = json.loads(spec)
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    structures = tag.get("structures") if isinstance(tag, dict) else None
    if (
        not isinstance(triggers, list)
        or not triggers
        or any(not isinstance(t, str) or not t for t in triggers)
    ):
        raise ValueError("triggers takes a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures takes a non-empty list of {begin, schema, end}")
    tags = []
    for item in structures:
        if not isinstance(item, dict) or not all(
            isinstance(item.get(key), str) for key in ("begin", "end")
        ):
            raise ValueError("each structure takes begin and end strings and a schema")
        schema = item.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(f"structure {item['begin']!r}: schema is a JSON schema (an object)")
        trigger = next((t for t in triggers if item["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structure {item['begin']!r} begins with none of the triggers")
        if closed:
            schema = closed_objects(schema)
        # The JSON options go in the schema ("x-guidance"): a grammar made of it
        # (grammar_from_json_schema) would be read here as a schema of unknown keywords,
        # which admits any JSON.
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
        tags.append(ll.StructTag(trigger=trigger, begin=item["begin"], grammar=schema,
                                 end=item["end"]))  # fmt: skip
    return ll.StructTag.to_grammar(tags)


#: Keywords whose value maps names to subschemas, and those whose value is a subschema
#: (or a list of them), where :func:`closed_objects` looks for objects.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "anyOf", "allOf", "oneOf", "not",
               "if", "then", "else", "contains", "propertyNames", "additionalProperties",
               "unevaluatedItems", "unevaluatedProperties")  # fmt: skip


def closed_objects(schema: Any) -> Any:
    """A copy of JSON schema ``schema`` in which every object schema that lists
    properties and says nothing of others admits no others (``additionalProperties:
    false``), as vLLM's ``disable_additional_properties``."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict | list):
            out[key] = closed_objects(out[key])
    listed = isinstance(out.get("properties"), dict) or isinstance(
        out.get("patternProperties"), dict
    )
    if listed and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def check(structured: StructuredOutput, tokenizer: Any) -> None:
    """Raise HalfmoonError (naming the problem) unless ``structured`` compiles against
    ``tokenizer`` (llguidance's, :func:`grammar_tokenizer`)."""
    grammar = grammar_text(structured)
    error = _llguidance().LLMatcher.validate_grammar(grammar, tokenizer)
    if error and not error.startswith("WARNING"):
        raise HalfmoonError(f"structured output ({structured.kind}): {error.strip()}")


class Constraint:
    """One request's place in its grammar."""

    def __init__(self, structured: StructuredOutput, tokenizer: Any):
        self.structured = structured
        self._matcher = _llguidance().LLMatcher(tokenizer, grammar_text(structured), log_level=0)
        if self._matcher.is_error():
            raise HalfmoonError(
                f"structured output ({structured.kind}): {self._matcher.get_error()}"
            )

    def allowed(self) -> torch.Tensor:
        """Which tokens may come next: a bool tensor over the vocabulary."""
        import torch

        bias = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)
        return torch.from_numpy(bias != 0)

    def drafts(self, proposed: Sequence[int], limit: int) -> tuple[int, ...]:
        """Draft tokens for speculative decoding (:mod:`halfmoon.engine.speculative`): the
        tokens the grammar forces next (llguidance's fast-forward tokens) when there are
        any, else ``proposed``; cut to the longest prefix the grammar admits and to
        ``limit``."""
        forced = self._matcher.compute_ff_tokens() if limit > 0 else []
        candidates = list(forced or proposed)[:limit]
        if not candidates:
            return ()
        return tuple(candidates[: self._matcher.validate_tokens(candidates)])

    def allowed_along(self, drafts: Sequence[int]) -> list[torch.Tensor]:
        """:meth:`allowed` now and after each of ``drafts`` in turn (the masks of a token
        and its drafts' rows; the grammar admits the drafts, see :meth:`drafts`), the
        grammar's state left as it was."""
        masks = [self.allowed()]
        consumed = 0
        for token in drafts:
            if not self._matcher.consume_token(token):
                break
            consumed += 1
            masks.append(self.allowed())
        self._matcher.rollback(consumed)
        if len(masks) < len(drafts) + 1:  # (never expected: drafts() checked them)
            raise HalfmoonError(f"structured output ({self.structured.kind}): a draft broke it")
        return masks

    def consume(self, tokens: Iterable[int]) -> None:
        """Follow tokens already generated (a request continued from another worker);
        HalfmoonError when the grammar does not admit them."""
        tokens = list(tokens)
        if tokens and not self._matcher.consume_tokens(tokens):
            raise HalfmoonError(
                f"structured output ({self.structured.kind}): the generated tokens do not "
                f"follow it: {self._matcher.get_error().splitlines()[0]}"
            )

    @property
    def done(self) -> bool:
        """Whether the grammar admits nothing more."""
        return self._matcher.is_stopped()

    def finish_after(self, token: int) -> str | None:
        """Follow the drawn ``token``: ``stop`` when the grammar then admits nothing more
        (or, never expected, did not admit the token), else None."""
        if not self._matcher.consume_token(token):
            log.warning(
                "structured output (%s): token %d broke the grammar: %s",
                self.structured.kind, token, self._matcher.get_error().splitlines()[0],
            )  # fmt: skip
            return "stop"
        return "stop" if self._matcher.is_stopped() else None

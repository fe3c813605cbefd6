"""Speculative decoding as the serving side names it (no torch): vLLM's
``--speculative-config``.

Only the ``ngram`` method (prompt lookup) is served: the draft tokens for a sequence are
the ones that followed the earliest earlier occurrence of its last ``n`` tokens, for the
largest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that occurs; the engine checks
up to ``num_speculative_tokens`` of them in one step (:mod:`halfmoon.engine.speculative`).
The JSON keys, their defaults and their checks are vLLM's, so one flag serves both
halfmoon's engine and vLLM-backed workers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.jsonconfig import json_object_option

#: The methods served (vLLM's ``method`` names).
METHODS = ("ngram",)
#: The most draft tokens checked in one step.
MAX_SPECULATIVE_TOKENS = 16
#: The longest n-gram looked up.
MAX_LOOKUP = 64
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculation: up to ``num_speculative_tokens`` drafts a step, found by
    the longest n-gram of ``prompt_lookup_min..prompt_lookup_max`` tokens that ends the
    sequence and occurred before."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise HalfmoonError(
                f"speculative method {self.method!r} is not served; use one of {', '.join(METHODS)}"
            )
        for name, top in (
            ("num_speculative_tokens", MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", MAX_LOOKUP),
            ("prompt_lookup_min", MAX_LOOKUP),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise HalfmoonError(
                    f"speculative config: {name} must be an integer in [1, {top}], got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise HalfmoonError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def to_json(self) -> str:
        """The config as vLLM's ``--speculative-config`` takes it."""
        return json.dumps(asdict(self), sort_keys=True)


def parse_speculative_config(value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """vLLM's ``--speculative-config`` value (a JSON object, or the parsed mapping) as a
    :class:`SpeculativeConfig`; None for None or an empty value. As in vLLM,
    ``num_speculative_tokens`` is required, and a missing ``prompt_lookup_min`` or
    ``prompt_lookup_max`` takes the other's value (both missing: 5). HalfmoonError names
    the problem (bad JSON, an unknown key or method, a value out of range)."""
    value = json_object_option(
        value, "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    )  # fmt: skip
    if value is None:
        return None
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise HalfmoonError(
            f"--speculative-config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"served: {', '.join(_KEYS)}"
        )
    method = value.get("method", "ngram")
    if method == "[ngram]":  # vLLM's older spelling
        method = "ngram"
    if "num_speculative_tokens" not in value:
        raise HalfmoonError("--speculative-config: num_speculative_tokens is required")
    lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
    if lookup_max is None and lookup_min is None:
        lookup_max = lookup_min = 5
    elif lookup_min is None:
        lookup_min = lookup_max
    elif lookup_max is None:
        lookup_max = lookup_min
    return SpeculativeConfig(
        num_speculative_tokens=value["num_speculative_tokens"],
        prompt_lookup_max=lookup_max,
        prompt_lookup_min=lookup_min,
        method=method,
    )


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's totals since the engine started (vLLM's
    ``spec_decode_*`` counters): chunks that carried drafts, draft tokens checked,
    drafts accepted, and drafts accepted at each draft position (first draft first);
    ``num_sequence_steps``: steps of sequences, with drafts or without (a sequence
    sampled in a step counts once; each gave 1 + its accepted drafts), the denominator
    of the speculation rates a decode step estimate uses
    (:meth:`~halfmoon.costmodel.speculation.SpeculationRates.from_counts`)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    num_sequence_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over checked draft tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_draft(self) -> float:
        """Tokens a chunk with drafts gave on average: its accepted drafts plus the one
        sampled after them (1 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

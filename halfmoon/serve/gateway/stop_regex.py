"""SGLang's ``stop_regex``: a request ends where its output first matches one of these
regular expressions (on ``/generate``'s ``sampling_params``, and as an extra field of
completions and chat, as SGLang's OpenAI server takes it).

The patterns are checked when the request comes (each must compile and must not match
the empty text: it would end every output at once; at most :data:`MAX_PATTERNS` of at
most :data:`MAX_PATTERN_CHARS` characters); the output is searched after each new piece
of text, from :data:`REACH` characters before it, so a match is found as soon as it
ends, and each search is bounded in time (:data:`SEARCH_TIMEOUT_S`; the ``regex``
module's timeout): a pattern that backtracks without end fails its request with an
error naming it instead of stalling the gateway. Text already streamed stays sent (a
match cannot be foreseen, so nothing is held back for it, as on SGLang); a whole answer
is cut before the match (kept with ``include_stop_str_in_output`` / ``no_stop_trim``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import regex

from halfmoon.serve.gateway.backend import BackendError

#: Most patterns one request may give, and most characters in one.
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 1024
#: How far before the new text a match may begin (characters).
REACH = 4096
#: Longest one search of the output may take.
SEARCH_TIMEOUT_S = 0.05


class StopRegexTimeout(BackendError):
    """A ``stop_regex`` pattern took too long over an output (it backtracks without end):
    the request fails as one the cluster could not finish, its message naming the
    pattern."""


def parse_stop_regex(given: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop_regex`` as a tuple of checked patterns (ValueError naming what is wrong)."""
    if given is None:
        return ()
    patterns = (given,) if isinstance(given, str) else tuple(given)
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"stop_regex takes at most {MAX_PATTERNS} patterns")
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"stop_regex patterns are non-empty strings of at most "
                             f"{MAX_PATTERN_CHARS} characters")  # fmt: skip
        try:
            compiled = regex.compile(pattern)
        except regex.error as exc:
            raise ValueError(f"stop_regex {pattern!r} does not compile: {exc}") from None
        if compiled.fullmatch("", timeout=SEARCH_TIMEOUT_S) is not None:
            raise ValueError(f"stop_regex {pattern!r} matches the empty text (it would end "
                             "every output at once)")  # fmt: skip
    return patterns


@dataclass(frozen=True)
class Match:
    """Where a pattern matched the output: its span and text."""

    start: int
    end: int
    text: str


class StopPatterns:
    """One request's compiled ``stop_regex`` patterns."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        self._compiled = [regex.compile(p) for p in self.patterns]

    def first_match(self, text: str, new_from: int) -> Match | None:
        """The earliest match in ``text`` that ends after ``new_from`` (where the new
        text begins; earlier ones were looked for before), or None; StopRegexTimeout
        when a search runs too long."""
        start = max(0, new_from - REACH)
        best: Match | None = None
        for pattern, compiled in zip(self.patterns, self._compiled, strict=True):
            try:
                found = compiled.search(text, start, timeout=SEARCH_TIMEOUT_S)
            except TimeoutError:
                raise StopRegexTimeout(
                    f"stop_regex {pattern!r} took over {SEARCH_TIMEOUT_S * 1e3:.0f} ms "
                    "on the output (a pattern that backtracks without end)"
                ) from None
            if found is not None and (best is None or found.start() < best.start):
                best = Match(found.start(), found.end(), found.group(0))
        return best

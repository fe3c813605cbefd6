"""Turning output token ids into text for the client: incremental detokenization plus
stop strings, with the hold-back streaming needs.

A stop string may straddle two deltas, so the last ``len(longest stop) - 1`` characters
are held back until more text arrives or the request ends; when a stop string appears,
the text is cut just before it and the request finishes with ``stop``; then SGLang's
``stop_regex`` patterns (:mod:`halfmoon.serve.gateway.stop_regex`: searched as text
comes, nothing held back for them). Under a reasoning parser the tokens whose text is
reasoning are counted (``reasoning_tokens``, as vLLM's usage reports them; the tags'
tokens are not).
"""

from __future__ import annotations

from collections.abc import Sequence

from halfmoon.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from halfmoon.serve.gateway.reasoning import ReasoningSplit
from halfmoon.serve.gateway.stop_regex import StopPatterns


class OutputText:
    """Accumulates one request's output text and decides what may be sent."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        reasoning: ReasoningSplit | None = None,
        stop_regex: Sequence[str] = (),
        hold_all: bool = False,
    ) -> None:
        """``include_stop``: keep the stop string that ended the text (vLLM's
        ``include_stop_str_in_output``); ``skip_special_tokens`` False: special tokens'
        text too; ``reasoning``: a reader of the output's reasoning, by which tokens are
        counted as reasoning; ``stop_regex``: patterns that end the text where it first
        matches one (after the stop strings); ``hold_all``: nothing goes out before the
        end (a whole answer's text, which a later match may still cut)."""
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             skip_special_tokens=skip_special_tokens)  # fmt: skip
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False
        #: The stop string that ended the text (None: none did).
        self.stop_string: str | None = None
        self.num_tokens = 0
        self._reasoning = reasoning
        self._regex = StopPatterns(stop_regex) if stop_regex else None
        self._hold_all = hold_all
        #: Tokens whose text was reasoning (a token whose text went out later, held while
        #: it might have begun the end tag, is counted with the token that settled it).
        self.reasoning_tokens = 0

    @property
    def text(self) -> str:
        """All text so far (cut at a stop string once one appeared)."""
        return self._text

    def add(self, token_ids: Sequence[int], stop_token: bool = False) -> str:
        """Add tokens; returns the text that may be sent now. ``stop_token``: the last
        one is the token that stopped the request (an end-of-sequence token or one of its
        ``stop_token_ids``): counted, its text left out, as vLLM does unless
        ``include_stop_str_in_output``."""
        last = len(token_ids) - 1
        for k, tid in enumerate(token_ids):
            if self.stopped:
                break
            self.num_tokens += 1
            if k == last and stop_token and not self._include_stop:
                break
            delta = self._detok.add(tid)
            if self._reasoning is not None and self._reasoning.add(delta)[0]:
                self.reasoning_tokens += 1
            if not delta:
                continue
            start = max(0, len(self._text) - self._hold)
            self._text += delta
            for s in self._stop:
                pos = self._text.find(s, start)
                if pos >= 0:
                    self._text = self._text[: pos + (len(s) if self._include_stop else 0)]
                    self.stopped = True
                    self.stop_string = s
                    break
            if self._regex is not None and not self.stopped:
                found = self._regex.first_match(self._text, len(self._text) - len(delta))
                if found is not None:
                    self._text = self._text[: found.end if self._include_stop else found.start]
                    self.stopped = True
                    self.stop_string = found.text
        if self.stopped:
            limit = len(self._text)
        elif self._hold_all:
            limit = self._sent
        else:
            limit = max(self._sent, len(self._text) - self._hold)
        out = self._text[self._sent : limit]
        self._sent = limit
        return out

    def flush(self) -> str:
        """The held-back remainder, at the end of the request."""
        if self._reasoning is not None and self._reasoning.add("", final=True)[0]:
            self.reasoning_tokens += 1
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out

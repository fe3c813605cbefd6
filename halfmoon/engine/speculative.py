"""Prompt-lookup (n-gram) speculative decoding: drafts from a sequence's own tokens.

Before a step, each decoding sequence may get draft tokens (:class:`NgramProposer`): the
tokens that followed the earliest earlier occurrence of the sequence's last ``n`` tokens,
for the largest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that occurred (text
that repeats its prompt, code being edited, quotes, lists). The step computes the last
token and the drafts together, one row of logits each; the engine samples every row
as it would have sampled that position (the draw for a request's ``n``-th output token is
seeded from ``(seed, n)``, see :mod:`halfmoon.engine.sampling`), accepts drafts while
they equal the sampled token, and keeps the first sampled token that differs (or the
one after the last draft). For a draft that is one fixed token this is exact rejection
sampling: a draft is accepted with its probability, a rejected one is replaced by a draw
from the rest of the distribution; so the output is the one decoding without drafts
gives, token for token (greedy or seeded), and several tokens come from one step when
drafts are right. The KV computed for rejected drafts is overwritten later.

A request with a structured output drafts the tokens its grammar forces next
(llguidance's fast-forward tokens: a JSON schema's keys and punctuation) when there are
any, else its n-gram drafts, cut to what the grammar admits; each row is sampled under
the grammar's mask after the drafts before it (:meth:`Constraint.allowed_along`).
Drafts are skipped where they cannot help or would change what is computed: prompts
(the chunk's last token is a prompt token), requests that keep their KV for export (a
prefill worker's) and the last tokens before ``max_tokens`` or the context's end. A sequence
whose drafts keep being rejected gets fewer (down to one a step): its share of drafts
accepted, a running average, scales ``num_speculative_tokens``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np

from halfmoon.core.speculative import SpecDecodeCounts, SpeculativeConfig

if TYPE_CHECKING:
    from halfmoon.engine.scheduler import Sequence


#: Weight of a step's acceptance in a sequence's running rate (:meth:`NgramProposer.observe`).
RATE_WEIGHT = 0.4


def find_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of ``tokens``'
    last ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that occurs (the
    occurrence ends before the last token); ``()`` when none does."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        starts = size - n  # candidate starts 0..size-n-1: a token follows each window
        match = tokens[0:starts] == tokens[size - n]
        for j in range(1, n):
            match &= tokens[j : starts + j] == tokens[size - n + j]
        hits = np.flatnonzero(match)
        if hits.size:
            first = int(hits[0]) + n
            return tuple(tokens[first : first + k].tolist())
    return ()


class SpecDecodeStats:
    """Accumulates :class:`SpecDecodeCounts` step by step."""

    def __init__(self, num_speculative_tokens: int):
        self.num_sequence_steps = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, drafted: int, accepted: int) -> None:
        """One sequence's step: ``accepted`` of its ``drafted`` drafts (``drafted`` > 0)."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def counts(self) -> SpecDecodeCounts:
        """The totals so far."""
        return SpecDecodeCounts(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
            tuple(self.accepted_per_position), self.num_sequence_steps,
        )  # fmt: skip


class NgramProposer:
    """Draft tokens for decoding sequences (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        # Each live sequence's tokens as an array grown in place (tokens are only ever
        # appended), so a step copies only the new ones.
        self._history: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, int]] = (
            weakref.WeakKeyDictionary()
        )
        # Each sequence's recent share of drafts accepted (1 until it drafted).
        self._rate: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()
        #: Every step's drafts checked and accepted, summed.
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        buffer, size = self._history.get(seq, (np.empty(0, dtype=np.int64), 0))
        total = seq.num_tokens
        if total > buffer.size:
            grown = np.empty(max(total, 2 * buffer.size, 256), dtype=np.int64)
            grown[:size] = buffer[:size]
            buffer = grown
        if total > size:
            buffer[size:total] = seq.token_ids[size:total]
        self._history[seq] = (buffer, total)
        return buffer[:total]

    def observe(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """``seq`` had ``accepted`` of its ``drafted`` drafts accepted this step: counted
        in :attr:`stats`, and its next drafts are as many as its recent acceptance makes
        worth checking."""
        self.stats.num_sequence_steps += 1
        if drafted:
            self.stats.record(drafted, accepted)
            rate = self._rate.get(seq, 1.0)
            self._rate[seq] = (1 - RATE_WEIGHT) * rate + RATE_WEIGHT * accepted / drafted

    def draft_limit(self, seq: Sequence) -> int:
        """How many drafts ``seq`` gets at most: ``num_speculative_tokens`` scaled by its
        recent acceptance (a text the model does not copy checks one draft at a time,
        each a wasted row in a step that holds other sequences), at least one."""
        k = self.config.num_speculative_tokens
        return max(1, min(k, int(k * self._rate.get(seq, 1.0) + 0.5)))

    def propose(self, seq: Sequence, max_drafts: int) -> tuple[int, ...]:
        """Up to ``max_drafts`` draft tokens to check after ``seq``'s last token, or
        ``()`` (not decoding, not eligible, no n-gram found)."""
        if (
            seq.num_computed_tokens < seq.num_prompt_tokens
            or seq.num_tokens - seq.num_computed_tokens != 1
            or seq.keep_kv
        ):
            return ()
        # Every draft accepted plus the token after them must fit max_tokens and the context.
        k = min(
            self.draft_limit(seq),
            max_drafts,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if k <= 0:
            return ()
        c = self.config
        drafts = find_drafts(self._tokens(seq), c.prompt_lookup_min, c.prompt_lookup_max, k)
        if seq.constraint is not None:  # what its grammar forces, else what it admits
            return seq.constraint.drafts(drafts, k)
        return drafts

"""Speculative decoding in the decode-step estimates: what a step costs and yields when
each decoding sequence also checks draft tokens (``--speculative-config``).

A speculating engine runs, per decoding sequence and step, its own token plus the drafts
proposed for it, as decode rows (halfmoon's engine: row ``j`` reads the sequence's
context up to its own position), and keeps 1 + the accepted drafts. Two rates describe
it, each per sequence and step:

- ``rows_per_seq``: rows computed, 1 + mean drafts checked;
- ``tokens_per_step``: tokens gained, 1 + mean drafts accepted (<= ``rows_per_seq``).

A step of ``b`` sequences holding ``c`` context tokens then costs what a one-token step
of ``b * rows_per_seq`` rows over ``c * rows_per_seq`` context tokens costs (the cost
models and profiles know one-token steps only; between whole row counts the step is
interpolated linearly), and a request of ``n`` output tokens decodes in
``n / tokens_per_step`` steps. Without speculation both rates are 1 and every estimate is
the one-token step's, to the float.

The rates come from counters (:class:`RecentSpeculation`): a live worker's engine (or its
vLLM server's ``vllm:spec_decode_*`` counters), over its recent steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpeculationRates:
    """Rows computed and tokens gained per decoding sequence and step (see the module
    docstring); ``SpeculationRates()`` is decoding without speculation."""

    rows_per_seq: float = 1.0
    tokens_per_step: float = 1.0

    def __post_init__(self) -> None:
        for name in ("rows_per_seq", "tokens_per_step"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 1.0:
                raise ValueError(f"{name} must be a finite number >= 1, got {value!r}")
        if self.tokens_per_step > self.rows_per_seq:
            raise ValueError(
                f"tokens_per_step ({self.tokens_per_step:g}) cannot exceed rows_per_seq "
                f"({self.rows_per_seq:g}): a step keeps at most the rows it computed"
            )

    @property
    def speculates(self) -> bool:
        """Whether any drafts are checked (else every estimate is the plain step's)."""
        return self.rows_per_seq != 1.0

    @classmethod
    def parse(cls, text: str) -> SpeculationRates:
        """``"ROWS,TOKENS"`` (e.g. ``"2.5,1.8"``: a CLI option's value); ValueError naming
        the problem otherwise."""
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(f"expected ROWS,TOKENS (e.g. 2.5,1.8), got {text!r}")
        try:
            rows, tokens = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"expected two numbers ROWS,TOKENS, got {text!r}") from None
        return cls(rows, tokens)

    @classmethod
    def from_counts(
        cls, sequence_steps: int, draft_tokens: int, accepted_tokens: int
    ) -> SpeculationRates:
        """The rates of ``sequence_steps`` decoding steps of sequences (one per sequence
        per step) that checked ``draft_tokens`` and accepted ``accepted_tokens``; none
        (1, 1) over no steps."""
        if sequence_steps <= 0:
            return NO_SPECULATION
        rows = 1.0 + max(0, draft_tokens) / sequence_steps
        tokens = 1.0 + min(max(0, accepted_tokens), max(0, draft_tokens)) / sequence_steps
        return cls(rows, tokens)

    def step_s(
        self, engine_step_s: Callable[[int, int], float], batch_size: int, context_tokens: int
    ) -> float:
        """``engine_step_s(batch, context)`` (a one-token step) for a speculating batch of
        ``batch_size`` sequences over ``context_tokens`` (the module docstring's rule);
        the plain call when nothing is drafted."""
        if not self.speculates:
            return engine_step_s(batch_size, context_tokens)
        rows = batch_size * self.rows_per_seq
        lo = math.floor(rows)
        context = round(context_tokens * self.rows_per_seq)
        low_s = engine_step_s(lo, context)
        frac = rows - lo
        if frac == 0.0:
            return low_s
        return low_s + frac * (engine_step_s(lo + 1, context) - low_s)

    def steps_s(
        self,
        engine_steps_s: Callable[[np.ndarray, np.ndarray], np.ndarray],
        batch_sizes: np.ndarray,
        contexts: np.ndarray,
    ) -> np.ndarray:
        """:meth:`step_s` of many batches at once (the same floats), given the one-token
        steps' vector form."""
        if not self.speculates:
            return engine_steps_s(batch_sizes, contexts)
        rows = batch_sizes * self.rows_per_seq
        lo = np.floor(rows)
        whole = lo.astype(np.int64)
        context = np.rint(contexts * self.rows_per_seq).astype(np.int64)
        low_s = engine_steps_s(whole, context)
        frac = rows - lo
        high_s = engine_steps_s(whole + 1, context)
        # a whole row count takes the lower step itself, as the scalar does
        return np.where(frac == 0.0, low_s, low_s + frac * (high_s - low_s))

    def per_token_s(self, step_s: float) -> float:
        """Seconds per generated token of a sequence when a step takes ``step_s``."""
        return step_s / self.tokens_per_step


#: Decoding without speculation: every estimate is the one-token step's.
NO_SPECULATION = SpeculationRates()


class RecentSpeculation:
    """The rates of a worker's recent decoding, from its running totals of sequence-steps,
    draft tokens and accepted tokens (:meth:`update`, e.g. at every load report): the
    counts since the oldest kept total that still leaves ``window_steps`` sequence-steps
    between it and the newest. Before any step with drafts: :data:`NO_SPECULATION`."""

    def __init__(self, window_steps: int = 256) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.window_steps = window_steps
        self._totals: deque[tuple[int, int, int]] = deque()
        self.rates = NO_SPECULATION

    def update(self, sequence_steps: int, draft_tokens: int, accepted_tokens: int) -> None:
        """The totals now (never decreasing; a restart that lowers them starts over)."""
        now = (sequence_steps, draft_tokens, accepted_tokens)
        if self._totals and any(n < o for n, o in zip(now, self._totals[-1], strict=True)):
            self._totals.clear()
        if self._totals and now == self._totals[-1]:
            return
        self._totals.append(now)
        while len(self._totals) > 2 and now[0] - self._totals[1][0] >= self.window_steps:
            self._totals.popleft()
        first = self._totals[0]
        steps = now[0] - first[0]
        if steps > 0:
            self.rates = SpeculationRates.from_counts(steps, now[1] - first[1], now[2] - first[2])

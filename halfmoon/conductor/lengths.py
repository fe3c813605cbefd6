"""Decode durations predicted from the prompt's prefix (the paper's open problem: "output
length is hard to predict", so its early rejection assumes one t_d for every request).

Requests that start with the same block (the same system prompt, document or app, in
one tenant: hashes chain from the tenant's salt) tend to answer at similar lengths. On
the public Mooncake trace, predicting a request's output length as the median of the
earlier requests that share its first block misses by 25 tokens on average (for the 44%
of requests that have such a predecessor), where the mean of all earlier requests misses
by 147 (outputs average 149 tokens). The Conductor holds the prefix hashes already; with
``ConductorConfig.decode_time_by_prefix`` it keeps the decode durations (join -> finish)
of the last :data:`KEEP` requests of each first block and predicts a new one's as their
median. The prediction (``early_reject="predict"``) then weighs a request with a
prediction by the durations of all scaled so that their median is its own (the spread
of all, its own size: :meth:`~halfmoon.conductor.admission.DecodeTimes.own_stay_probability`),
and the others by the durations of all.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque

from halfmoon.core.request import Request

#: Durations kept per first block (the most recent).
KEEP = 16
#: First blocks remembered (least recently used out first).
MAX_ROOTS = 100_000


def prefix_root(request: Request) -> int | None:
    """The hash of the request's first full block (None: its prompt has none)."""
    return request.block_hashes[0] if request.num_full_blocks >= 1 else None


class PrefixDurations:
    """Decode durations per first block, and a prediction from them."""

    def __init__(self, keep: int = KEEP, max_roots: int = MAX_ROOTS) -> None:
        self.keep = keep
        self.max_roots = max_roots
        self._by_root: OrderedDict[int, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_root)

    def observe(self, root: int, duration_s: float) -> None:
        """A request whose prompt starts with ``root`` decoded for ``duration_s``."""
        kept = self._by_root.get(root)
        if kept is None:
            kept = self._by_root[root] = deque(maxlen=self.keep)
            if len(self._by_root) > self.max_roots:
                self._by_root.popitem(last=False)
        else:
            self._by_root.move_to_end(root)
        kept.append(duration_s)

    def predict(self, root: int | None) -> float | None:
        """The median duration of the requests kept for ``root`` (None: none)."""
        kept = None if root is None else self._by_root.get(root)
        return statistics.median(kept) if kept else None

"""Request priorities for a replayed workload (vLLM's ``priority``: under
``--scheduling-policy priority`` a lower value is served first).

``--priority-mix -1:0.1,5:0.2`` gives each request priority -1 with probability 0.1 and 5
with 0.2, and leaves the rest at 0; the draws are seeded, so the same flags give the same
requests the same priorities in every run.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Iterator

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request

#: (priority, fraction of the requests) pairs; the fractions sum to at most 1.
PriorityMix = tuple[tuple[int, float], ...]


def parse_priority_mix(text: str, flag: str = "--priority-mix") -> PriorityMix:
    """``VALUE:FRACTION[,VALUE:FRACTION...]`` as pairs (a HalfmoonError naming ``flag``
    for anything else: a non-integer priority, a fraction outside (0, 1], fractions
    summing past 1, a priority given twice, or 0, which is every other request's)."""
    pairs: list[tuple[int, float]] = []
    for part in text.split(","):
        value, sep, fraction = part.strip().partition(":")
        try:
            priority, share = int(value), float(fraction)
        except ValueError:
            priority, share = 0, -1.0
        if not sep or share == -1.0:
            raise HalfmoonError(
                f"{flag} takes VALUE:FRACTION pairs (e.g. -1:0.1,5:0.2), got {part.strip()!r}"
            )
        if not 0.0 < share <= 1.0:
            raise HalfmoonError(f"{flag}: a fraction must be in (0, 1], got {fraction!r}")
        if priority == 0:
            raise HalfmoonError(f"{flag}: priority 0 is every other request's; name others")
        if any(priority == p for p, _ in pairs):
            raise HalfmoonError(f"{flag}: priority {priority} given twice")
        pairs.append((priority, share))
    if sum(share for _, share in pairs) > 1.0 + 1e-9:
        raise HalfmoonError(f"{flag}: the fractions sum to more than 1")
    return tuple(pairs)


def with_priorities(requests: Iterable[Request], mix: PriorityMix, seed: int) -> Iterator[Request]:
    """``requests`` with priorities drawn from ``mix`` (one seeded draw per request, in
    order; the requests of no pair keep theirs)."""
    rng = random.Random(0x5EED_0000 + seed)
    for request in requests:
        draw, below = rng.random(), 0.0
        for priority, share in mix:
            below += share
            if draw < below:
                request = dataclasses.replace(request, priority=priority)
                break
        yield request

"""Prefill placement policies behind one interface, and coupled routers.

A policy sees every candidate the Conductor built (one per prefill instance with its
local prefix, plus — for policies that use them — candidates that fetch a longer prefix
from another instance) and picks one. Ties go to the earlier candidate, so results are
deterministic for a given instance order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from halfmoon.conductor.messages import PrefillCandidate


@dataclass(frozen=True)
class PrefillPolicy:
    """A named choice rule. ``uses_remote_prefixes``: give it remote-prefix candidates."""

    name: str
    uses_remote_prefixes: bool
    choose: Callable[[Sequence[PrefillCandidate], random.Random], PrefillCandidate]
    description: str


def _random(cands: Sequence[PrefillCandidate], rng: random.Random) -> PrefillCandidate:
    return cands[rng.randrange(len(cands))]


def _load_balance(cands: Sequence[PrefillCandidate], rng: random.Random) -> PrefillCandidate:
    return min(cands, key=lambda c: c.queue_s)


def _cache_aware(cands: Sequence[PrefillCandidate], rng: random.Random) -> PrefillCandidate:
    return min(cands, key=lambda c: (-c.cached_tokens, c.queue_s))


def _kvcache_centric(cands: Sequence[PrefillCandidate], rng: random.Random) -> PrefillCandidate:
    return min(cands, key=lambda c: c.ttft_s)


POLICIES: dict[str, PrefillPolicy] = {
    p.name: p
    for p in (
        PrefillPolicy("random", False, _random, "uniformly random prefill instance"),
        PrefillPolicy("load-balance", False, _load_balance, "least estimated queue time (T_queue)"),
        PrefillPolicy(
            "cache-aware", False, _cache_aware, "longest local cached prefix; ties: least queue"
        ),
        PrefillPolicy(
            "kvcache-centric",
            True,
            _kvcache_centric,
            "minimum estimated TTFT = queue + prefill of the uncached part "
            "[+ transfer of a better remote prefix] (Mooncake's Conductor)",
        ),
    )
}

#: ``kvcache-centric``: least estimated TTFT (queue + prefill of the uncached part), the
#: paper's rule; ``cache-aware``: longest cached prefix, then load. With a real chat
#: model every prompt shares the template's first blocks, so ``cache-aware`` sends all
#: requests to whichever instance holds them; ``kvcache-centric`` weighs a hit against
#: the queue it would wait in.
COUPLED_ROUTERS = ("round-robin", "least-load", "cache-aware", "kvcache-centric")


def get_policy(name: str) -> PrefillPolicy:
    """Look a policy up by name; unknown names get an error listing the choices."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None

"""Finding the highest load a configuration sustains within its SLO (a rate sweep).

The paper's "throughput within SLO" is the largest request rate at which the SLO still
holds. :func:`max_rate_within_slo` finds it for any predicate ``ok(rate)``: it brackets
the boundary by doubling or halving from ``start_rate``, then bisects geometrically until
the bracket is narrower than ``rel_tol``. It assumes ``ok`` is (roughly) monotone: true
below some rate, false above.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def max_rate_within_slo(
    ok: Callable[[float], bool],
    start_rate: float,
    rel_tol: float = 0.03,
    max_doublings: int = 20,
) -> float:
    """The largest rate (to ``rel_tol``) for which ``ok`` holds; 0.0 when it fails even at
    ``start_rate / 2**max_doublings``. Raises ValueError for bad arguments, or when ``ok``
    still holds after ``max_doublings`` doublings (the load never saturates)."""
    if not (math.isfinite(start_rate) and start_rate > 0):
        raise ValueError(f"start_rate must be a positive number, got {start_rate}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    low = high = start_rate
    if ok(start_rate):
        for _ in range(max_doublings):
            high = low * 2
            if not ok(high):
                break
            low = high
        else:
            raise ValueError(f"the SLO still holds at rate {high}: the sweep never saturates")
    else:
        for _ in range(max_doublings):
            low = high / 2
            if ok(low):
                break
            high = low
        else:
            return 0.0
    while high / low > 1 + rel_tol:
        mid = math.sqrt(low * high)
        if ok(mid):
            low = mid
        else:
            high = mid
    return low

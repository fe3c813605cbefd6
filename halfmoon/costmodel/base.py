"""The cost-model interface shared by the Conductor and the simulator, plus input checks.

A cost model answers "how long" for one *instance*: a group of GPUs (tensor-parallel)
serving one model replica. Every implementation (roofline, throughput, measured profile)
satisfies :class:`CostModel`, so callers never care which one they hold.

Conventions for every implementation:

- negative or non-finite inputs raise ``ValueError`` naming the argument;
- zero work costs zero time (``prefill_time_s(0, c) == 0``, ``decode_step_time_s(0, 0) == 0``,
  ``transfer_time_s(0) == 0``): a fixed per-step overhead is only paid for real work.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class CostModel(Protocol):
    """Time estimates for one instance (a group of GPUs serving one model replica)."""

    kv_bytes_per_token: int

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Seconds to prefill ``num_new_tokens`` new tokens after ``num_cached_tokens`` cached
        ones: the new tokens attend causally over the cached prefix and themselves, so the
        quadratic attention over the prefix is included."""
        ...

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        """Seconds for one decode iteration of ``batch_size`` sequences whose KV caches hold
        ``total_context_tokens`` tokens in total."""
        ...

    def transfer_time_s(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` over this instance's network link."""
        ...

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit in the instance's memory after the weights."""
        ...


def check_count(name: str, value: int) -> int:
    """Return ``value`` if it is a non-negative integer, else raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers are accepted: they index like ints and convert exactly.
        try:
            as_int = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if as_int != value:
            raise ValueError(f"{name} must be an integer, got {value!r}")
        value = as_int
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_counts(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as an int64 array if every one is a non-negative integer, else raise
    ``ValueError`` naming them (the vector form of :func:`check_count`)."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        as_int = array.astype(np.int64)
        if array.dtype.kind not in "f" or not np.array_equal(as_int, array):
            raise ValueError(f"{name} must be integers, got {values!r}")
        array = as_int
    if array.size and array.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {array.min()}")
    return array.astype(np.int64, copy=False)


def check_amount(name: str, value: float) -> float:
    """Return ``value`` as a float if it is finite and non-negative, else raise ``ValueError``."""
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(as_float) or as_float < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return as_float


def check_positive(name: str, value: float) -> float:
    """Return ``value`` as a float if it is finite and > 0, else raise ``ValueError``."""
    as_float = check_amount(name, value)
    if as_float == 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return as_float


def check_fraction(name: str, value: float) -> float:
    """Return ``value`` if it lies in (0, 1], else raise ``ValueError`` (efficiency factors)."""
    as_float = check_amount(name, value)
    if not 0 < as_float <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return as_float


def causal_attention_pairs(num_new_tokens: int, num_cached_tokens: int) -> int:
    """Query-key pairs when ``num_new_tokens`` tokens attend causally over a cached prefix.

    New token i (1-based) sees the whole prefix plus new tokens 1..i::

        prefix (c cached)        new tokens (n)
        [c c c c c c c c c c] [1 . . .]   token 1 sees c + 1
        [c c c c c c c c c c] [1 2 . .]   token 2 sees c + 2
        ...                               token n sees c + n
        total = n*c + n*(n+1)/2
    """
    n = check_count("num_new_tokens", num_new_tokens)
    c = check_count("num_cached_tokens", num_cached_tokens)
    return n * c + n * (n + 1) // 2

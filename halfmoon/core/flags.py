"""Checks of command-line option values, shared by every CLI: each returns the value or
raises a one-line :class:`~halfmoon.core.errors.HalfmoonError` naming the flag (the CLI
prints it as an error, never a traceback)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from halfmoon.core.errors import HalfmoonError

#: vLLM's switch for its development endpoints (``/reset_prefix_cache``): halfmoon's
#: gateway serves its own under it, and the vLLM servers halfmoon starts inherit it.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` turns the development endpoints on (as vLLM reads it: a
    non-zero integer)."""
    try:
        return int(environ.get(DEV_MODE_ENV, "0")) != 0
    except ValueError:
        return False


def check_choice(what: str, value: str, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise HalfmoonError(f"unknown {what} {value!r}; choose from {', '.join(options)}")
    return value


def check_positive(flag: str, value: float) -> float:
    """``value`` if it is a finite number > 0."""
    if not (math.isfinite(value) and value > 0):
        raise HalfmoonError(f"{flag} must be a positive number, got {value}")
    return value


def check_at_least(flag: str, value: int, least: int) -> int:
    """``value`` if it is >= ``least``."""
    if value < least:
        raise HalfmoonError(f"{flag} must be >= {least}, got {value}")
    return value


def check_fraction(flag: str, value: float) -> float:
    """``value`` if it is a number in [0, 1]."""
    if not 0 <= value <= 1:  # (NaN fails too)
        raise HalfmoonError(f"{flag} must be in [0, 1], got {value}")
    return value


def check_range(flag: str, value: float, low: float, high: float) -> float:
    """``value`` if it is a number in [``low``, ``high``]."""
    if not low <= value <= high:  # (NaN fails too)
        raise HalfmoonError(f"{flag} must be in [{low:g}, {high:g}], got {value}")
    return value

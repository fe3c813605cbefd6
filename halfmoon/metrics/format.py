"""Number formatting shared by the tables of ``halfmoon simulate`` and ``halfmoon bench``."""

from __future__ import annotations

from typing import Any


def fmt_num(value: Any, digits: int = 3) -> str:
    """``-`` for a missing value, thousands separators for an int, else fixed digits."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}f}"


def fmt_ms(value_s: Any) -> str:
    """Seconds shown as milliseconds with one decimal (``-`` when missing)."""
    return "-" if value_s is None else f"{value_s * 1e3:.1f}"

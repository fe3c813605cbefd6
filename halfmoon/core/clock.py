"""Clocks are passed in, never global: the live system uses wall time, the simulator and
tests a manual clock they advance themselves."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Anything that tells the time in seconds."""

    def now(self) -> float: ...


class WallClock:
    """Monotonic wall time in seconds."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (simulator, tests)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now(self) -> float:
        return self._now_s

    def advance_to(self, t_s: float) -> None:
        """Move to ``t_s``; time never goes backwards."""
        if t_s < self._now_s:
            raise ValueError(f"clock cannot go backwards: {t_s} < {self._now_s}")
        self._now_s = t_s

    def advance(self, dt_s: float) -> None:
        """Move forward by ``dt_s`` seconds."""
        self.advance_to(self._now_s + dt_s)

"""The discrete-event loop: events that return their successor events (as in vidur).

An :class:`Event` is a time and an action; firing it runs the action, which returns the
events it causes. The loop keeps pending events in a heap keyed by ``(time, sequence
number)``: events at the same instant fire in the order they were scheduled, so a run is
deterministic. The loop owns the simulated clock and moves it to each event's time
before firing it (the Conductor reads the same clock).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from halfmoon.core.clock import ManualClock


@dataclass(frozen=True, slots=True)
class Event:
    """At ``time_s``, run ``action``; it returns the events that follow from it."""

    time_s: float
    action: Callable[[], Iterable[Event]]


NO_EVENTS: tuple[Event, ...] = ()


class EventLoop:
    """A heap of pending events over a :class:`ManualClock`."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0
        self.num_fired = 0

    def __len__(self) -> int:
        """Pending events."""
        return len(self._heap)

    def schedule(self, events: Iterable[Event]) -> None:
        """Add events; one in the past is a bug in the caller and raises ValueError."""
        now = self.clock.now()
        for event in events:
            if event.time_s < now:
                raise ValueError(f"event scheduled in the past: {event.time_s} < {now}")
            self._seq += 1
            heapq.heappush(self._heap, (event.time_s, self._seq, event))

    def run(self, until_s: float | None = None) -> int:
        """Fire events in time order until none is left (or the next is after ``until_s``);
        returns the number fired by this call."""
        heap = self._heap
        clock = self.clock
        fired = 0
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                break
            time_s, _, event = heapq.heappop(heap)
            clock.advance_to(time_s)
            fired += 1
            successors = event.action()
            if successors:
                self.schedule(successors)
        self.num_fired += fired
        return fired

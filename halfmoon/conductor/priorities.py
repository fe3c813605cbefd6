"""Queue estimates under vLLM's ``priority`` scheduling policy.

An engine under ``--scheduling-policy priority`` serves its queue by the requests'
``priority`` (lower first). So a request of priority ``p`` waits for two things:

- the bookings its engine serves before it: those of a value up to ``p`` and the one in
  service (:meth:`PrefillState.queue_s(now, p) <halfmoon.conductor.state.PrefillState.queue_s>`);
- the more urgent requests that arrive while it waits and go ahead of it. The Conductor
  cannot know those, but it sees the rate at which it places them: with ``rho`` the share
  of the prefill instances' time that more urgent placements booked over the last
  :data:`WINDOW_S` seconds, each second of waiting brings ``rho`` seconds of work ahead,
  and the wait stretches to ``queue / (1 - rho)`` (the waiting time of a class in a
  priority queue), ``rho`` capped at :data:`MAX_SHARE`.

Under ``fcfs`` every request has priority 0: both are the plain T_queue, at no cost
(:class:`UrgentShare` records nothing until it sees a priority other than 0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from halfmoon.conductor.loads import PrefillLoads
from halfmoon.conductor.state import PrefillState

#: Seconds of placements the share of more urgent work is taken over.
WINDOW_S = 60.0
#: The largest share of more urgent work a wait is stretched for (10x at most).
MAX_SHARE = 0.9


@dataclass(frozen=True)
class QueueView:
    """How one request sees the prefill queues: as a request of ``priority`` (None: the
    whole queue, as under ``fcfs``), stretched by ``stretch`` for the more urgent work
    expected to arrive meanwhile."""

    priority: int | None = None
    stretch: float = 1.0

    def state_s(self, state: PrefillState, now_s: float) -> float:
        """The request's wait on one instance."""
        queue_s = state.queue_s(now_s, self.priority)
        return queue_s if self.stretch == 1.0 else queue_s * self.stretch

    def loads_s(self, loads: PrefillLoads, now_s: float) -> np.ndarray:
        """The request's wait on every instance of ``loads``, in their order."""
        queue = loads.queue_s(now_s, self.priority)
        return queue if self.stretch == 1.0 else queue * self.stretch


#: The view of a priority-blind estimate (every booking counts; nothing stretched).
WHOLE_QUEUE = QueueView()
#: The view of a request of priority 0 when no other priority was seen (fcfs's).
FCFS_VIEW = QueueView(0)


class UrgentShare:
    """The prefill seconds placed per priority over the last ``window_s`` seconds (kept
    once a request of a priority other than 0 has been seen)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.active = False
        self._placed: deque[tuple[float, int, float]] = deque()
        self._booked_s: dict[int, float] = {}
        self._count: dict[int, int] = {}

    def placed(self, now_s: float, priority: int, prefill_s: float) -> None:
        """A request of ``priority`` was placed for ``prefill_s`` seconds of prefill."""
        if not self.active:
            if not priority:
                return
            self.active = True
        self._placed.append((now_s, priority, prefill_s))
        self._booked_s[priority] = self._booked_s.get(priority, 0.0) + prefill_s
        self._count[priority] = self._count.get(priority, 0) + 1

    def share(self, now_s: float, priority: int, num_instances: int) -> float:
        """The share of ``num_instances`` instances' time that placements more urgent
        than ``priority`` took over the window, at most :data:`MAX_SHARE`."""
        if not self.active or num_instances < 1:
            return 0.0
        placed, booked, count = self._placed, self._booked_s, self._count
        while placed and placed[0][0] <= now_s - self.window_s:
            _, old, seconds = placed.popleft()
            booked[old] -= seconds
            count[old] -= 1
            if not count[old]:  # no float residue for a priority gone from the window
                del booked[old], count[old]
        urgent_s = sum(seconds for p, seconds in booked.items() if p < priority)
        return min(MAX_SHARE, max(0.0, urgent_s / (self.window_s * num_instances)))

    def summary(self, now_s: float, num_instances: int) -> dict[str, object]:
        """What an operator reads (the Conductor's status): the prefill seconds placed
        per priority over the window, and the share of the instances' time more urgent
        work took for a request of each priority seen (its wait is stretched by
        ``1 / (1 - share)``)."""
        self.share(now_s, 0, num_instances)  # drop what left the window
        seen = sorted(self._booked_s)
        return {
            "window_s": self.window_s,
            "placed_prefill_s": {str(p): self._booked_s[p] for p in seen},
            "urgent_share": {str(p): self.share(now_s, p, num_instances) for p in seen},
        }

    def view(self, now_s: float, priority: int, num_instances: int) -> QueueView:
        """A request of ``priority``'s view of the queues now."""
        if not self.active:  # nothing more urgent placed yet (always so under fcfs)
            return FCFS_VIEW if priority == 0 else QueueView(priority)
        return QueueView(priority, 1.0 / (1.0 - self.share(now_s, priority, num_instances)))

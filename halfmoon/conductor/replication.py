"""Hot-spot replication: copy prefixes that many requests use to more instances.

A prefix is identified by the hash of its last cached block (chained hashes make that
hash name the whole prefix). When at least ``min_requests`` requests used it within the
last ``window_s`` seconds and fewer than ``max_replicas`` instances hold it, the planner
proposes one copy to the least-loaded prefill instance lacking it. A (prefix, target)
pair is proposed at most once per window, so a hot prefix is not copied twice while the
first copy is in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from halfmoon.conductor.index import PrefixIndex
from halfmoon.conductor.messages import ReplicationPlan


class HotSpotPlanner:
    """Counts prefix uses in a sliding window and proposes replications."""

    def __init__(self, min_requests: int, window_s: float, max_replicas: int) -> None:
        self.min_requests = min_requests
        self.window_s = window_s
        self.max_replicas = max_replicas
        self._uses: deque[tuple[float, int]] = deque()
        self._counts: dict[int, int] = {}
        self._planned: dict[tuple[int, str], float] = {}

    @property
    def enabled(self) -> bool:
        """False when configured off (K = 0 or at most one replica)."""
        return self.min_requests > 0 and self.max_replicas > 1

    def _expire(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._uses and self._uses[0][0] < horizon:
            _, key = self._uses.popleft()
            left = self._counts[key] - 1
            if left:
                self._counts[key] = left
            else:
                del self._counts[key]
        for pair in [p for p, t in self._planned.items() if t < horizon]:
            del self._planned[pair]

    def observe(
        self,
        now_s: float,
        prefix: Sequence[int],
        index: PrefixIndex,
        instance_ids: Sequence[str],
        load_of: Callable[[str], float],
    ) -> ReplicationPlan | None:
        """Record one use of ``prefix`` (its cached blocks); maybe return a copy to make."""
        if not self.enabled or not prefix:
            return None
        self._expire(now_s)
        key = prefix[-1]
        self._uses.append((now_s, key))
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        if count < self.min_requests:
            return None
        holders = [i for i in instance_ids if index.holds(i, key)]
        in_flight = [i for i in instance_ids if (key, i) in self._planned and i not in holders]
        if not holders or len(holders) + len(in_flight) >= self.max_replicas:
            return None
        lacking = [i for i in instance_ids if i not in holders and i not in in_flight]
        if not lacking:
            return None
        target = min(lacking, key=load_of)
        source = min(holders, key=load_of)
        self._planned[(key, target)] = now_s
        return ReplicationPlan(
            source, target, tuple(prefix), f"hot prefix: {count} requests in {self.window_s:g}s"
        )

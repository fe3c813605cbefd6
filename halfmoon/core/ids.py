"""Identifier types and a deterministic id generator (no module-level counters)."""

from __future__ import annotations

import itertools
from typing import NewType

RequestId = NewType("RequestId", str)
InstanceId = NewType("InstanceId", str)
#: A chained block hash: xxh3_128 of (parent hash || token ids), or a trace's integer hash id.
BlockHash = int


class IdGenerator:
    """Hands out ``prefix-0``, ``prefix-1``, ... ; one generator per owner, never global."""

    def __init__(self, prefix: str = "req") -> None:
        self._prefix = prefix
        self._counter = itertools.count()

    def next(self) -> str:
        """Return the next id."""
        return f"{self._prefix}-{next(self._counter)}"

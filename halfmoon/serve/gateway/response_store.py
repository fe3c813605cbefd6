"""Stored responses of the Responses API: what ``previous_response_id``,
``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items`` read.

A :class:`ResponseStore` keeps, per response, its ``response`` object, its own input items
and the whole conversation through its output (every earlier turn's input and output items
of its ``previous_response_id`` chain; not ``instructions``, which the API does not carry
over). It lives in the gateway's memory, bounded in bytes (least recently used out first),
and is lost when the gateway restarts. Each response belongs to the API key that made it
(``None`` on a server without keys): another key reads it as missing.

A response made in the background *and* streamed keeps its server-sent events as they are
made (:class:`EventLog`, in :class:`EventLogs`): the request that made it streams them, and
``GET /v1/responses/{id}?stream=true&starting_after=N`` streams them again from event
``N + 1`` on, following the generation while it runs (a client that lost its connection
resumes where it was).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any


def _size(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":")))


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its ``body`` (the ``response`` object), its request's own
    ``input_items``, and ``conversation``, the items of every turn through its output."""

    owner: str | None
    body: dict[str, Any]
    input_items: tuple[dict[str, Any], ...]
    conversation: tuple[dict[str, Any], ...]
    #: Bytes of the whole conversation as JSON (earlier turns' items included).
    conversation_bytes: int
    #: What it counts against the store's budget (bytes of JSON): earlier turns are
    #: counted in every response that holds them, so the real memory is at most this.
    size: int


class ResponseStore:
    """Responses kept for later turns, at most ``max_bytes`` of them (JSON bytes; 0 keeps
    none), the least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        #: Responses evicted to make room (not counting deletions).
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        """Whether this store keeps anything."""
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(
        self,
        owner: str | None,
        body: dict[str, Any],
        input_items: Sequence[dict[str, Any]],
        previous: StoredResponse | None = None,
    ) -> StoredResponse | None:
        """Keep ``body`` (a finished ``response`` object), made from ``input_items`` after
        ``previous``; returns it, or None when it alone is larger than the whole store."""
        output = tuple(body.get("output") or ())
        earlier = previous.conversation if previous is not None else ()
        earlier_bytes = previous.conversation_bytes if previous is not None else 0
        own = _size(list(input_items))
        conversation_bytes = earlier_bytes + own + _size(list(output))
        size = _size(body) + own + conversation_bytes
        entry = StoredResponse(owner, body, tuple(input_items),
                               (*earlier, *input_items, *output), conversation_bytes, size)  # fmt: skip
        if size > self.max_bytes:
            return None
        self.delete(owner, body["id"])
        while self._items and self.bytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
            self.evictions += 1
        self._items[body["id"]] = entry
        self.bytes += size
        return entry

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """The response ``response_id`` of ``owner`` (None: none such, or another's)."""
        entry = self._items.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._items.move_to_end(response_id)
        return entry

    def delete(self, owner: str | None, response_id: str) -> bool:
        """Forget ``owner``'s response ``response_id``; whether there was one."""
        entry = self._items.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        del self._items[response_id]
        self.bytes -= entry.size
        return True


class EventLog:
    """The server-sent events of one streamed background response, in the order they
    were made (event ``i`` has ``sequence_number`` ``i``), and whether it has ended."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.bytes = 0
        self.ended = False
        self._changed = asyncio.Event()

    def append(self, event: bytes) -> None:
        """Add the next event (wakes every follower)."""
        self.events.append(event)
        self.bytes += len(event)
        self._wake()

    def end(self) -> None:
        """No event follows (the response finished, failed or was cancelled)."""
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        # A new event per change: a follower waits on the one it saw, so no wake-up is
        # lost between its look at the events and its wait.
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, start: int = 0) -> AsyncIterator[bytes]:
        """The events from ``start`` on, then each as it comes, until the log ends."""
        index = max(0, start)
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.ended:
                return
            await self._changed.wait()


class EventLogs:
    """The event logs of streamed background responses by response id: a running one's
    is always kept; of those that ended, the most recently ended up to ``max_bytes`` (the
    oldest dropped first; 0 keeps none once ended)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._running: dict[str, EventLog] = {}
        self._ended: OrderedDict[str, EventLog] = OrderedDict()
        self.ended_bytes = 0

    def __len__(self) -> int:
        return len(self._running) + len(self._ended)

    def open(self, response_id: str) -> EventLog:
        """A new, running log for ``response_id``."""
        log = self._running[response_id] = EventLog()
        return log

    def get(self, response_id: str) -> EventLog | None:
        """The log of ``response_id`` (None: it was not streamed in the background, or
        its log was dropped)."""
        return self._running.get(response_id) or self._ended.get(response_id)

    def end(self, response_id: str) -> None:
        """``response_id``'s generation is over: end its log and keep it within bounds."""
        log = self._running.pop(response_id, None)
        if log is None:
            return
        log.end()
        self._ended[response_id] = log
        self.ended_bytes += log.bytes
        while self._ended and self.ended_bytes > self.max_bytes:
            _, old = self._ended.popitem(last=False)
            self.ended_bytes -= old.bytes

    def drop(self, response_id: str) -> None:
        """Forget ``response_id``'s log (its response was deleted)."""
        old = self._ended.pop(response_id, None)
        if old is not None:
            self.ended_bytes -= old.bytes

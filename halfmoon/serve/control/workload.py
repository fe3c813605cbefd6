"""The recent workload as the Conductor service saw it, for live re-planning.

:class:`ArrivalLog` keeps every disaggregated request the service was asked to place
(time, prompt and output lengths, block hashes) for the last ``keep_s`` seconds, within
``max_entries``. :func:`workload_window` answers a ``workload_query``
(:class:`WorkloadWindow`): the last ``window_s`` of arrivals, oldest first, with what a
simulation of this cluster needs (the placeable and draining instances, a worker's
measured cost profile, the decode KV pool, the Conductor's config). The re-planner
(:mod:`halfmoon.serve.launch.replan`) replays it on other P:D splits.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from halfmoon.serve.control.messages import Arrival, Register, WorkloadWindow
from halfmoon.serve.control.protocol import HASH_BYTES

if TYPE_CHECKING:
    from halfmoon.serve.control.conductor_service import ConductorService


@dataclass
class _Entry:
    at_s: float
    input_length: int
    #: The client's ``max_tokens`` until the request finishes, then what it generated.
    output_length: int
    hashes: bytes
    request_id: str = ""
    done: bool = False
    prefill_only: bool = False

    @property
    def root(self) -> bytes:
        """Its first block's hash (b"": its prompt has no full block)."""
        return self.hashes[:HASH_BYTES]


class ArrivalLog:
    """Requests placed in the last ``keep_s`` seconds (at most ``max_entries``).

    A request's output length is its ``max_tokens`` when it arrives, a bound (a chat
    request that leaves it out may grow to the whole context); :meth:`finished` puts in
    what it generated once its decode worker says, so that a replay sees real outputs.
    A request still running when the window is read is replayed with the median output
    of the finished requests that share its first block (the same system prompt or
    document, in one tenant), else of all finished ones, within its bound: replayed at
    ``max_tokens``, a window's running chats (each bounded by the whole context) made a
    decode pool look far busier than it was.
    """

    def __init__(self, keep_s: float = 600.0, max_entries: int = 100_000) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._entries: deque[_Entry] = deque()
        self._by_id: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, input_length: int, output_length: int, hashes: bytes,
               now_s: float | None = None, request_id: str = "",
               prefill_only: bool = False) -> None:  # fmt: skip
        """A request arrived (``now_s``: monotonic seconds, now by default;
        ``prefill_only``: an embedding, which generates nothing)."""
        now_s = time.monotonic() if now_s is None else now_s
        entry = _Entry(now_s, input_length, output_length, hashes, request_id,
                       done=prefill_only, prefill_only=prefill_only)  # fmt: skip
        self._entries.append(entry)
        if request_id:
            self._by_id[request_id] = entry
        while self._entries and (
            len(self._entries) > self.max_entries or self._entries[0].at_s < now_s - self.keep_s
        ):
            old = self._entries.popleft()
            if self._by_id.get(old.request_id) is old:
                del self._by_id[old.request_id]

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        """Request ``request_id`` generated ``num_output_tokens`` in all (ignored when it
        is not in the log: older, or never placed here)."""
        entry = self._by_id.get(request_id)
        if entry is not None and num_output_tokens >= 1:
            entry.output_length, entry.done = num_output_tokens, True

    def _running_outputs(self) -> tuple[dict[bytes, float], float | None]:
        """Median outputs of the finished requests: per first block, and of all."""
        by_root: dict[bytes, list[int]] = {}
        every: list[int] = []
        for e in self._entries:
            if e.done and not e.prefill_only:
                every.append(e.output_length)
                if e.root:
                    by_root.setdefault(e.root, []).append(e.output_length)
        medians = {root: statistics.median(outs) for root, outs in by_root.items()}
        return medians, statistics.median(every) if every else None

    def window(self, window_s: float, now_s: float | None = None) -> list[Arrival]:
        """The arrivals of the last ``window_s`` seconds, oldest first."""
        now_s = time.monotonic() if now_s is None else now_s
        since = now_s - window_s
        recent = [e for e in reversed(self._entries) if e.at_s >= since]
        by_root, overall = self._running_outputs()

        def output(e: _Entry) -> int:
            if e.done:
                return e.output_length
            typical = by_root.get(e.root, overall)
            return e.output_length if typical is None else max(1, min(e.output_length,
                                                                      round(typical)))  # fmt: skip

        return [
            Arrival(
                age_s=round(now_s - e.at_s, 6),
                input_length=e.input_length,
                output_length=output(e),
                hashes=e.hashes,
                prefill_only=e.prefill_only,
            )  # fmt: skip
            for e in reversed(recent)
        ]


def workload_window(service: ConductorService, window_s: float) -> WorkloadWindow:
    """The answer to a ``workload_query`` for the last ``window_s`` seconds."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    draining = service.draining
    prefill = sorted(i for i, e in service.instances.items()
                     if e.role == "prefill" and i not in draining)  # fmt: skip
    decode = sorted(i for i, e in service.instances.items()
                    if e.role == "decode" and i not in draining)  # fmt: skip
    registrations = [service.registrations[i] for i in (*prefill, *decode)
                     if i in service.registrations]  # fmt: skip
    profiled: Register | None = next((r for r in registrations if r.profile), None)
    capacities = [service.registrations[i].kv_capacity_tokens for i in decode
                  if i in service.registrations and service.registrations[i].kv_capacity_tokens]  # fmt: skip
    return WorkloadWindow(
        window_s=window_s,
        arrivals=service.arrivals.window(window_s),
        prefill=prefill,
        decode=decode,
        draining=sorted(draining),
        profile=None if profiled is None else profiled.profile,
        kv_bytes_per_token=0 if profiled is None else profiled.kv_bytes_per_token,
        hidden_bytes_per_token=0 if profiled is None else profiled.hidden_bytes_per_token,
        decode_kv_capacity_tokens=min(capacities, default=0),
        conductor=service.conductor.config.to_json(),
    )

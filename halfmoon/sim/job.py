"""One request as it moves through the simulated cluster."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from halfmoon.core.request import Request
from halfmoon.metrics.records import RequestRecord

if TYPE_CHECKING:
    from halfmoon.sim.cpp import CPPRun
    from halfmoon.sim.decode import DecodeInstance
    from halfmoon.sim.prefill import PrefillInstance


@dataclass(eq=False, slots=True)
class Job:
    """A request, its record, and where the Conductor placed it.

    ``planned_cached_blocks`` is the prefix the decision counted on, held by
    ``cache_source`` (the prefill instance itself, or another one to fetch it from);
    ``keep_fetched`` says whether fetched blocks become cached copies on arrival (the
    decision planned that replication). ``generated`` counts output tokens emitted and
    ``prefilled_tokens`` prompt tokens computed so far (chunked coupled prefill);
    ``cpp`` is set when a chunked-pipeline group runs the prefill. ``fetched_blocks``:
    the prefix blocks a fetch that ran before the request's turn brought (an instance
    that overlaps fetches with its queue). ``spec_credit``: the fraction of a token
    speculative decoding owes it, carried from step to step.
    """

    request: Request
    record: RequestRecord
    prefill: PrefillInstance | None = None
    decode: DecodeInstance | None = None
    cache_source: PrefillInstance | None = None
    planned_cached_blocks: int = 0
    keep_fetched: bool = False
    generated: int = 0
    prefilled_tokens: int = 0
    cpp: CPPRun | None = None
    fetched_blocks: int = 0
    spec_credit: float = 0.0

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def full_block_hashes(self) -> tuple[int, ...]:
        """The prompt's cacheable (full) blocks."""
        request = self.request
        return request.block_hashes[: request.num_full_blocks]

    @property
    def kv_reserved_tokens(self) -> int:
        """KV a decoding request reserves: its prompt and every output token."""
        return self.request.input_length + self.request.output_length

    @property
    def context_tokens(self) -> int:
        """Tokens in its KV while decoding: the prompt plus the tokens emitted so far."""
        return self.request.input_length + self.generated

    @property
    def done(self) -> bool:
        """Every output token has been emitted."""
        return self.generated >= self.request.output_length


def rank(job: Job) -> tuple[int, float]:
    """A job's place in a ``priority`` queue: its priority (lower first), then arrival."""
    return job.request.priority, job.request.arrival_time_s


def enqueue(queue: deque[Job], job: Job, by_priority: bool) -> None:
    """Append ``job`` to ``queue``, or (``by_priority``: vLLM's ``priority`` policy) put
    it after the queued jobs ranked before or with it."""
    if by_priority:
        bisect.insort(queue, job, key=rank)
    else:
        queue.append(job)

"""Replaying planned requests against a server at their send times, and the result.

One asyncio task per request: it waits for its send time (and, with
``max_concurrency``, for a free slot), records the moment it actually sends as its
arrival, and streams the response (:func:`halfmoon.bench.client.send_request`). All times
are seconds on one monotonic clock, counted from the start of the run, so records from
the client compare directly with each other and with a simulated run's.

The loop is bounded: exactly one HTTP request per planned request, each with the
client's timeout; nothing is retried (a 429 is an outcome, not a reason to resend).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from halfmoon.bench.client import ClientConfig, StreamStats, send_request
from halfmoon.bench.workload import BenchRequest, PromptMaker
from halfmoon.metrics.records import RequestRecord

#: Open connections when no ``max_concurrency`` is given; more requests in flight wait
#: inside the client for a connection (their wait counts in their TTFT).
DEFAULT_MAX_CONNECTIONS = 512


@dataclass
class BenchRun:
    """The records of one run (in plan order), per-request stream statistics, how late
    each request was sent against its plan, and the run's wall time."""

    records: list[RequestRecord]
    stats: list[StreamStats]
    send_lag_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    start_monotonic_s: float = 0.0


async def _one(
    index: int,
    planned: BenchRequest,
    run: BenchRun,
    client: httpx.AsyncClient,
    config: ClientConfig,
    prompts: PromptMaker,
    slots: asyncio.Semaphore | None,
    now: Callable[[], float],
) -> None:
    delay_s = planned.send_at_s - now()
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    if slots is not None:
        await slots.acquire()
    try:
        request = planned.request
        prompt_ids = prompts.prompt_ids(request)
        sent_s = now()
        record = RequestRecord(
            request.request_id, sent_s, request.input_length, request.output_length
        )
        run.records[index] = record
        run.send_lag_s[index] = max(0.0, sent_s - planned.send_at_s)
        run.stats[index] = await send_request(
            client, config, record, prompt_ids, now, request.priority
        )
    finally:
        if slots is not None:
            slots.release()


async def run_requests(
    planned: Sequence[BenchRequest],
    config: ClientConfig,
    prompts: PromptMaker,
    max_concurrency: int | None = None,
    on_done: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> BenchRun:
    """Send every planned request at its time; returns when all have finished."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    num = len(planned)
    placeholder = [RequestRecord(p.request_id, 0.0, 0, 0) for p in planned]
    run = BenchRun(placeholder, [StreamStats() for _ in planned], [0.0] * num)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or DEFAULT_MAX_CONNECTIONS
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    # The per-request deadline is enforced by the client (asyncio.wait_for); httpx's own
    # timeouts only catch a server that stops talking mid-way.
    timeout = httpx.Timeout(config.timeout_s, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        # The clock starts once the client exists (building it takes tens of ms).
        start_s = run.start_monotonic_s = clock()

        def now() -> float:
            return clock() - start_s

        tasks = [
            asyncio.create_task(_one(i, p, run, client, config, prompts, slots, now))
            for i, p in enumerate(planned)
        ]
        if on_done is not None:
            for task in tasks:
                task.add_done_callback(lambda _: on_done())
        await asyncio.gather(*tasks)
    run.wall_s = now()
    return run


def run_benchmark(
    planned: Sequence[BenchRequest],
    config: ClientConfig,
    prompts: PromptMaker,
    max_concurrency: int | None = None,
    on_done: Callable[[], None] | None = None,
) -> BenchRun:
    """:func:`run_requests` in a fresh event loop (for callers without one)."""
    return asyncio.run(run_requests(planned, config, prompts, max_concurrency, on_done))

"""An overload burst on a real cluster: every connection gets an answer (issue #17 item 10).

Counts, never timings: the host is noisy. ``benchmarks.eval.overload`` measures how fast the
answers come (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import random

import httpx

NUM_REQUESTS = 96
CONCURRENCY = 24
MAX_TOKENS = 8


async def _burst(base_url: str) -> list[httpx.Response | Exception]:
    """``NUM_REQUESTS`` completions from ``CONCURRENCY`` connections, each its own client
    (each prompt its own 512 token ids, so nothing is a cache hit)."""
    rng = random.Random(0)
    bodies = [
        {"model": "tiny", "prompt": [rng.randrange(1, 500) for _ in range(512)],
         "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        for _ in range(NUM_REQUESTS)
    ]  # fmt: skip
    outcomes: list[httpx.Response | Exception] = []

    async def connection() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, trust_env=False) as client:
            while bodies:
                try:
                    outcomes.append(await client.post("/v1/completions", json=bodies.pop()))
                except httpx.HTTPError as exc:  # a connection closed without an answer
                    outcomes.append(exc)

    await asyncio.gather(*(connection() for _ in range(CONCURRENCY)))
    return outcomes


def test_an_overload_burst_gets_an_answer_on_every_connection(cluster_factory):
    """96 requests from 24 connections at once, against a gateway that takes 8 at a time
    and a Conductor with a 0.2 s TTFT SLO: each request gets a 200 with all its tokens or
    a 429 with Retry-After and a JSON error saying which refusal it was."""
    cluster = cluster_factory("--kv-cache-mb", "32", "--ttft-slo", "0.2",
                              "--max-concurrent-requests", "8")  # fmt: skip
    outcomes = asyncio.run(_burst(cluster.base_url))
    assert len(outcomes) == NUM_REQUESTS
    errors = [o for o in outcomes if isinstance(o, Exception)]
    assert not errors, errors[:3]
    assert {o.status_code for o in outcomes} <= {200, 429}, [o.text for o in outcomes][:3]
    refused = [o for o in outcomes if o.status_code == 429]
    assert refused  # 24 at once against a limit of 8
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        message = r.json()["error"]["message"]
        assert message.startswith(("server busy", "request rejected")), message
    for r in outcomes:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS

"""Overload answers at the gateway (issue #17 item 10): a request refused for the
in-flight limit is refused before it is tokenized, even in a burst, every refusal is a
429 with ``Retry-After`` and a JSON error, and a Conductor rejection is final after one
round trip. Counts, never timings (the host is noisy)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.protocol import decode, encode
from halfmoon.serve.gateway.backend import GenerationChunk, Rejected
from halfmoon.serve.gateway.cluster_client import ClusterBackend


class HeldBackend:
    """Holds every request until ``gate`` opens, then emits one token."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.num_started = 0

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.num_started += 1
        await self.gate.wait()
        yield GenerationChunk((5,), "length", 0)

    async def abort(self, request_id: str) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        return {"mode": "held"}


def test_a_burst_over_the_limit_is_refused_before_it_is_tokenized(gateways, monkeypatch):
    """24 requests at once against a limit of 4: 4 run, 20 get a 429 at once, and only the
    4 that run are tokenized. (Before, the requests being tokenized did not count: every
    request of a burst passed the first check, all 24 were tokenized, one behind the
    other on two threads, and only then were 20 refused.)"""
    limit, burst = 4, 24
    backend = HeldBackend()
    app = gateways.app(backend, max_concurrent_requests=limit)
    tokenizer = app.state.gateway.tokenizer
    tokenized: list[str] = []
    encode = tokenizer.encode

    def counting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        tokenized.append(text)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", counting_encode)

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "echo", "prompt": "hi", "max_tokens": 1}
            sent = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                    for _ in range(burst)]  # fmt: skip
            while sum(r.done() for r in sent) < burst - limit:  # the refusals come first
                await asyncio.sleep(0.01)
            backend.gate.set()
            return await asyncio.gather(*sent)

    responses = asyncio.run(asyncio.wait_for(scenario(), 60))
    refused = [r for r in responses if r.status_code == 429]
    assert sorted(r.status_code for r in responses) == [200] * limit + [429] * (burst - limit)
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert all(r.json()["error"]["message"].startswith("server busy") for r in refused)
    assert len(tokenized) == backend.num_started == limit


def test_a_conductor_rejection_is_final_after_one_round_trip():
    """The cluster backend asks the Conductor once and raises the rejection at once: no
    retry waits for capacity (only "no instance available", a restart, is asked again)."""
    secret = b"overload-test-secret"
    received: list[str] = []

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        async def conductor() -> None:  # rejects every placement for its TTFT
            while True:
                identity, *frames = await router.recv_multipart()
                msg = decode(frames, secret)
                received.append(msg["type"])
                if msg["type"] == "schedule":
                    reply = {"type": "decision", "accepted": False, "why": "",
                             "reject_reason": "estimated TTFT 9.00s on p0 exceeds the 2s SLO",
                             "msg_id": msg["msg_id"]}  # fmt: skip
                    await router.send_multipart([identity, *encode(reply, secret)])

        serving = asyncio.ensure_future(conductor())
        backend = ClusterBackend(f"tcp://127.0.0.1:{port}", secret, 16)
        try:
            params = SamplingParams(max_tokens=4)
            with pytest.raises(Rejected, match="TTFT"):
                async for _ in backend.generate("r1", list(range(40)), params):
                    pass
        finally:
            serving.cancel()
            await backend.close()
            router.close(0)
            ctx.term()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert received.count("schedule") == 1, received

"""The bench client against halfmoon's own gateway (in-process, a model-free backend)
whose tokens include some without text: with ``continuous_usage_stats`` every token is
counted at its own event; without it, tokens without text arrive merged into later ones."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest

from halfmoon.bench.client import ClientConfig, send_request
from halfmoon.core.request import SamplingParams
from halfmoon.metrics.records import RequestRecord
from halfmoon.serve.gateway.backend import GenerationChunk

#: Ids 0-4 of the preset tokenizer decode to no text; 40 and 41 to letters.
TOKENS = (40, 0, 1, 41, 2, 40, 0, 41)


class ScriptedBackend:
    """Emits :data:`TOKENS`, one per chunk."""

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        for i, tok in enumerate(TOKENS):
            last = i == len(TOKENS) - 1
            yield GenerationChunk((tok,), "length" if last else None, 3 if i == 0 else None)

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return {"mode": "scripted"}


@pytest.fixture(scope="module")
def app():
    from halfmoon.engine.tokenizer import Tokenizer, build_preset_tokenizer, preset_tokenizer_config
    from halfmoon.serve.gateway.app import GatewayConfig, create_app

    tok = Tokenizer(build_preset_tokenizer(512), preset_tokenizer_config(256))
    return create_app(ScriptedBackend(), tok, GatewayConfig("m", max_model_len=256))


def _events(app, stream_options: dict) -> list[dict]:
    async def go() -> list[dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            body = {"model": "m", "prompt": [20, 21], "max_tokens": len(TOKENS),
                    "stream": True, "stream_options": stream_options}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            lines = [ln[5:].strip() for ln in response.text.splitlines() if ln.startswith("data:")]
            return [json.loads(ln) for ln in lines if ln != "[DONE]"]

    return asyncio.run(go())


def test_continuous_usage_sends_a_chunk_per_token_with_running_usage(app) -> None:
    events = _events(app, {"include_usage": True, "continuous_usage_stats": True})
    outputs = [e for e in events if e["choices"]]
    assert len(outputs) == len(TOKENS)
    assert [e["usage"]["completion_tokens"] for e in outputs] == list(range(1, len(TOKENS) + 1))
    assert outputs[0]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(TOKENS)


def test_without_continuous_usage_empty_tokens_send_nothing(app) -> None:
    events = _events(app, {"include_usage": True})
    outputs = [e for e in events if e["choices"]]
    assert len(outputs) < len(TOKENS)  # the textless tokens have no event of their own
    assert all("usage" not in e for e in outputs)


@pytest.mark.parametrize(("extensions", "num_events"), [(True, len(TOKENS)), (False, 4)])
def test_bench_client_counts_every_token_arrival(app, extensions: bool, num_events: int) -> None:
    """The client asks for continuous usage (vLLM extension on): one arrival per token.
    Without it, only events with text count; the rest are placed at the finishing event."""
    config = ClientConfig("http://gw", "m", vllm_extensions=extensions)
    record = RequestRecord("r", 0.0, 2, len(TOKENS))
    ticks = iter(range(1, 1000))

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, config, record, [20, 21], lambda: next(ticks))

    stats = asyncio.run(go())
    assert record.completed and len(record.token_times_s) == len(TOKENS)
    assert stats.num_events == num_events and stats.num_reported_tokens == len(TOKENS)
    assert len(set(record.token_times_s)) == num_events  # each event its own arrival time

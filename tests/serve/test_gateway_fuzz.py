"""The gateway never answers 5xx and never crashes, whatever the body (hypothesis).

The HTTP layer runs in-process (ASGI) over a backend that generates tokens without a
model, so thousands of inputs take seconds; the real cluster is covered in tests/e2e.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.backend import GenerationChunk, Rejected


class EchoBackend:
    """Emits the prompt's tokens back, one per chunk; a prompt starting with id 7 is
    rejected, as the Conductor would."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        if prompt_token_ids and prompt_token_ids[0] == 7:
            raise Rejected("queue full", 2.0)
        out = list(prompt_token_ids)[: params.max_tokens] or [5]
        for i, tok in enumerate(out):
            last = i == len(out) - 1
            yield GenerationChunk((tok,), "length" if last else None, 0 if i == 0 else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "echo"}


@pytest.fixture(scope="module")
def client(gateways):
    app = gateways.app(EchoBackend(), max_tokens_limit=64)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
fields = {
    "model": st.sampled_from(["echo", "other", ""]) | json_values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 600), max_size=20) | json_values,
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "robot"]),
                "content": st.text(max_size=20) | json_values,
            }
        ),
        max_size=3,
    )
    | json_values,  # fmt: skip
    "max_tokens": st.integers(-3, 300) | json_values,
    "temperature": st.floats(-1, 3, allow_nan=False) | json_values,
    "top_p": st.floats(-1, 2, allow_nan=False) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "min_tokens": st.integers(-2, 100),
    "seed": st.integers(-(2**70), 2**70) | json_values,
    "logprobs": st.integers(-1, 22) | st.booleans() | json_values,
    "top_logprobs": st.integers(-1, 22) | json_values,
    "echo": st.booleans() | json_values,
    "presence_penalty": st.floats(-3, 3, allow_nan=False) | json_values,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False) | json_values,
    "repetition_penalty": st.floats(-1, 3, allow_nan=False) | json_values,
    "stop_token_ids": st.lists(st.integers(-5, 600), max_size=5) | json_values,
    "include_stop_str_in_output": st.booleans() | json_values,
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2) | json_values,
    "best_of": st.integers(-1, 3) | json_values,
    "tools": json_values,
    "response_format": json_values,
}
bodies = st.fixed_dictionaries({}, optional=fields)


@pytest.mark.slow  # 300 examples: ~8 s here
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=bodies, chat=st.booleans())
def test_no_5xx_on_any_body(client, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = client.post(path, content=json.dumps(body))
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=200))
def test_no_5xx_on_any_bytes(client, raw):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500


token_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["echo", "other"]) | json_values,
        "prompt": st.text(max_size=30) | json_values,
        "messages": fields["messages"],
        "tokens": st.lists(st.integers(-5, 600), max_size=10) | json_values,
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=token_bodies, path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_no_5xx_from_tokenize_endpoints(client, body, path):
    r = client.post(path, content=json.dumps(body))
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@pytest.mark.parametrize("n", [1, 3])
def test_rejection_is_429_with_retry_after(client, n):
    r = client.post("/v1/completions", json={"model": "echo", "prompt": [7, 8, 9], "n": n})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert "queue full" in r.json()["error"]["message"]


def test_api_key_and_body_limit(gateways):
    app = gateways.app(EchoBackend(), api_key="sekrit", max_body_bytes=1000)
    with TestClient(app) as c:
        body = {"model": "echo", "prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        big = {"model": "echo", "prompt": "x" * 5000}
        r = c.post("/v1/completions", json=big, headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 413
        assert c.get("/health").status_code == 200  # health needs no key


@pytest.mark.parametrize("public", [(), ("metrics",), ("docs",), ("metrics", "docs")])
def test_metrics_and_docs_need_the_key_unless_made_public(gateways, public):
    """With an API key, /metrics, /docs, /redoc and /openapi.json answer 401 without it
    (before, they were always open), unless ``public`` (``--public``) names them."""
    app = gateways.app(EchoBackend(), api_key="sekrit", public=public)
    key = {"authorization": "Bearer sekrit"}
    with TestClient(app) as c:
        for name, paths in {"metrics": ["/metrics"],
                            "docs": ["/docs", "/redoc", "/openapi.json"]}.items():  # fmt: skip
            for path in paths:
                assert c.get(path).status_code == (200 if name in public else 401), path
                assert c.get(path, headers=key).status_code == 200, path
        assert c.get("/health").status_code == 200
    open_app = gateways.app(EchoBackend())  # no key at all: everything is open
    with TestClient(open_app) as c:
        assert c.get("/metrics").status_code == 200 and c.get("/docs").status_code == 200
    with pytest.raises(ValueError, match="unknown public paths"):
        gateways.app(EchoBackend(), api_key="sekrit", public=("v1",))


def test_body_limit_holds_for_chunked_bodies(gateways):
    """A chunked body carries no Content-Length: it is counted while read and refused the
    moment it passes the limit (once, a 50 MB chunked request was read, parsed and
    tokenized whole)."""
    app = gateways.app(EchoBackend(), max_body_bytes=1000)
    sent: list[int] = []

    def chunks(total: int):
        body = json.dumps({"model": "echo", "prompt": "x" * total, "max_tokens": 2}).encode()
        for i in range(0, len(body), 100):
            sent.append(i)
            yield body[i : i + 100]

    with TestClient(app) as c:
        r = c.post("/v1/completions", content=chunks(200_000),
                   headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 413
        assert r.json()["error"]["message"] == "request body over 1000 bytes"
        small = c.post("/v1/completions", content=chunks(100),
                       headers={"content-type": "application/json"})  # fmt: skip
        assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2


def test_overload_turns_into_429_not_a_queue(gateways):
    import asyncio

    class SlowBackend(EchoBackend):
        async def generate(self, request_id, prompt_token_ids, params):
            await asyncio.sleep(0.5)
            yield GenerationChunk((5,), "length", 0)

    app = gateways.app(SlowBackend(), max_concurrent_requests=2)

    async def run():
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"model": "echo", "prompt": "hi", "max_tokens": 1}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(6)])

    codes = sorted(r.status_code for r in asyncio.run(run()))
    assert codes.count(200) >= 2 and 429 in codes
    assert set(codes) <= {200, 429}


def test_response_ids_are_openai_shaped_and_unique_per_gateway(client, gateways):
    completion = client.post("/v1/completions", json={"model": "echo", "prompt": "ab"}).json()
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": "a"}]},
    ).json()
    assert completion["id"].startswith("cmpl-") and chat["id"].startswith("chatcmpl-")
    assert completion["id"].removeprefix("cmpl-") != chat["id"].removeprefix("chatcmpl-")
    # A second gateway (a restart, or another replica) never repeats the first one's ids.
    with TestClient(gateways.app(EchoBackend())) as c:
        again = c.post("/v1/completions", json={"model": "echo", "prompt": "ab"}).json()
    assert again["id"] != completion["id"]
    stream = client.post(
        "/v1/completions", json={"model": "echo", "prompt": "ab", "stream": True}
    ).text
    ids = {json.loads(line[6:])["id"] for line in stream.splitlines() if line.startswith("data: {")}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")


def test_tokenization_runs_off_the_event_loop(gateways):
    """Prompts and chat templates are tokenized on the gateway's CPU threads, never on the
    event loop (there, three 3.9 MB prompts once froze another client's stream for 5 s,
    and one froze it for 14.6 s on a busy host)."""
    import threading

    app = gateways.app(EchoBackend())
    tokenizer = app.state.gateway.tokenizer
    threads: list[str] = []
    encode = tokenizer.encode

    def recording_encode(text, add_special_tokens=True):
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    tokenizer.encode = recording_encode
    with TestClient(app) as c:
        body = {"model": "echo", "max_tokens": 2}
        assert c.post("/v1/completions", json={**body, "prompt": "hi"}).status_code == 200
        chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        assert c.post("/tokenize", json={"model": "echo", "prompt": "hi"}).status_code == 200
    assert len(threads) == 3 and all(t.startswith("gateway-cpu") for t in threads), threads

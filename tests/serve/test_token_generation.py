"""vLLM's token-in, token-out API (halfmoon/serve/gateway/token_generation.py, routes in
tokens_api.py): ``/inference/v1/generate`` whole and streamed, in both output modes, with
vLLM's defaults; the ``/render`` routes, whose output generates what the original request
would; ``/abort_requests``; vLLM's ``/pause`` and ``/resume``; and a 400 naming every
option that cannot be done.

In-process (ASGI) over a backend that counts tokens up; a live cluster's answers are
checked in tests/e2e/test_serve_disaggregated.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.serve.gateway.backend import GenerationChunk

#: What the backend generates: these letters' tokens, one per chunk, in turn.
LETTERS = "abcdefghijklmnopqrstuvwxyz"
DEFAULTS = {"temperature": 0.2, "top_p": 0.9}  # the served model's generation config


class CountingBackend:
    """Generates ``LETTERS``' tokens, one a chunk, ``max_tokens`` of them (``length``);
    with ``pace_s`` one every ``pace_s`` seconds, and a request it is told to abort ends
    there (finished ``abort``, as the cluster's backend ends it)."""

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode(LETTERS, add_special_tokens=False)
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []
        self.pace_s = 0.0
        self.aborted: set[str] = set()

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.params.append(params)
        self.prompts.append(list(prompt_token_ids))
        for i in range(params.max_tokens):
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
            if request_id in self.aborted:
                yield GenerationChunk((), "abort")
                return
            token = self.ids[i % len(self.ids)]
            logprobs = ()
            if params.logprobs is not None:
                logprobs = (TokenLogprob(-0.5, ((token, -0.5), (self.ids[0], -1.5)), 1),)
            last = i == params.max_tokens - 1
            yield GenerationChunk((token,), "length" if last else None, 0 if i == 0 else None,
                                  logprobs=logprobs)  # fmt: skip

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "counting"}


async def started(backend: CountingBackend, count: int, tokens_s: float = 0.1) -> None:
    """Wait until ``backend`` has been asked for ``count`` generations (a loaded host, or
    a chat template's first use, may take a while), then ``tokens_s`` more for them to
    generate a few tokens: a fixed sleep instead once aborted one before it began."""
    for _ in range(1000):
        if len(backend.prompts) >= count:
            break
        await asyncio.sleep(0.02)
    assert len(backend.prompts) >= count, f"{len(backend.prompts)} of {count} generations began"
    await asyncio.sleep(tokens_s)


def generation_of(client: httpx.AsyncClient, max_tokens: int) -> asyncio.Future:
    """A token-in generation of ``max_tokens`` tokens, started in the background (its
    answer when awaited)."""
    body = {"token_ids": [5], "sampling_params": {"max_tokens": max_tokens}}
    return asyncio.ensure_future(client.post("/inference/v1/generate", json=body))


@contextlib.contextmanager
def counting(gateways, **config):
    """A gateway over a :class:`CountingBackend` whose model has generation defaults:
    (test client, backend)."""
    backend = CountingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", sampling_defaults=DEFAULTS, **config)
    with TestClient(app) as client:
        yield client, backend


@pytest.fixture(scope="module")
def served(gateways):
    with counting(gateways) as pair:
        yield pair


def _ids(gateways, text: str) -> list[int]:
    return gateways.tokenizer.encode(text, add_special_tokens=False)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_tokens_in_tokens_out_with_vllms_defaults(served, gateways):
    client, backend = served
    prompt = _ids(gateways, "Hi there")
    body = {"token_ids": prompt, "request_id": "r1",
            "sampling_params": {"max_tokens": 5, "temperature": 0}}  # fmt: skip
    answer = client.post("/inference/v1/generate", json=body)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["request_id"] == "generate-tokens-r1" and out["output_mode"] == "tokens"
    (choice,) = out["choices"]
    assert choice["token_ids"] == backend.ids[:5] and choice["finish_reason"] == "length"
    assert "text" not in choice and choice["logprobs"] is None
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                            "total_tokens": len(prompt) + 5}  # fmt: skip
    assert backend.prompts[-1] == prompt and out["prompt_token_ids"] is None
    assert backend.params[-1].temperature == 0.0
    # left out: SamplingParams' own defaults (not the model's), output to the context's end
    client.post("/inference/v1/generate", json={"token_ids": prompt})
    params = backend.params[-1]
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.max_tokens == 256 - len(prompt)


def test_text_mode_logprobs_and_several_choices(served, gateways):
    client, backend = served
    body = {"token_ids": _ids(gateways, "Hi"), "output_mode": "text", "return_token_ids": True,
            "sampling_params": {"max_tokens": 3, "logprobs": 1, "n": 2, "seed": 5,
                                "stop_token_ids": [7], "top_k": -1}}  # fmt: skip
    out = client.post("/inference/v1/generate", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        assert choice["text"] == LETTERS[:3] and choice["token_ids"] == backend.ids[:3]
        first = choice["logprobs"]["content"][0]  # chat-shaped: token text, bytes
        assert first["token"] == "a" and first["logprob"] == -0.5 and first["bytes"] == [97]
    assert out["prompt_token_ids"] == _ids(gateways, "Hi")
    assert out["usage"]["completion_tokens"] == 6
    assert sorted(p.seed for p in backend.params[-2:]) == [5, 6]
    assert backend.params[-1].stop_token_ids == (7,) and backend.params[-1].top_k == 0
    tokens = client.post("/inference/v1/generate", json={**body, "output_mode": "tokens"})
    entry = tokens.json()["choices"][0]["logprobs"]["content"][0]  # generate-shaped: ids
    assert entry == {"token_id": backend.ids[0], "logprob": -0.5, "rank": 1,
                     "top_logprobs": [{"token_id": backend.ids[0], "logprob": -0.5},
                                      {"token_id": backend.ids[0], "logprob": -1.5}]}  # fmt: skip


def test_a_stream_carries_the_tokens_then_usage(served, gateways):
    client, backend = served
    prompt = _ids(gateways, "Hi")
    body = {"token_ids": prompt, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 4}}  # fmt: skip
    text = client.post("/inference/v1/generate", json=body).text
    events = _events(text)
    assert text.rstrip().endswith("data: [DONE]")
    assert events[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert streamed == backend.ids[:4]
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    texts = _events(client.post("/inference/v1/generate",
                                json={**body, "output_mode": "text"}).text)  # fmt: skip
    assert "".join(c["text"] for e in texts for c in e["choices"]) == LETTERS[:4]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"sampling_params": {"bogus": 1}}, "bogus"),
        ({"sampling_params": {"extra_args": {"a": 1}}}, "sampling_params.extra_args"),
        ({"sampling_params": {"thinking_token_budget": 8}}, "thinking_token_budget"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"token_ids": [-1]}, "token_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [100000]}, "prompt"),
        ({"output_mode": "text", "sampling_params": {"detokenize": False}}, "detokenize"),
        ({"sampling_params": {"max_tokens": 0}}, "max_tokens"),
        ({"sampling_params": {"temperature": 9.0}}, "temperature"),
        ({"token_ids": [5] * 256}, "maximum context length"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_it(served, change, words):
    client, _ = served
    body = {"token_ids": [5, 6], **change}
    answer = client.post("/inference/v1/generate", json=body)
    assert answer.status_code == 400, answer.text
    assert words in json.dumps(answer.json())
    assert client.post("/inference/v1/generate",
                       json={"token_ids": [5], "model": "other"}).status_code == 404  # fmt: skip


def test_a_rendered_chat_generates_what_the_chat_would(served, gateways):
    client, backend = served
    messages = [{"role": "user", "content": "Name a colour"}]
    schema = {"type": "object", "properties": {"c": {"type": "string"}}}
    chat = {"model": "m", "messages": messages, "max_tokens": 6, "stop": ["zz"],
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
            "request_id": "mine"}  # fmt: skip
    rendered = client.post("/v1/chat/completions/render", json=chat)
    assert rendered.status_code == 200, rendered.text
    request = rendered.json()
    tokenized = client.post("/tokenize", json={"model": "m", "messages": messages}).json()
    assert request["token_ids"] == tokenized["tokens"] and request["request_id"] == "mine"
    sp = request["sampling_params"]
    assert sp["temperature"] == 0.2 and sp["top_p"] == 0.9  # the model's defaults, filled in
    assert sp["max_tokens"] == 6 and sp["stop"] == ["zz"]
    assert sp["structured_outputs"] == {"json": schema}
    client.post("/v1/chat/completions", json=chat)
    direct = backend.params[-1], backend.prompts[-1]
    generated = client.post("/inference/v1/generate", json={**request, "output_mode": "text"})
    assert generated.status_code == 200, generated.text
    assert (backend.params[-1], backend.prompts[-1]) == direct  # the same request to the cluster


def test_rendered_completions_and_messages(served, gateways):
    client, _ = served
    batch = client.post("/v1/completions/render",
                        json={"model": "m", "prompt": ["ab", "cde"], "max_tokens": 3}).json()  # fmt: skip
    encode = gateways.tokenizer.encode  # (a completion's text prompt: with BOS)
    assert [r["token_ids"] for r in batch] == [encode("ab"), encode("cde")]
    assert batch[0]["request_id"].endswith("-0") and batch[1]["request_id"].endswith("-1")
    assert batch[0]["sampling_params"]["max_tokens"] == 3
    echo = client.post("/v1/completions/render", json={"model": "m", "prompt": "a", "echo": True})
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
    message = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Yo"}]}
    rendered = client.post("/v1/messages/render", json=message).json()
    chat = client.post("/v1/chat/completions/render",
                       json={**message, "max_tokens": 4}).json()  # fmt: skip
    assert rendered["token_ids"] == chat["token_ids"]
    assert rendered["sampling_params"] == chat["sampling_params"]


def test_abort_requests_ends_running_generations(gateways):
    backend = CountingBackend(gateways.tokenizer)
    backend.pace_s = 0.02
    app = gateways.app(backend, "m")

    async def scenario() -> tuple[dict, dict, dict, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {
                "token_ids": [5, 6],
                "request_id": "long",
                "sampling_params": {"max_tokens": 200},
            }
            running = asyncio.ensure_future(client.post("/inference/v1/generate", json=body))
            chat = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 200, "request_id": "talk"}  # fmt: skip
            talking = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat))
            await started(backend, 2)
            ended = await client.post("/abort_requests",
                                      json={"request_ids": ["long", "chatcmpl-talk", "none"]})  # fmt: skip
            unknown = await client.post("/inference/v1/abort_requests", json={"request_ids": ["x"]})
            return (
                ended.json(),
                (await running).json(),
                (await talking).json(),
                unknown.json()["aborted"],
            )

    ended, generated, chatted, unknown = asyncio.run(scenario())
    assert ended == {"status": "aborted", "aborted": 2} and unknown == 0
    choice = generated["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 200
    assert chatted["choices"][0]["finish_reason"] == "abort"


def test_abort_requests_without_ids_ends_every_one(gateways):
    backend = CountingBackend(gateways.tokenizer)
    backend.pace_s = 0.02
    app = gateways.app(backend, "m")

    async def scenario() -> tuple[dict, list[str]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 200, "n": 2}}
            running = [asyncio.ensure_future(client.post("/inference/v1/generate", json=body))
                       for _ in range(2)]  # fmt: skip
            await started(backend, 4)
            ended = (await client.post("/abort_requests", json={})).json()
            answers = [(await r).json() for r in running]
            return ended, [c["finish_reason"] for a in answers for c in a["choices"]]

    ended, finishes = asyncio.run(scenario())
    assert ended == {"status": "aborted", "aborted": 4} and finishes == ["abort"] * 4


def test_the_new_routes_need_the_key(gateways):
    with counting(gateways, api_key="k") as (client, _):
        for path, body in (("/inference/v1/generate", {"token_ids": [5]}),
                           ("/abort_requests", {"request_ids": ["a"]}),
                           ("/inference/v1/abort_requests", {"request_ids": ["a"]}),
                           ("/v1/chat/completions/render", {"model": "m", "messages": []})):  # fmt: skip
            assert client.post(path, json=body).status_code == 401
        keyed = client.post("/inference/v1/generate", json={"token_ids": [5]},
                            headers={"Authorization": "Bearer k"})  # fmt: skip
        assert keyed.status_code == 200


def test_pause_and_resume_hold_new_generations(gateways):
    """vLLM's RL controls (with its development switch): ``/pause`` aborts what runs
    (``mode=abort``) or lets it finish first (``wait``); what arrives meanwhile waits and
    runs on ``/resume``."""
    backend = CountingBackend(gateways.tokenizer)
    backend.pace_s = 0.02
    app = gateways.app(backend, "m", dev_endpoints=True)

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out: dict[str, Any] = {}
            running = generation_of(client, 200)
            await started(backend, 1)
            out["paused"] = (await client.post("/pause")).json()
            out["aborted"] = (await running).json()["choices"][0]["finish_reason"]
            held = generation_of(client, 3)
            await asyncio.sleep(0.3)
            out["held"] = not held.done()
            out["is_paused"] = (await client.get("/is_paused")).json()
            await client.post("/resume")
            out["after"] = (await held).json()["choices"][0]["finish_reason"]
            out["resumed"] = (await client.get("/is_paused")).json()
            finishing = generation_of(client, 10)
            await started(backend, 3, tokens_s=0.0)
            await client.post("/pause", params={"mode": "wait"})
            out["waited"] = finishing.done() and (await finishing).json()["choices"][0][
                "finish_reason"]  # fmt: skip
            await client.post("/resume")
            out["keep"] = (await client.post("/pause", params={"mode": "keep"})).status_code
            return out

    out = asyncio.run(scenario())
    assert out["paused"] == {"status": "paused"} and out["aborted"] == "abort"
    assert out["held"] and out["is_paused"] == {"is_paused": True}
    assert out["after"] == "length" and out["resumed"] == {"is_paused": False}
    assert out["waited"] == "length" and out["keep"] == 400
    with counting(gateways) as (client, _):  # (without the switch: no such routes)
        assert client.post("/pause").status_code == 404
